"""Asynchronous checkpoint saves (cfg.checkpoint.async_save) with the streamed step, on CPU.

Real parts: Megatron-Core's dist_checkpointing.save with async_sharded_save=True (torch_dist), its
TorchDistSaveShardedStrategy and both asynchronous writers (nvidia-resiliency-ext's, Bridge's default,
with its persistent worker process; Megatron-Core's, with its forked worker), their AsyncCallsQueues,
the harness's real DistributedOptimizer (its dp_reshardable sharded_state_dict, guarded by the engine's
readers) stepped through Bridge's real train_step, bridge_fgo's call sites (train, save_checkpoint),
one gloo rank. Stand-ins: Bridge's save_checkpoint itself (what it does with the optimizer: its sharded
state dict, dist_checkpointing.save, the request scheduled on the run's queue; the rest of it reads the
RNG states of a GPU), torch.cuda.synchronize / current_device in this process (the writers' D2H
fences and the done-flag's device; nothing is on a GPU) and nvidia-resiliency-ext's worker started in
its cpu_shm_mode (it sets up a CUDA device otherwise; CPU tensors take the same path either way).

Each checkpoint is read back with torch.distributed.checkpoint and compared, entry by entry (tensors and
objects, scripts/check_checkpoint.py's comparison), with a synchronous save of the same iteration,
but for the fp32 parameter's own shard (the model's tensor, which never moves): the harness keeps the
model's "GPU" tensors on the CPU, where a tensor owning its whole storage is not copied by the writers
but handed to the worker process live, through shared memory; on a GPU it is copied by the worker
inside the save call, as without offload.
"""
import inspect
import os
import sys
import threading
import time
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing

import bridge_fgo
from conftest import MCORE
from bridge_fgo import BridgeFGOConfigError, BridgeFGOError, hostmem
from bridge_fgo.instrument import patcher, refusals, saves, targets
from support import harness
from test_resume_fix import FORMAT, optimizer
from test_resume_host import megatron_core_for  # noqa: F401  (a fixture: Megatron-Core's flags per optimizer)
from test_streamed import OPTIMIZERS as CASES, snapshot

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import check_checkpoint  # noqa: E402

KINDS = [*harness.OPTIMIZERS, "te-precision-aware-bf16"]
# Bridge's writer: from megatron-core 0.17 dist_checkpointing.save takes an async_strategy, and Bridge's
# default is nvidia-resiliency-ext's ("nvrx"); megatron-core 0.16 (Bridge 0.3.1) has only its own
_SAVE_TAKES_STRATEGY = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
WRITER = "nvrx" if _SAVE_TAKES_STRATEGY else "mcore"
ns = types.SimpleNamespace


@pytest.fixture(scope="module")
def writers():
    """One gloo rank and this process's stand-ins for the GPU-only calls; the asynchronous queues
    (nvidia-resiliency-ext's persistent worker is started once for the module)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as McoreQueue
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue as NvrxQueue

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cuda = [mock.patch("torch.cuda.synchronize", lambda *a, **k: None),
            mock.patch("torch.cuda.current_device", lambda *a, **k: "cpu")]
    for p in cuda:
        p.start()
    queues = {}
    try:  # (a failure here must not leave the process group to the next test files)
        # nvidia-resiliency-ext 0.6 hands CPU tensors to its worker through /dev/shm when asked; 0.4.1
        # (Bridge 0.3.1's) has no such mode. (The class's own signature is a wrapper's: *args, **kwargs)
        shm = {"cpu_shm_mode": True} if "cpu_shm_mode" in inspect.signature(NvrxQueue.__init__).parameters else {}
        if _SAVE_TAKES_STRATEGY:
            queues["nvrx"] = NvrxQueue(persistent=True, **shm)
        queues["mcore"] = McoreQueue(persistent=False)
        yield queues
    finally:
        for q in queues.values():
            q.close()
        for p in cuda:
            p.stop()
        dist.destroy_process_group()


def checkpoint_cfg(directory, **kw):
    fields = dict(save=str(directory), load=None, save_optim=True, load_optim=True, async_save=True,
                  ckpt_format="torch_dist", use_persistent_ckpt_worker=True, dist_ckpt_optim_fully_reshardable=False)
    fields.update(kw)
    return ns(**fields)


def rig_for(kind, directory, queue, **ckpt):
    """Bridge's real train_step over the harness's loadable DistributedOptimizer (`kind`), with a
    checkpoint config saving asynchronously and the run's queue on its global state."""
    rig = harness.Rig(cfg=harness.config_container(mxfp8_copy=False, checkpoint=checkpoint_cfg(directory, **ckpt)))
    opt = optimizer(**({} if kind == "torch" else CASES[kind]))
    rig.dist_optimizer, rig.optimizer = opt, harness.ChainedOptimizer([opt], rig.events)
    rig.global_state.async_calls_queue = queue
    return rig


