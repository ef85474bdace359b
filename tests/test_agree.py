"""bridge_fgo.instrument.agree: one verdict for every rank. In one process (no group, a group of one), and with
three real processes joined by gloo on 127.0.0.1: a refusal on rank 1 makes every rank raise the same
message, promptly; no refusal, nobody raises; and the engine's sequence (check_fits on every rank
against that rank's faked /proc/meminfo, then agree) stops all three ranks with rank 1's figures."""
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from datetime import timedelta
from multiprocessing import forkserver

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from bridge_fgo import BridgeFGOConfigError, hostmem
from bridge_fgo.instrument.agree import agree, refusal
from support import ports

GiB = 2**30
WHAT = "optimizer-state offload"
# The whole multi-process run: spawning, importing torch (and Megatron), rendezvous, agreeing.
# Promptness is asserted apart, from each rank's own clock.
DEADLINE_S = 120


# -- one process ----------------------------------------------------------------------------------------

def test_refusal_lists_each_message_once_with_its_ranks():
    verdicts = [None, "short of memory", None, "short of memory", "no cgroup", "short of memory", None, None]
    assert refusal(WHAT, verdicts) == (
        "optimizer-state offload: refused on rank(s) 1, 3-5 (of 8) before anything was pinned: "
        "ranks 1, 3, 5: short of memory | rank 4: no cgroup")
    assert refusal(WHAT, [None] * 4) is None
    assert refusal(WHAT, [None, ""]) == f"{WHAT}: refused on rank(s) 1 (of 2) before anything was pinned: rank 1: (no message)"


def test_without_a_process_group_the_local_verdict_stands():
    assert not dist.is_initialized()
    assert agree(None, WHAT) is None
    with pytest.raises(BridgeFGOConfigError) as exc:
        agree("this rank is short of memory", WHAT)
    assert str(exc.value) == "this rank is short of memory"


def test_a_group_of_one_does_not_exchange(monkeypatch):
    def no_exchange(*a, **k):
        raise AssertionError("a group of one has nobody to agree with")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_gather_object", no_exchange)
        assert agree(None, WHAT) is None
        with pytest.raises(BridgeFGOConfigError, match="^short$"):
            agree("short", WHAT)
    finally:
        dist.destroy_process_group()


def test_agreeing_without_a_group_does_not_import_torch():
    code = ("import sys, bridge_fgo.instrument.agree as a; a.agree(None, 'x')\n"
            "try:\n    a.agree('no', 'x')\nexcept a.BridgeFGOConfigError as e:\n    print(e)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.split() == ["no", "False"]


# -- three processes, gloo on loopback ------------------------------------------------------------------

@contextlib.contextmanager
def gloo_group(rank, world, port):
    """This rank in a gloo group of `world` on loopback, for the body. Leaving is ordered: the ranks
    meet in a barrier when the body returned, each destroys its group, and rank 0, which serves the
    TCPStore, leaves only after every rank has destroyed its group, so no rank's teardown talks to a
    store or a peer that is gone (an error in gloo's or the store's C++ teardown aborts the process)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=DEADLINE_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=DEADLINE_S))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
        store.set(f"left/{rank}", "1")
        if rank == 0:
            store.wait([f"left/{r}" for r in range(world)])


def _rank_main(rank, world, port, out_dir, problems, roots):
    """One rank: join the group, decide (a given problem, or check_fits against this rank's faked
    root), agree, and write what happened to out_dir/rank<N>.json."""
    with gloo_group(rank, world, port):
        problem = problems[rank] if problems else None
        if roots:
            try:
                hostmem.check_fits(4 * GiB, root=roots[rank], ranks=1)
            except BridgeFGOConfigError as exc:
                problem = str(exc)
        t0 = time.monotonic()
        try:
            agree(problem, WHAT)
            result = {"raised": None, "message": None}
        except Exception as exc:
            result = {"raised": type(exc).__name__, "message": str(exc)}
        result["agree_s"] = time.monotonic() - t0
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


def run_ranks(out_dir, problems=None, roots=None, world=3):
    return run_ranks_with(_rank_main, out_dir, problems, roots, world=world, preload=["test_agree"])


def run_ranks_with(main, out_dir, *args, world=3, preload=None):
    """main(rank, world, port, out_dir, *args) in `world` spawned processes; every rank's result (its
    out_dir/rank<N>.json); fails the test if the ranks are not all done within DEADLINE_S, or if any
    rank exits non-zero, with the tail of every rank's output (out_dir/rank<N>.log).

    `preload`: the modules a rank imports before it does anything bridge_fgo would see: the module of
    `main` (what a spawned rank imports to find it), and more where `main` imports them first thing
    (Bridge's, Megatron-Core's). They are imported once, in multiprocessing's fork server, whose forks
    are then the ranks: each starts with them loaded instead of importing them (10 s a rank for Bridge
    on a 2-core host), with this process's environment, directory and sys.path, as a spawned rank."""
    t0 = time.monotonic()
    if preload is not None:
        _fork_server(tuple(preload))
    ctx = mp.start_processes(_logged, args=(main, world, ports.free_ports(), str(out_dir), dict(os.environ), *args),
                             nprocs=world, join=False, start_method="spawn" if preload is None else "forkserver")
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() - t0 > DEADLINE_S:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the {world} ranks did not finish within {DEADLINE_S} s: agree hung\n"
                            + _tails(out_dir, world))
    except ProcessException as exc:
        pytest.fail(f"{exc}\n" + _tails(out_dir, world))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


