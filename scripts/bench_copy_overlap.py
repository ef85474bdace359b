#!/usr/bin/env python3
"""How device-to-host copies of many tensors overlap with compute, under Megatron's
CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware work queue shared by every stream).

Compute on the current stream, timed with CUDA events on that stream: few long matmuls
(compute-bound) or many short kernels (launch/latency-bound, like a small model's forward). Copies:
300 tensors (8 GiB) into one pinned buffer on a side stream, issued just before. Prints JSON: each
compute alone, with the copies issued in one burst, and with the copies paced by a background thread
(at most one 256 MiB chunk queued). small_kernels_with_item reads a scalar back every 750 kernels,
as Megatron's loss checks do: such a tiny device-to-host copy queues behind whatever copies the
copy engine already holds.
  CUDA_DEVICE_MAX_CONNECTIONS=1 python scripts/bench_copy_overlap.py
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bridge_fgo import hostmem  # noqa: E402

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
    host = hostmem.pin(per * n_tensors).tensor
    slots = [host[i * per:(i + 1) * per].view(torch.float32) for i in range(n_tensors)]
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)

    def big_kernels():  # few long matmuls: compute-bound
        x = big
        for _ in range(120):
            x = (x @ big) * 1e-4

    def small_kernels():  # many short kernels, as a small model's forward: launch/latency-bound
        x = small
        for _ in range(6000):
            x = (x @ small) * 1e-3 + 1.0

    def small_kernels_with_item():  # ... reading a scalar back now and then, as loss checks do
        x = small
        for i in range(6000):
            x = (x @ small) * 1e-3 + 1.0
            if i % 750 == 749:
                x.sum().item()

    side = torch.cuda.Stream()

    def copies(chunks=1):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for src, dst in zip(srcs, slots):
                dst.copy_(src, non_blocking=True)

    import threading

    pending = []

    def paced_copies(chunk_bytes=256 * 2**20):
        """A background thread keeps at most one chunk of copies queued on the copy engine."""
        side.wait_stream(torch.cuda.current_stream())

        def feed():
            done, queued = None, 0
            with torch.cuda.stream(side):
                for src, dst in zip(srcs, slots):
                    dst.copy_(src, non_blocking=True)
                    queued += src.numel() * 4
                    if queued >= chunk_bytes:
                        if done is not None:
                            done.synchronize()
                        done, queued = torch.cuda.Event(), 0
                        done.record(side)

        t = threading.Thread(target=feed)
        t.start()
        pending.append(t)

    def compute_time(work, with_copies):
        """Seconds the compute stream spends on `work` (CUDA events), copies issued just before."""
        torch.cuda.synchronize()
        if with_copies == "paced":
            paced_copies()
        elif with_copies:
            copies()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        work()
        b.record()
        torch.cuda.synchronize()
        while pending:
            pending.pop().join()
        return a.elapsed_time(b) / 1e3

    out = {"connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "copy_bytes": per * n_tensors,
           "copies_alone_s": timed(copies)}
    for name, work in (("big_kernels", big_kernels), ("small_kernels", small_kernels),
                       ("small_kernels_with_item", small_kernels_with_item)):
        compute_time(work, False)  # warm-up
        out[f"{name}_alone_s"] = min(compute_time(work, False) for _ in range(3))
        out[f"{name}_with_copies_s"] = min(compute_time(work, True) for _ in range(3))
        out[f"{name}_with_paced_copies_s"] = min(compute_time(work, "paced") for _ in range(3))
    # Host side: a memory-heavy Python workload (pointer chasing over a large list of objects, as a
    # big framework's Python does), timed on the CPU with and without the copies writing host memory.
    objs = [{"k": i, "v": [i, i + 1]} for i in range(3_000_000)]
    order = list(range(len(objs)))
    import random

    random.Random(0).shuffle(order)

    def python_work():
        total = 0
        for i in order[:1_500_000]:
            total += objs[i]["v"][1]
        return total

    def cpu_time(with_copies):
        torch.cuda.synchronize()
        if with_copies:
            copies()
        t0 = time.perf_counter()
        python_work()
        dt = time.perf_counter() - t0
        torch.cuda.synchronize()
        return dt

    cpu_time(False)
    out["python_alone_s"] = min(cpu_time(False) for _ in range(3))
    out["python_with_copies_s"] = min(cpu_time(True) for _ in range(3))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