def bridge_save(state, dist_optimizer, directory, strategy, schedule=True):
    """What Bridge's save_checkpoint does with the optimizer state when async_save is set
    (checkpointing.py): the sharded state dict (dp_reshardable, Bridge's default), Megatron-Core's
    dist_checkpointing.save with async_sharded_save, the request scheduled on the run's queue.
    schedule=False returns the request instead (scheduled later by the test)."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory)
    state_dict = {"optimizer": dist_optimizer.sharded_state_dict({}, False, metadata=FORMAT)}
    strategy = {"async_strategy": strategy} if _SAVE_TAKES_STRATEGY else {}
    request = dist_checkpointing.save(state_dict, str(directory), async_sharded_save=True, **strategy)
    if not schedule:
        return request
    state.async_calls_queue.schedule_async_request(request)


def sync_save(dist_optimizer, directory):
    from megatron.core import dist_checkpointing

    os.makedirs(directory)
    dist_checkpointing.save({"optimizer": dist_optimizer.sharded_state_dict({}, False, metadata=FORMAT)},
                            str(directory))


def save_site():
    return patcher._current.callsites.site(targets.target("save_checkpoint"))


def model_keys(dist_optimizer):
    """The checkpoint keys of tensors that are the model's own (the fp32 parameter's shard)."""
    from test_resume_host import sharded_tensors

    model = {b.param_data.untyped_storage().data_ptr() for b in dist_optimizer.buffers}
    state_dict = dist_optimizer.sharded_state_dict({}, False, metadata=FORMAT)
    return {t.key for t in sharded_tensors(state_dict) if t.data.untyped_storage().data_ptr() in model}


def differing(a, b, skip=()):
    """The keys in which two checkpoints differ (scripts/check_checkpoint.py, entry by entry), but `skip`."""
    return [k for k in check_checkpoint.differing(str(a), str(b)) if k not in skip]


def engine_of(rig):
    _, session = patcher._current.callsites.registry.lookup(rig.optimizer)
    return session.adapter.engine


def setup_kind(megatron_core_for, kind):
    megatron_core_for("torch" if kind == "torch" else kind.split("-")[0])


# -- 1. a save captured while the next updates run ------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_save_pending_while_the_next_updates_run_holds_its_own_iteration(writers, megatron_core_for, kind,
                                                                            tmp_path):
    """Bridge's flow with its default writer (nvidia-resiliency-ext, persistent worker): an
    asynchronous save at iteration 2, not finalized; iterations 3 and 4 run, the streamed update
    rewriting the host buffer; then Bridge's finalize. The checkpoint is iteration 2's, equal to a
    synchronous save of it; iteration 4's differs from it."""
    setup_kind(megatron_core_for, kind)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for(kind, tmp_path, writers[WRITER])
    harness.run_steps(rig, steps=2)
    sync_save(rig.dist_optimizer, tmp_path / "sync2")  # the last update's copies are waited for by its reader
    save_site()(bridge_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "async2", WRITER), {})
    assert writers[WRITER].get_num_unfinalized_calls() == 1
    harness.run_steps(rig, steps=2)
    writers[WRITER].maybe_finalize_async_calls(blocking=True)
    sync_save(rig.dist_optimizer, tmp_path / "sync4")
    assert engine_of(rig).on_host()
    skip = model_keys(rig.dist_optimizer)
    assert len(skip) <= 1 and check_checkpoint.contents(str(tmp_path / "sync2"))["optimizer_tensors"] >= 6
    assert differing(tmp_path / "async2", tmp_path / "sync2", skip) == []
    assert differing(tmp_path / "async2", tmp_path / "sync4", skip)  # the buffer was rewritten meanwhile


@pytest.mark.parametrize("strategy", ["nvrx", "mcore"])
@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_each_writer_captures_inside_the_save_call(writers, megatron_core_for, kind, strategy, tmp_path):
    """Both writers copy the host states inside the save call: a request made at iteration 2 and
    scheduled only after iterations 3 and 4 rewrote the host buffer still writes iteration 2 (a
    writer that kept views of the buffer would write iteration 4's values here)."""
    if strategy not in writers:
        pytest.skip(f"megatron-core {MCORE} saves only with its own writer (no async_strategy)")
    setup_kind(megatron_core_for, kind)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for(kind, tmp_path, writers[strategy])
    harness.run_steps(rig, steps=2)
    sync_save(rig.dist_optimizer, tmp_path / "sync2")
    request = save_site()(bridge_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "async2", strategy),
                          {"schedule": False})
    harness.run_steps(rig, steps=2)
    writers[strategy].schedule_async_request(request)
    writers[strategy].maybe_finalize_async_calls(blocking=True)
    assert differing(tmp_path / "async2", tmp_path / "sync2", model_keys(rig.dist_optimizer)) == []


# -- 2. and 3. a save pending at the end of training, at unpatch() ----------------------------------------

def train(rig, body):
    """bridge_fgo's wrapper of Bridge's train() around `body` (the loop: Bridge's real train_step)."""
    import importlib

    for name in targets.MODULES:  # the patch applies once every target module is imported (a test run alone)
        importlib.import_module(name)
    loop = patcher._current.callsites.site(targets.target("train"))
    return loop(body, None, (), {"model": rig.model, "optimizer": rig.optimizer, "global_state": rig.global_state})


