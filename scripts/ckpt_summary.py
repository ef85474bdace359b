#!/usr/bin/env python3
"""Issue 43's summary: checkpoint I/O with and without offload, from scripts/gpu/bench_ckpt.sh's runs.

  python3 scripts/ckpt_summary.py RESULTS_DIR [--link-gbs 45]      # prints the summary (summary.txt)
  python3 scripts/ckpt_summary.py --compare OUT.json BASE_CKPT BUILTIN_CKPT ITER...   # GROUP_compare.json

Each run is RESULTS_DIR/GROUP_MODE_rN.json (scripts/bench_offload.py run's output; a data-parallel run's
rank 1 beside it as .rank1.json), GROUP one of GROUPS below, MODE base or builtin;
GROUP_compare.json holds the checkpoint comparison. Per group and mode, over the runs: medians and spread
(min-max) of model-and-optimizer setup, the pinning within it (builtin), the load, the first iteration after
it and the steady step (each with its phases: where the first iteration's excess is), the first asynchronous
save's stall, the next one's, the synchronous save, the host's RSS peak and /dev/shm; then the targets: async
stall, sync save and load each at most 1.1x without offload, the first iteration after a load at most 1.1x
builtin's steady step (beside it, against no offload's first iteration plus what a steady streamed step adds: no
offload's is itself 3-4x its steady step), setup at most no offload's plus the masters' bytes over the link
(--link-gbs) plus the pinning (the landing block's registration and its unregistration, reported apart), and the
checkpoints identical.
Every data-parallel figure is the slower rank's. Runs made with BENCH_PROFILE_LOAD (scripts/bench_saves.py) add
the functions of most own time during the load, medians per mode (rank 0's).

Imports neither torch nor Megatron.
"""
import argparse
import glob
import json
import os
import re
import statistics

from bench_saves import PHASES  # an iteration's phases, as each run records them

TARGET = 1.1
# each phase's name in the summary
PHASE_NAMES = dict(zip(PHASES, ("before forward-backward", "forward-backward", "the rest (reload, update)")))
GROUPS = ("one-dp", "one-full", "one-dp-1t", "one-fsdp", "one-first", "dp2-dp", "dp2-full", "dp2-fsdp")
# builtin-NAME: bench_ckpt.sh's BENCH_CKPT_VARIANT, builtin under other settings, interleaved with the two
RUN = re.compile(r"^(?P<group>[a-z0-9-]+)_(?P<mode>base|builtin(?:-[a-z0-9]+)?)_r(?P<rep>\d+)\.json$")


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)["summary"]
    except (OSError, ValueError, KeyError):
        return None


def figures(s):
    """One rank's figures of one run (None where the run did not record it)."""
    stalls, syncs = s.get("async_stalls_s") or [], s.get("sync_saves_s") or []
    # the landing block's pinning during setup (not its release, recorded with the same bytes)
    masters = sum(x.get("bytes", 0) for x in s.get("pins") or []
                  if x.get("during") == "model-and-optimizer-setup" and not x.get("released"))
    return {
        "setup_s": s.get("setup_s"), "setup_pin_s": s.get("setup_pin_s"), "setup_unpin_s": s.get("setup_unpin_s"),
        "landing_bytes": masters or None,
        "load_s": s.get("load_s"), "load_pin_s": s.get("load_pin_s"),
        "load_straight_s": (s.get("load_straight") or {}).get("seconds"),
        "first_after_load_s": s.get("first_iter_after_load_s"), "steady_s": s.get("steady_after_first_median_s"),
        **{f"first_{k}": (s.get("first_iter_after_load_phases") or {}).get(k) for k in PHASES},
        **{f"steady_{k}": (s.get("steady_phases_median") or {}).get(k) for k in PHASES},
        "async_first_s": stalls[0] if stalls else None, "async_next_s": stalls[1] if len(stalls) > 1 else None,
        "async_next_finishing_s": (s.get("async_finishing_s") or [None, None])[1] if len(stalls) > 1 else None,
        "sync_save_s": syncs[0] if syncs else None,
        "rss_peak_gib": s.get("host_peak_rss_gib"), "shm_max_gib": s.get("max_shm_used_gib"),
        # function -> its own seconds during the load, where the run was profiled
        "load_profile": {r[3]: r[1] for r in (s.get("load_profile") or {}).get("own", [])} or None,
    }


