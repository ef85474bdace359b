"""A refusal on one rank stops every rank, through the real patched train_step: three processes joined
by gloo on 127.0.0.1 each run bridge_fgo's builtin engine on the harness's real DistributedOptimizer;
only rank 1's host is short of memory. All three raise the same BridgeFGOConfigError, promptly, before
any of them pinned anything or entered the step, so no rank is left waiting in a collective."""
import json
import os
import time

from test_agree import gloo_group, run_ranks_with

GiB = 2**30


def _rank_main(rank, world, port, out_dir):
    from support import te_free

    te_free.install()
    import bridge_fgo
    from bridge_fgo import hostmem
    from bridge_fgo.hostmem import available
    from support import harness
    from test_streamed import rig

    with gloo_group(rank, world, port):
        if rank == 1:  # this node has 1 MiB available
            real = available.host_memory
            available.host_memory = lambda root=None: available.HostMemory(
                2**20, "MemAvailable", "a node with 1 MiB left", 2**20, None) if real(root) else None
        bridge_fgo.patch(offload="builtin", chunk_mb=1)
        r = rig()
        t0 = time.monotonic()
        try:
            harness.run_steps(r, steps=1)
            result = {"raised": None, "message": None}
        except Exception as exc:
            result = {"raised": type(exc).__name__, "message": str(exc)}
        result.update(seconds=time.monotonic() - t0, events=list(r.events), pinned=hostmem.pinned_bytes(),
                      patched=bridge_fgo.is_patched())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


def test_one_rank_short_of_host_memory_stops_every_rank_before_anything_is_pinned(tmp_path):
    # (preloaded: the rank's module and test_streamed, imported before the patch; Bridge only after it)
    results = run_ranks_with(_rank_main, tmp_path, world=3,
                             preload=["test_agree", "test_collective_refusal", "test_streamed"])
    assert [r["raised"] for r in results] == ["BridgeFGOConfigError"] * 3
    (message,) = {r["message"] for r in results}
    assert message.startswith("optimizer-state offload: refused on rank(s) 1 (of 3) before anything was pinned: "
                              "rank 1: optimizer-state offload would pin more host memory than this node has")
    assert "a node with 1 MiB left" in message
    assert all(r["events"] == [] and r["pinned"] == 0 and r["patched"] for r in results)  # no step, no pin
    assert max(r["seconds"] for r in results) < 15  # promptly: nobody waited out a timeout
