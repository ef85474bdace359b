"""Issue 43's benchmark pieces on CPU: what each run records about setup, loads and saves
(scripts/bench_saves.py, with Megatron-Core's real Timer and bridge_fgo's real hostmem.pin), the summary of
scripts/gpu/bench_ckpt.sh's runs (scripts/ckpt_summary.py) on made-up results, its checkpoint comparison
on real torch.distributed.checkpoint directories, and the shell script's syntax."""
import importlib
import json
import os
import subprocess
import sys
import types

import pytest

from test_bench_modes import bench_modes  # noqa: F401  (scripts/ is on sys.path from here on)
from test_bench_saves import state, write

saves = importlib.import_module("bench_saves")
summary = importlib.import_module("ckpt_summary")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def restore_patched(monkeypatch):
    """Whatever instrument_setup rebinds is put back after the test."""
    from megatron.core import timers

    from bridge_fgo import hostmem
    from bridge_fgo.engine.streamed.engine import StreamedEngine
    from bridge_fgo.engine.streamed.head import Head
    from bridge_fgo.engine.streamed.transfers import Transfers
    from bridge_fgo.hostmem import pinning
    from bridge_fgo.instrument import reads

    for obj, name in ((timers.Timer, "start"), (timers.Timer, "stop"), (hostmem, "pin"),
                      (pinning.PinnedHost, "wait"), (pinning.PinnedHost, "free"), (reads, "straight_into"),
                      (StreamedEngine, "register_after_load"), (Transfers, "warm"), (Head, "begin_step"),
                      (Head, "_arm")):
        monkeypatch.setattr(obj, name, getattr(obj, name))


def test_setup_and_load_timers_and_the_pinning_are_recorded(restore_patched, monkeypatch):
    import torch
    from megatron.core import timers

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # the Timer's fence; no GPU here

    from bridge_fgo import hostmem

    held = {}
    saves.instrument_setup(held)
    t = timers.Timers(0, "minmax")
    t("model-and-optimizer-setup", log_level=0).start()
    buf = hostmem.pin(4096)  # the construction's landing block pins during setup
    buf.free()  # and is unpinned at its end
    t("model-and-optimizer-setup").stop()
    t("load-checkpoint", log_level=0).start()
    t("load-checkpoint").stop()
    hostmem.pin(8192).free()  # outside any timer: not recorded
    recs = [{"step_s": 2.0}, {"step_s": 1.0}, {"step_s": 1.2}]
    got = saves.setup_figures(held, recs)
    assert got["setup_s"] > 0 and got["load_s"] >= 0
    pin, unpin = got["pins"][0], got["pins"][1]
    assert pin["bytes"] == 4096 and pin["during"] == "model-and-optimizer-setup" and not pin["deferred"]
    assert unpin["bytes"] == 4096 and unpin["during"] == "model-and-optimizer-setup" and unpin["released"]
    assert [p["bytes"] for p in got["pins"][2:]] == [8192]  # its pinning (the first step's, as the bench names it)
    assert got["setup_pin_s"] == pin["pin_s"] and got["setup_unpin_s"] == unpin["free_s"] and got["load_pin_s"] == 0
    assert got["first_iter_after_load_s"] == 2.0 and got["steady_after_first_median_s"] == 1.1
    assert got["warm"] == "made" and got["head"] == "measured"  # neither BENCH_WARM nor BENCH_HEAD set
    assert got["host_after_setup"]["rss_gib"] > 0 and "rss_gib" in got["host_after_load"]
    fresh = saves.setup_figures({"timers": {"model-and-optimizer-setup": 1.0}}, recs)
    assert fresh["first_iter_after_load_s"] is None and fresh["load_s"] is None  # no load: no figure


def test_bench_load_threads_sets_torchs_threads_for_the_load_only(restore_patched, monkeypatch):
    import torch
    from megatron.core import timers

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    before = torch.get_num_threads()
    monkeypatch.setenv("BENCH_LOAD_THREADS", "3")
    held, seen = {}, []
    saves.instrument_setup(held)
    t = timers.Timers(0, "minmax")
    t("model-and-optimizer-setup", log_level=0).start()
    seen.append(torch.get_num_threads())
    t("model-and-optimizer-setup").stop()
    t("load-checkpoint", log_level=0).start()
    seen.append(torch.get_num_threads())
    t("load-checkpoint").stop()
    seen.append(torch.get_num_threads())
    assert seen == [before, 3, before]
    assert saves.setup_figures(held, [])["load_threads"] == {"before": before, "during": 3}
    monkeypatch.setenv("BENCH_LOAD_THREADS", "many")
    with pytest.raises(SystemExit, match="BENCH_LOAD_THREADS='many': a positive integer"):
        saves.instrument_setup({})


