"""scripts/bench_saves.py (checkpoint saves in scripts/bench_offload.py) and scripts/check_checkpoint.py's
comparison, on CPU: the save kinds' runs and tags, the options' checks, the per-save records the training
process keeps (Bridge's own functions timed where the loop finds them), the summary and checks, and
checkpoints compared entry by entry then pruned (real torch.distributed.checkpoint directories)."""
import importlib
import os
import sys
import time
import types

import pytest

from test_bench_modes import bench_modes, bench_offload  # scripts/ is on sys.path from here on

saves = importlib.import_module("bench_saves")
check_checkpoint = importlib.import_module("check_checkpoint")


def test_every_mode_runs_once_per_save_kind():
    runs = saves.expand(bench_modes.parse_modes("base,builtin:256"), saves.parse_kinds("sync,async"), 4, "/out")
    assert [r["tag"] for r in runs] == ["base_sync", "base_async", "builtin256_sync", "builtin256_async"]
    assert runs[1]["args"] == ["--save", "/out/ckpt_base_async", "--save-interval", "4", "--async-save"]
    assert runs[2]["args"] == ["--save", "/out/ckpt_builtin256_sync", "--save-interval", "4"]
    assert [r["save"] for r in runs] == ["sync", "async"] * 2 and runs[3]["chunk_mb"] == 256
    plain = bench_modes.parse_modes("base")
    assert saves.expand(plain, ["async"], None, "/out") == plain  # without --save-every nothing changes


@pytest.mark.parametrize("text", ["", "async,async", "async,later", "sync;async"])
def test_bad_save_kinds_are_refused(text):
    with pytest.raises(ValueError, match="sync, async"):
        saves.parse_kinds(text)


@pytest.mark.parametrize("argv, message", [
    (["--save-every", "0"], "--save-every must be >= 1"),
    (["--save-every", "3", "--save-kinds", "async,x"], "sync, async"),
    (["--compare-at", "3"], "--compare-at needs --save-every"),
    (["--save-every", "3", "--compare-at", "4"], "multiple of it"),
    (["--save-every", "3", "--compare-at", "12", "--iters", "10"], "at most --iters"),
])
def test_the_options_are_checked_before_anything_runs(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["bench_offload.py", "all", "--out-dir", "/nonexistent", *argv])
    monkeypatch.setattr(bench_offload, "run_all", lambda args: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exit_:
        bench_offload.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_host_figures_on_this_machine():
    figures = saves.host_figures()
    assert figures["rss_gib"] > 0 and figures["rss_peak_gib"] >= figures["rss_gib"]
    assert figures["mem_available_gib"] > 0 and figures["shm_used_gib"] >= 0


def test_bridges_save_and_finalize_are_timed_where_the_loop_finds_them(monkeypatch):
    """Bridge's checkpoint manager calls save_checkpoint and maybe_finalize_async_save through the
    checkpointing module's globals (older releases bind them elsewhere too): each call is recorded."""
    import megatron.bridge.training.checkpointing as ckpt

    calls = []

    def save_checkpoint(state, *a, **k):  # finishing the pending save inside the call, as bridge_fgo may
        state.async_calls_queue.maybe_finalize_async_calls(blocking=True)
        calls.append("save")

    monkeypatch.setattr(ckpt, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(ckpt, "maybe_finalize_async_save",
                        lambda global_state, ckpt_cfg, blocking=False, terminate=False: calls.append("finalize"))
    alias = types.ModuleType("megatron.bridge.alias_for_test")
    alias.save_checkpoint = ckpt.save_checkpoint
    monkeypatch.setitem(sys.modules, alias.__name__, alias)
    recorded, finalized = [], []
    saves.instrument(recorded, finalized)
    def finish(blocking=False):
        time.sleep(0.02)

    queue = types.SimpleNamespace(get_num_unfinalized_calls=lambda: 1, maybe_finalize_async_calls=finish)
    state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=4), async_calls_queue=queue,
                                  cfg=types.SimpleNamespace(checkpoint=types.SimpleNamespace(async_save=True)))
    alias.save_checkpoint(state, "model", "optimizer")
    ckpt.maybe_finalize_async_save(global_state=state, ckpt_cfg=None, blocking=True)
    queue.get_num_unfinalized_calls = lambda: 0
    ckpt.maybe_finalize_async_save(state, None, False)  # nothing pending: not recorded
    assert calls == ["save", "finalize", "finalize"]
    (s,) = recorded
    assert s["iteration"] == 4 and s["async"] and s["save_s"] >= s["finishing_pending_s"] >= 0.02
    assert s["rss_gib_before"] > 0 and queue.maybe_finalize_async_calls is finish  # the queue as it was
    assert "mem_available_gib_after" in s and "shm_used_gib_before" in s
    (f,) = finalized
    assert f["iteration"] == 4 and f["blocking"] and f["pending"] == 1 and f["finalize_s"] >= 0