_server = []  # what this process's fork server preloads, once run_ranks_with has set it


def _fork_server(preload):
    """multiprocessing's fork server (one per process) preloading `preload`: the one there, or, where it
    preloads other modules, a new one (the next rank starts it)."""
    if _server and _server[0] != preload:
        forkserver._forkserver._stop()  # (its ranks are done: run_ranks_with waited for them)
        _server.clear()
    if not _server:
        multiprocessing.set_forkserver_preload(list(preload))
        # Started here, with this process's sys.path as PYTHONPATH: the server imports `preload` before it
        # applies the sys.path it is given (CPython 3.11, 3.12, 3.13.0: forkserver.main ignores sys_path), so
        # started by the first rank, with pytest's entries (the checkout, tests/) missing, it found none of
        # them and said nothing (an ImportError there is passed over): every rank imported them itself.
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        _server.append(preload)


def _logged(rank, main, world, port, out_dir, environ, *args):
    """A rank's output goes to out_dir/rank<N>.log at the file-descriptor level, so what C++ writes
    before an abort (gloo, torch) is kept and shown when the rank fails. The environment is the
    starting process's (a fork server's rank would otherwise have the server's, as it was when it started)."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    with open(os.path.join(out_dir, f"rank{rank}.log"), "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    main(rank, world, port, out_dir, *args)
    # Done: leave without the interpreter's teardown (a spawned child ends with sys.exit), where a rank once
    # aborted after its work was written ("terminate called without an active exception", a C++ thread of
    # torch's destroyed at exit; CI, 0.4.2, twice in 2026-11). A rank that raised does not get here.
    # That teardown would also have stopped the rank's own child processes: Megatron-Core's filesystem
    # writer starts a multiprocessing Manager for its results queue, a server process that would
    # otherwise outlive the rank and the test run, holding 0.7 GB, for good.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tails(out_dir, world, lines=40):
    out = []
    for r in range(world):
        path = out_dir / f"rank{r}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no output)"]
        out.append(f"--- rank {r}: last {lines} lines of {path.name} ---\n" + "\n".join(text))
    return "\n".join(out)


def test_a_refusal_on_rank_1_stops_every_rank_with_one_message(tmp_path):
    results = run_ranks(tmp_path, problems=[None, "rank 1 is short of host memory", None])
    expected = (f"{WHAT}: refused on rank(s) 1 (of 3) before anything was pinned: "
                "rank 1: rank 1 is short of host memory")
    assert [r["raised"] for r in results] == ["BridgeFGOConfigError"] * 3
    assert [r["message"] for r in results] == [expected] * 3
    assert max(r["agree_s"] for r in results) < 15  # promptly: nobody waited out a timeout


def test_no_refusal_nobody_raises(tmp_path):
    results = run_ranks(tmp_path, problems=[None, None, None])
    assert [r["raised"] for r in results] == [None] * 3


def test_check_on_every_rank_then_agree(tmp_path):
    """The engine's sequence: every rank checks its own host memory, then they agree. Only rank 1's
    node is short, and all three ranks stop, each naming rank 1 and its figures."""
    roots = []
    for rank, avail in enumerate((100 * GiB, 1 * GiB, 100 * GiB)):
        root = tmp_path / f"root{rank}"
        (root / "proc").mkdir(parents=True)
        (root / "proc" / "meminfo").write_text(f"MemTotal: {4 * avail // 1024} kB\nMemAvailable: {avail // 1024} kB\n")
        roots.append(str(root))
    out = tmp_path / "out"
    out.mkdir()
    results = run_ranks(out, roots=roots)
    messages = {r["message"] for r in results}
    assert [r["raised"] for r in results] == ["BridgeFGOConfigError"] * 3 and len(messages) == 1
    msg = messages.pop()
    assert msg.startswith(f"{WHAT}: refused on rank(s) 1 (of 3) before anything was pinned: rank 1: "
                          "optimizer-state offload would pin more host memory than this node has")
    for part in ("4.00 GiB (4294967296 bytes) per rank x 1 local rank(s)", "reserve of 2.00 GiB",
                 "only 1.00 GiB (1073741824 bytes) is available (MemAvailable", roots[1]):
        assert part in msg, part
    assert roots[0] not in msg and roots[2] not in msg  # ranks 0 and 2 fit: no message of theirs


# -- a save started beside a pending one: every rank's room, one decision --------------------------------

class _Adapter:
    def __init__(self, room):
        self.room, self.told = room, []

    def room_beside_a_pending_save(self):
        return self.room

    def beside_a_pending_save(self, agreed):
        self.told.append(agreed)


def _overlap_main(rank, world, port, out_dir, rooms):
    """One rank of an asynchronous save started while the previous one is pending on every rank: this rank's room
    for a second copy is rooms[rank] (None: it has room); saves.finish_pending over the real gloo group."""
    import logging
    import types

    from bridge_fgo.instrument import saves
    from support import harness

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("bridge_fgo").addHandler(handler)
    with gloo_group(rank, world, port):
        adapter, queue, finished = _Adapter(rooms[rank]), harness.LaterQueue(), []
        queue.schedule_async_request(lambda: finished.append(True))  # the save pending on every rank
        saves.finish_pending(types.SimpleNamespace(async_calls_queue=queue),
                             [types.SimpleNamespace(adapter=adapter)], 4096)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"told": adapter.told, "finished": finished, "said": said}, f)


@pytest.mark.parametrize("rooms", [(None, None), (None, "1.00 GiB available")], ids=["room", "no-room-on-rank-1"])
def test_a_save_beside_a_pending_one_is_decided_once_for_every_rank(tmp_path, rooms):
    """With room for a second copy on every rank, every rank goes on beside the pending save (the snapshot's other
    set); where one rank has none, every rank finishes the pending save (finishing is collective), each saying
    why once, with that rank's figures."""
    results = run_ranks_with(_overlap_main, tmp_path, list(rooms), world=2, preload=["test_agree"])
    room = rooms[1] is None
    assert [r["told"] for r in results] == [[room], [room]]
    assert [r["finished"] for r in results] == ([[], []] if room else [[True], [True]])
    said = [r["said"] for r in results]
    if room:
        assert said == [[], []]
    else:
        assert len(said[0]) == 1 and "(rank 1: 1.00 GiB available)" in said[0][0] and "save_interval" in said[0][0]
        assert len(said[1]) == 1 and "(1.00 GiB available)" in said[1][0]

