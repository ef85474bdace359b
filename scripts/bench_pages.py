"""Making a pinned host buffer: how its pages are mapped and faulted in (bridge_fgo.hostmem).

    python scripts/bench_pages.py --gib 3.6 --reps 2 --out result.json [--device 0]

Issue 43: a checkpoint load with offload maps the engine's buffer, faults its pages in from threads bound to
the GPU's node, and registers it (cudaHostRegister); the first touch alone took 0.80-0.88 s for 3.8 GB on
one H200. Variants, alternated `--reps` times: the mapping (`shared`: MAP_SHARED|MAP_ANONYMOUS, what
hostmem maps, Python's default; `private`: MAP_PRIVATE; `private-huge`: private with madvise(MADV_HUGEPAGE))
times the fault-in (`memset`: writing zeros, what hostmem does; `populate`: madvise(MADV_POPULATE_WRITE),
which leaves present pages' contents alone), from THREADS threads bound to the GPU's node on 2 MiB-aligned
slices. Each: the fault-in, the registration, the release, the huge pages the kernel gave (AnonHugePages),
and device-to-host and host-to-device copies of the whole buffer (CUDA events). Also the host's THP
settings. Prints the JSON and writes it to --out. Needs only torch and bridge_fgo.
"""
import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bridge_fgo.hostmem import numa, pinning  # noqa: E402  (the registration as hostmem does it)

THP = "/sys/kernel/mm/transparent_hugepage"
THREADS = 8
MADV_POPULATE_WRITE = 23  # Linux 5.14
VARIANTS = [(m, f) for m in ("shared", "private", "private-huge") for f in ("memset", "populate")]
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def mapped(nbytes: int, mapping: str):
    m = mmap.mmap(-1, nbytes, flags=(mmap.MAP_SHARED if mapping == "shared" else mmap.MAP_PRIVATE))
    if mapping == "private-huge":
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)


def fault_in(tensor, how: str, cpus) -> None:
    ptr, nbytes = tensor.data_ptr(), tensor.numel()
    step = -(-(-(-nbytes // THREADS)) // 2**21) * 2**21
    errors = []

    def work(start, length):
        if cpus:
            os.sched_setaffinity(0, cpus)
        if how == "memset":
            ctypes.memset(ptr + start, 0, length)
        elif _libc.madvise(ptr + start, length, MADV_POPULATE_WRITE) != 0:
            errors.append(os.strerror(ctypes.get_errno()))

    threads = [threading.Thread(target=work, args=(s, min(step, nbytes - s))) for s in range(0, nbytes, step)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise OSError(f"madvise(MADV_POPULATE_WRITE): {errors[0]}")


def sysfs(name: str) -> str:
    try:
        with open(os.path.join(THP, name)) as f:
            return f.read().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def anon_huge_kib(ptr: int, nbytes: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping [ptr, ptr + nbytes)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < ptr + nbytes and hi > ptr
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def copies(host, dev, iters: int) -> dict:
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        gbps = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            gbps.append(host.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
        out[f"{name}_GBps"] = round(statistics.median(gbps), 2)
    return out


def variant(nbytes: int, device: int, target, mapping: str, how: str, iters: int) -> dict:
    t0 = time.perf_counter()
    tensor = mapped(nbytes, mapping)
    t1 = time.perf_counter()
    fault_in(tensor, how, target.cpus)
    t2 = time.perf_counter()
    err = pinning._register(tensor, device, nbytes)
    t3 = time.perf_counter()
    out = {"map_s": round(t1 - t0, 4), "touch_s": round(t2 - t1, 3), "register_s": round(t3 - t2, 3),
           "touch_GBps": round(nbytes / (t2 - t1) / 1e9, 2), "registered": pinning._code(err) == 0,
           "anon_huge_GiB": round(anon_huge_kib(tensor.data_ptr(), nbytes) / 2**20, 3),
           "zero": bool(tensor[::2**20].eq(0).all())}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    dev.fill_(1)
    out.update(copies(tensor, dev, iters))
    del dev
    t4 = time.perf_counter()
    if out["registered"]:
        pinning._unregister(tensor, device, nbytes)
    del tensor
    out["release_s"] = round(time.perf_counter() - t4, 3)
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=3.6)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "CUDA is not available"}))
        return 1
    torch.cuda.set_device(args.device)
    torch.cuda.init()
    nbytes = int(args.gib * 2**30)
    target = numa.numa_target(args.device)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
              "gpu": torch.cuda.get_device_name(args.device), "torch": torch.__version__, "bytes": nbytes,
              "cpus": os.cpu_count(), "gpu_numa": target.reason,
              "thp": {k: sysfs(k) for k in ("enabled", "defrag", "shmem_enabled", "khugepaged/defrag")},
              "threads": THREADS, "runs": {f"{m} {f}": [] for m, f in VARIANTS}}
    for _ in range(args.reps):
        for m, f in VARIANTS:
            try:
                result["runs"][f"{m} {f}"].append(variant(nbytes, args.device, target, m, f, args.iters))
            except OSError as exc:
                result["runs"][f"{m} {f}"].append({"error": str(exc)})
    result["median"] = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]
                               if isinstance(runs[0][k], float)}
                        for name, runs in result["runs"].items() if all("error" not in r for r in runs)}
    text = json.dumps(result, indent=2)
    print(json.dumps({k: result[k] for k in ("date", "gpu", "cpus", "gpu_numa", "thp", "median")}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