def _work_during_the_load():
    return sum(i * i for i in range(20000))


def test_bench_profile_load_records_where_the_load_went(restore_patched, monkeypatch):
    from megatron.core import timers
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setenv("BENCH_PROFILE_LOAD", "4")
    held = {}
    saves.instrument_setup(held)
    t = timers.Timers(0, "minmax")
    t("model-and-optimizer-setup", log_level=0).start()
    t("model-and-optimizer-setup").stop()
    t("load-checkpoint", log_level=0).start()
    _work_during_the_load()
    t("load-checkpoint").stop()
    _work_during_the_load()  # after the load: not profiled
    got = saves.setup_figures(held, [])["load_profile"]
    assert set(got) == {"cumulative", "own"} and all(1 <= len(rows) <= 4 for rows in got.values())
    (work,) = [r for r in got["cumulative"] if r[3].endswith("(_work_during_the_load)")]
    assert work[0] == 1 and work[2] >= work[1] >= 0  # one call, its cumulative time at least its own
    assert work[3].startswith("test_bench_ckpt.py:")
    monkeypatch.setenv("BENCH_PROFILE_LOAD", "0")
    with pytest.raises(SystemExit, match="BENCH_PROFILE_LOAD='0': a positive integer"):
        saves.instrument_setup({})


@pytest.mark.parametrize("touch, engine_touch, want", [(None, False, "skip"), (None, True, "before"),
                                                       ("before", False, "before"), ("skip", True, "skip")])
def test_bench_load_touch_chooses_whether_a_loads_buffer_is_touched(restore_patched, monkeypatch, touch, engine_touch,
                                                                    want):
    """BENCH_LOAD_TOUCH=before|skip: the buffer a load prepares (pin(defer=True), its registration held back) is
    faulted in before the load, or not, whatever the engine chose; unset: the engine's choice (no touch where the
    load brings the states). Every other pin is left as the engine asks; recorded as load_touch."""
    from bridge_fgo import hostmem

    calls = []
    monkeypatch.setattr(hostmem, "pin", lambda nbytes, **kw: calls.append(kw) or _Buf())
    if touch:
        monkeypatch.setenv("BENCH_LOAD_TOUCH", touch)
    held = {}
    saves.instrument_setup(held)
    hostmem.pin(4096, defer=True, start=False, touch=engine_touch)  # a load's, registered after it
    hostmem.pin(8192)  # the first step's or the construction's
    assert calls == [dict(defer=True, start=False, touch=want == "before"), {}]
    assert saves.setup_figures(held, [])["load_touch"] == want


class _Buf:
    method = "cudaHostRegister"


@pytest.mark.parametrize("touch, register, message", [
    ("later", None, "BENCH_LOAD_TOUCH='later': 'before' or 'skip'"),
    ("skip", "beside", "BENCH_LOAD_TOUCH=skip needs the registration after the load, not BENCH_LOAD_REGISTER=beside"),
    ("skip", "before", "not BENCH_LOAD_REGISTER=before")])
def test_bench_load_touch_refuses_what_cannot_run(restore_patched, monkeypatch, touch, register, message):
    monkeypatch.setenv("BENCH_LOAD_TOUCH", touch)
    if register:
        monkeypatch.setenv("BENCH_LOAD_REGISTER", register)
    with pytest.raises(SystemExit, match=message):
        saves.instrument_setup({})