def slowest(ranks):
    """Over a run's ranks: the largest of each figure (a data-parallel run waits for its slowest rank)."""
    out = {"load_profile": ranks[0]["load_profile"]}
    for key in (k for k in ranks[0] if k != "load_profile"):
        vals = [r[key] for r in ranks if r.get(key) is not None]
        out[key] = max(vals) if vals else None
    return out


def collect(results):
    """{group: {mode: [figures of each run]}}"""
    out = {}
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        m = RUN.match(os.path.basename(path))
        if not m:
            continue
        s = _load(path)
        if s is None:
            continue
        ranks = [figures(s)] + [figures(r) for r in map(_load, sorted(glob.glob(path[:-5] + ".rank*.json"))) if r]
        out.setdefault(m["group"], {}).setdefault(m["mode"], []).append(slowest(ranks))
    return out


def stat(values):
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def fmt(st, unit="s"):
    if st is None:
        return "-"
    return f"{st['median']:.3f} {unit} ({st['min']:.3f}-{st['max']:.3f}, n={st['n']})"


def ratio_line(name, base, ours, limit=TARGET):
    if base is None or ours is None or not base["median"]:
        return f"  {name}: not measured", None
    r = ours["median"] / base["median"]
    return f"  {name}: {ours['median']:.3f} / {base['median']:.3f} s = {r:.2f}x (target <= {limit}x: " \
           f"{'MET' if r <= limit else 'NOT met'})", r <= limit


KEYS = (("setup_s", "model-and-optimizer setup"), ("setup_pin_s", "  of which pinning (landing block)"),
        ("setup_unpin_s", "  of which unpinning it"),
        ("load_s", "load"), ("load_pin_s", "  of which pinning (first touch, then any wait for cudaHostRegister)"),
        ("load_straight_s", "  of which the reads straight into the host buffer"),
        ("first_after_load_s", "first iteration after the load"),
        *((f"first_{k}", f"  of which {name}") for k, name in PHASE_NAMES.items()),
        ("steady_s", "steady step"), *((f"steady_{k}", f"  of which {name}") for k, name in PHASE_NAMES.items()),
        ("async_first_s", "async save stall, first"),
        ("async_next_s", "async save stall, the next (beside the first)"),
        ("async_next_finishing_s", "  of which finishing the pending save"),
        ("sync_save_s", "sync save"), ("rss_peak_gib", "host RSS peak"), ("shm_max_gib", "/dev/shm at most"))


def _where(name):
    """cProfile's name for a built-in, shorter: "~:0(<method 'copy_' of 'torch._C.TensorBase' objects>)" ->
    "torch._C.TensorBase.copy_", "~:0(<built-in method torch.empty>)" -> "torch.empty"."""
    m = re.fullmatch(r"~:0\(<method '(\w+)' of '([\w.]+)' objects>\)", name) or \
        re.fullmatch(r"~:0\(<built-in method ([\w.]+)>\)", name)
    return (f"{m[2]}.{m[1]}" if m.re.groups == 2 else m[1]) if m else name


