#!/usr/bin/env python3
"""GPU check of the builtin engine's CUDA path (streams, events, the window, storage-less masters), in
seconds, before the long benchmark runs: Megatron-Core's real step_with_ready_grads on a stand-in
DistributedOptimizer whose tensors are on the GPU, with and without the engine, for every inner
optimizer importable here (torch AdamW foreach and not; the real apex FusedAdam; the real Transformer
Engine FusedAdam, plain and precision-aware with bf16 moments, fp16 scaled moments and int16
remainders), several windows, a memory budget, and the one-window engine. Exits non-zero on any
difference.

  python3 scripts/check_streamed_cuda.py [--out result.json] [--device cpu]
"""
import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
sys.path.insert(0, HERE)


def cases(torch, device):
    out = [("torch-foreach", dict(optimizer="torch", foreach=True)),
           ("torch-for-loop", dict(optimizer="torch", foreach=False))]
    real = device == "cuda"
    if real and importlib.util.find_spec("apex") is not None:
        out.append(("apex", dict(optimizer="apex-real", groups=2)))
    if real and importlib.util.find_spec("transformer_engine") is not None:
        out += [("te", dict(optimizer="te-real", groups=2)),
                ("te-precision-aware-bf16", dict(optimizer="te-real", precision_aware=True,
                                                 exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)),
                ("te-precision-aware-fp16", dict(optimizer="te-real", precision_aware=True,
                                                 exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)),
                ("te-precision-aware-remainders", dict(optimizer="te-real", precision_aware=True,
                                                       store_param_remainders=True))]
    if not real:  # the stand-ins, so the same logic runs anywhere
        out += [("apex-stand-in", dict(optimizer="apex", groups=2)), ("te-stand-in", dict(optimizer="te", groups=2))]
    return out


def snapshot(torch, opt):
    inner = opt.optimizer
    snap = [p.detach().cpu().clone() for g in inner.param_groups for p in g["params"]]
    snap += [v.detach().cpu().clone() for g in inner.param_groups for p in g["params"]
             for v in inner.state[p].values() if isinstance(v, torch.Tensor)]
    snap += [v.cpu().clone() for p in getattr(inner, "_scales", {}) for v in inner._scales[p].values()]
    snap += [torch.tensor(float(g["step"])) for g in inner.param_groups if "step" in g]
    snap.append(opt.buffers[0].param_data.cpu().clone())
    return snap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cuda (the point); cpu runs the same logic anywhere")
    ap.add_argument("--only", help="comma-separated optimizer names (e.g. te,te-precision-aware-bf16); default: all")
    args = ap.parse_args()
    import bench_imports

    bench_imports.install()
    import torch
    from support import harness

    from bridge_fgo.engine import contracts
    from bridge_fgo.engine.onewindow import OneWindowEngine
    from bridge_fgo.engine.streamed import StreamedEngine

    shapes = ((512, 1024), (4096,), (1000, 3), (257, 129), (3, 5), (2048, 2048))
    # ring: four window slots; head: the first two chunks' copies started before gradient finalization,
    # as the prefetch during backward starts them (engine/streamed/head.py)
    engines = [("streamed", 1), ("streamed", 3 * 2**20), ("streamed", 2**30), ("budget", 3 * 2**20),
               ("ring", 1), ("ring+head", 1), ("one-window", 0)]
    results, ok = [], True
    only = set(args.only.split(",")) if args.only else None
    harness.checked_passes().__enter__()  # for the whole run: every pass reads only whole storage
    for name, kw in cases(torch, args.device):
        if only and name not in only:
            continue
        for kind, chunk in engines:
            runs = []
            for offload in (False, True):
                opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True, shapes=shapes,
                                                         device=args.device, **kw)
                engine = None
                if offload:
                    if kind == "one-window":
                        engine = OneWindowEngine([opt])
                    else:  # the budget: room for about half the states on top of what is allocated now
                        budget = None
                        if kind == "budget":
                            budget = (torch.cuda.max_memory_allocated() if args.device == "cuda" else 0) + 40 * 2**20
                        engine = StreamedEngine([opt], chunk, budget)
                    engine.prepare()
                    if kind.startswith("ring"):
                        engine.fitting.window_at(chunk, 4)
                for _ in range(4):
                    if engine:
                        engine.offload()
                        engine.release()
                        if kind == "ring+head":
                            for i in range(2):
                                engine.transfers.h2d(i)
                        engine.reload()
                        engine.wait_reload()
                    opt.step_states()
                    if engine:
                        engine.settle()
                if engine:
                    engine.synchronize()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                runs.append((snapshot(torch, opt), engine, opt))
            same = len(runs[0][0]) == len(runs[1][0]) and all(
                a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
            engine, opt = runs[1][1], runs[1][2]
            row = {"optimizer": name, "inner": contracts.describe(opt.optimizer), "engine": kind,
                   "chunk_bytes": chunk, "bytes": engine.bytes, "bit_identical": same}
            if kind != "one-window":
                row.update(chunks=len(engine.chunks), slots=engine.plan.slots, window_bytes=engine.window_bytes,
                           resident_bytes=engine.resident_bytes, on_host=engine.on_host(), budget=engine.budget_note)
            engine.close()
            ok &= same
            results.append(row)
            print("CHECK " + json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{sum(r['bit_identical'] for r in results)}/{len(results)} bit-identical", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
