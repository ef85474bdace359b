#!/usr/bin/env python3
"""GPU check: checkpoints saved while bridge_fgo offloads equal, tensor by tensor, the ones saved
without offload at the same iterations; and a run resumed from them continues exactly as the
uninterrupted run (real Megatron-Bridge pretrain(), torch_dist, a small model so that comparing
takes seconds).

  python3 scripts/check_checkpoint.py --out-dir OUT --iters 6 --save-at 3 \\
      --modes base,builtin:256,builtin:0,builtin:0+async,builtin:256+async --resume

MODE is base or builtin:CHUNK_MB, with +async for Bridge's async_save=True (builtin:256+async: the
streamed step's asynchronous saves). Each mode trains --iters iterations in its own process
(scripts/bench_offload.py) and saves every --save-at iterations; every checkpoint is read back with
torch.distributed.checkpoint (no process group) and compared with the first mode's at the same
iteration, one entry at a time: same keys, dtypes and shapes, bit-identical values, equal objects.
--resume then restarts each mode from its own checkpoint at --save-at (same mode, with
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
import warnings

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


def _entries(path):
    """A torch_dist (DCP) checkpoint's entries: key -> its storage metadata (tensor or bytes)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata().state_dict_metadata


def _load(path, key, meta):
    """One entry of a checkpoint: a tensor (read alone, full size), or the object stored as bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    value = torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
    holder = {key: value}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(holder, checkpoint_id=path, no_dist=True)
    return holder[key]


def _same(a, b):
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__array__") or hasattr(b, "__array__"):  # numpy's RNG state in the saved rng_state
        import numpy as np

        return (type(a) is type(b) and np.asarray(a).dtype == np.asarray(b).dtype
                and np.array_equal(a, b))
    return a == b


def contents(path):
    """What a checkpoint holds, from its metadata: entries, tensors, optimizer tensors, tensor bytes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k: m for k, m in _entries(path).items() if isinstance(m, TensorStorageMetadata)}
    return {"entries": len(_entries(path)), "tensors": len(tensors),
            "optimizer_tensors": sum("optimizer" in k for k in tensors),
            "bytes": sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors.values())}


def differing(a, b):
    """The keys in which two torch_dist checkpoints differ (missing on one side; another dtype, shape or
    value; another object), read one entry at a time: a checkpoint of any size compares in the memory of
    its largest tensor, without a scratch file."""
    ea, eb = _entries(a), _entries(b)
    out = []
    for key in sorted(ea.keys() | eb.keys()):
        if key not in ea or key not in eb or type(ea[key]) is not type(eb[key]):
            out.append(key)
        elif not _same(_load(a, key, ea[key]), _load(b, key, eb[key])):
            out.append(key)
    return out


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
    ap.add_argument("--modes", default="base,builtin:256,builtin:0,builtin:0+async,builtin:256+async")
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
            path = iteration_dir(os.path.join(args.out_dir, f"ckpt_{tag}"), it)
            row = {"check": "checkpoint", "mode": tag, "iteration": it, **contents(path)}
            if it not in reference:
                reference[it] = path
                row.update(reference=True, identical=True)
            else:
                diff = differing(reference[it], path)
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
