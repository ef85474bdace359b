"""Does registering the host buffer slow a checkpoint load's reads beside it? (issue 43)

    python scripts/bench_reads_beside_pinning.py --file-gib 3.8 --gib 3.6 --reps 3 --out result.json

A load with offload makes the engine's buffer with bridge_fgo's own hostmem.pin(defer=True): its pages faulted in
first, then cudaHostRegister in a thread of its own while the load reads the checkpoint from disk. Profiled on one
H200 (docs/benchmarks.md#gpu-2026-11-29j), those reads (torch.load: each tensor read with readinto into fresh
memory) took 0.15-0.35 s longer with offload than without. This reads a file of --file-gib the same way (items
of --item-mib, each into a fresh torch.empty, after one pass that puts the file in the page cache), alternating
--reps times:

- `alone`: the reads only;
- `beside`: hostmem.pin(--gib, defer=True) first, then the reads while its registration runs, then its wait();
- `before`: hostmem.pin(--gib) (registered before returning), then the reads.

Each: the reads' seconds, the pinning's (the registration's own for `beside`), the whole. Prints the JSON and
writes it to --out. Without CUDA, hostmem.pin does not register (method "unpinned"): the run shows only that the
reads work. Needs only torch and bridge_fgo. --dir: where the file is written (default: the system's temp).
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bridge_fgo import hostmem  # noqa: E402  (the buffer as a load with offload makes it)

MIB = 2**20
VARIANTS = ("alone", "beside", "before")


def write_file(path: str, nbytes: int) -> None:
    block = os.urandom(64 * MIB)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)


def read_all(path: str, item: int) -> float:
    """Every byte of `path`, item by item, each into a fresh tensor (as torch.load reads a checkpoint's)."""
    kept, got = [], 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while True:
            t = torch.empty(item, dtype=torch.uint8)
            n = f.readinto((ctypes.c_char * item).from_address(t.data_ptr()))  # (no numpy needed)
            if not n:
                break
            kept.append(t)
            got += n
    seconds = time.perf_counter() - t0
    if got != os.path.getsize(path):
        raise RuntimeError(f"read {got} of {path}'s {os.path.getsize(path)} bytes")
    return seconds


def variant(kind: str, path: str, nbytes: int, item: int) -> dict:
    t0 = time.perf_counter()
    buf = None
    if kind == "beside":
        buf = hostmem.pin(nbytes, defer=True)
    elif kind == "before":
        buf = hostmem.pin(nbytes)
    made = time.perf_counter() - t0
    reads = read_all(path, item)
    if buf is not None:
        buf.wait()
    out = {"variant": kind, "reads_s": reads, "whole_s": time.perf_counter() - t0, "buffer_s": made,
           "method": buf.method if buf is not None else None,
           "register_s": buf.register_s if kind == "beside" else None}
    if buf is not None:
        buf.free()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file-gib", type=float, default=3.8)
    ap.add_argument("--gib", type=float, default=3.6, help="the buffer's size")
    ap.add_argument("--item-mib", type=int, default=28, help="bytes read into each fresh tensor")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if min(args.file_gib, args.gib) <= 0 or args.item_mib <= 0 or args.reps <= 0:
        ap.error("--file-gib, --gib, --item-mib and --reps must be positive")
    nbytes, item = int(args.gib * 2**30), args.item_mib * MIB
    fd, path = tempfile.mkstemp(prefix="bench_reads_", dir=args.dir)
    os.close(fd)
    try:
        write_file(path, int(args.file_gib * 2**30))
        read_all(path, item)  # into the page cache, as a checkpoint just written or read before is
        runs = [variant(kind, path, nbytes, item) for _ in range(args.reps) for kind in VARIANTS]
    finally:
        os.unlink(path)
    medians = {kind: {key: statistics.median(r[key] for r in runs if r["variant"] == kind)
                      for key in ("reads_s", "whole_s")} for kind in VARIANTS}
    result = {"file_gib": args.file_gib, "buffer_gib": args.gib, "item_mib": args.item_mib, "reps": args.reps,
              "cuda": torch.cuda.is_available(), "runs": runs, "medians": medians,
              "reads_beside_over_alone": medians["beside"]["reads_s"] / medians["alone"]["reads_s"],
              "reads_before_over_alone": medians["before"]["reads_s"] / medians["alone"]["reads_s"]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
