#!/usr/bin/env python3
"""GPU check: checkpoints saved while bridge_fgo offloads equal, tensor by tensor, the ones saved
without offload at the same iterations; and a run resumed from them continues exactly as the
uninterrupted run (real Megatron-Bridge pretrain(), torch_dist, a small model so that comparing
takes seconds).

  python3 scripts/check_checkpoint.py --out-dir OUT --iters 6 --save-at 3 \\
      --modes base,builtin:256,builtin:0,builtin:0+async --resume

MODE is base or builtin:CHUNK_MB, with +async for Bridge's async_save=True. Each mode trains --iters
iterations in its own process (scripts/bench_offload.py) and saves every --save-at iterations; every
checkpoint is read back with torch.distributed.checkpoint (dcp_to_torch_save, no process group) and
compared with the first mode's at the same iteration: same keys, dtypes and shapes, bit-identical
values. --resume then restarts each mode from its own checkpoint at --save-at (same mode, with
scripts/resume_fix.py, without which Megatron-Core cannot load torch AdamW state) and compares its
losses and final parameters with the first mode's uninterrupted run; a base resume with only the
assertion fixed (--resume-fix prime) shows what Megatron-Core's own step handling does. Prints one
JSON line per comparison, writes OUT/checkpoint_check.json and exits non-zero on any difference.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = ["--layers", "2", "--hidden", "512", "--ffn", "1408", "--heads", "8", "--groups", "4"]


def iteration_dir(root, iteration):
    """A Bridge checkpoint's directory for one iteration (it holds DCP's .metadata)."""
    path = os.path.join(root, f"iter_{iteration:07d}")
    if not os.path.exists(os.path.join(path, ".metadata")):
        sys.exit(f"no torch_dist checkpoint at {path}")
    return path


def flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat(v, f"{prefix}{k}/")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flat(v, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/"), obj


def tensors_of(path, scratch):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, scratch)
    state = dict(flat(torch.load(scratch, weights_only=False)))
    os.remove(scratch)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def differing(a, b):
    import torch

    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
                  or not torch.equal(a[k], b[k]))


def parse(token):
    """'builtin:0+async' -> ('builtin0_async', 'builtin', '0', True)"""
    name, _, flags = token.partition("+")
    mode, _, mb = name.partition(":")
    return mode + mb + ("_async" if flags == "async" else ""), mode, mb, flags == "async"


def bench(out_dir, tag, mode, mb, extra):
    """One bench_offload.py run; its summary, or None when it failed (the log says why)."""
    out = os.path.join(out_dir, f"{tag}.json")
    cmd = [sys.executable, os.path.join(HERE, "bench_offload.py"), "run", "--mode", mode, "--out", out, *SMALL, *extra]
    cmd += ["--chunk-mb", mb] if mb else []
    with open(os.path.join(out_dir, f"{tag}.log"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc:
        return None
    with open(out) as f:
        return json.load(f)["summary"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--save-at", type=int, default=3, help="save every N iterations; resume from iteration N")
    ap.add_argument("--modes", default="base,builtin:256,builtin:0,builtin:0+async")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    if args.iters % args.save_at or args.iters == args.save_at:
        ap.error("--iters must be a multiple of --save-at, and larger")
    os.makedirs(args.out_dir, exist_ok=True)
    rows, ok = [], True

    def report(row):
        nonlocal ok
        ok &= bool(row.get("as_expected", row.get("identical")))
        rows.append(row)
        print(json.dumps(row), flush=True)

    iterations = range(args.save_at, args.iters + 1, args.save_at)
    tokens = [parse(t) for t in args.modes.split(",")]
    runs, reference = {}, {}
    for tag, mode, mb, is_async in tokens:
        extra = ["--iters", str(args.iters), "--save", os.path.join(args.out_dir, f"ckpt_{tag}"),
                 "--save-interval", str(args.save_at)] + (["--async-save"] if is_async else [])
        runs[tag] = bench(args.out_dir, tag, mode, mb, extra)
        if runs[tag] is None:
            report({"mode": tag, "error": "run failed; see its log"})
            continue
        for it in iterations:
            tensors = tensors_of(iteration_dir(os.path.join(args.out_dir, f"ckpt_{tag}"), it),
                                 os.path.join(args.out_dir, "scratch.pt"))
            row = {"check": "checkpoint", "mode": tag, "iteration": it, "tensors": len(tensors),
                   "optimizer_tensors": sum("optimizer" in k for k in tensors),
                   "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
            if it not in reference:
                reference[it] = tensors
                row.update(reference=True, identical=True)
            else:
                diff = differing(reference[it], tensors)
                row.update(identical=not diff, differing=diff[:10], n_differing=len(diff))
            report(row)
    first = runs.get(tokens[0][0])
    if args.resume and first:
        resumes = [(f"resume_{tag}", tag, mode, mb, "full") for tag, mode, mb, _ in tokens if runs.get(tag)]
        resumes.append(("resume_base_megatron_step", tokens[0][0], "base", "", "prime"))
        for name, source, mode, mb, fix in resumes:
            extra = ["--iters", str(args.iters), "--load", os.path.join(args.out_dir, f"ckpt_{source}"),
                     "--ckpt-step", str(args.save_at), "--resume-fix", fix]
            got = bench(args.out_dir, name, mode, mb, extra)
            if got is None:
                report({"check": "resume", "mode": name, "error": "run failed; see its log"})
                continue
            want = first["losses"][args.save_at:]
            row = {"check": "resume", "mode": name, "from": source, "resume_fix": fix,
                   "losses": got["losses"], "uninterrupted_losses": want,
                   "losses_identical": got["losses"] == want,
                   "final_params_identical": got["final_params_sha256"] == first["final_params_sha256"]}
            row["identical"] = row["losses_identical"] and row["final_params_identical"]
            if fix == "prime":  # the witness: Megatron-Core's own step handling, expected to differ
                row["as_expected"] = not row["identical"]
            report(row)
    with open(os.path.join(args.out_dir, "checkpoint_check.json"), "w") as f:
        json.dump({"args": vars(args), "ok": ok, "rows": rows}, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
