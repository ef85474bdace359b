#!/usr/bin/env python3
"""GPU check: a checkpoint saved while bridge_fgo offloads equals, tensor by tensor, the one saved
without offload at the same iteration (real Megatron-Bridge pretrain(), synchronous torch_dist save,
a small model so the comparison takes seconds).

  python3 scripts/check_checkpoint.py --out-dir OUT [--iters 4] [--modes base,builtin:256,builtin:0]

Each mode runs scripts/bench_offload.py in its own process with --save; every checkpoint is read back
with torch.distributed.checkpoint (format_utils.dcp_to_torch_save, no process group) and compared
with the first mode's: same keys, same dtypes and shapes, bit-identical values. Prints one JSON line
per mode and exits non-zero on any difference.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = ["--layers", "2", "--hidden", "512", "--ffn", "1408", "--heads", "8", "--groups", "4"]


def checkpoint_dir(root):
    """The newest iteration directory of a Bridge checkpoint (the one holding DCP's .metadata)."""
    found = sorted(d for d, _, files in os.walk(root) if ".metadata" in files)
    if not found:
        sys.exit(f"no torch_dist checkpoint under {root}")
    return found[-1]


def flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat(v, f"{prefix}{k}/")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flat(v, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/"), obj


def load(path, out):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out)
    return dict(flat(torch.load(out, weights_only=False)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--modes", default="base,builtin:256,builtin:0")
    args = ap.parse_args()
    import torch

    os.makedirs(args.out_dir, exist_ok=True)
    reference, ok = None, True
    for token in args.modes.split(","):
        mode, _, mb = token.partition(":")
        tag = mode + mb
        save = os.path.join(args.out_dir, f"ckpt_{tag}")
        cmd = [sys.executable, os.path.join(HERE, "bench_offload.py"), "run", "--mode", mode, "--iters",
               str(args.iters), "--save", save, "--out", os.path.join(args.out_dir, f"{tag}.json"), *SMALL]
        cmd += ["--chunk-mb", mb] if mb else []
        with open(os.path.join(args.out_dir, f"{tag}.log"), "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        if rc:
            print(json.dumps({"mode": tag, "error": f"run failed (rc={rc})"}), flush=True)
            ok = False
            continue
        state = load(checkpoint_dir(save), os.path.join(args.out_dir, f"{tag}.pt"))
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        row = {"mode": tag, "checkpoint": checkpoint_dir(save), "tensors": len(tensors),
               "optimizer_tensors": sum("optimizer" in k for k in tensors),
               "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        if reference is None:
            reference = tensors
            row["reference"] = True
        else:
            differ = sorted(k for k in reference.keys() | tensors.keys()
                            if k not in reference or k not in tensors or reference[k].dtype != tensors[k].dtype
                            or reference[k].shape != tensors[k].shape or not torch.equal(reference[k], tensors[k]))
            row.update(identical=not differ, differing=differ[:10], n_differing=len(differ))
            ok &= not differ
        print(json.dumps(row), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
