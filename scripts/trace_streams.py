#!/usr/bin/env python3
"""What a profiled streamed step did on the GPU, from the timeline scripts/bench_offload.py writes
(--profile-iter N: OUT.profile-iterN.trace.json.gz): the engine's host-to-device and device-to-host
copies (the two streams holding pinned-host copies in both directions), how long each direction was
busy and at what rate, the gaps between consecutive copies in (time the link waited for the update),
the kernels that ran meanwhile, and the host's CUDA runtime calls over the update (a synchronisation
there would show as cudaStreamSynchronize or cudaEventSynchronize). Also, over the whole profiled
iteration, the compute stream (the one with the most kernel time): how long it was idle, and its largest
idle gaps with the engine copies in flight meanwhile, so a forward or backward that waits for the
engine shows where (a run without offload gives the same figures to compare with).

  python3 scripts/trace_streams.py builtin.json.profile-iter6.trace.json.gz [...]
"""
import collections
import gzip
import json
import sys


def analyse(path):
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream = collections.defaultdict(set)
    for e in gpu:
        if e["cat"] == "gpu_memcpy" and "Pinned" in e["name"]:
            by_stream[e["args"].get("stream")].add("HtoD" if "HtoD" in e["name"] else "DtoH")
    # the engine's copy streams carry one direction each; the compute stream carries both (Megatron's own)
    h2d_streams = {s for s, d in by_stream.items() if d == {"HtoD"}}
    d2h_streams = {s for s, d in by_stream.items() if d == {"DtoH"}}
    h2d = sorted((e for e in gpu if e["args"].get("stream") in h2d_streams), key=lambda e: e["ts"])
    d2h = sorted((e for e in gpu if e["args"].get("stream") in d2h_streams), key=lambda e: e["ts"])
    compute = compute_stream(gpu, h2d + d2h)
    if not h2d:
        return {"trace": path, "engine_copies": 0, "compute": compute}
    start, end = h2d[0]["ts"], max(e["ts"] + e["dur"] for e in h2d + d2h)
    busy = {name: sum(e["dur"] for e in es) / 1e3 for name, es in (("h2d", h2d), ("d2h", d2h))}
    moved = {name: sum(e["args"].get("bytes", 0) for e in es) for name, es in (("h2d", h2d), ("d2h", d2h))}
    gaps = [(b["ts"] - (a["ts"] + a["dur"])) / 1e3 for a, b in zip(h2d, h2d[1:])]
    kernels = [e for e in gpu if e["cat"] == "kernel" and start <= e["ts"] <= end]
    runtime = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and start <= e["ts"] <= end:
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e["dur"] / 1e3
    return {
        "trace": path,
        "copies": {"h2d": len(h2d), "d2h": len(d2h)},
        "span_ms": round((end - start) / 1e3, 1),
        "busy_ms": {k: round(v, 1) for k, v in busy.items()},
        "GBps": {k: round(moved[k] / busy[k] / 1e6, 1) if busy[k] else None for k in busy},
        "h2d_gaps_ms": {"total": round(sum(g for g in gaps if g > 0), 2), "largest": round(max(gaps, default=0), 2)},
        "kernels_during_update": {"count": len(kernels), "busy_ms": round(sum(e["dur"] for e in kernels) / 1e3, 1)},
        "runtime_calls": {n: {"calls": c, "ms": round(t, 1)} for n, (c, t) in
                          sorted(runtime.items(), key=lambda kv: -kv[1][1])[:6]},
        "compute": compute,
    }


def compute_stream(gpu, copies, gap_ms=0.5, top=8):
    """The compute stream over the whole trace: span, busy, idle, and its largest idle gaps (offset from
    its first kernel, length, the engine copy directions in flight)."""
    busy = collections.Counter()
    for e in gpu:
        if e["cat"] == "kernel":
            busy[e["args"].get("stream")] += e["dur"]
    if not busy:
        return None
    stream = busy.most_common(1)[0][0]
    ks = sorted((e for e in gpu if e["cat"] == "kernel" and e["args"].get("stream") == stream), key=lambda e: e["ts"])
    t0, gaps, end = ks[0]["ts"], [], ks[0]["ts"]
    for e in ks:
        if e["ts"] > end:
            gaps.append((end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])

    def during(a, b):
        return sorted({"h2d" if "HtoD" in c["name"] else "d2h" for c in copies if c["ts"] < b and c["ts"] + c["dur"] > a})

    idle = sum(b - a for a, b in gaps)
    large = sorted((g for g in gaps if g[1] - g[0] >= gap_ms * 1e3), key=lambda g: g[0] - g[1])[:top]
    return {"span_ms": round((end - t0) / 1e3, 1), "idle_ms": round(idle / 1e3, 1),
            "idle_in_gaps_over_ms": {str(gap_ms): round(sum(b - a for a, b in gaps if b - a >= gap_ms * 1e3) / 1e3, 1)},
            "largest_gaps": [{"at_ms": round((a - t0) / 1e3, 1), "ms": round((b - a) / 1e3, 2),
                              "copies": during(a, b)} for a, b in sorted(large)]}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print(json.dumps(analyse(p), indent=1))