@pytest.mark.parametrize("end", ["finalized-by-train", "pending-when-train-raised"])
@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_a_save_pending_at_the_end_of_training(writers, megatron_core_for, kind, end, tmp_path):
    """Bridge's train() finalizes its queue (blocking) before it returns; when it raises, the save is
    still in flight as bridge_fgo parks the states (copies waited for, the buffer unpinned in place,
    never freed or rewritten): the checkpoint is the save's iteration either way, nothing stays pinned."""
    setup_kind(megatron_core_for, kind)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = writers[WRITER]
    rig = rig_for(kind, tmp_path, queue)

    def loop(**_):
        harness.run_steps(rig, steps=2)
        sync_save(rig.dist_optimizer, tmp_path / "sync2")
        save_site()(bridge_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "async2", WRITER), {})
        harness.run_steps(rig, steps=1)
        if end == "finalized-by-train":
            queue.maybe_finalize_async_calls(blocking=True)  # Bridge's train(): finalize_async_saves(blocking=True)
        else:
            raise RuntimeError("fault in iteration 4")

    if end == "finalized-by-train":
        train(rig, loop)
        assert queue.get_num_unfinalized_calls() == 0
    else:
        with pytest.raises(RuntimeError, match="iteration 4"):
            train(rig, loop)
        assert queue.get_num_unfinalized_calls() == 1
    engine = engine_of(rig)
    assert hostmem.pinned_bytes() == 0 and engine.buffer.unpinned and not engine.buffer.freed
    queue.maybe_finalize_async_calls(blocking=True)
    assert differing(tmp_path / "async2", tmp_path / "sync2", model_keys(rig.dist_optimizer)) == []


@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_a_save_pending_at_unpatch(writers, megatron_core_for, kind, tmp_path):
    """unpatch() with a save in flight: the engine closes (states back on the device as ordinary
    tensors, the pinned buffer freed) while the writer still has to write; the checkpoint is the save's
    iteration, and the optimizer goes on as one that never offloaded."""
    setup_kind(megatron_core_for, kind)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = writers[WRITER]
    rig = rig_for(kind, tmp_path, queue)
    twin = rig_for(kind, tmp_path, queue)  # the same run without offload, stepped after unpatch
    harness.run_steps(rig, steps=2)
    sync_save(rig.dist_optimizer, tmp_path / "sync2")
    save_site()(bridge_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "async2", WRITER), {})
    harness.run_steps(rig, steps=1)
    engine = engine_of(rig)
    bridge_fgo.unpatch()
    assert engine.buffer is None and hostmem.pinned_bytes() == 0 and queue.get_num_unfinalized_calls() == 1
    queue.maybe_finalize_async_calls(blocking=True)
    assert differing(tmp_path / "async2", tmp_path / "sync2", model_keys(rig.dist_optimizer)) == []
    harness.run_steps(twin, steps=3)
    harness.run_steps(rig, steps=1)
    harness.run_steps(twin, steps=1)
    from test_streamed import assert_same

    assert_same(snapshot(twin.dist_optimizer), snapshot(rig.dist_optimizer))


def no_room(monkeypatch):
    """This host, as room_for() sees it while training runs: 1 GiB available, less than the reserve alone."""
    monkeypatch.setattr(hostmem.available, "host_memory",
                        lambda root=None: hostmem.HostMemory(hostmem.GiB, "MemAvailable", "faked by the test", None, None))


def overlapping_saves(rig, queue, tmp_path, its=(2, 3, 4), after_the_first=None):
    """Bridge's flow when saves overlap: an asynchronous save at each of `its`, one step apart, none finalized in
    between, each beside a synchronous save of its iteration (`after_the_first()` called after the first); what
    was pending as each save began writing, and the ids of the snapshot tensors each save was handed."""
    pending_at_entry, handed = [], []

    def save(state, dist_optimizer, directory, strategy):
        pending_at_entry.append(queue.get_num_unfinalized_calls())
        bridge_save(state, dist_optimizer, directory, strategy)

    for it in its:
        harness.run_steps(rig, steps=it if it == its[0] else 1)
        sync_save(rig.dist_optimizer, tmp_path / f"sync{it}")
        save_site()(save, None, (rig.global_state, rig.dist_optimizer, tmp_path / f"async{it}", WRITER), {})
        handed.append({id(t) for _, t in engine_of(rig).snapshot.tensors.values()})
        if after_the_first is not None and it == its[0]:
            after_the_first()
    return pending_at_entry, handed


def same_iterations(rig, tmp_path, its=(2, 3, 4)):
    skip = model_keys(rig.dist_optimizer)
    return [differing(tmp_path / f"async{it}", tmp_path / f"sync{it}", skip) for it in its]


@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_a_save_started_while_the_previous_is_written_gets_a_second_snapshot(writers, megatron_core_for, kind,
                                                                             tmp_path, caplog):
    """Bridge starts a save with the previous one still in flight ("Starting a checkpoint save before previous
    has finished"), as without offload, where each pending save holds its own copy. With room for a second copy
    on every local rank (hostmem.room_for), a second snapshot is made for it, once, said once, and the saves
    alternate between the two; with two saves pending, they are finished first (said once). Every checkpoint
    holds its own iteration."""
    caplog.set_level("INFO", logger="bridge_fgo")
    setup_kind(megatron_core_for, kind)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = writers[WRITER]
    rig = rig_for(kind, tmp_path, queue)
    pending_at_entry, handed = overlapping_saves(rig, queue, tmp_path)
    assert pending_at_entry == [0, 1, 0] and queue.get_num_unfinalized_calls() == 1
    assert handed[0] and not handed[0] & handed[1] and handed[2] == handed[1]  # two sets, alternating
    queue.maybe_finalize_async_calls(blocking=True)
    assert same_iterations(rig, tmp_path) == [[], [], []]
    made = [r.getMessage() for r in caplog.records if "a second snapshot was made" in r.getMessage()]
    assert len(made) == 1 and "room checked on every local rank" in made[0]
    said = [r.getMessage() for r in caplog.records if "still being written," in r.getMessage()]
    assert len(said) == 1 and "2 saves are still being written" in said[0] and "save_interval" in said[0]


