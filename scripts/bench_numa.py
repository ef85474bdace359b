"""Pinned-host bandwidth with and without NUMA placement of the first touch (bridge_fgo.hostmem.pin).

    python scripts/bench_numa.py --gib 4 --out result.json [--device 0] [--iters 10]

For each variant a --gib buffer is pinned through bridge_fgo.hostmem (first touch, then
cudaHostRegister), where its pages landed is read from /proc/self/numa_maps, and device-to-host and
host-to-device copies of the whole buffer are timed with CUDA events. Variants:
  unbound  plain first touch (torch's zero_(), threads wherever the scheduler puts them)
  gpu_node first touch from threads bound to the GPU's NUMA node (what pin() does by default)
  far_node first touch bound to another node (the worst case), when the host has one
On a host with a single NUMA node only `unbound` runs, and the JSON says so. Prints the JSON, and
writes it to --out. Needs only torch and bridge_fgo.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bridge_fgo import hostmem  # noqa: E402


def node_pages(ptr: int, nbytes: int) -> dict:
    """{node: pages} of the mappings overlapping [ptr, ptr+nbytes), from /proc/self/numa_maps. The kernel
    may have merged neighbouring anonymous memory into the same mapping, so the total can exceed the
    buffer; the split between nodes is what matters."""
    try:
        out = {}
        # the two files are read one after the other; another thread's mmap in between can move a
        # mapping boundary, so read again when nothing matched
        for _ in range(5):
            with open("/proc/self/maps") as f:
                ranges = {int(lo, 16): int(hi, 16) for lo, hi in (line.split()[0].split("-") for line in f)}
            with open("/proc/self/numa_maps") as f:
                for line in f:
                    fields = line.split()
                    lo = int(fields[0], 16)
                    hi = ranges.get(lo)
                    if hi is None or hi <= ptr or lo >= ptr + nbytes:
                        continue
                    for fld in fields[1:]:
                        if fld.startswith("N") and "=" in fld:
                            node, pages = fld[1:].split("=")
                            out[node] = out.get(node, 0) + int(pages)
            if out:
                break
        return out
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def timed_copies(host, dev, iters: int) -> dict:
    nbytes = host.numel()
    res = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        for _ in range(2):  # warm-up
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        gbps = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            gbps.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        res[name] = {"GBps_median": round(statistics.median(gbps), 2), "GBps_min": round(min(gbps), 2),
                     "GBps_max": round(max(gbps), 2), "iters": iters}
    return res


def variant(nbytes: int, device: int, target, iters: int) -> dict:
    """Pin with the given first-touch target (None: no placement) and measure."""
    t0 = time.perf_counter()
    buf = hostmem.pin(nbytes, device_index=device, numa=target is not None, target=target)
    out = {"pin_seconds": round(time.perf_counter() - t0, 3), "method": buf.method, "registered": buf.registered,
           "numa_node": buf.numa_node, "placement": buf.placement,
           "pages_per_node": node_pages(buf.tensor.data_ptr(), nbytes)}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    dev.fill_(1)
    out.update(timed_copies(buf.tensor, dev, iters))
    del dev
    buf.free()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "CUDA is not available"}))
        return 1
    torch.cuda.set_device(args.device)
    nbytes = int(args.gib * 2**30)
    nodes = hostmem.numa_nodes()
    target = hostmem.numa_target(args.device)
    props = torch.cuda.get_device_properties(args.device)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "gpu": props.name,
        "torch": torch.__version__, "cuda": torch.version.cuda, "bytes": nbytes, "device": args.device,
        "numa_nodes": nodes, "gpu_numa_node": target.node, "gpu_numa_reason": target.reason,
        "process_cpus": hostmem.format_cpulist(sorted(os.sched_getaffinity(0))),
        "host_memory": hostmem.fmt_bytes(hostmem.available_bytes() or 0),
        "variants": {},
    }
    result["variants"]["unbound"] = variant(nbytes, args.device, None, args.iters)
    if target.node is None:
        result["note"] = (f"no NUMA placement possible here ({target.reason}); only the unbound variant was "
                          "measured" + (": this machine has a single NUMA node" if nodes and len(nodes) == 1 else ""))
    else:
        result["variants"]["gpu_node"] = variant(nbytes, args.device, target, args.iters)
        others = [n for n in nodes if n != target.node and hostmem.node_cpus(n)]
        if others:
            result["variants"]["far_node"] = variant(nbytes, args.device, hostmem.node_target(others[0]), args.iters)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
