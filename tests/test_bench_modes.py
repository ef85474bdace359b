"""scripts/bench_offload.py's mode grammar, checks and optimizer-stack helpers, and
scripts/bench_imports.py's blocker: no GPU, no torch (the parser, and bench_saves.py, must import
without it)."""
import importlib
import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)
bench = importlib.import_module("bench_offload")
bench_imports = importlib.import_module("bench_imports")


def test_imports_without_torch():
    code = ("import sys; import bench_offload, bench_saves; "
            "assert 'torch' not in sys.modules and 'megatron' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SCRIPTS)


def test_plain_modes_keep_their_tags():
    runs = bench.parse_modes("base,builtin:0,builtin:256,dev-base,dev-auto:256")
    assert [r["tag"] for r in runs] == ["base", "builtin0", "builtin256", "dev-base", "dev-auto256"]
    assert [(r["mode"], r["chunk_mb"], r["dev"]) for r in runs][-1] == ("auto", 256, True)
    assert all(r["env"] == {} and r["args"] == [] for r in runs)


def test_budget_and_fraction():
    budget, fraction = bench.parse_modes("builtin:256+budget=16.2,dev-auto:256+fraction=0.5")
    assert budget["tag"] == "builtin256_budget16.2"
    assert budget["env"] == {"BRIDGE_FGO_GPU_BUDGET_GIB": "16.2"} and budget["args"] == []
    assert fraction["tag"] == "dev-auto256_fraction0.5"
    assert fraction["args"] == ["--offload-fraction", "0.5"] and fraction["env"] == {} and fraction["dev"]
    assert fraction["extras"] == {"fraction": "0.5"}


def test_repeats_are_numbered_and_tags_file_safe():
    runs = bench.parse_modes("base,builtin:256+budget=12,base,builtin:256+budget=12")
    assert [r["tag"] for r in runs] == ["base_0", "builtin256_budget12_1", "base_2", "builtin256_budget12_3"]
    assert all(bench._TAG.fullmatch(r["tag"]) for r in runs)


@pytest.mark.parametrize("text", [
    "nope", "builtin:x", "base+budget=3", "builtin:256+budget", "builtin:256+budget=-1", "builtin:256+budget=1e3",
    "builtin:256+budget=0", "dev-auto:256+fraction=1.5", "builtin:256+fraction=0.5", "builtin:256+color=3",
    "builtin:256+budget=3+budget=4", "builtin:256+budget=3/4",
])
def test_bad_modes_are_refused(text):
    with pytest.raises(ValueError):
        bench.parse_modes(text)


def summary(step, peak, **kw):
    s = {"steady_iter_peak_gib": peak, "steady_fwdbwd_peak_gib": peak - 1, "steady_step_median_s": step,
         "first_iter_s": 2 * step, "losses": [1.0], "final_params_sha256": "x", "resident_gib": 5.0,
         "sessions": [{"bytes": 100, "pinned_bytes": 100, "master_bytes": 0, "step_peak_bytes": 0}],
         "run_peak_gib": peak + 0.5, "setup_peak_gib": 3.0, "inner_optimizer": "torch.optim.adamw.AdamW"}
    s.update(kw)
    return s


def test_checks_report_budget_and_chunked_line():
    runs = bench.parse_modes("base,builtin:256,builtin:256+budget=16.2,dev-base,dev-auto:256,"
                             "dev-auto:256+fraction=0.5")
    results = {"base": summary(0.6, 20.0), "builtin256": summary(1.0, 10.0),
               "builtin256_budget16.2": summary(0.8, 16.0), "dev-base": summary(0.6, 20.0),
               "dev-auto256": summary(1.1, 11.0), "dev-auto256_fraction0.5": summary(0.9, 15.0)}
    c = bench.checks(results, 256, {r["tag"]: r["extras"] for r in runs})
    b = c["budget_runs"]["builtin256_budget16.2"]
    assert b["budget_gib"] == 16.2 and b["peak_within_budget"] and not b["run_peak_within_budget"]
    assert b["overhead_over_streamed"] == pytest.approx(0.2 / 0.4)
    line = c["chunked_line"]
    assert c["chunked_overhead_s"] == pytest.approx(0.5)  # the full chunked run, not the fraction one
    assert line["dev-auto256_fraction0.5"]["overhead_over_full_chunked"] == pytest.approx(0.3 / 0.5)
    assert line["dev-auto256"]["step_over_base"] == pytest.approx(1.1 / 0.6)
    assert c["run_peak_gib"]["base"] == 20.5


def test_checks_without_base_still_report_runs():
    c = bench.checks({"builtin256": summary(1.0, 10.0)}, 256)
    assert c["whole_iteration_peak_gib"] == {"builtin256": 10.0} and "builtin_overhead_s" not in c


def test_peak_line_puts_the_whole_iteration_peak_first():
    line = bench.peak_line("base", summary(0.6, 20.0, first_iter_peak_gib=19.0, resume_peak_gib=None))
    assert line.startswith("base: iteration peak 20.00 GiB (run 20.50, setup 3.00, first iteration 19.00)")


def _optimizer(module):
    cls = type("FusedAdam", (), {"__module__": module})
    return type("Wrapper", (), {"optimizer": cls()})()


def test_check_optimizer():
    assert bench.check_optimizer(_optimizer("transformer_engine.pytorch.optimizers.fused_adam"), "te") == \
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    chained = type("Chained", (), {"chained_optimizers": [_optimizer("apex.optimizers.fused_adam")] * 2})()
    assert bench.check_optimizer(chained, "apex") == "apex.optimizers.fused_adam.FusedAdam"
    with pytest.raises(RuntimeError, match="expected a class from torch.optim"):
        bench.check_optimizer(_optimizer("apex.optimizers.fused_adam"), "torch")


def test_blocker_hides_an_installed_package(tmp_path, monkeypatch):
    (tmp_path / "bench_hidden_pkg").mkdir()
    (tmp_path / "bench_hidden_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    blocker = bench_imports.Blocker(("bench_hidden_pkg",))
    monkeypatch.setattr(sys, "meta_path", [blocker, *sys.meta_path])
    assert not bench_imports.present("bench_hidden_pkg")
    with pytest.raises(ImportError):
        importlib.import_module("bench_hidden_pkg")
    with pytest.raises(ImportError):
        importlib.import_module("bench_hidden_pkg.sub")
    assert "bench_hidden_pkg" not in sys.modules


def test_stacks_hide_the_other_optimizers():
    assert "transformer_engine" in bench_imports.stack_hides("torch") and "apex" in bench_imports.stack_hides("torch")
    assert "transformer_engine" in bench_imports.stack_hides("apex") and "apex" not in bench_imports.stack_hides("apex")
    assert "transformer_engine" not in bench_imports.stack_hides("te")


def test_symbolic_budget_and_fraction_come_from_the_runs_before():
    runs = bench.parse_modes("base,builtin:256,builtin:256+budget=half,dev-auto:256+fraction=moved")
    results = {"base": {"steady_iter_peak_gib": 20.0}, "builtin256": {"steady_iter_peak_gib": 10.0}}
    assert not bench.resolve_symbolic(runs[3], results, 256)  # no budget run yet
    assert bench.resolve_symbolic(runs[2], results, 256)
    assert runs[2]["env"] == {"BRIDGE_FGO_GPU_BUDGET_GIB": "15.000"} and runs[2]["extras"]["budget"] == "15.000"
    results["builtin256_budgethalf"] = {"sessions": [{"bytes": 3 * 2**30, "resident_bytes": 2**30}]}
    assert bench.resolve_symbolic(runs[3], results, 256)
    assert runs[3]["args"] == ["--offload-fraction", "0.7500"]
    with pytest.raises(ValueError, match="or half"):
        bench.parse_modes("builtin:256+budget=quarter")


def test_activation_offload_is_a_switch_on_base_and_builtin():
    runs = bench.parse_modes("base,base+act=1,builtin,builtin+act=1")
    assert [(r["tag"], r["args"]) for r in runs] == [("base", []), ("base_act", ["--act-offload"]),
                                                      ("builtin", []), ("builtin_act", ["--act-offload"])]
    for bad in ("builtin+act=2", "dev-auto:256+act=1", "builtin+act"):
        with pytest.raises(ValueError):
            bench.parse_modes(bad)


def test_checks_judge_the_four_activation_offload_cases_and_the_auto_window():
    results = {"base": summary(0.6, 20.0), "base_act": summary(0.7, 16.0), "builtin": summary(0.8, 10.0),
               "builtin_act": summary(0.85, 6.2)}
    c = bench.checks(results, "auto")
    a = c["activation_offload"]
    assert a["both_expected_gib"] == pytest.approx(6.0) and a["both_within_5pct_of_additive"]
    assert a["overhead_s"]["both"] == pytest.approx(0.25) and a["both_overhead_at_most_sum"]
    assert c["builtin_overhead_s"] == pytest.approx(0.2)  # the auto window is the streamed run judged
    results["builtin_act"] = summary(1.2, 7.0)
    a = bench.checks(results, "auto")["activation_offload"]
    assert not a["both_within_5pct_of_additive"] and not a["both_overhead_at_most_sum"]


def test_checks_compare_the_logged_parameter_norms_with_the_base_runs():
    results = {"base": summary(0.6, 20.0, params_norms=[100.0, 101.0]),
               "builtin": summary(0.8, 10.0, params_norms=[100.0, 101.0 * (1 + 2e-7)]),
               "builtin256": summary(0.8, 10.0, params_norms=[100.0, 101.0])}
    n = bench.checks(results, "auto")["params_norm"]
    assert n["builtin256"] == {"identical": True, "largest_relative_difference": 0.0}
    assert not n["builtin"]["identical"] and n["builtin"]["largest_relative_difference"] == pytest.approx(2e-7)


def test_the_out_folder_is_made_before_the_run(tmp_path):
    out = tmp_path / "prof" / "deeper" / "builtin.json"
    bench.prepare_out(str(out))
    assert out.parent.is_dir()
    bench.prepare_out(str(out))  # already there
    bench.prepare_out(None)


def test_trace_streams_finds_where_the_compute_stream_waited(tmp_path):
    """scripts/trace_streams.py on a made-up timeline: kernels on stream 7, 2 ms idle while an engine copy
    in runs, the copies' figures beside."""
    import gzip
    import json

    trace_streams = importlib.import_module("trace_streams")
    events = [dict(cat="kernel", name="k", ts=ts, dur=dur, args=dict(stream=7)) for ts, dur in
              ((0, 100), (100, 100), (2200, 100), (2300, 10))]
    events += [dict(cat="gpu_memcpy", name="Memcpy HtoD (Pinned -> Device)", ts=120, dur=3000,
                    args=dict(stream=20, bytes=3_000_000)),
               dict(cat="gpu_memcpy", name="Memcpy DtoH (Device -> Pinned)", ts=3000, dur=500,
                    args=dict(stream=21, bytes=1_000_000))]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = trace_streams.analyse(str(path))
    assert out["copies"] == {"h2d": 1, "d2h": 1} and out["GBps"] == {"h2d": 1.0, "d2h": 2.0}
    assert out["compute"] == {"span_ms": 2.3, "idle_ms": 2.0, "idle_in_gaps_over_ms": {"0.5": 2.0},
                              "largest_gaps": [{"at_ms": 0.2, "ms": 2.0, "copies": ["h2d"]}]}