def test_summary_and_checks_of_the_saves():
    def run(stall, after, steady):
        recs = [{"iter": i, "step_s": after if i in (5, 9) else steady, "mem_available_gib": 100 - i} for i in
                range(1, 11)]
        rec_saves = [{"iteration": it, "save_s": stall, "mem_available_gib_after": 80.0, "shm_used_gib_after": 9.5}
                     for it in (4, 8)]
        s = saves.summarize(recs, rec_saves, [{"finalize_s": 0.25}])
        s.update(steady_step_median_s=steady, host_peak_rss_gib=30.0, checkpoint_compare={"identical": True})
        return s

    summary = run(0.5, 1.2, 1.0)
    assert summary["save_stall_median_s"] == 0.5 and summary["after_save_step_median_s"] == 1.2
    assert summary["min_mem_available_gib"] == 80.0 and summary["max_shm_used_gib"] == 9.5
    assert summary["finalize_wait_max_s"] == 0.25
    c = saves.checks({"base_async": run(0.5, 1.0, 1.0), "builtin_async": run(0.75, 1.3, 1.1),
                      "builtin_sync": run(3.0, 1.1, 1.1), "base": {"steady_step_median_s": 1.0}})
    assert set(c) == {"base_async", "builtin_async", "builtin_sync"}  # runs without saves are left out
    assert c["builtin_async"]["stall_over_base_async"] == pytest.approx(1.5)
    assert c["builtin_async"]["stall_within_base_async"] is False
    assert c["builtin_async"]["after_save_over_steady_s"] == pytest.approx(0.2)
    assert c["builtin_async"]["saves"] == 2 and c["builtin_async"]["checkpoint_compare"] == {"identical": True}
    assert "stall_over_base_async" not in c["builtin_sync"]
    assert saves.line("base_async", {**summary, "checkpoint_compare": {"iteration": 4, "reference": "base_sync",
                                                                       "identical": True}}) == (
        "base_async: 2 save(s), stall median 0.500 s (max 0.500 s), iteration after a save 1.200 s (steady 1.000 s), "
        "checkpoint at 4 identical to base_sync's: True")


# -- checkpoints compared entry by entry (real torch.distributed.checkpoint directories) ----------------------

def write(path, **entries):
    import torch.distributed.checkpoint as dcp

    dcp.save(entries, checkpoint_id=str(path), no_dist=True)


def state(**changes):
    import torch

    out = {"optimizer.exp_avg": torch.arange(6, dtype=torch.float32), "model.weight": torch.ones(2, 3).bfloat16(),
           "optimizer.groups": {"lr": 0.1, "step": 4}}
    out.update(changes)
    return out