@pytest.mark.parametrize("register, deferred", [(None, True), ("before", False), ("beside", True), ("after", True)])
def test_bench_load_register_places_the_buffers_registration(restore_patched, monkeypatch, register, deferred):
    from bridge_fgo import hostmem
    from bridge_fgo.engine.streamed.engine import StreamedEngine

    real, calls = hostmem.pin, []
    monkeypatch.setattr(hostmem, "pin", lambda nbytes, **kw: calls.append(kw) or real(nbytes, **kw))
    if register:
        monkeypatch.setenv("BENCH_LOAD_REGISTER", register)
    held = {}
    saves.instrument_setup(held)
    hostmem.pin(4096, defer=True).free()  # as the engine's prepare() before a load asks for it
    assert calls == [{"defer": deferred}] and held["pins"][0]["deferred"] is deferred
    assert saves.setup_figures(held, [])["load_register"] == (register or "after")  # unset: the engine's default
    assert StreamedEngine.register_after_load is (register != "beside")  # the engine's own choice unless "beside"
    monkeypatch.setenv("BENCH_LOAD_REGISTER", "later")
    with pytest.raises(SystemExit, match="BENCH_LOAD_REGISTER='later': 'before', 'beside' or 'after'"):
        saves.instrument_setup({})


def test_the_first_iterations_phases_are_recorded_beside_the_steady_ones(restore_patched):
    held = {"timers": {"load-checkpoint": 3.0}}
    recs = [{"step_s": 0.9, "pre_s": 0.01, "fwdbwd_s": 0.7, "post_s": 0.19},
            {"step_s": 0.3, "pre_s": 0.001, "fwdbwd_s": 0.2, "post_s": 0.1},
            {"step_s": 0.32, "pre_s": 0.003, "fwdbwd_s": 0.2, "post_s": 0.12}]
    got = saves.setup_figures(held, recs)
    assert got["first_iter_after_load_phases"] == {"pre_s": 0.01, "fwdbwd_s": 0.7, "post_s": 0.19}
    assert got["steady_phases_median"] == {"pre_s": 0.002, "fwdbwd_s": 0.2, "post_s": 0.11}
    fresh = saves.setup_figures({"timers": {}}, recs)  # no load: no first iteration after one
    assert fresh["first_iter_after_load_phases"] is None and fresh["steady_phases_median"]["fwdbwd_s"] == 0.2


def test_bench_warm_skip_and_bench_head_off_change_only_what_they_name(restore_patched, monkeypatch):
    """BENCH_WARM=skip: the warm pass only waits for the registration (every later copy would); BENCH_HEAD=off: the
    first step begins unmeasured (the real Head: it stays off, nothing recorded). Bad values refused by name."""
    from bridge_fgo.engine.streamed.head import Head
    from bridge_fgo.engine.streamed.transfers import Transfers

    monkeypatch.setenv("BENCH_WARM", "skip")
    monkeypatch.setenv("BENCH_HEAD", "off")
    held = {}
    saves.instrument_setup(held)
    waited = []
    fake = types.SimpleNamespace(ready=lambda: waited.append(True))
    Transfers.warm(fake, wait=False)
    assert waited == [True]
    starts = []
    head = Head.__new__(Head)
    head.state, head.why_off, head.curve, head._handles = "off", None, None, [object()]
    head._start_trace = lambda: starts.append(True)
    monkeypatch.setattr("bridge_fgo.engine.streamed.head._microbatches", lambda: 1)
    Head.begin_step(head, True)
    assert starts == [] and head.state == "off"
    assert saves.setup_figures(held, [])["warm"] == "skip" and saves.setup_figures(held, [])["head"] == "off"
    for var, value, message in (("BENCH_WARM", "later", "BENCH_WARM='later': 'skip'"),
                                ("BENCH_HEAD", "on", "BENCH_HEAD='on': 'off' or 'whole'")):
        monkeypatch.setenv(var, value)
        with pytest.raises(SystemExit, match=message):
            saves.instrument_setup({})
        monkeypatch.delenv(var)


def test_bench_head_whole_records_from_the_steps_start(restore_patched, monkeypatch):
    """BENCH_HEAD=whole: the first step's recording starts when it is armed (the step's start), as before
    2026-11-29; unset, at the last backward's first hook."""
    from bridge_fgo.engine.streamed.head import Head

    started = []
    monkeypatch.setattr(Head, "_start_trace", lambda self: started.append(self.hook))

    def armed(self):
        self.state = "armed"

    monkeypatch.setattr(Head, "_arm", armed)
    head = Head.__new__(Head)
    saves.instrument_setup({})
    Head._arm(head)
    assert started == []
    monkeypatch.setenv("BENCH_HEAD", "whole")
    saves.instrument_setup({})
    head.hook = 0
    Head._arm(head)
    assert started == [0]