@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_without_room_for_a_second_copy_the_pending_save_is_finished_first(writers, megatron_core_for, kind,
                                                                          tmp_path, caplog, monkeypatch):
    """The host has no room for a second copy now (room_for: what is available, less the reserve): the pending
    save is finished before the next one starts, said once with the figures and the fix; one snapshot serves
    every save, and each checkpoint holds its own iteration."""
    setup_kind(megatron_core_for, kind)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = writers[WRITER]
    rig = rig_for(kind, tmp_path, queue)
    pending_at_entry, handed = overlapping_saves(rig, queue, tmp_path, after_the_first=lambda: no_room(monkeypatch))
    assert pending_at_entry == [0, 0, 0] and queue.get_num_unfinalized_calls() == 1
    assert handed[0] == handed[1] == handed[2] and not engine_of(rig).snapshot._other
    queue.maybe_finalize_async_calls(blocking=True)
    assert same_iterations(rig, tmp_path) == [[], [], []]
    said = [r.getMessage() for r in caplog.records if "still being written," in r.getMessage()]
    assert len(said) == 1 and "cannot be held beside the first" in said[0] and "faked by the test" in said[0]
    assert "reserve of 2.00 GiB" in said[0] and "save_interval" in said[0]
    assert not [r for r in caplog.records if "a second snapshot was made" in r.getMessage()]


class RequestQueue(harness.LaterQueue):
    """Bridge's queue with a writer that writes later than any real one: each scheduled request (the real
    writer's, Megatron-Core's or nvidia-resiliency-ext's) runs, in this process, only when the queue is finalized
    blocking, so it reads what it was handed after every step that ran meanwhile."""

    def schedule_async_request(self, request):
        super().schedule_async_request(request.execute_sync)


@pytest.mark.parametrize("alternating", [True, False], ids=["two-sets", "control-one-set"])
@pytest.mark.parametrize("kind", ["te", "apex"])
def test_a_save_beside_a_pending_one_never_rewrites_what_that_one_writes(megatron_core_for, kind, alternating,
                                                                         tmp_path, monkeypatch):
    """Two saves pending at once, both written only after the third iteration's step (RequestQueue), each from its
    own snapshot set: each checkpoint is its own iteration's. The control, with the sets kept from alternating,
    shows the test can fail: the first save then writes what the second copied over it."""
    from bridge_fgo.engine.streamed.snapshot import Snapshot

    setup_kind(megatron_core_for, kind)
    if not alternating:
        monkeypatch.setattr(Snapshot, "alternate", lambda self, agreed: None)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = RequestQueue()
    rig = rig_for(kind, tmp_path, queue, use_persistent_ckpt_worker=False)
    with mock.patch("torch.cuda.synchronize", lambda *a, **k: None), \
            mock.patch("torch.cuda.current_device", lambda *a, **k: "cpu"):
        pending_at_entry, handed = overlapping_saves(rig, queue, tmp_path, its=(2, 3))
        harness.run_steps(rig, steps=1)  # the third step, before either is written
        assert pending_at_entry == [0, 1] and queue.get_num_unfinalized_calls() == 2
        assert engine_of(rig).snapshot.served > 0
        queue.maybe_finalize_async_calls(blocking=True)
    if alternating:
        assert same_iterations(rig, tmp_path, (2, 3)) == [[], []]
    else:
        assert same_iterations(rig, tmp_path, (2, 3))[0]  # iteration 2's checkpoint holds iteration 3's states


def test_another_ranks_pending_save_is_finished_on_every_rank(monkeypatch, tmp_path):
    """Finishing is collective: a rank with nothing pending finishes too when another rank has a save in
    flight and no room for a second copy beside it; with room there, or nothing pending anywhere, nothing is
    finished."""
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = ViewWriterQueue()
    rig = rig_for("torch", tmp_path, queue)
    harness.run_steps(rig, steps=1)
    finishes = []
    monkeypatch.setattr(queue, "maybe_finalize_async_calls", lambda blocking=False: finishes.append(blocking))
    other = []  # what the other rank answers: first to finish_pending, then to the watch (nothing held)
    monkeypatch.setattr(saves.agree, "gather", lambda v: [v, other.pop(0)])
    other += [None, None]
    save_site()(lambda state: None, None, (rig.global_state,), {})
    assert finishes == [] and other == []
    other += ["", None]  # one save pending there, with room for a second copy beside it
    save_site()(lambda state: None, None, (rig.global_state,), {})
    assert finishes == [] and other == []
    other += ["no room there", None]
    save_site()(lambda state: None, None, (rig.global_state,), {})
    assert finishes == [True] and other == []


# -- 4. the safety net: a writer that keeps views of the host buffer ---------------------------------------

class ViewWriterQueue(harness.LaterQueue):
    """A stand-in writer that does not copy: its request keeps the sharded state dict's tensors (views of
    the pinned buffer) and writes them when it runs, here when the queue is finalized (an in-process,
    background writer reading at its own pace)."""


