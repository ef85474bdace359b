#!/usr/bin/env python3
"""GPU check of the streamed step's CUDA path (streams, events, slots, storage-less masters), in
seconds, before the long benchmark runs: Megatron-Core's real step_with_ready_grads on a stand-in
DistributedOptimizer whose tensors are on the GPU, with and without the streamed engine, for torch
AdamW foreach and not, several window sizes. Exits non-zero on any difference.

  python3 scripts/check_streamed_cuda.py [--out result.json]
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cuda (the point); cpu runs the same logic anywhere")
    args = ap.parse_args()
    import bench_imports

    bench_imports.install()
    import torch
    from support import harness

    from bridge_fgo.streamed import StreamedEngine

    shapes = ((512, 1024), (4096,), (1000, 3), (257, 129), (3, 5), (2048, 2048))
    results = []
    ok = True
    for foreach in (True, False):
        for chunk in (1, 3 * 2**20, 2**30):
            runs = []
            for streamed in (False, True):
                opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True, shapes=shapes,
                                                         foreach=foreach, device=args.device)
                engine = StreamedEngine(opt, chunk) if streamed else None
                if engine:
                    engine.prepare()
                for _ in range(4):
                    if engine:
                        engine.offload()
                        engine.release()
                        engine.reload()
                    opt.step_states()
                    if engine:
                        engine.settle()
                        assert engine.on_host()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                snap = [p.detach().cpu().clone() for g in opt.optimizer.param_groups for p in g["params"]]
                snap += [v.detach().cpu().clone() for g in opt.optimizer.param_groups for p in g["params"]
                         for v in opt.optimizer.state[p].values()]
                snap.append(opt.buffers[0].param_data.cpu().clone())
                runs.append((snap, engine))
            same = all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
            engine = runs[1][1]
            row = {"foreach": foreach, "chunk_bytes": chunk, "chunks": len(engine.chunks),
                   "arena_bytes": engine.arena_bytes, "bytes": engine.bytes, "bit_identical": same,
                   "masters_on_host": engine.on_host()}
            engine.close()
            row["closed_back_on_device"] = all(p.device.type == args.device for p in engine.masters.values())
            ok &= same
            results.append(row)
            print("CHECK " + json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