def profile_lines(modes, ours_mode="builtin", top=8):
    """The functions of most own time during the load, medians over each mode's profiled runs."""
    per_mode = {mode: [r["load_profile"] for r in modes.get(mode, []) if r["load_profile"]]
                for mode in ("base", ours_mode)}
    if not any(per_mode.values()):
        return []
    medians = {mode: {f: statistics.median(p[f] for p in profs if f in p) for f in {f for p in profs for f in p}}
               for mode, profs in per_mode.items()}
    names = sorted({f for m in medians.values() for f in m},
                   key=lambda f: -max(m.get(f, 0.0) for m in medians.values()))
    n = {mode: len(profs) for mode, profs in per_mode.items()}
    lines = [f"  the load's own time by function (median, profiled runs: base {n['base']}, {ours_mode} {n[ours_mode]})"]
    for f in names[:top]:
        got = {mode: (f"{medians[mode][f]:.3f} s" if f in medians[mode] else "-") for mode in medians}
        lines.append(f"    {_where(f)[:44]:44s} base {got['base']:>9s}   {ours_mode} {got[ours_mode]:>9s}")
    return lines


def summarize(results, link_gbs=45.0):
    """The summary's text and each comparison's verdict: {group: ...} for builtin against base, {"group
    builtin-NAME": ...} for each variant."""
    runs = collect(results)
    lines, verdicts = [], {}
    for group in [g for g in GROUPS if g in runs] + sorted(set(runs) - set(GROUPS)):
        for ours in ["builtin"] + sorted(m for m in runs[group] if m.startswith("builtin-")):
            name = group if ours == "builtin" else f"{group} {ours}"
            lines.append(f"== {group} ==" if ours == "builtin" else f"== {group}, {ours} (builtin with "
                                                                     "BENCH_CKPT_VARIANT's settings) ==")
            verdicts[name] = _report(lines, results, runs[group], group, ours, link_gbs)
    return "\n".join(lines), verdicts


def _report(lines, results, modes, group, ours_mode, link_gbs):
    """One group's table and targets, `ours_mode` (builtin or a variant) against base, appended to `lines`;
    whether every target was met."""
    stats = {mode: {k: stat([r[k] for r in modes.get(mode, [])]) for k, _ in KEYS} for mode in ("base", ours_mode)}
    for key, name in KEYS:
        unit = "GiB" if key.endswith("gib") else "s"
        lines.append(f"{name:48s} base {fmt(stats['base'][key], unit):32s} "
                     f"{ours_mode} {fmt(stats[ours_mode][key], unit)}")
    lines += profile_lines(modes, ours_mode)
    base, ours = stats["base"], stats[ours_mode]
    checks = []
    for key, name in (("async_first_s", "async stall, first"), ("async_next_s", "async stall, the next"),
                      ("sync_save_s", "sync save"), ("load_s", "load")):
        line, ok = ratio_line(name, base[key], ours[key])
        lines.append(line)
        checks.append(ok)
    if ours["first_after_load_s"] and ours["steady_s"]:
        r = ours["first_after_load_s"]["median"] / ours["steady_s"]["median"]
        ok = r <= TARGET
        lines.append(f"  first iteration after the load / {ours_mode}'s steady step: {r:.2f}x (target <= {TARGET}x: "
                     f"{'MET' if ok else 'NOT met'})")
        checks.append(ok)
        if base["first_after_load_s"] and base["steady_s"]:  # beside it, what the same ratio is without offload
            lines.append(f"    without offload: {base['first_after_load_s']['median'] / base['steady_s']['median']:.2f}x "
                         f"its steady step; {ours_mode}'s first iteration / base's: "
                         f"{ours['first_after_load_s']['median'] / base['first_after_load_s']['median']:.2f}x")
            # without offload the first iteration after a load is itself 3-4x a steady step (warm-up): the
            # offload's share is its first iteration against base's plus what every streamed step adds
            plus = base["first_after_load_s"]["median"] + ours["steady_s"]["median"] - base["steady_s"]["median"]
            lines.append(f"    {ours_mode}'s first iteration / (base's + the streamed step's own cost, {ours_mode}'s "
                         f"steady step - base's): {ours['first_after_load_s']['median'] / plus:.2f}x")
            lines += _phase_lines(base, ours)
    if base["setup_s"] and ours["setup_s"]:
        landing = [r["landing_bytes"] for r in modes.get(ours_mode, []) if r["landing_bytes"]]
        link_s = (statistics.median(landing) / (link_gbs * 1e9)) if landing else 0.0
        # the pinning reported apart: the landing block's registration and its unregistration at the construction's
        # end, each timed in the run (bench_saves.py)
        pin = ours["setup_pin_s"]["median"] if ours["setup_pin_s"] else 0.0
        unpin = ours["setup_unpin_s"]["median"] if ours["setup_unpin_s"] else 0.0
        added = ours["setup_s"]["median"] - base["setup_s"]["median"]
        ok = added <= link_s + pin + unpin
        lines.append(f"  setup adds {added:.3f} s; allowed: the masters over the link {link_s:.3f} s (at "
                     f"{link_gbs} GB/s) + the pinning {pin:.3f} s + its unpinning {unpin:.3f} s "
                     f"({'MET' if ok else 'NOT met'}); without the pinning: {added - pin - unpin:.3f} s")
        checks.append(ok)
    compare = _compare(results, group, ours_mode)
    lines.append(f"  checkpoints {ours_mode} vs base: {compare[0]}")
    checks.append(compare[1])
    verdict = all(c is True for c in checks)
    lines.append(f"  all targets: {'MET' if verdict else 'NOT all met'}")
    return verdict