def view_writer_save(state, dist_optimizer, path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    state_dict = dist_optimizer.sharded_state_dict({}, False, metadata=FORMAT)
    held = {k: v for k, v in check_checkpoint.flat(state_dict) if isinstance(v, ShardedTensor)}

    def write():
        torch.save({k: v.data.clone() for k, v in held.items()}, path)

    state.async_calls_queue.schedule_async_request(write)


# A run whose writer is handed views of the pinned buffer: no snapshot kept (the engine keeps none where the
# optimizer state is saved fully_reshardable, whose writer gets gathered copies); the stand-in writers below
# build the dp_reshardable state dict all the same
VIEWS = {"dist_ckpt_optim_fully_reshardable": True}


def at_iteration_2(megatron_core_for, kind, tmp_path, queue, **ckpt):
    """A run under the streamed step after iteration 2, and its states as a direct reader sees them."""
    setup_kind(megatron_core_for, kind)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for(kind, tmp_path, queue, **ckpt)
    harness.run_steps(rig, steps=2)
    bridge_fgo.synchronize()  # a direct reader of the states waits for the last update's copies
    return rig, snapshot(rig.dist_optimizer)


def _same_states(written, want):
    """Every tensor the writer wrote is one of the states the optimizer held at the save."""
    pool = [t for t in want.values() if isinstance(t, torch.Tensor)]
    return all(any(w.dtype == p.dtype and w.numel() == p.numel() and torch.equal(w.flatten(), p.flatten())
                   for p in pool) for w in written.values() if w.numel())


@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_a_writer_holding_views_is_finished_before_training_goes_on(megatron_core_for, kind, tmp_path, caplog):
    """The watch around save_checkpoint sees the request holding the states after the call: every rank
    finishes the save before training goes on, with one WARNING, and the checkpoint is iteration 2's."""
    caplog.set_level("WARNING", logger="bridge_fgo")
    queue = ViewWriterQueue()
    rig, want = at_iteration_2(megatron_core_for, kind, tmp_path, queue, **VIEWS)
    assert not engine_of(rig).snapshot.kept
    for _ in range(2):  # one warning per rank, however many saves wait
        save_site()(view_writer_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "held.pt"), {})
        assert queue.get_num_unfinalized_calls() == 0  # finished inside the save call
    harness.run_steps(rig, steps=2)
    warnings = [r.getMessage() for r in caplog.records if "async_save" in r.getMessage()]
    assert len(warnings) == 1 and "still held the optimizer states' pinned host buffer" in warnings[0]
    assert "as a synchronous one would be" in warnings[0] and "chunk_mb=0" in warnings[0]
    assert _same_states(torch.load(tmp_path / "held.pt"), want)


@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_without_the_watch_that_writer_would_write_later_states(megatron_core_for, kind, tmp_path):
    """The control: the same writer called without the watch writes what the next updates left."""
    queue = ViewWriterQueue()
    rig, want = at_iteration_2(megatron_core_for, kind, tmp_path, queue, **VIEWS)
    view_writer_save(rig.global_state, rig.dist_optimizer, tmp_path / "held.pt")  # not through the call site
    harness.run_steps(rig, steps=2)
    queue.maybe_finalize_async_calls(blocking=True)
    assert not _same_states(torch.load(tmp_path / "held.pt"), want)


def test_a_writer_holding_views_is_seen_with_the_last_updates_copies_still_queued(megatron_core_for, tmp_path):
    """The save comes straight after a step, its device-to-host copies still queued (they hold slices of
    the buffer until the save's guarded reader waits for them): the count before the save is taken
    after those copies, so the writer's views are seen and the save finished inside the call."""
    setup_kind(megatron_core_for, "torch")
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = ViewWriterQueue()
    rig = rig_for("torch", tmp_path, queue, **VIEWS)
    harness.run_steps(rig, steps=2)  # no synchronize()
    engine = engine_of(rig)
    assert engine.transfers.tail is not None  # copies in flight as the save begins

    def one_view_save(state, dist_optimizer):
        # a writer that keeps a single state (fewer views than the copies queued before the save), read
        # through Megatron-Core's guarded reader, which waits for those copies
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        state_dict = dist_optimizer.sharded_state_dict({}, False, metadata=FORMAT)
        view = next(v for _, v in check_checkpoint.flat(state_dict) if isinstance(v, ShardedTensor)).data
        del state_dict
        state.async_calls_queue.schedule_async_request(lambda: view.clone())

    save_site()(one_view_save, None, (rig.global_state, rig.dist_optimizer), {})
    assert queue.get_num_unfinalized_calls() == 0


def test_where_torch_cannot_count_the_holders_every_save_is_finished_and_said_once(megatron_core_for, tmp_path,
                                                                                   monkeypatch, caplog):
    caplog.set_level("WARNING", logger="bridge_fgo")
    queue = ViewWriterQueue()
    rig, want = at_iteration_2(megatron_core_for, "torch", tmp_path, queue)
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    finished = []
    for _ in range(2):  # each save schedules its own request, as Bridge's does
        save_site()(lambda state: queue.schedule_async_request(lambda: finished.append(True)), None,
                    (rig.global_state,), {})
    assert finished == [True, True]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cannot count what holds the optimizer states' pinned host buffer" in said[0]


def test_another_ranks_held_save_makes_every_rank_finish_it(monkeypatch, tmp_path):
    """Finishing the save is collective (Bridge's finalize all-reduces and barriers): a rank whose own
    save left nothing behind finishes it too when another rank's did."""
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = ViewWriterQueue()
    rig = rig_for("torch", tmp_path, queue)
    harness.run_steps(rig, steps=1)
    exchanged, other = [], [None, saves.HELD]  # the other rank: nothing pending before; its save held after
    monkeypatch.setattr(saves.agree, "gather", lambda v: exchanged.append(v) or [v, other.pop(0)])
    finished = []
    save_site()(lambda state: queue.schedule_async_request(lambda: finished.append(True)), None,
                (rig.global_state,), {})
    assert exchanged == [None, None] and finished == [True]


