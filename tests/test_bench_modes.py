"""scripts/bench_offload.py's mode grammar, checks and optimizer-stack helpers, and
scripts/bench_imports.py's blocker: no GPU, no torch (the parser, and bench_saves.py, must import
without it)."""
import importlib
import os
import subprocess
import types
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)
bench_offload = importlib.import_module("bench_offload")
bench_modes = importlib.import_module("bench_modes")
bench_checks = importlib.import_module("bench_checks")
bench_workload = importlib.import_module("bench_workload")
bench_run = importlib.import_module("bench_run")
bench_imports = importlib.import_module("bench_imports")


def test_imports_without_torch():
    code = ("import sys; import bench_offload, bench_saves, bench_run, bench_workload, bench_checks, bench_modes; "
            "assert 'torch' not in sys.modules and 'megatron' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SCRIPTS)


def test_plain_modes_keep_their_tags():
    runs = bench_modes.parse_modes("base,builtin:0,builtin:256,dev-base,dev-auto:256")
    assert [r["tag"] for r in runs] == ["base", "builtin0", "builtin256", "dev-base", "dev-auto256"]
    assert [(r["mode"], r["chunk_mb"], r["dev"]) for r in runs][-1] == ("auto", 256, True)
    assert all(r["env"] == {} and r["args"] == [] for r in runs)


def test_budget_and_fraction():
    budget, fraction = bench_modes.parse_modes("builtin:256+budget=16.2,dev-auto:256+fraction=0.5")
    assert budget["tag"] == "builtin256_budget16.2"
    assert budget["env"] == {"BRIDGE_FGO_GPU_BUDGET_GIB": "16.2"} and budget["args"] == []
    assert fraction["tag"] == "dev-auto256_fraction0.5"
    assert fraction["args"] == ["--offload-fraction", "0.5"] and fraction["env"] == {} and fraction["dev"]
    assert fraction["extras"] == {"fraction": "0.5"}


def test_repeats_are_numbered_and_tags_file_safe():
    runs = bench_modes.parse_modes("base,builtin:256+budget=12,base,builtin:256+budget=12")
    assert [r["tag"] for r in runs] == ["base_0", "builtin256_budget12_1", "base_2", "builtin256_budget12_3"]
    assert all(bench_modes._TAG.fullmatch(r["tag"]) for r in runs)


@pytest.mark.parametrize("text", [
    "nope", "builtin:x", "base+budget=3", "builtin:256+budget", "builtin:256+budget=-1", "builtin:256+budget=1e3",
    "builtin:256+budget=0", "dev-auto:256+fraction=1.5", "builtin:256+fraction=0.5", "builtin:256+color=3",
    "builtin:256+budget=3+budget=4", "builtin:256+budget=3/4",
])
def test_bad_modes_are_refused(text):
    with pytest.raises(ValueError):
        bench_modes.parse_modes(text)


def summary(step, peak, **kw):
    s = {"steady_iter_peak_gib": peak, "steady_fwdbwd_peak_gib": peak - 1, "steady_step_median_s": step,
         "first_iter_s": 2 * step, "losses": [1.0], "final_params_sha256": "x", "resident_gib": 5.0,
         "sessions": [{"bytes": 100, "pinned_bytes": 100, "master_bytes": 0, "step_peak_bytes": 0}],
         "run_peak_gib": peak + 0.5, "setup_peak_gib": 3.0, "inner_optimizer": "torch.optim.adamw.AdamW"}
    s.update(kw)
    return s


def test_checks_report_budget_and_chunked_line():
    runs = bench_modes.parse_modes("base,builtin:256,builtin:256+budget=16.2,dev-base,dev-auto:256,"
                             "dev-auto:256+fraction=0.5")
    results = {"base": summary(0.6, 20.0), "builtin256": summary(1.0, 10.0),
               "builtin256_budget16.2": summary(0.8, 16.0), "dev-base": summary(0.6, 20.0),
               "dev-auto256": summary(1.1, 11.0), "dev-auto256_fraction0.5": summary(0.9, 15.0)}
    c = bench_checks.checks(results, 256, {r["tag"]: r["extras"] for r in runs})
    b = c["budget_runs"]["builtin256_budget16.2"]
    assert b["budget_gib"] == 16.2 and b["peak_within_budget"] and not b["run_peak_within_budget"]
    assert b["overhead_over_streamed"] == pytest.approx(0.2 / 0.4)
    line = c["chunked_line"]
    assert c["chunked_overhead_s"] == pytest.approx(0.5)  # the full chunked run, not the fraction one
    assert line["dev-auto256_fraction0.5"]["overhead_over_full_chunked"] == pytest.approx(0.3 / 0.5)
    assert line["dev-auto256"]["step_over_base"] == pytest.approx(1.1 / 0.6)
    assert c["run_peak_gib"]["base"] == 20.5


def test_checks_without_base_still_report_runs():
    c = bench_checks.checks({"builtin256": summary(1.0, 10.0)}, 256)
    assert c["whole_iteration_peak_gib"] == {"builtin256": 10.0} and "builtin_overhead_s" not in c


def test_peak_line_puts_the_whole_iteration_peak_first():
    line = bench_checks.peak_line("base", summary(0.6, 20.0, first_iter_peak_gib=19.0, resume_peak_gib=None))
    assert line.startswith("base: iteration peak 20.00 GiB (run 20.50, setup 3.00, first iteration 19.00)")


def _optimizer(module):
    cls = type("FusedAdam", (), {"__module__": module})
    return type("Wrapper", (), {"optimizer": cls()})()


def test_check_optimizer():
    assert bench_workload.check_optimizer(_optimizer("transformer_engine.pytorch.optimizers.fused_adam"), "te") == \
        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    chained = type("Chained", (), {"chained_optimizers": [_optimizer("apex.optimizers.fused_adam")] * 2})()
    assert bench_workload.check_optimizer(chained, "apex") == "apex.optimizers.fused_adam.FusedAdam"
    with pytest.raises(RuntimeError, match="expected a class from torch.optim"):
        bench_workload.check_optimizer(_optimizer("apex.optimizers.fused_adam"), "torch")


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
    runs = bench_modes.parse_modes("base,builtin:256,builtin:256+budget=half,dev-auto:256+fraction=moved")
    results = {"base": {"steady_iter_peak_gib": 20.0}, "builtin256": {"steady_iter_peak_gib": 10.0}}
    assert not bench_modes.resolve_symbolic(runs[3], results, 256)  # no budget run yet
    assert bench_modes.resolve_symbolic(runs[2], results, 256)
    assert runs[2]["env"] == {"BRIDGE_FGO_GPU_BUDGET_GIB": "15.000"} and runs[2]["extras"]["budget"] == "15.000"
    results["builtin256_budgethalf"] = {"sessions": [{"bytes": 3 * 2**30, "resident_bytes": 2**30}]}
    assert bench_modes.resolve_symbolic(runs[3], results, 256)
    assert runs[3]["args"] == ["--offload-fraction", "0.7500"]
    with pytest.raises(ValueError, match="or half"):
        bench_modes.parse_modes("builtin:256+budget=quarter")


def test_activation_offload_is_a_switch_on_base_and_builtin():
    runs = bench_modes.parse_modes("base,base+act=1,builtin,builtin+act=1")
    assert [(r["tag"], r["args"]) for r in runs] == [("base", []), ("base_act", ["--act-offload"]),
                                                      ("builtin", []), ("builtin_act", ["--act-offload"])]
    for bad in ("builtin+act=2", "dev-auto:256+act=1", "builtin+act"):
        with pytest.raises(ValueError):
            bench_modes.parse_modes(bad)


def test_checks_judge_the_four_activation_offload_cases_and_the_auto_window():
    results = {"base": summary(0.6, 20.0), "base_act": summary(0.7, 16.0), "builtin": summary(0.8, 10.0),
               "builtin_act": summary(0.85, 6.2)}
    c = bench_checks.checks(results, "auto")
    a = c["activation_offload"]
    assert a["both_expected_gib"] == pytest.approx(6.0) and a["both_within_5pct_of_additive"]
    assert a["overhead_s"]["both"] == pytest.approx(0.25) and a["both_overhead_at_most_sum"]
    assert c["builtin_overhead_s"] == pytest.approx(0.2)  # the auto window is the streamed run judged
    results["builtin_act"] = summary(1.2, 7.0)
    a = bench_checks.checks(results, "auto")["activation_offload"]
    assert not a["both_within_5pct_of_additive"] and not a["both_overhead_at_most_sum"]


def test_checks_compare_the_logged_parameter_norms_with_the_base_runs():
    results = {"base": summary(0.6, 20.0, params_norms=[100.0, 101.0]),
               "builtin": summary(0.8, 10.0, params_norms=[100.0, 101.0 * (1 + 2e-7)]),
               "builtin256": summary(0.8, 10.0, params_norms=[100.0, 101.0])}
    n = bench_checks.checks(results, "auto")["params_norm"]
    assert n["builtin256"] == {"identical": True, "largest_relative_difference": 0.0}
    assert not n["builtin"]["identical"] and n["builtin"]["largest_relative_difference"] == pytest.approx(2e-7)


def test_the_out_folder_is_made_before_the_run(tmp_path):
    out = tmp_path / "prof" / "deeper" / "builtin.json"
    bench_run.prepare_out(str(out))
    assert out.parent.is_dir()
    bench_run.prepare_out(str(out))  # already there
    bench_run.prepare_out(None)


def test_a_run_told_to_resume_from_no_checkpoint_is_refused(tmp_path):
    # Bridge would train from scratch and the run would pass for a resumed one (2026-11-28: a cleanup had
    # removed the checkpoint a later device call's run resumed from)
    run = [sys.executable, os.path.join(SCRIPTS, "bench_offload.py"), "run", "--mode", "base", "--load", str(tmp_path),
           "--iters", "2"]
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 2 and "no checkpoint there (no latest_checkpointed_iteration.txt)" in out.stderr


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


# -- Megatron-Core's CPU optimizer beside the streamed step (issue 35) ----------------------------------------------
def test_the_cpu_mode_and_its_fraction():
    runs = bench_modes.parse_modes("cpu,cpu+fraction=0.5,builtin,cpu")
    assert [r["tag"] for r in runs] == ["cpu_0", "cpu_fraction0.5", "builtin", "cpu_3"]
    assert runs[1]["args"] == ["--offload-fraction", "0.5"] and [r["group"] for r in runs] == [
        "cpu", "cpu+fraction=0.5", "builtin", "cpu"]
    with pytest.raises(ValueError, match="budget= applies to mode builtin, not cpu"):
        bench_modes.parse_modes("cpu+budget=3")


def test_the_cpu_mode_builds_megatron_cores_cpu_optimizer_config():
    """The run's Bridge configuration (no GPU needed to build it): optimizer_cpu_offload with the fraction given
    (1.0 by default) and the copies overlapped; the batch as given."""
    from megatron.bridge.training import config

    if not hasattr(config, "ValidationConfig"):  # the GPU kit installs 0.6.2 (scripts/gpu/prepare_wheels.sh)
        pytest.skip("the benchmark's workload is written for Megatron-Bridge >= 0.4 (ValidationConfig)")
    ap = bench_offload.parser()
    args = ap.parse_args(["run", "--mode", "cpu", "--offload-fraction", "0.5", "--global-batch", "8",
                          "--seq-length", "2048", "--micro-batch", "1"])
    cfg, opt, _, dp, _ = bench_workload.build(args)
    assert (opt.optimizer_cpu_offload, opt.optimizer_offload_fraction, opt.overlap_cpu_optimizer_d2h_h2d) == (True, 0.5, True)
    assert cfg.train.global_batch_size == 8 and cfg.model.seq_length == 2048 and cfg.dataset.seq_length == 2048
    _, opt, _, _, _ = bench_workload.build(ap.parse_args(["run", "--mode", "cpu"]))
    assert opt.optimizer_cpu_offload and opt.optimizer_offload_fraction == 1.0
    _, opt, _, _, _ = bench_workload.build(ap.parse_args(["run", "--mode", "base"]))
    assert not opt.optimizer_cpu_offload
    with pytest.raises(SystemExit):
        ap.parse_args(["run", "--mode", "cpu", "--offload-fraction", "0.5", "--optimizer", "nope"])


def test_hsdp_is_configured_as_bridges_nemotron_recipes_set_it():
    """--hsdp: Megatron-FSDP with optimizer instances on the outer data-parallel dimension and its outer
    sharding strategy (Megatron-Bridge 0.6.2's perf_recipes/nemotronh/common.py: "optim")."""
    from megatron.bridge.training import config

    if not hasattr(config, "ValidationConfig"):
        pytest.skip("the benchmark's workload is written for Megatron-Bridge >= 0.4 (ValidationConfig)")
    ap = bench_offload.parser()
    cfg, _, _, _, _ = bench_workload.build(ap.parse_args(["run", "--mode", "base", "--fsdp", "optim_grads_params",
                                                          "--hsdp", "optim"]))
    assert (cfg.ddp.use_megatron_fsdp, cfg.ddp.num_distributed_optimizer_instances,
            cfg.ddp.outer_dp_sharding_strategy) == (True, 2, "optim")
    cfg, _, _, _, _ = bench_workload.build(ap.parse_args(["run", "--mode", "base", "--fsdp", "optim_grads_params"]))
    assert cfg.ddp.num_distributed_optimizer_instances == 1
    with pytest.raises(SystemExit, match="--hsdp needs --fsdp"):
        bench_workload.build(ap.parse_args(["run", "--mode", "base", "--hsdp", "optim"]))


def test_check_optimizer_knows_megatron_cores_cpu_optimizer():
    class HybridDeviceOptimizer:
        pass

    HybridDeviceOptimizer.__module__ = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
    wrapped = types.SimpleNamespace(optimizer=HybridDeviceOptimizer())
    assert bench_workload.check_optimizer(wrapped, "torch", cpu=True).endswith(".HybridDeviceOptimizer")
    with pytest.raises(RuntimeError, match="--mode cpu: Megatron-Core built"):
        bench_workload.check_optimizer(types.SimpleNamespace(optimizer=object()), "torch", cpu=True)


def run_summary(step, losses, peak, post=0.2, sha="a"):
    return {"steady_step_median_s": step, "losses": losses, "run_peak_gib": peak, "steady_iter_peak_gib": peak,
            "setup_peak_gib": 1.0, "steady_fwdbwd_peak_gib": peak, "first_iter_s": 2.0, "inner_optimizer": "x",
            "final_params_sha256": sha, "steady_pre_median_s": 0.01, "steady_fwdbwd_median_s": step - 0.21,
            "steady_post_median_s": post}


def test_modes_given_several_times_are_judged_by_their_medians_and_the_cpu_optimizer_beside():
    runs = {"base_0": run_summary(1.0, [3.0, 2.5, 2.0], 20), "builtin_1": run_summary(1.2, [3.0, 2.5, 2.0], 10, 0.4),
            "cpu_2": run_summary(1.3, [3.0, 2.5, 2.1], 14, 0.5, "b"), "base_3": run_summary(1.1, [3.0, 2.5, 2.0], 20),
            "builtin_4": run_summary(1.25, [3.0, 2.5, 2.0], 10.5, 0.41), "cpu_5": run_summary(1.28, [3.0, 2.6, 2.1], 14, 0.5, "b")}
    groups = {t: t.rsplit("_", 1)[0] for t in runs}
    modes = bench_checks.by_mode(runs, groups)
    assert modes["base"]["runs"] == 2 and modes["base"]["step_median_s"] == pytest.approx(1.05)
    assert modes["builtin"]["overhead_s"] == pytest.approx(0.175) and modes["builtin"]["step_spread_s"] == [1.2, 1.25]
    assert modes["builtin"]["overhead_share_of_step"] == pytest.approx(0.175 / 1.05)
    assert modes["builtin"]["post_overhead_s"] == pytest.approx(0.205)
    assert modes["builtin"]["first_loss_difference_iter"] is None and modes["builtin"]["final_params_identical"]
    assert modes["cpu"]["first_loss_difference_iter"] == 2 and not modes["cpu"]["final_params_identical"]
    assert modes["builtin"]["run_peak_gib"] == 10.5
    peer = bench_checks.against_cpu_optimizer(modes, "auto")["cpu"]
    assert peer["overhead_ratio"] == pytest.approx(0.175 / 0.24) and peer["run_peak_ratio"] == pytest.approx(10.5 / 14)
    assert peer["cpu_first_loss_difference_iter"] == 2 and peer["streamed_first_loss_difference_iter"] is None
    out = bench_checks.checks(runs, "auto", {}, groups)
    assert out["by_mode"] == modes and out["against_cpu_optimizer"]["cpu"] == peer


def test_first_divergence():
    assert bench_checks.first_divergence([1.0, 2.0], [1.0, 2.0]) is None
    assert bench_checks.first_divergence([1.0, 2.5], [1.0, 2.0]) == 2
    assert bench_checks.first_divergence([1.0], [1.0, 2.0]) == 2


def test_results_table_compares_each_run_with_its_own_base_fp8_state_included(tmp_path):
    """A folder of several configurations (scripts/gpu/bench_fp8.sh): NAME_mode against NAME_base, the FP8
    scaling state's hash too; a folder with a plain `base` compares everything with it."""
    import json

    results_table = importlib.import_module("results_table")

    def write(tag, losses=(2.0, 1.5, 1.2), params="p", meta="m"):
        summary = dict(losses=list(losses), final_params_sha256=params, final_fp8_meta_sha256=meta, run_peak_gib=1.0,
                       steady_iter_peak_gib=1.0, steady_step_median_s=0.5, first_iter_s=1.0, setup_peak_gib=0.5,
                       sessions=[])
        iters = [dict(iter=i, post_s=0.1) for i in range(1, 5)]
        (tmp_path / f"{tag}.json").write_text(json.dumps(dict(summary=summary, iters=iters)))

    write("delayed_base")
    write("delayed_streamed")
    write("delayed_onewindow", meta="other amax history")
    write("tensorwise_base", params="q")
    write("tensorwise_streamed", params="p")  # equal to delayed's, not to its own base
    write("tensorwise_dp2_streamed.rank1", params="q")  # no tensorwise_dp2_base here
    same = {row[0]: row[-1] for row in results_table.rows(str(tmp_path))}
    assert same == {"delayed_base": "(the base)", "delayed_streamed": "yes", "delayed_onewindow": "NO",
                    "tensorwise_base": "(the base)", "tensorwise_streamed": "NO",
                    "tensorwise_dp2_streamed.rank1": "no base run in this folder"}
    write("base", params="q")
    assert {row[0]: row[-1] for row in results_table.rows(str(tmp_path))}["tensorwise_streamed"] == "NO"
    assert {row[0]: row[-1] for row in results_table.rows(str(tmp_path))}["tensorwise_base"] == "yes"


# -- Muon (issue 34) ----------------------------------------------------------------------------------------
def test_check_optimizer_walks_the_layer_wise_chain_and_wants_muon_there():
    muon = type("TensorParallelMuon", (), {"__module__": "megatron.core.optimizer.emerging_optimizers"})
    adam = type("AdamW", (), {"__module__": "torch.optim.adamw"})
    part = lambda inner: types.SimpleNamespace(optimizer=inner())  # noqa: E731
    layer_wise = types.SimpleNamespace(chained_optimizers=[part(muon), part(adam)])
    outer = types.SimpleNamespace(chained_optimizers=[layer_wise])
    assert bench_workload.check_optimizer(outer, "torch", muon=True) == [
        "megatron.core.optimizer.emerging_optimizers.TensorParallelMuon", "torch.optim.adamw.AdamW"]
    with pytest.raises(RuntimeError, match="expected a class from torch.optim"):
        bench_workload.check_optimizer(outer, "torch")  # Muon where the run claims Adam only
    with pytest.raises(RuntimeError, match="no TensorParallelMuon"):
        bench_workload.check_optimizer(types.SimpleNamespace(chained_optimizers=[part(adam)]), "torch", muon=True)


def test_the_muon_run_takes_bridges_own_recipe_optimizer(monkeypatch):
    from megatron.bridge.training import config

    if not hasattr(config, "ValidationConfig"):
        pytest.skip("the benchmark's workload is written for Megatron-Bridge >= 0.4 (ValidationConfig)")
    ap = bench_offload.parser()
    cfg, opt, _, _, _ = bench_workload.build(ap.parse_args(["run", "--mode", "builtin", "--chunk-mb", "0", "--muon"]))
    recipe, _ = bench_workload.recipe_optimizer_utils().distributed_muon_with_cosine_annealing()
    assert opt.optimizer == "dist_muon" and not opt.use_distributed_optimizer
    assert not cfg.ddp.use_distributed_optimizer and not cfg.ddp.overlap_param_gather
    assert all(getattr(opt, k) == getattr(recipe, k) for k in vars(recipe) if k.startswith("muon_"))
    monkeypatch.setattr(sys, "argv", ["bench_offload.py", "run", "--mode", "cpu", "--muon"])
    with pytest.raises(SystemExit):
        bench_offload.main()  # Megatron-Core's Muon has no CPU optimizer
