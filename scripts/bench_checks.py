"""What scripts/bench_offload.py `all` judges from its runs (ratios within one call: same machine, same
hour): the streamed step's targets, budget runs, Megatron-Core's chunked line and CPU optimizer beside
it, activation offloading, the parameter norm; and each run's line. Imports no torch.
"""
import json

from bench_modes import streamed_tag

GIB = 2**30


def _overhead(run, ref):
    return run["steady_step_median_s"] - ref["steady_step_median_s"]


def _ratio(a, b):
    return a / b if b and b > 0 else None


def checks(runs, default_mb, extras=None, groups=None):
    """The streamed step's targets (issue 9), as ratios within this call; and, when present, the budget
    runs (peak against budget, overhead against the full-offload streamed run's) and the chunked line
    (overhead ratios). `extras`: tag -> {key: value} from parse_modes."""
    extras = extras or {}
    base, one, streamed = runs.get("base"), runs.get("builtin0"), runs.get(streamed_tag(default_mb))
    dev_base = runs.get("dev-base")
    chunked_tags = [k for k in runs if k.startswith("dev-auto") and not extras.get(k)]
    chunked = runs[chunked_tags[0]] if chunked_tags else None
    out = {}
    if runs:
        out.update({
            "whole_iteration_peak_gib": {k: v["steady_iter_peak_gib"] for k, v in runs.items()},
            "run_peak_gib": {k: v.get("run_peak_gib") for k, v in runs.items()},
            "setup_peak_gib": {k: v.get("setup_peak_gib") for k, v in runs.items()},
            "forward_backward_peak_gib": {k: v["steady_fwdbwd_peak_gib"] for k, v in runs.items()},
            "steady_step_median_s": {k: v["steady_step_median_s"] for k, v in runs.items()},
            "first_iter_s": {k: v["first_iter_s"] for k, v in runs.items()},
            "inner_optimizer": {k: v.get("inner_optimizer") for k, v in runs.items()},
            "losses_bit_identical": len({json.dumps(v["losses"]) for v in runs.values()}) == 1,
            "final_params_identical": len({v["final_params_sha256"] for v in runs.values()}) == 1,
        })
    overhead = _overhead(streamed, base) if base and streamed else None
    if base and streamed:
        sess = streamed["sessions"]
        step_peak = sum(s.get("step_peak_bytes", 0) for s in sess) / GIB
        offloaded = sum(s.get("bytes", 0) for s in sess)
        pinned = sum(s.get("pinned_bytes", 0) for s in sess)
        masters = sum(s.get("master_bytes", 0) for s in sess) / GIB
        floor = max(streamed["steady_fwdbwd_peak_gib"], streamed["resident_gib"])
        bound = (floor + step_peak) * 1.03
        out.update({
            "peak_bound_gib": bound,
            "peak_within_bound": streamed["steady_iter_peak_gib"] <= bound,
            "step_peak_gib": step_peak,
            "master_gib": masters,
            "builtin_overhead_s": overhead,
            "first_iter_ratio": streamed["first_iter_s"] / base["first_iter_s"],
            "first_iter_within_1_2x": streamed["first_iter_s"] <= 1.2 * base["first_iter_s"],
            "bytes_offloaded": offloaded,
            "pinned_over_offloaded": pinned / offloaded if offloaded else None,
            "pinned_within_5pct": bool(offloaded) and abs(pinned / offloaded - 1) <= 0.05,
        })
        if one:
            out["one_window_peak_gib"] = one["steady_iter_peak_gib"]
        if chunked:
            chunked_overhead = _overhead(chunked, dev_base or base)
            gap = chunked["steady_iter_peak_gib"] - streamed["steady_iter_peak_gib"]
            out.update({
                "chunked_overhead_s": chunked_overhead,
                "overhead_over_chunked": _ratio(overhead, chunked_overhead),
                "overhead_within_0_8x_chunked": overhead <= 0.8 * chunked_overhead,
                "peak_below_chunked_gib": gap,
                "peak_below_chunked_over_masters": gap / masters if masters else None,
                "peak_below_chunked_by_80pct_masters": bool(masters) and gap >= 0.8 * masters,
            })
    budget = {}
    for tag, extra in extras.items():
        if "budget" not in extra or tag not in runs:
            continue
        r, gib = runs[tag], float(extra["budget"])
        entry = {"budget_gib": gib, "whole_iteration_peak_gib": r["steady_iter_peak_gib"],
                 "run_peak_gib": r.get("run_peak_gib"),
                 "peak_within_budget": r["steady_iter_peak_gib"] <= gib,
                 "run_peak_within_budget": r.get("run_peak_gib") is not None and r["run_peak_gib"] <= gib}
        if base:
            entry["overhead_s"] = _overhead(r, base)
            entry["overhead_over_streamed"] = _ratio(entry["overhead_s"], overhead)
        budget[tag] = entry
    if budget:
        out["budget_runs"] = budget
    line = {}
    for tag in (k for k in runs if k.startswith("dev-auto") or k.startswith("auto")):
        ref = dev_base if tag.startswith("dev-") and dev_base else base
        if not ref:
            continue
        r = runs[tag]
        entry = {"offload_fraction": (extras.get(tag) or {}).get("fraction"), "overhead_s": _overhead(r, ref),
                 "step_over_base": _ratio(r["steady_step_median_s"], ref["steady_step_median_s"]),
                 "whole_iteration_peak_gib": r["steady_iter_peak_gib"]}
        if chunked and tag not in chunked_tags:
            entry["overhead_over_full_chunked"] = _ratio(entry["overhead_s"], _overhead(chunked, dev_base or base))
        if overhead is not None:
            entry["streamed_overhead_over_this"] = _ratio(overhead, entry["overhead_s"])
        line[tag] = entry
    if line:
        out["chunked_line"] = line
    both = activation_offload(runs, default_mb)
    if both:
        out["activation_offload"] = both
    norms = params_norms(runs)
    if norms:
        out["params_norm"] = norms
    modes = by_mode(runs, groups or {})
    if modes:
        out["by_mode"] = modes
        out["against_cpu_optimizer"] = against_cpu_optimizer(modes, default_mb)
    return out