def test_the_saves_named_in_bench_sync_at_are_synchronous(monkeypatch):
    import megatron.bridge.training.checkpointing as ckpt

    seen = []
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda state, *a, **k: seen.append(state.cfg.checkpoint.async_save))
    monkeypatch.setattr(ckpt, "maybe_finalize_async_save", lambda *a, **k: None)
    monkeypatch.setenv("BENCH_SYNC_AT", "8")
    recorded = []
    saves.instrument(recorded, [])
    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(async_save=True))
    queue = types.SimpleNamespace(get_num_unfinalized_calls=lambda: 1)
    for it in (4, 6, 8):
        st = types.SimpleNamespace(train_state=types.SimpleNamespace(step=it), cfg=cfg, async_calls_queue=queue)
        ckpt.save_checkpoint(st)
    assert seen == [True, True, False] and cfg.checkpoint.async_save  # off for that call only
    assert [(r["iteration"], r["async"], r["pending_before"]) for r in recorded] == [(4, True, 1), (6, True, 1),
                                                                                      (8, False, 1)]
    s = saves.summarize([{"iter": 5, "step_s": 1.0}], recorded, [])
    assert len(s["async_stalls_s"]) == 2 and len(s["sync_saves_s"]) == 1


def fake_run(path, setup, load, first, steady, stalls, sync, pins=(), rank1=None, finishing=None, profile=None,
             phases=None):
    s = {"setup_s": setup, "load_s": load, "first_iter_after_load_s": first, "steady_after_first_median_s": steady,
         "async_stalls_s": list(stalls), "sync_saves_s": [sync], "host_peak_rss_gib": 12.0, "max_shm_used_gib": 5.0,
         "pins": list(pins), "setup_pin_s": sum(p.get("pin_s", 0) for p in pins),
         "setup_unpin_s": sum(p.get("free_s", 0) for p in pins), "load_profile": profile}
    if phases is not None:  # (the first iteration's, the steady steps' median), each (pre, fwdbwd, post)
        s["first_iter_after_load_phases"], s["steady_phases_median"] = (
            dict(zip(("pre_s", "fwdbwd_s", "post_s"), p)) for p in phases)
    if finishing is not None:
        s["async_finishing_s"] = list(finishing)
    with open(path, "w") as f:
        json.dump({"summary": s}, f)
    if rank1 is not None:
        with open(path.replace(".json", ".rank1.json"), "w") as f:
            json.dump({"summary": {**s, **rank1}}, f)


