"""A checkpoint load's reads into the host buffer: torch's own against straight in (issue 43)

    python scripts/bench_straight_reads.py --gib 3.57 --tensors 81 --reps 3 --out result.json

torch.distributed.checkpoint's FileSystemReader reads each saved tensor with torch.load into fresh memory and copies
it into its target; bridge_fgo reads the items whose targets are views of its pinned buffer straight into them
(bridge_fgo/instrument/reads.py). This saves --tensors fp32 tensors (--gib in all, the shape of one rank's
optimizer states) with torch.distributed.checkpoint, reads them once into the page cache (a checkpoint just
written, or read before), then loads them, alternating --reps times:

- `gpu`: into tensors on the GPU, as a load without offload fills them (torch's read_data; skipped without CUDA);
- `torch`: into views of a buffer made as a load with offload makes it (hostmem.pin(defer=True, start=False,
  touch=False): untouched pages, registered after the reads), through torch's read_data;
- `straight`: the same buffer, through bridge_fgo's reads.straight_into.

Each: the load's seconds and GB/s, the registration after it for the buffers; every load's bytes are compared
with what was saved. Prints the JSON and writes it to --out. Needs torch and bridge_fgo only (no Megatron).
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from bridge_fgo import hostmem  # noqa: E402
from bridge_fgo.instrument import reads  # noqa: E402

VARIANTS = ("gpu", "torch", "straight")


def saved_state(nbytes: int, tensors: int):
    per = nbytes // 4 // tensors
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(per, generator=g) for i in range(tensors)}


def targets(kind: str, shapes: dict):
    """The tensors a load fills, and the buffer they are views of (None for the GPU's)."""
    if kind == "gpu":
        return {k: torch.empty(n, device="cuda") for k, n in shapes.items()}, None
    buf = hostmem.pin(sum(shapes.values()) * 4, defer=True, start=False, touch=False)  # a load's buffer
    flat, views, at = buf.tensor.view(torch.float32), {}, 0
    for k, n in shapes.items():
        views[k] = flat[at:at + n]
        at += n
    return views, buf


def variant(kind: str, path: str, shapes: dict, want: dict) -> dict:
    t0 = time.perf_counter()
    into, buf = targets(kind, shapes)
    made = time.perf_counter() - t0
    t1 = time.perf_counter()
    with reads.straight_into([buf] if kind == "straight" else []) as r:
        dcp.load(into, checkpoint_id=path, no_dist=True)
    if kind == "gpu":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    if buf is not None:
        buf.wait()  # the registration, after the reads (as the engine's register_after_load)
    register_s = time.perf_counter() - t2
    same = all(torch.equal(into[k].cpu(), want[k]) for k in want)
    nbytes = sum(shapes.values()) * 4
    out = {"variant": kind, "buffer_s": made, "load_s": load_s, "gb_per_s": nbytes / load_s / 1e9,
           "register_s": register_s, "method": buf.method if buf is not None else None, "identical": same,
           "straight": {"tensors": r.tensors, "bytes": r.nbytes, "threads": r.threads, "as_torch": r.as_torch}}
    del into
    if buf is not None:
        buf.free()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=3.57)
    ap.add_argument("--tensors", type=int, default=81)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gib <= 0 or args.tensors <= 0 or args.reps <= 0:
        ap.error("--gib, --tensors and --reps must be positive")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    kinds = [k for k in VARIANTS if k != "gpu" or torch.cuda.is_available()]
    path = tempfile.mkdtemp(prefix="bench_straight_", dir=args.dir)
    try:
        want = saved_state(int(args.gib * 2**30), args.tensors)
        t0 = time.perf_counter()
        dcp.save(want, checkpoint_id=path, no_dist=True)
        save_s = time.perf_counter() - t0
        shapes = {k: v.numel() for k, v in want.items()}
        dcp.load({k: torch.empty(n) for k, n in shapes.items()}, checkpoint_id=path, no_dist=True)  # page cache
        runs = [variant(kind, path, shapes, want) for _ in range(args.reps) for kind in kinds]
    finally:
        shutil.rmtree(path, ignore_errors=True)
    medians = {kind: {key: statistics.median(r[key] for r in runs if r["variant"] == kind)
                      for key in ("load_s", "gb_per_s", "register_s")} for kind in kinds}
    result = {"gib": args.gib, "tensors": args.tensors, "reps": args.reps, "cuda": torch.cuda.is_available(),
              "torch": torch.__version__, "cores": os.cpu_count(), "save_s": save_s, "runs": runs,
              "medians": medians, "all_identical": all(r["identical"] for r in runs),
              "straight_over_torch": medians["straight"]["load_s"] / medians["torch"]["load_s"]}
    if "gpu" in medians:
        result["straight_over_gpu"] = medians["straight"]["load_s"] / medians["gpu"]["load_s"]
        result["torch_over_gpu"] = medians["torch"]["load_s"] / medians["gpu"]["load_s"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