def _median(values):
    values = sorted(values)
    n = len(values)
    return (values[n // 2] + values[(n - 1) // 2]) / 2 if n else None


def first_divergence(losses, reference):
    """The first iteration (1-based) whose loss differs from the reference run's, bit for bit; None if none."""
    for i, (a, b) in enumerate(zip(losses, reference), 1):
        if a != b:
            return i
    return None if len(losses) == len(reference) else min(len(losses), len(reference)) + 1


def by_mode(runs, groups):
    """Runs of the same mode (a mode given several times, interleaved) as one entry: the medians of their
    steady steps and of each phase, the spread, the overhead against the median no-offload run (and as a
    share of its step), the highest run's peak from process start and steady peak, and the first iteration
    whose loss differs from the first no-offload run's (None: bit-identical losses)."""
    members = {}
    for tag, r in runs.items():
        members.setdefault(groups.get(tag, tag), []).append(r)
    base = members.get("base")
    if not base:
        return None
    reference = base[0]["losses"]
    out = {}
    for group, rs in members.items():
        steps = [r["steady_step_median_s"] for r in rs]
        entry = {"runs": len(rs), "step_median_s": _median(steps), "step_spread_s": [min(steps), max(steps)],
                 "run_peak_gib": max((r.get("run_peak_gib") or 0) for r in rs),
                 "steady_peak_gib": max(r["steady_iter_peak_gib"] for r in rs),
                 "first_loss_difference_iter": min((d for d in (first_divergence(r["losses"], reference) for r in rs)
                                                    if d is not None), default=None),
                 "final_params_identical": len({r["final_params_sha256"] for r in rs + base[:1]}) == 1}
        for phase in ("pre", "fwdbwd", "post"):
            values = [r[f"steady_{phase}_median_s"] for r in rs if f"steady_{phase}_median_s" in r]
            if values:
                entry[f"{phase}_median_s"] = _median(values)
        out[group] = entry
    ref = out["base"]
    for entry in out.values():
        entry["overhead_s"] = entry["step_median_s"] - ref["step_median_s"]
        entry["overhead_share_of_step"] = entry["overhead_s"] / ref["step_median_s"]
        for phase in ("pre", "fwdbwd", "post"):
            if f"{phase}_median_s" in entry and f"{phase}_median_s" in ref:
                entry[f"{phase}_overhead_s"] = entry[f"{phase}_median_s"] - ref[f"{phase}_median_s"]
    return out


def against_cpu_optimizer(modes, default_mb):
    """The streamed step beside Megatron-Core's CPU optimizer (every cpu mode given): overhead and run's
    peak as ratios (issue 35's targets: overhead at most 1.0x, run's peak at most 0.8x)."""
    streamed = modes.get("builtin" if default_mb in (None, "auto") else f"builtin:{default_mb}")
    out = {}
    for group, entry in modes.items():
        if not group.startswith("cpu") or streamed is None:
            continue
        out[group] = {"overhead_ratio": _ratio(streamed["overhead_s"], entry["overhead_s"]),
                      "run_peak_ratio": _ratio(streamed["run_peak_gib"], entry["run_peak_gib"]),
                      "cpu_first_loss_difference_iter": entry["first_loss_difference_iter"],
                      "streamed_first_loss_difference_iter": streamed["first_loss_difference_iter"]}
    return out or None


def params_norms(runs):
    """Each run's logged parameter norms against the base run's: the largest relative difference (0.0:
    bit-identical), for issue 24's log_params_norm."""
    base = (runs.get("base") or {}).get("params_norms")
    if not base:
        return None
    out = {}
    for tag, r in runs.items():
        mine = r.get("params_norms")
        if tag == "base" or not mine or len(mine) != len(base):
            continue
        out[tag] = {"identical": mine == base,
                    "largest_relative_difference": max(abs(a - b) / abs(b) for a, b in zip(mine, base) if b)}
    return out or None


def activation_offload(runs, default_mb):
    """The four cases of issue 24 (neither, activation offload alone, the streamed step alone, both):
    whether the savings add up (both within 5% of the base's peak less both savings) and the overheads
    too (both at most the sum of the two single overheads), and bit-identical losses."""
    tag = streamed_tag(default_mb)
    base, act, streamed, both = (runs.get(t) for t in ("base", "base_act", tag, f"{tag}_act"))
    if not (base and act and streamed and both):
        return None
    peak = {k: r["steady_iter_peak_gib"] for k, r in (("base", base), ("act", act), ("streamed", streamed),
                                                      ("both", both))}
    additive = peak["base"] - (peak["base"] - peak["act"]) - (peak["base"] - peak["streamed"])
    over = {k: _overhead(r, base) for k, r in (("act", act), ("streamed", streamed), ("both", both))}
    return {"whole_iteration_peak_gib": peak, "both_expected_gib": additive,
            "both_within_5pct_of_additive": peak["both"] <= 1.05 * additive,
            "overhead_s": over, "both_overhead_at_most_sum": over["both"] <= over["act"] + over["streamed"],
            "losses_bit_identical": len({json.dumps(r["losses"]) for r in (base, act, streamed, both)}) == 1,
            "final_params_identical": len({r["final_params_sha256"] for r in (base, act, streamed, both)}) == 1}


def peak_line(tag, s):
    """One run's line in `all`: whole-iteration peak first, then the peaks from process start."""
    def gib(key):
        v = s.get(key)
        return "-" if v is None else f"{v:.2f}"

    return (f"{tag}: iteration peak {gib('steady_iter_peak_gib')} GiB (run {gib('run_peak_gib')}, setup "
            f"{gib('setup_peak_gib')}, first iteration {gib('first_iter_peak_gib')}"
            + (f", resume {gib('resume_peak_gib')}" if s.get("resume_peak_gib") is not None else "")
            + f"), forward-backward {gib('steady_fwdbwd_peak_gib')} GiB, step {s['steady_step_median_s']:.3f} s, "
            f"first {s['first_iter_s']:.2f} s, {s.get('inner_optimizer')}")