def test_a_save_that_moves_the_buffer_is_refused(tmp_path):
    """Pickling a view of the pinned buffer for a worker process moves the whole storage into shared
    memory: the watch refuses it, naming the fix."""
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for("torch", tmp_path, ViewWriterQueue())
    harness.run_steps(rig, steps=1)
    engine = engine_of(rig)

    def moving_save(state):
        engine.buffer.tensor[:8].untyped_storage().share_memory_()

    with pytest.raises(BridgeFGOError, match="moved the .*pinned buffer.*chunk_mb=0"):
        save_site()(moving_save, None, (rig.global_state,), {})


def test_synchronous_saves_and_other_modes_are_not_watched(monkeypatch, tmp_path):
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for("torch", tmp_path, ViewWriterQueue(), async_save=False)
    harness.run_steps(rig, steps=1)
    monkeypatch.setattr(saves, "Watch", None)  # would fail if used
    assert save_site()(lambda state: "saved", None, (rig.global_state,), {}) == "saved"
    options = bridge_fgo.options.Options(offload="builtin", chunk_mb=0)
    assert not saves.watched(rig_for("torch", tmp_path, None).cfg, options)


# -- 5. the host-memory check counts the writer's copy -------------------------------------------------------

@pytest.mark.parametrize("persistent", [True, False])
def test_the_host_memory_check_counts_the_snapshot(monkeypatch, tmp_path, caplog, persistent):
    caplog.set_level("INFO", logger="bridge_fgo")
    checked = []
    real = hostmem.check_fits
    monkeypatch.setattr(hostmem, "check_fits", lambda *a, **k: checked.append((a, k)) or real(*a, **k))
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for("te", tmp_path, ViewWriterQueue(), use_persistent_ckpt_worker=persistent)
    harness.run_steps(rig, steps=1)
    engine = engine_of(rig)
    ((pinned,), kw), = checked
    assert pinned == engine.pinned_bytes > 0 and kw == {"snapshot_per_rank": pinned, "snapshot_in_shm": persistent,
                                                       "load_per_rank": 0}
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[rank 0] host memory:")]
    assert f"+ {hostmem.fmt_bytes(pinned)} per rank for asynchronous checkpoint saves (the snapshot" in line
    assert ("/dev/shm" in line) == persistent


def test_without_async_saves_nothing_more_is_counted(monkeypatch, tmp_path):
    checked = []
    monkeypatch.setattr(hostmem, "check_fits", lambda *a, **k: checked.append(k) or hostmem.check.check_fits(*a))
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    harness.run_steps(rig_for("te", tmp_path, None, async_save=False), steps=1)
    assert checked == [{"snapshot_per_rank": 0, "snapshot_in_shm": False, "load_per_rank": 0}]


def test_a_dev_shm_too_small_for_the_snapshots_is_refused_before_anything_is_pinned(monkeypatch, tmp_path):
    monkeypatch.setattr(hostmem.available, "shm_free", lambda root=None: 4096)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    pinned = []
    monkeypatch.setattr(hostmem, "pin", lambda *a, **k: pinned.append(a))
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for("te", tmp_path, None)
    with pytest.raises(BridgeFGOConfigError) as err:
        harness.run_steps(rig, steps=1)
    msg = str(err.value)
    assert "would not fit in /dev/shm" in msg and "use_persistent_ckpt_worker" in msg and "--shm-size" in msg
    assert "async_save=False" in msg and "chunk_mb=0" in msg and pinned == [] and rig.events == []


# -- 6. what is refused --------------------------------------------------------------------------------------

def test_async_save_is_served_for_torch_dist_and_the_rest_still_refused(tmp_path):
    inners = [optimizer().optimizer]
    cfg = ns(optimizer=ns(), ddp=ns(), model=ns(), logger=ns(), checkpoint=checkpoint_cfg(tmp_path))
    assert refusals.streamed(cfg, inners) == []
    cfg.checkpoint.ckpt_format = "fsdp_dtensor"
    (only,) = refusals.streamed(cfg, inners)
    assert only.startswith("cfg.checkpoint.ckpt_format='fsdp_dtensor'") and "chunk_mb=0" in only
    # fully_reshardable is served too: its save gathers copies of the host views (tests/test_resume_dp.py)
    cfg.checkpoint.ckpt_format, cfg.checkpoint.dist_ckpt_optim_fully_reshardable = "torch_dist", True
    assert refusals.streamed(cfg, inners) == []
    # Megatron-Core's chunked line keeps its refusal (tests/test_chunked.py runs it through train_step)
    cfg.checkpoint.dist_ckpt_optim_fully_reshardable = False
    (only,) = refusals.async_checkpoint(cfg, "why")
    assert only.startswith("cfg.checkpoint.async_save=True while optimizer state is saved: why")


# -- 7. the snapshot kept for the run (engine/streamed/snapshot.py) ----------------------------------------

