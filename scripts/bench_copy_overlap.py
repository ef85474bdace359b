#!/usr/bin/env python3
"""How device-to-host copies of many tensors overlap with compute, under Megatron's
CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware work queue shared by every stream).

Compute: a chain of bf16 matmuls on the current stream. Copies: N tensors (~total GiB) into one
pinned buffer, issued as a burst before the compute, on 1 or S side streams. Prints JSON: compute
alone, copies alone, and both together for each strategy.
  CUDA_DEVICE_MAX_CONNECTIONS=1 python scripts/bench_copy_overlap.py
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bridge_fgo.engine import PinnedBuffer  # noqa: E402

GIB = 2**30


def timed(fn, reps=3):
    best = None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best


def main():
    n_tensors, total = 300, 8 * GIB
    per = total // n_tensors // 4 * 4
    srcs = [torch.randn(per // 4, device="cuda") for _ in range(n_tensors)]
    host = PinnedBuffer(per * n_tensors, cuda=True).tensor
    slots = [host[i * per:(i + 1) * per].view(torch.float32) for i in range(n_tensors)]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def compute():
        x = a
        for _ in range(40):
            x = (x @ a) * 1e-4

    streams = {s: [torch.cuda.Stream() for _ in range(s)] for s in (1, 8, 64)}

    def copies(n_streams, interleave=0):
        ss = streams[n_streams]
        cur = torch.cuda.current_stream()
        for s in ss:
            s.wait_stream(cur)
        for i, (src, dst) in enumerate(zip(srcs, slots)):
            with torch.cuda.stream(ss[i % n_streams]):
                dst.copy_(src, non_blocking=True)

    out = {"connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "bytes": per * n_tensors,
           "compute_s": timed(compute), "copies_1_stream_s": timed(lambda: copies(1))}
    for s in (1, 8, 64):
        out[f"both_{s}_streams_s"] = timed(lambda: (copies(s), compute()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
