#!/usr/bin/env python3
"""What an asynchronous checkpoint save costs inside the save call for host states that are views of one
buffer (the streamed step's), handed to Bridge's persistent checkpoint worker, on the CPU:

- writers: what Megatron-Core's and nvidia-resiliency-ext's writers do, a clone of each view (their
  test: a storage larger than the tensor), then pickling for the worker process, which moves each
  clone's storage into shared memory;
- shared: a prototype, not in bridge_fgo (docs/design.md#async-save): one copy of each view straight
  into a shared storage of its own size, which the writers would not clone and pickling passes by
  handle.

Each round is timed up to the pickled request, alternating the two, and the shared memory released
between rounds. Host memory only: no GPU is involved in either copy.

  python3 scripts/bench_snapshot.py [--gib 2] [--tensors 64] [--rounds 3] [--threads N]
"""
import argparse
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes of states, in GiB")
    ap.add_argument("--tensors", type=int, default=64, help="views the buffer is cut into")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()

    import torch
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions: storages go by shared memory)
    from multiprocessing.reduction import ForkingPickler

    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.gib * 2**30) // 4 // args.tensors * args.tensors
    buffer = torch.randn(n + 16)  # one storage larger than every view, as the pinned buffer is
    views = list(buffer[:n].view(args.tensors, -1).unbind(0))

    def writers():
        return [v.clone() for v in views]  # each clone is moved into /dev/shm as it is pickled

    def shared():
        out = []
        for v in views:
            t = torch.empty(0, dtype=v.dtype).set_(torch.UntypedStorage._new_shared(v.numel() * v.element_size()),
                                                   0, v.shape)
            out.append(t.copy_(v))
        return out

    times = {"writers": [], "shared": []}
    for _ in range(args.rounds):
        for name, make in (("writers", writers), ("shared", shared)):
            t0 = time.perf_counter()
            request = make()
            ForkingPickler.dumps(request)
            times[name].append(time.perf_counter() - t0)
            assert all(torch.equal(a, b) for a, b in zip(request, views))
            del request
    gb = n * 4 / 1e9
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name}: median {med:.3f} s for {gb:.2f} GB ({gb / med:.2f} GB/s), rounds {', '.join(f'{t:.3f}' for t in ts)}")
    print(f"shared / writers: {statistics.median(times['shared']) / statistics.median(times['writers']):.2f}; "
          f"torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
