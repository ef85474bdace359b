#!/usr/bin/env python3
"""The configuration matrix: real Megatron-Bridge pretrain() in the layouts users run, each without
offload and with bridge_fgo's builtin engine (streamed step and one window), on the lent GPUs.

  python3 scripts/bench_matrix.py run --out-dir OUT --rows tp2,pp2_vpp2,moe_ep2 [--deadline-s 540]
  python3 scripts/bench_matrix.py table [LABEL=]DIR ...    # the README's table from row directories

Every run is scripts/bench_offload.py (its model, data and measurements); multi-GPU rows start under
torchrun, and offload runs through bridge-fgo-run (`python3 -m bridge_fgo.cli.launcher`), as a user
launches. A row writes OUT/<row>/<tag>.json (rank 0) and <tag>.rank<N>.json, the logs, and
OUT/<row>/row.json: per mode, losses and final parameters against no offload on every rank, bytes
offloaded per rank and per optimizer of the chain, the forward-backward and whole-iteration peaks
(the highest rank), and the steady step. --deadline-s skips what would not finish in time (a device
call is cut at 10 minutes), saying so in row.json.
"""
import argparse
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> GPUs, bench_offload.py arguments, what the row is
ROWS = {
    "tp2": (2, ["--tp", "2"], "tensor-parallel 2"),
    "pp2_vpp2": (2, ["--pp", "2", "--vpp", "2"], "pipeline-parallel 2, 2 virtual stages each"),
    # 8 layers of 8 experts (top-2, SequentialMLP on the local spec): a chain of two DistributedOptimizers
    # (dense params over DP 2, expert params over expert-DP 1); deterministic: the unpermute adds with
    # atomics otherwise
    "moe_ep2": (2, ["--experts", "8", "--ep", "2", "--layers", "8", "--deterministic"],
                "mixture of experts, expert-parallel 2 (DP 2 for dense)"),
    # the same without deterministic_mode, should deterministic kernels not run: base vs offload then
    # also measures the atomics' run-to-run noise
    "moe_ep2_atomic": (2, ["--experts", "8", "--ep", "2", "--layers", "8"], "mixture of experts, expert-parallel 2, "
                       "non-deterministic unpermute"),
    "dp2": (2, [], "data-parallel 2, overlap_grad_reduce and overlap_param_gather"),
    "recompute": (1, ["--recompute"], "full activation recomputation"),
    "fp16": (1, ["--fp16", "--iters", "12"], "fp16, dynamic loss scaling (first steps skipped)"),
}
MODES = "base,builtin:256,builtin:0"
RUN_S = 75  # a 2-GPU run of the 887M model with start-up, as measured; what the deadline reserves


def command(gpus, mode, chunk_mb, out, extra):
    bench = [os.path.join(HERE, "bench_offload.py"), "run", "--mode", mode, "--out", out, *extra]
    bench += ["--chunk-mb", str(chunk_mb)] if chunk_mb is not None else []
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
              if gpus > 1 else [sys.executable])
    patcher = ([sys.executable, "-m", "bridge_fgo.cli.launcher", "--offload", "builtin", "--chunk-mb", str(chunk_mb)]
               if mode == "builtin" else [])
    return patcher + launch + bench


def run_rows(args):
    start = time.monotonic()
    for name in args.rows.split(","):
        gpus, extra, what = ROWS[name]
        row_dir = os.path.join(args.out_dir, name)
        os.makedirs(row_dir, exist_ok=True)
        skipped = []
        for token in args.modes.split(","):
            mode, _, mb = token.partition(":")
            tag = mode + mb
            left = args.deadline_s - (time.monotonic() - start)
            if left < RUN_S:
                skipped.append(tag)
                print(f"{name} {tag}: not run, {left:.0f} s left of the deadline", flush=True)
                continue
            cmd = command(gpus, mode, int(mb) if mb else None, os.path.join(row_dir, f"{tag}.json"),
                          [*extra, "--iters", str(args.iters)] if "--iters" not in extra else extra)
            with open(os.path.join(row_dir, f"{tag}.log"), "w") as log:
                log.write("$ " + " ".join(cmd) + "\n")
                log.flush()
                try:
                    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=left - 10)
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            print(f"{name} {tag}: rc={rc}", flush=True)
        row = summarize(row_dir)
        row.update(row=name, what=what, gpus=gpus, args=extra, not_run=skipped,
                   date=datetime.date.today().isoformat())
        with open(os.path.join(row_dir, "row.json"), "w") as f:
            json.dump(row, f, indent=1)
        print(json.dumps({k: row[k] for k in ("row", "identical", "modes")}, default=str), flush=True)


