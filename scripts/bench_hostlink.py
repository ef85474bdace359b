#!/usr/bin/env python3
"""The host link as the ranks of one node share it: each rank pins a buffer with bridge_fgo's own pinning
(hostmem.pin, NUMA-placed) and copies it to and from its GPU, host-to-device and device-to-host at once
(what a streamed update does), all ranks together after a barrier. Prints one JSON line per rank and,
on rank 0, the node's sums: per-rank and aggregate GB/s each way, and the ratio to the same rank alone
(run first, the others waiting), i.e. what sharing the host's memory and PCIe switches costs.

  torchrun --standalone --nproc-per-node 4 scripts/bench_hostlink.py --gib 2 --out /tmp/hostlink.json
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30


def duplex(host, dev_in, dev_out, reps):
    """Median seconds of one host-to-device copy of `host` and one device-to-host copy into it, at once on two
    streams (each direction its own copy engine), and each direction's own time."""
    import torch

    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    out = {"both": [], "h2d": [], "d2h": []}
    for _ in range(reps):
        torch.cuda.synchronize()
        events = {k: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for k in ("h2d", "d2h")}
        t0 = time.perf_counter()
        with torch.cuda.stream(h2d):
            events["h2d"][0].record()
            dev_in.copy_(host[: dev_in.numel()], non_blocking=True)
            events["h2d"][1].record()
        with torch.cuda.stream(d2h):
            events["d2h"][0].record()
            host[dev_in.numel():].copy_(dev_out, non_blocking=True)
            events["d2h"][1].record()
        torch.cuda.synchronize()
        out["both"].append(time.perf_counter() - t0)
        for k, (a, b) in events.items():
            out[k].append(a.elapsed_time(b) / 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="GiB each way per rank")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    from bridge_fgo import hostmem

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group("gloo")
    n = int(args.gib * GIB)
    pinned = hostmem.pin(2 * n, device_index=local)
    host = pinned.tensor
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_out = torch.ones(n, dtype=torch.uint8, device="cuda")
    duplex(host, dev_in, dev_out, 1)  # first use of the pages
    alone = None
    for r in range(world):  # each rank alone, the others waiting at the barrier
        if world > 1:
            dist.barrier()
        if r == rank:
            alone = duplex(host, dev_in, dev_out, args.reps)
    if world > 1:
        dist.barrier()
    together = duplex(host, dev_in, dev_out, args.reps)
    gbps = lambda s: n / s / 1e9  # noqa: E731
    mine = {"rank": rank, "gpu": torch.cuda.get_device_name(), "bytes_each_way": n, "method": getattr(pinned, "method", None),
            "alone": {k: gbps(v) for k, v in alone.items()}, "together": {k: gbps(v) for k, v in together.items()}}
    print("RANK " + json.dumps(mine), flush=True)
    rows = [None] * world
    if world > 1:
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    if rank == 0:
        node = {"ranks": world, "gib_each_way": args.gib, "per_rank": rows,
                "aggregate_together_GBps": {k: sum(r["together"][k] for r in rows) for k in ("h2d", "d2h")},
                "together_over_alone": {k: statistics.median(r["together"][k] / r["alone"][k] for r in rows)
                                        for k in ("both", "h2d", "d2h")}}
        print("NODE " + json.dumps(node), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(node, f, indent=1)
    pinned.free()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
