#!/usr/bin/env python3
"""A markdown table of bench_offload.py runs: the run's peak from process start first (setup, a load,
every iteration), then the steady whole-iteration peak, the steady step, the
optimizer-step phase (from gradient finalization to the end of train_step: where offload's copies
are), the first iteration, the setup peak, and whether losses and final parameters (FP8 runs: their data,
scales and amax histories too) match the folder's base run, or NAME_base for a run NAME_mode.

  python3 scripts/results_table.py benchmarks/results/2026-11-23_h100/torch_887m [...]
"""
import glob
import json
import os
import statistics
import sys


def rows(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        if os.path.basename(path) == "summary.json":
            continue
        with open(path) as f:
            data = json.load(f)
        if "summary" in data:
            runs[os.path.basename(path)[:-5]] = data
    folder_base = next((runs[t]["summary"] for t in ("base", "dev-base") if t in runs), None)
    for tag, data in runs.items():
        # a folder of several configurations (scripts/gpu/bench_fp8.sh): NAME_streamed against NAME_base
        stem = tag.split(".")[0].rsplit("_", 1)[0]
        base = folder_base or runs.get(f"{stem}_base", {}).get("summary")
        s, its = data["summary"], data["iters"]
        steady = [r for r in its if r["iter"] > 2]
        post = statistics.median(r["post_s"] for r in steady)
        sess = (s.get("sessions") or [{}])[0]
        same = None if base is None else (s["losses"] == base["losses"]
                                          and s["final_params_sha256"] == base["final_params_sha256"]
                                          and s.get("final_fp8_meta_sha256") == base.get("final_fp8_meta_sha256"))
        moved = sess.get("bytes")
        run_peak = s.get("run_peak_gib")
        yield (tag, "-" if run_peak is None else f"{run_peak:.2f}", f"{s['steady_iter_peak_gib']:.2f}", f"{s['steady_step_median_s']:.3f}", f"{post:.3f}",
               f"{s['first_iter_s']:.2f}", f"{s.get('setup_peak_gib', 0):.2f}",
               f"{moved / 2**30:.2f}" if moved else "-",
               "no base run in this folder" if same is None else "(the base)" if base is s else "yes" if same else "NO")


def main(folders):
    print("| run | run's peak (GiB) | whole-iteration peak (GiB) | steady step (s) | step phase (s) | "
          "first iteration (s) | setup peak (GiB) | moved each way (GiB) | losses and parameters = base |")
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in folders:
        for row in rows(folder):
            print(f"| {os.path.basename(folder.rstrip('/'))}/{row[0]} | " + " | ".join(row[1:]) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