def test_a_shared_storage_of_its_own_is_neither_cloned_nor_moved():
    """What the kept snapshot rests on, in the installed nvidia-resiliency-ext and torch: a CPU tensor owning
    exactly its shared storage passes the writer's test uncloned, and pickling it for a worker process passes
    its handle (the storage stays where it is); a view of a larger storage is cloned, its clone moved."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (torch's reductions)
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    src = inspect.getsource(filesystem_async.FileSystemWriterAsync.prepare_write_data)
    assert "untyped_storage().size() != ten.numel() * ten.itemsize" in src and "ten.clone() if is_view" in src
    own = torch.empty(0).set_(torch.UntypedStorage._new_shared(4096 * 4), 0, (64, 64))
    ptr = own.untyped_storage().data_ptr()
    assert own.untyped_storage().size() == own.numel() * own.itemsize  # the writer's test: not a view
    ForkingPickler.dumps(own)
    assert own.untyped_storage().data_ptr() == ptr and own.is_shared()
    view = torch.zeros(8192)[:4096]
    moved = view.untyped_storage().data_ptr()
    ForkingPickler.dumps(view)
    assert view.untyped_storage().data_ptr() != moved  # the whole storage copied into shared memory
    # the persistent worker writes nothing of a request after saying it is done: 0.6.0 drops it then (only GPU
    # tensors are cached there); 0.4.1 (Bridge 0.3.1's) holds the last one until the next arrives, unread
    caller = __import__("nvidia_resiliency_ext.checkpointing.async_ckpt.core", fromlist=["_"]).PersistentAsyncCaller
    if hasattr(caller, "async_process_target"):
        worker = inspect.getsource(caller.async_process_target)
        assert "del item" in worker and "gc.collect()" in worker
    else:
        worker = inspect.getsource(caller.async_loop)
        assert worker.index("item.async_fn(") < worker.index("comp_q.put(item.call_idx)")


def _writer_tensors(monkeypatch):
    """The CPU tensors each nvidia-resiliency-ext writer passes to its worker, recorded after prepare_write_data."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

    seen = []
    real = FileSystemWriterAsync.prepare_write_data

    def spy(self, plan, planner):
        real(self, plan, planner)
        seen.append([t for t in (self.uncached_tensor_data or ((), ()))[1] if isinstance(t, torch.Tensor)])
    monkeypatch.setattr(FileSystemWriterAsync, "prepare_write_data", spy)
    return seen


@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_the_writer_is_handed_the_snapshot_made_once(writers, megatron_core_for, kind, tmp_path, monkeypatch):
    """With Bridge's default writer and persistent worker: the snapshot exists before the first save (made
    at prepare, faulted in beside training), every save hands the writer its tensors (shared storages of
    their own: neither cloned nor moved), the same storages at every save that starts after the last one was
    written, and each checkpoint is its iteration's, equal to a synchronous save."""
    if WRITER != "nvrx":
        pytest.skip("megatron-core 0.16 saves only with its own writer")
    setup_kind(megatron_core_for, kind)
    seen = _writer_tensors(monkeypatch)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    queue = writers[WRITER]
    rig = rig_for(kind, tmp_path, queue)
    harness.run_steps(rig, steps=1)
    snap = engine_of(rig).snapshot
    assert snap.kept and snap.route == "shm" and 0 < snap.nbytes <= engine_of(rig).pinned_bytes  # (less its alignment)
    made = sorted(t.untyped_storage().data_ptr() for _, t in snap.tensors.values())
    assert all(t.is_shared() for _, t in snap.tensors.values())
    for it in (2, 3):
        harness.run_steps(rig, steps=1)
        sync_save(rig.dist_optimizer, tmp_path / f"sync{it}")
        save_site()(bridge_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / f"async{it}", WRITER), {})
        handed = {t.untyped_storage().data_ptr() for t in seen[-1]}
        assert snap.served == len(snap.tensors) and set(made) <= handed
        assert sorted(t.untyped_storage().data_ptr() for _, t in snap.tensors.values()) == made  # not moved
        harness.run_steps(rig, steps=1)
        queue.maybe_finalize_async_calls(blocking=True)  # written before the next save (no second set needed)
    assert not snap._other
    skip = model_keys(rig.dist_optimizer)
    for it in (2, 3):
        assert differing(tmp_path / f"async{it}", tmp_path / f"sync{it}", skip) == []
    assert not engine_of(rig).buffer.moved()


@pytest.mark.parametrize("room", [True, False], ids=["room", "no-room"])
@pytest.mark.parametrize("kind", harness.OPTIMIZERS)
def test_a_writer_holding_the_snapshot_is_not_waited_for_and_the_next_save_never_rewrites_it(
        megatron_core_for, kind, room, tmp_path, caplog, monkeypatch):
    """A writer that keeps what it is handed and writes it later: with the snapshot it holds no view of the
    pinned buffer, so the save is not finished inside the call (no stall), and the next updates do not reach
    what it writes. The next save, started while it is pending, is handed the snapshot's second set where the
    host has room, and finishes it first where not. Without either it would write the next save's values (the
    control, below)."""
    caplog.set_level("WARNING", logger="bridge_fgo")
    queue = ViewWriterQueue()
    rig, want2 = at_iteration_2(megatron_core_for, kind, tmp_path, queue)
    save_site()(view_writer_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "held2.pt"), {})
    assert queue.get_num_unfinalized_calls() == 1  # not finished inside the call
    harness.run_steps(rig, steps=2)
    bridge_fgo.synchronize()
    want4 = snapshot(rig.dist_optimizer)
    if not room:
        no_room(monkeypatch)
    save_site()(view_writer_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "held4.pt"), {})
    assert (tmp_path / "held2.pt").exists() != room and queue.get_num_unfinalized_calls() == (2 if room else 1)
    queue.maybe_finalize_async_calls(blocking=True)
    assert _same_states(_buffers(tmp_path / "held2.pt"), want2)
    assert _same_states(_buffers(tmp_path / "held4.pt"), want4)
    assert not _same_states(_buffers(tmp_path / "held2.pt"), want4)
    assert not [r for r in caplog.records if "still held" in r.getMessage()]