def _phase_lines(base, ours):
    """Where the first iteration's excess is: each phase's difference, first iteration against steady."""
    out = []
    for k, name in PHASE_NAMES.items():
        b1, o1, bs, os_ = (x[f"{w}_{k}"] for w in ("first", "steady") for x in (base, ours))
        if None in (b1, o1, bs, os_):
            continue
        first, steady = o1["median"] - b1["median"], os_["median"] - bs["median"]
        out.append(f"    {name}: offload adds {first:+.3f} s to the first iteration, {steady:+.3f} s to a steady "
                   f"step: {first - steady:+.3f} s more in the first")
    return out


def _compare(results, group, ours_mode="builtin"):
    path = os.path.join(results, f"{group}_compare.json" if ours_mode == "builtin" else
                        f"{group}_{ours_mode}_compare.json")
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, ValueError):
        return "not compared", None
    ok = all(r.get("identical") for r in rows) and bool(rows)
    text = "; ".join(f"iteration {r.get('iteration')}: " + ("identical" if r.get("identical") else
                                                            f"DIFFER {r.get('differing') or r.get('error')}")
                     for r in rows)
    return text, ok


def compare(out, base, ours, iterations):
    """Each iteration's checkpoint of the builtin run against the base run's, entry by entry
    (scripts/check_checkpoint.py, tensors bit for bit), into `out`."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import check_checkpoint

    rows = []
    for it in iterations:
        a, b = (os.path.join(d, f"iter_{it:07d}") for d in (base, ours))
        row = {"iteration": it, "base": a, "builtin": b}
        missing = [p for p in (a, b) if not os.path.exists(os.path.join(p, ".metadata"))]
        if missing:
            row.update(identical=False, error=f"no torch_dist checkpoint at {', '.join(missing)}")
        else:
            diff = check_checkpoint.differing(a, b)
            row.update(identical=not diff, n_differing=len(diff), differing=diff[:10])
        rows.append(row)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="RESULTS_DIR; with --compare: OUT.json BASE_CKPT BUILTIN_CKPT ITER...")
    ap.add_argument("--compare", action="store_true", help="compare two runs' checkpoints instead")
    ap.add_argument("--link-gbs", type=float, default=45.0,
                    help="host link speed for the masters' copy allowed in setup (GB/s; the H100's, measured)")
    args = ap.parse_args()
    if args.compare:
        if len(args.results) < 4:
            ap.error("--compare OUT.json BASE_CKPT BUILTIN_CKPT ITER...")
        out, base, ours, *its = args.results
        for row in compare(out, base, ours, [int(i) for i in its]):
            print(f"iteration {row['iteration']}: {'identical' if row['identical'] else 'DIFFER'}")
        return
    text, _ = summarize(args.results[0], args.link_gbs)
    print(text)


if __name__ == "__main__":
    main()
