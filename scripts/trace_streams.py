#!/usr/bin/env python3
"""What a profiled streamed step did on the GPU, from the timeline scripts/bench_offload.py writes
(--profile-iter N: OUT.profile-iterN.trace.json.gz): the engine's host-to-device and device-to-host
copies (the two streams holding pinned-host copies in both directions), how long each direction was
busy and at what rate, the gaps between consecutive copies in (time the link waited for the update),
the kernels that ran meanwhile, and the host's CUDA runtime calls over the update (a synchronisation
there would show as cudaStreamSynchronize or cudaEventSynchronize).

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
    if not h2d:
        return {"trace": path, "engine_copies": 0}
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
    }


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print(json.dumps(analyse(p), indent=1))