def test_the_summary_gives_medians_spread_and_each_target(tmp_path):
    landing = [{"bytes": 45 * 10**9 // 10, "pin_s": 0.2, "during": "model-and-optimizer-setup"}]  # 0.1 s at 45 GB/s
    for rep, jitter in ((1, 0.0), (2, 0.1), (3, -0.1)):
        fake_run(str(tmp_path / f"one-dp_base_r{rep}.json"), 1.0, 10.0 + jitter, 0.6, 0.5, (6.0, 9.0), 12.0)
        fake_run(str(tmp_path / f"one-dp_builtin_r{rep}.json"), 1.3, 10.5, 0.62, 0.6, (6.2, 9.1), 11.0, landing)
        fake_run(str(tmp_path / f"dp2-dp_base_r{rep}.json"), 1.0, 10.0, 0.4, 0.4, (6.0, 9.45), 12.0)
        # data-parallel: the slower rank counts (rank 1's load here)
        fake_run(str(tmp_path / f"dp2-dp_builtin_r{rep}.json"), 1.0, 10.0, 0.4, 0.4, (9.88, 16.13), 12.0,
                 rank1={"load_s": 15.1}, finishing=(0.0, 6.5))
    (tmp_path / "one-dp_compare.json").write_text(json.dumps([{"iteration": 4, "identical": True},
                                                              {"iteration": 8, "identical": True}]))
    (tmp_path / "dp2-dp_compare.json").write_text(json.dumps([{"iteration": 4, "identical": False,
                                                              "differing": ["optimizer.x"]}]))
    (tmp_path / "one-dp_prep.json").write_text("{}")  # not a measured run
    text, verdicts = summary.summarize(str(tmp_path))
    assert verdicts == {"one-dp": True, "dp2-dp": False}
    assert "load" in text and "10.000 s (9.900-10.100, n=3)" in text
    assert "async stall, first: 6.200 / 6.000 s = 1.03x (target <= 1.1x: MET)" in text
    assert "async stall, first: 9.880 / 6.000 s = 1.65x (target <= 1.1x: NOT met)" in text
    assert "load: 15.100 / 10.000 s = 1.51x" in text  # rank 1's
    assert ("setup adds 0.300 s; allowed: the masters over the link 0.100 s (at 45.0 GB/s) + the pinning 0.200 s "
            "+ its unpinning 0.000 s (MET); without the pinning: 0.100 s") in text
    assert "iteration 4: DIFFER ['optimizer.x']" in text
    # where the next save finished the pending one, how long that took (recorded by bench_saves.instrument)
    assert [line for line in text.splitlines() if "of which finishing the pending save" in line and
            "builtin 6.500 s (6.500-6.500, n=3)" in line]
    # the first iteration after a load, beside the same ratio without offload
    assert "without offload: 1.20x its steady step; builtin's first iteration / base's: 1.03x" in text
    # and against base's plus what a streamed step adds: 0.62 / (0.6 + 0.6 - 0.5)
    assert "builtin's first iteration / (base's + the streamed step's own cost, builtin's steady step - base's): 0.89x" in text


def test_the_summary_shows_where_the_first_iterations_excess_is(tmp_path):
    """Each phase of the first iteration after the load and of the steady step, and what offload adds to each phase
    of the first iteration beyond what it adds to a steady step; the setup's allowance counts the unpinning too."""
    pins = [{"bytes": 45 * 10**9 // 100, "pin_s": 0.09, "during": "model-and-optimizer-setup"},
            {"bytes": 45 * 10**9 // 100, "free_s": 0.02, "during": "model-and-optimizer-setup", "released": True}]
    for rep in (1, 2, 3):
        fake_run(str(tmp_path / f"one-first_base_r{rep}.json"), 0.10, 3.0, 0.62, 0.175, (), None,
                 phases=((0.001, 0.53, 0.09), (0.0005, 0.17, 0.007)))
        fake_run(str(tmp_path / f"one-first_builtin_r{rep}.json"), 0.23, 3.3, 0.88, 0.306, (), None, pins,
                 phases=((0.007, 0.67, 0.20), (0.001, 0.18, 0.113)))
    text, verdicts = summary.summarize(str(tmp_path))
    assert [line for line in text.splitlines() if line.startswith("  of which forward-backward") and
            "base 0.530 s (0.530-0.530, n=3)" in line and "builtin 0.670 s" in line]
    assert "forward-backward: offload adds +0.140 s to the first iteration, +0.010 s to a steady step: +0.130 s more " \
           "in the first" in text
    assert "the rest (reload, update): offload adds +0.110 s to the first iteration, +0.106 s to a steady step: " \
           "+0.004 s more in the first" in text
    assert "sync save: not measured" in text and "checkpoints builtin vs base: not compared" in text
    # 0.13 s added; allowed 0.01 s over the link + 0.09 s pinning + 0.02 s unpinning = 0.12 s
    assert "setup adds 0.130 s; allowed: the masters over the link 0.010 s (at 45.0 GB/s) + the pinning 0.090 s + " \
           "its unpinning 0.020 s (NOT met); without the pinning: 0.020 s" in text
    assert verdicts == {"one-first": False}


def test_the_summary_shows_where_profiled_loads_went(tmp_path):
    def profile(read, copy, touch=None):  # bench_saves.profile_lines's shape: [calls, own s, cumulative s, where]
        own = [[2240, read, read, "~:0(<method 'readinto' of '_io.BufferedReader' objects>)"],
               [220, copy, copy, "~:0(<method 'copy_' of 'torch._C.TensorBase' objects>)"]]
        if touch is not None:
            own.append([8, touch, touch, "numa.py:148(_touch_range)"])
        return {"cumulative": own, "own": own}

    for rep, read in ((1, 2.3), (2, 2.5)):
        fake_run(str(tmp_path / f"one-dp_base_r{rep}.json"), 1.0, 3.3, 0.7, 0.2, (5.0, 5.0), 14.0,
                 profile=profile(read, 0.55))
        fake_run(str(tmp_path / f"one-dp_builtin_r{rep}.json"), 1.0, 3.8, 0.9, 0.3, (4.0, 4.7), 14.0,
                 profile=profile(read + 0.2, 0.41, 0.16))
    fake_run(str(tmp_path / "one-dp_builtin_r3.json"), 1.0, 3.8, 0.9, 0.3, (4.0, 4.7), 14.0)  # not profiled
    lines = summary.summarize(str(tmp_path))[0].splitlines()
    at = lines.index("  the load's own time by function (median, profiled runs: base 2, builtin 2)")
    assert [" ".join(x.split()) for x in lines[at + 1:at + 4]] == [
        "_io.BufferedReader.readinto base 2.400 s builtin 2.600 s",
        "torch._C.TensorBase.copy_ base 0.550 s builtin 0.410 s",
        "numa.py:148(_touch_range) base - builtin 0.160 s"]
    for path in tmp_path.glob("one-dp_*_r*.json"):
        fake_run(str(path), 1.0, 3.3, 0.7, 0.2, (5.0, 5.0), 14.0)
    assert "the load's own time" not in summary.summarize(str(tmp_path))[0]  # no profiled run: no lines


def test_the_comparison_reads_both_checkpoints_entry_by_entry(tmp_path):
    import torch

    for run, value in (("base", 0.0), ("builtin", 0.0)):
        write(tmp_path / run / "iter_0000004", **state())
        write(tmp_path / run / "iter_0000008", **state(**{"optimizer.exp_avg": torch.full((6,), value)}))
    write(tmp_path / "other" / "iter_0000004", **state(**{"optimizer.exp_avg": torch.ones(6)}))
    out = str(tmp_path / "c.json")
    rows = summary.compare(out, str(tmp_path / "base"), str(tmp_path / "builtin"), [4, 8])
    assert [r["identical"] for r in rows] == [True, True] and json.load(open(out)) == rows
    rows = summary.compare(out, str(tmp_path / "base"), str(tmp_path / "other"), [4, 8])
    assert rows[0]["differing"] == ["optimizer.exp_avg"] and "no torch_dist checkpoint" in rows[1]["error"]


def test_the_gpu_script_parses_and_names_its_groups():
    script = os.path.join(ROOT, "scripts", "gpu", "bench_ckpt.sh")
    subprocess.run(["bash", "-n", script], check=True)
    text = open(script).read()
    for group in summary.GROUPS:
        assert f"{group})" in text
    assert "BENCH_SYNC_AT=8" in text and "ckpt_summary.py --compare" in text and "DEADLINE_S" in text


def test_the_gpu_script_keeps_a_second_pass_in_a_folder_of_its_own(tmp_path):
    """BENCH_CKPT_RESULTS: results, checkpoints, tarball and summary of a pass under other settings apart."""
    out, results = tmp_path / "out", tmp_path / "i43reg"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), BENCH_CKPT_RESULTS=str(results))
    done = subprocess.run(["bash", os.path.join("scripts", "gpu", "bench_ckpt.sh"), "no-such-group"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "unknown group no-such-group" in done.stderr
    assert (tmp_path / "i43regck").is_dir() and (results / "summary.txt").exists()
    got = sorted(p.name for p in out.iterdir())
    assert got[0].startswith("i43reg-") and got[0].endswith(".tgz") and got[1:] == ["summary-i43reg.txt"]


FAKE_PYTHON = """#!/usr/bin/env bash
# python3 on the fake PATH: a run records its settings and leaves its JSON and checkpoint folder; the summary
# runs for real; a checkpoint comparison says identical
echo "${BENCH_LOAD_TOUCH:-}${BENCH_WARM:+ warm=$BENCH_WARM}|$*" >> "$RUNS_LOG"
args=("$@")
for i in "${!args[@]}"; do
  case ${args[$i]} in --out) out=${args[$((i + 1))]} ;; --save) save=${args[$((i + 1))]} ;; --compare) cmp=${args[$((i + 1))]} ;; esac
done
if [[ -n ${cmp:-} ]]; then echo '[{"iteration": 4, "identical": true}]' > "$cmp"; echo "iteration 4: identical"; exit 0; fi
if [[ "$*" == *ckpt_summary.py* ]]; then exec "$REAL_PYTHON" "$@"; fi
mkdir -p "$save"
echo '{"summary": {"load_s": 1.0, "setup_s": 0.1}}' > "$out"
"""


def _fake_bench_ckpt(tmp_path, group, **env_vars):
    """bench_ckpt.sh GROUP with python3 faked (FAKE_PYTHON): (the process, [(the run's variables, its command)])."""
    import sys

    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python3").write_text(FAKE_PYTHON)
    (fake / "python3").chmod(0o755)
    log = tmp_path / "runs.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", RUNS_LOG=str(log), REAL_PYTHON=sys.executable,
               BENCH_CKPT_RESULTS=str(tmp_path / "res"), **env_vars)
    env.pop("OUT", None)
    done = subprocess.run(["bash", os.path.join("scripts", "gpu", "bench_ckpt.sh"), group], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    runs = [line.split("|", 1) for line in log.read_text().splitlines() if "bench_offload.py" in line] \
        if log.exists() else []
    return done, runs


def _out(cmd):
    return os.path.basename(cmd.split("--out ")[1].split()[0])


def test_variants_run_in_each_repetition_beside_base_and_builtin_and_are_compared(tmp_path):
    """BENCH_CKPT_VARIANT="NAME VAR=VALUE; NAME VAR=VALUE": one more mode each, builtin-NAME, run after base and
    builtin in each repetition with its own variables (only it), its checkpoints compared with base's, its own block
    in the summary."""
    done, runs = _fake_bench_ckpt(tmp_path, "one-dp", REPS="2",
                                  BENCH_CKPT_VARIANT="touchskip BENCH_LOAD_TOUCH=skip; nowarm BENCH_WARM=skip")
    assert done.returncode == 0, done.stderr
    got = [(env, "--mode builtin" in cmd, "bridge_fgo.cli.launcher" in cmd, _out(cmd)) for env, cmd in runs]
    assert got == [("", False, False, "one-dp_prep.json")] + [
        run for rep in (1, 2) for run in (("", False, False, f"one-dp_base_r{rep}.json"),
                                          ("", True, True, f"one-dp_builtin_r{rep}.json"),
                                          ("skip", True, True, f"one-dp_builtin-touchskip_r{rep}.json"),
                                          (" warm=skip", True, True, f"one-dp_builtin-nowarm_r{rep}.json"))]
    for mode in ("builtin", "builtin-touchskip", "builtin-nowarm"):
        assert f"COMPARE one-dp {mode}: iteration 4: identical" in done.stdout
    assert not (tmp_path / "resck" / "one-dp").exists()  # every run and every comparison done: removed
    text = (tmp_path / "res" / "summary.txt").read_text()
    assert "== one-dp ==" in text and "== one-dp, builtin-touchskip (builtin with BENCH_CKPT_VARIANT's settings) ==" in text
    assert "checkpoints builtin-nowarm vs base: iteration 4: identical" in text
    for bad in ("Touch Skip", "touchskip BENCH_LOAD_TOUCH=skip; touchskip BENCH_WARM=skip", "nowarm"):
        done, runs = _fake_bench_ckpt(tmp_path, "one-dp", BENCH_CKPT_VARIANT=bad)
        assert done.returncode == 2 and f"BENCH_CKPT_VARIANT='{bad}': 'NAME VAR=VALUE...[; NAME VAR=VALUE...]'" \
            in done.stderr and runs == []


def test_the_first_iteration_group_loads_without_saves_and_profiles_base_and_builtin(tmp_path):
    """one-first: one-dp's prep, then each mode resumed for FIRST_ITERS iterations with no save and nothing to
    compare; PROFILE_FIRST=1 adds one profiled run of base and of builtin (its first iteration after the load)."""
    done, runs = _fake_bench_ckpt(tmp_path, "one-first", REPS="2", FIRST_ITERS="3", PROFILE_FIRST="1")
    assert done.returncode == 0, done.stderr
    assert [_out(cmd) for _, cmd in runs] == ["one-first_prep.json"] + [
        f"one-first_{mode}_r{rep}.json" for rep in (1, 2) for mode in ("base", "builtin")] + [
        "one-first_base_profile.json", "one-first_builtin_profile.json"]
    for _, cmd in runs[1:]:
        assert "--save" not in cmd and "--async-save" not in cmd and "--load" in cmd and "--ckpt-step 2" in cmd
    assert all("--iters 5" in cmd and "--profile-iter" not in cmd for _, cmd in runs[1:5])
    assert all("--profile-iter 1" in cmd for _, cmd in runs[5:])
    assert "COMPARE" not in done.stdout and not (tmp_path / "resck" / "one-first").exists()
    assert "== one-first ==" in (tmp_path / "res" / "summary.txt").read_text()


def test_each_run_leaves_a_tarball_that_comes_back_if_the_call_is_cut(tmp_path):
    """deadline_runs.sh: after each run, what is done so far is tarred into $OUT (a call its limit ends before
    run_kit.sh tars the logs still returns it; run_kit.sh removes it once its own holds everything)."""
    import tarfile

    out, runs = tmp_path / "out", tmp_path / "i43"
    out.mkdir()
    runs.mkdir()
    script = os.path.join(ROOT, "scripts", "gpu", "deadline_runs.sh")
    code = "import sys; open(sys.argv[-1], 'w').write('{}')"
    subprocess.run(["bash", "-c", f'set -u; R={runs}; OUT={out}; DEADLINE_S=100; MIN_S=5; source {script}; '
                    f'run first {sys.executable} -c "{code}"; run second {sys.executable} -c "{code}"'],
                   check=True, capture_output=True)
    with tarfile.open(out / "partial-i43.tgz") as tar:
        names = set(tar.getnames())
    assert {"i43/first.json", "i43/first.log", "i43/second.json", "i43/second.log"} <= names
    assert [p.name for p in out.iterdir()] == ["partial-i43.tgz"]


def test_the_reads_beside_the_pinning_bench_reads_every_byte_and_cleans_up(tmp_path, monkeypatch, capsys):
    """scripts/bench_reads_beside_pinning.py on CPU: each variant reads the whole file through the real
    hostmem.pin (unregistered without CUDA), the file is removed after, and bad sizes are refused."""
    reads = importlib.import_module("bench_reads_beside_pinning")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--file-gib", "0.004", "--gib", "0.002", "--item-mib", "1",
                                      "--reps", "2", "--dir", str(tmp_path), "--out", str(out)])
    assert reads.main() == 0
    got = json.loads(out.read_text())
    assert [r["variant"] for r in got["runs"]] == list(reads.VARIANTS) * 2
    assert all(r["reads_s"] > 0 and r["whole_s"] >= r["reads_s"] for r in got["runs"])
    assert {r["method"] for r in got["runs"] if r["variant"] != "alone"} == {"unpinned (CUDA unavailable)"}
    assert set(got["medians"]) == set(reads.VARIANTS) and got["reads_beside_over_alone"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # the file it read is gone
    monkeypatch.setattr(sys, "argv", ["bench", "--reps", "0"])
    with pytest.raises(SystemExit) as exc:
        reads.main()
    assert exc.value.code == 2 and "must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("how", [None, "straight", "torch"])
def test_bench_load_reads_chooses_torchs_reads_or_straight_ones_and_records_them(restore_patched, monkeypatch,
                                                                                 tmp_path, how):
    """BENCH_LOAD_READS=torch: a load's reads go through torch's own read_data (as before 2026-12-01), for a variant
    beside the default (straight into the buffer); what was read straight in is recorded either way."""
    import torch
    import torch.distributed.checkpoint as dcp

    from bridge_fgo.instrument import reads

    if how:
        monkeypatch.setenv("BENCH_LOAD_READS", how)
    held = {}
    saves.instrument_setup(held)
    buf = torch.zeros(64, dtype=torch.uint8)
    dcp.save({"x": torch.arange(16.0)}, checkpoint_id=tmp_path, no_dist=True)
    with reads.straight_into([types.SimpleNamespace(tensor=buf)]):  # as the load's call site enters it
        dcp.load({"x": buf.view(torch.float32)}, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(buf.view(torch.float32), torch.arange(16.0))
    got = saves.setup_figures(held, [])
    assert got["load_reads"] == (how or "straight")
    assert got["load_straight"]["tensors"] == (0 if how == "torch" else 1)
    monkeypatch.setenv("BENCH_LOAD_READS", "both")
    with pytest.raises(SystemExit, match="BENCH_LOAD_READS='both': 'torch' or 'straight'"):
        saves.instrument_setup({})


def test_bench_straight_reads_runs_and_finds_every_load_identical(tmp_path):
    """scripts/bench_straight_reads.py on CPU (no GPU variant here): torch's reads and the straight ones of the same
    checkpoint, each load's bytes compared with what was saved."""
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_straight_reads.py"), "--gib", "0.01",
                           "--tensors", "3", "--reps", "1", "--dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["all_identical"] and [r["variant"] for r in got["runs"]] == ["torch", "straight"]
    assert [r["straight"]["tensors"] for r in got["runs"]] == [0, 3]