def load_runs(row_dir):
    """{tag: {rank: summary}} from a directory of bench_offload.py results."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(row_dir, "*.json"))):
        m = re.fullmatch(r"(.+?)(?:\.rank(\d+))?\.json", os.path.basename(path))
        if m[1] in ("row", "summary", "checkpoint_check"):
            continue
        with open(path) as f:
            data = json.load(f)
        if "summary" in data:
            runs.setdefault(m[1], {})[int(m[2] or 0)] = data["summary"]
    return runs


def summarize(row_dir):
    runs = load_runs(row_dir)
    base = runs.get("base", {})
    modes = {}
    for tag, ranks in runs.items():
        s = list(ranks.values())
        entry = {
            "ranks": sorted(ranks),
            "device": s[0]["device"],
            "layout": s[0].get("layout"),
            "whole_iteration_peak_gib": max(r["steady_iter_peak_gib"] for r in s),
            "forward_backward_peak_gib": max(r["steady_fwdbwd_peak_gib"] for r in s),
            "steady_step_s": max(r["steady_step_median_s"] for r in s),
            "first_iter_s": max(r["first_iter_s"] for r in s),
            "skipped_iters": s[0].get("skipped_iters", []),
            # per rank: each optimizer of the chain (bytes moved each way per step)
            "offloaded_bytes_per_rank": {rank: [b for sess in r.get("sessions", []) for b in sess.get("per_optimizer_bytes", [])]
                                         for rank, r in sorted(ranks.items())},
            "chunks_per_rank": {rank: [sess.get("chunks") for sess in r.get("sessions", [])] for rank, r in sorted(ranks.items())},
        }
        if base and tag != "base":
            same_ranks = sorted(ranks) == sorted(base)
            entry["losses_identical"] = same_ranks and all(ranks[k]["losses"] == base[k]["losses"] for k in base)
            entry["params_identical"] = same_ranks and all(
                ranks[k]["final_params_sha256"] == base[k]["final_params_sha256"] for k in base)
            entry["step_over_base"] = entry["steady_step_s"] / max(r["steady_step_median_s"] for r in base.values())
        modes[tag] = entry
    compared = [m for t, m in modes.items() if t != "base"]
    # losses: the ranks that compute them (the last pipeline stage), as the driver saw them
    losses = {rank: r["losses"] for rank, r in sorted(base.items()) if any(x is not None for x in r["losses"])}
    return {"modes": modes, "base_losses": losses,
            "identical": bool(compared) and all(m["losses_identical"] and m["params_identical"] for m in compared)}


def gb(n):
    return f"{n / 1e9:.2f}"


def table(dirs):
    """Markdown: one line per row directory (row.json, or summarised now for older result dirs)."""
    lines = ["| row | machine | losses, final params | whole-iteration peak: none / 256 MB / one window | "
             "forward-backward peak | GB offloaded per rank (per optimizer) | steady step: none / 256 MB / one window |",
             "|---|---|---|---|---|---|---|"]
    for item in dirs:
        label, _, d = item.rpartition("=")
        path = os.path.join(d, "row.json")
        row = json.load(open(path)) if os.path.exists(path) else {**summarize(d), "row": os.path.basename(d.rstrip("/"))}
        if label:
            row["what"] = label
        m = row["modes"]
        order = [t for t in ("base", "builtin256", "builtin0") if t in m]

        def col(key, fmt):
            return " / ".join(fmt(m[t][key]) if t in m else "—" for t in ("base", "builtin256", "builtin0"))

        some = next((m[t] for t in order if t != "base"), None)
        per_rank = "; ".join(f"r{rank}: " + " + ".join(gb(b) for b in bs)
                             for rank, bs in (some or {}).get("offloaded_bytes_per_rank", {}).items())
        verdict = ("bit-identical" if row["identical"] else "**differ**") if some else "not compared"
        lines.append(f"| {row.get('what', row['row'])} | {m[order[0]]['device'] if order else '?'} "
                     f"| {verdict} | {col('whole_iteration_peak_gib', lambda v: f'{v:.2f}')} GiB "
                     f"| {col('forward_backward_peak_gib', lambda v: f'{v:.2f}')} GiB | {per_rank} "
                     f"| {col('steady_step_s', lambda v: f'{v:.3f}')} s |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--rows", required=True, help=f"comma-separated, of: {', '.join(ROWS)}")
    r.add_argument("--modes", default=MODES, help="comma-separated MODE[:CHUNK_MB] (bench_offload.py modes)")
    r.add_argument("--iters", type=int, default=8)
    r.add_argument("--deadline-s", type=float, default=540)
    t = sub.add_parser("table")
    t.add_argument("dirs", nargs="+", metavar="[LABEL=]DIR", help="a row's directory (any bench_offload.py results)")
    args = ap.parse_args()
    if args.cmd == "run":
        unknown = [x for x in args.rows.split(",") if x not in ROWS]
        if unknown:
            ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
        run_rows(args)
    else:
        print(table(args.dirs))


if __name__ == "__main__":
    main()