def _buffers(path):
    """What a writer holding its tensors wrote, but the fp32 parameter's own shard: the model's tensor, never
    in the host buffer, which such a writer writes as it is at write time, with or without offload."""
    return {k: v for k, v in torch.load(path).items() if "torch.float32" not in k.split("/")[2]}


def test_without_the_finish_the_reused_snapshot_would_be_rewritten(megatron_core_for, tmp_path, monkeypatch):
    """The control: finish_pending skipped (no second set, no finish), the second save rewrites the snapshot the
    first still holds."""
    queue = ViewWriterQueue()
    rig, want2 = at_iteration_2(megatron_core_for, "torch", tmp_path, queue)
    monkeypatch.setattr(saves, "finish_pending", lambda state, sessions, nbytes: None)
    save_site()(view_writer_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "held2.pt"), {})
    harness.run_steps(rig, steps=2)
    save_site()(view_writer_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "held4.pt"), {})
    queue.maybe_finalize_async_calls(blocking=True)
    assert not _same_states(_buffers(tmp_path / "held2.pt"), want2)


def test_no_snapshot_for_fully_reshardable_or_synchronous_saves_and_none_after_training(tmp_path):
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    for ckpt in ({"dist_ckpt_optim_fully_reshardable": True}, {"async_save": False}):
        rig = rig_for("torch", tmp_path, ViewWriterQueue(), **ckpt)
        harness.run_steps(rig, steps=1)
        assert not engine_of(rig).snapshot.kept, ckpt
    rig = rig_for("torch", tmp_path, ViewWriterQueue(), use_persistent_ckpt_worker=False)
    harness.run_steps(rig, steps=1)
    snap = engine_of(rig).snapshot
    assert snap.kept and snap.route == "memory" and not any(t.is_shared() for _, t in snap.tensors.values())
    train(rig, lambda **_: harness.run_steps(rig, steps=1))  # train() ends: parked, the snapshot let go
    assert not snap.kept


def test_a_snapshot_that_cannot_be_made_is_said_once_and_the_writers_copy_as_before(monkeypatch, tmp_path, caplog):
    import resource

    caplog.set_level("WARNING", logger="bridge_fgo")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (16, 16))
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for("torch", tmp_path, ViewWriterQueue())
    harness.run_steps(rig, steps=1)
    assert not engine_of(rig).snapshot.kept
    (said,) = [r.getMessage() for r in caplog.records if "could not be made" in r.getMessage()]
    assert "RLIMIT_NOFILE is 16" in said and "ulimit -n" in said


def test_after_a_load_the_first_save_makes_the_snapshot_and_hands_it_over(train_module, megatron_core_for, tmp_path):
    setup_kind(megatron_core_for, "te")
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for("te", tmp_path, ViewWriterQueue())
    site = patcher._current.callsites.site(targets.target("load_checkpoint"))
    site(lambda *a: (0, 0), None, (rig.global_state, rig.model, rig.optimizer, None), {})
    snap = engine_of(rig).snapshot
    assert snap.tensors == {} and snap._faulting is None  # nothing made by the load, nor after it
    save_site()(view_writer_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "first.pt"), {})
    assert snap.served and snap.kept and snap._faulting is None and snap.copy_s


def test_beside_a_load_the_snapshot_is_made_at_the_first_save(train_module, megatron_core_for, tmp_path,
                                                              monkeypatch):
    """Making the snapshot holds the GIL while torch allocates its shared pages, which would stall the load's
    end and the first iterations: beside a load nothing of it is made, nor after it; the first save makes it
    and faults it in, and waits for that. No second fault-in thread while one runs (its zeros could land on
    a save's copy)."""
    setup_kind(megatron_core_for, "te")
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = rig_for("te", tmp_path, ViewWriterQueue())
    site = patcher._current.callsites.site(targets.target("load_checkpoint"))
    during = []

    def load(state, model, optimizer, scheduler):
        snap = engine_of(rig).snapshot
        during.append((snap.tensors, snap._faulting))
        return 0, 0

    from bridge_fgo.engine.streamed.snapshot import Snapshot

    site(load, None, (rig.global_state, rig.model, rig.optimizer, None), {})
    snap = engine_of(rig).snapshot
    assert during == [({}, None)] and snap.tensors == {} and snap._faulting is None and snap._later
    gate, real_fault_in = threading.Event(), Snapshot._fault_in
    monkeypatch.setattr(Snapshot, "_fault_in", lambda self, tensors: (gate.wait(10), real_fault_in(self, tensors)))
    snap.fault_in()  # what the first save calls first: made by a thread, its fault-in held at the gate
    making = snap._faulting
    while making.is_alive() and not snap.tensors:
        time.sleep(0.01)
    snap._unfaulted = True  # as if made and not yet faulted in: still no second thread while that one runs
    snap.fault_in()
    assert snap._faulting is making and [t.name for t in threading.enumerate()].count("bridge_fgo-snapshot") == 1
    gate.set()
    save_site()(view_writer_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "held.pt"), {})
    assert snap.served and snap._faulting is None  # the save waited for it
    assert snap.kept and all(t.is_shared() for _, t in snap.tensors.values())