def test_checkpoints_compare_entry_by_entry(tmp_path):
    import torch

    write(tmp_path / "a", **state())
    write(tmp_path / "same", **state())
    write(tmp_path / "value", **state(**{"optimizer.exp_avg": torch.arange(6, dtype=torch.float32) + 1e-7}))
    write(tmp_path / "dtype", **state(**{"model.weight": torch.ones(2, 3)}))
    write(tmp_path / "object", **state(**{"optimizer.groups": {"lr": 0.1, "step": 5}}))
    extra = state()
    extra["optimizer.more"] = torch.zeros(1)
    write(tmp_path / "extra", **extra)
    a = str(tmp_path / "a")
    assert check_checkpoint.differing(a, str(tmp_path / "same")) == []
    assert check_checkpoint.differing(a, str(tmp_path / "value")) == ["optimizer.exp_avg"]
    assert check_checkpoint.differing(a, str(tmp_path / "dtype")) == ["model.weight"]
    assert check_checkpoint.differing(a, str(tmp_path / "object")) == ["optimizer.groups.step"]  # DCP flattens dicts
    assert check_checkpoint.differing(a, str(tmp_path / "extra")) == ["optimizer.more"]
    assert check_checkpoint.contents(a) == {"entries": 4, "tensors": 2, "optimizer_tensors": 1, "bytes": 6 * 4 + 6 * 2}


def test_numpy_rng_states_compare_by_value(tmp_path):
    # Bridge saves numpy's RNG state (a tuple holding a uint32 array) in rng_state: `==` on it raised
    import numpy as np

    rng = np.random.RandomState(1234).get_state()
    other = np.random.RandomState(4321).get_state()
    write(tmp_path / "a", **state(rng_state={"np": rng}))
    write(tmp_path / "same", **state(rng_state={"np": np.random.RandomState(1234).get_state()}))
    write(tmp_path / "other", **state(rng_state={"np": other}))
    a = str(tmp_path / "a")
    assert check_checkpoint.differing(a, str(tmp_path / "same")) == []
    assert check_checkpoint.differing(a, str(tmp_path / "other")) != []
    assert check_checkpoint._same(np.zeros(2, np.uint32), np.zeros(2, np.int64)) is False


def test_each_run_is_compared_with_the_reference_then_pruned(tmp_path):
    import torch

    for tag, value in (("base_sync", 0.0), ("builtin_async", 0.0), ("builtin_sync", 1.0)):
        for it in (3, 6):
            write(saves.iteration_path(str(tmp_path), tag, it), **state(**{"optimizer.exp_avg": torch.full((6,), value)}))
    out = str(tmp_path)
    ref = saves.compare_and_prune(out, "base_sync", "base_sync", 3, keep=False)
    assert ref["identical"] and ref["tensors"] == 2
    assert os.listdir(tmp_path / "ckpt_base_sync") == ["iter_0000003"]  # the reference keeps the compared one
    assert saves.compare_and_prune(out, "builtin_async", "base_sync", 3, keep=False)["identical"]
    assert os.listdir(tmp_path / "ckpt_builtin_async") == []
    row = saves.compare_and_prune(out, "builtin_sync", "base_sync", 3, keep=True)
    assert not row["identical"] and row["differing"] == ["optimizer.exp_avg"] and row["n_differing"] == 1
    assert sorted(os.listdir(tmp_path / "ckpt_builtin_sync")) == ["iter_0000003", "iter_0000006"]
    assert "no torch_dist checkpoint" in saves.compare_and_prune(out, "missing", "base_sync", 3, keep=False)["error"]


def test_the_snapshot_prototype_benchmark_runs_and_checks_its_copies():
    """scripts/bench_snapshot.py (the shared-memory snapshot prototype of docs/design.md#async-save): both
    ways produce the views' values (it asserts so) and it reports both and their ratio."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_snapshot.py")
    out = subprocess.run([sys.executable, script, "--gib", "0.01", "--tensors", "4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("writers: median ") and lines[1].startswith("shared: median ")
    assert lines[2].startswith("shared / writers: ")
