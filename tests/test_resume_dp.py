"""A resume into host memory with data parallelism: Megatron-Core's real DistributedDataParallel and
DistributedOptimizer on two CPU processes joined by gloo (tests/support/dp.py), each rank holding its
shard of every bucket, checkpointed through torch_dist in every sharding type Bridge writes or reads.

Two ranks train under the streamed step and save; then, in each format:
- two ranks resume (2 -> 2), and so does one (2 -> 1, in this process); two ranks also resume what one
  rank saved (1 -> 2): the data-parallel reshard, which dp_reshardable, dp_zero_gather_scatter and
  fully_reshardable allow;
- with the streamed step prepared before the load (as the patched load_checkpoint does), Megatron-Core's
  own load (sharded_state_dict(is_loading=True), torch_dist, load_state_dict, with the scatter of
  dp_zero_gather_scatter over the data-parallel group) puts nothing on the GPU, every state stays in
  its view of the pinned buffer, and dp_reshardable's torch_dist writes straight into it;
- what loads is what was saved, element for element, in model space over all ranks;
- the resumed ranks step bit-identically to the same resume without offload, and (same world size) to
  the run that was never interrupted.

A save under offload (the last step's device-to-host copies still in flight) puts no state on the
GPU: only the gathers of fully_reshardable and dp_zero_gather_scatter stage each bucket's shards there,
as Megatron-Core does without offload. The streamed step with data parallelism steps as Megatron-Core
does alone, bit for bit. fully_sharded_model_space, which older checkpoints carry, cannot be saved at
all by megatron-core 0.19 (its tests skip there, after checking it fails alike with and without offload).

For torch AdamW (no TE or apex installed) with scripts/resume_fix.py; TE's and apex's FusedAdam are
the stand-ins of support/fused_adam.py, TE also precision-aware (bf16 moments), with Megatron-Core
keeping the fp32 masters (Bridge's bf16_mixed) and with TE holding them. "On the GPU" is what
support/dp.py's GpuOnCpu marks as made there.
"""
import contextlib
import gc
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bridge_fgo.engine.tensors import SCALE
from conftest import MCORE
from test_agree import gloo_group, run_ranks_with
from test_streamed import _equal, snapshot
from support import dp

CHUNK = 300  # bytes: several chunks per rank
STEPS, MORE = 2, 2  # steps before the save; steps after it (uninterrupted) or after the resume
ALL = [(case, fmt) for case in dp.CASES for fmt in dp.FORMATS]
TE_MASTERS = "te-precision-aware-te-masters"


def checkpoint(out, world, case, fmt, variant):
    return os.path.join(str(out), f"world{world}", case, fmt, variant)


# -- what one rank does (in a spawned process, or in this one for a world of one) -------------------------

def save_all(out, world, gpu):
    """Train under the streamed step and, in step, without offload; save both in every format."""
    from bridge_fgo.engine.streamed import StreamedEngine

    record = {}
    for case in dp.CASES:
        refreeze()
        with dp.megatron_core_with(case):
            offloaded, plain = dp.Run(case), dp.Run(case)
            engine = StreamedEngine([offloaded.dist], CHUNK)
            engine.prepare()
            for i in range(STEPS):
                offloaded.step(engine, wait=i < STEPS - 1)  # the last step's tail is in flight at the save
                plain.step()
            rec = record[case] = {}
            for fmt in dp.FORMATS:
                for variant, run in (("offload", offloaded), ("plain", plain)):
                    # (only what was saved under offload is loaded: without, the state dict is enough)
                    path = checkpoint(out, world, case, fmt, variant)
                    try:
                        made = run.save(path, fmt, gpu, write=variant == "offload")
                        rec[fmt, variant] = {"error": None, "gpu": made[0], "calls": made[1]}
                    except Exception as exc:  # Megatron-Core's own (fully_sharded_model_space on 0.19)
                        rec[fmt, variant] = {"error": f"{type(exc).__name__}: {exc}"}
            # (the first save waited for the last step's tail: the states are whole to read directly)
            rec["saved"] = offloaded.model_space()
            rec["streamed"] = (_equal(snapshot(offloaded.dist), snapshot(plain.dist))
                               and _same_space(rec["saved"], plain.model_space()))
            for _ in range(MORE):
                offloaded.step(engine)
            rec["uninterrupted"] = snapshot(offloaded.dist)
            engine.close()
    return record


def resume_all(out, world, saved_by, gpu):
    """Resume each checkpoint saved under offload by `saved_by` ranks, with and without offload."""
    record = {}
    for case in dp.CASES:
        refreeze()
        with dp.megatron_core_with(case):
            for fmt in dp.FORMATS:
                path = checkpoint(out, saved_by, case, fmt, "offload")
                if not os.path.exists(path) or not os.listdir(path):
                    continue
                record[case, fmt] = {variant: resume_one(case, fmt, path, variant == "offload", gpu)
                                     for variant in ("plain", "offload")}
    return record


def resume_one(case, fmt, path, offload, gpu):
    from bridge_fgo.engine.streamed import StreamedEngine

    run = dp.Run(case, seed=7)  # other weights and masters: the load must replace every one
    engine = StreamedEngine([run.dist], CHUNK) if offload else None
    rec = {}

    def seen(loading):
        """What torch_dist is about to fill: host views of the pinned buffer, but for the model's own
        weights (they never move)."""
        if engine is None:
            return
        rec["views"] = views(engine)
        low, high = engine.buffer.tensor.data_ptr(), engine.buffer.tensor.data_ptr() + engine.buffer.tensor.numel()
        model = {b.param_data.untyped_storage().data_ptr() for b in run.model.buffers}
        filled = [(t.data, padding) for t, padding in _sharded_tensors(loading["optimizer"])
                  if t.data is not None and t.data.numel()]
        rec["filled in the buffer"] = sum(low <= t.data_ptr() < high for t, _ in filled)
        # but Megatron-Core's own padding between parameters (dp_reshardable), made where the states are
        rec["filled elsewhere"] = sum(not low <= t.data_ptr() < high and not padding
                                      and t.untyped_storage().data_ptr() not in model for t, padding in filled)
        rec["entries"] = sum(e.kind != SCALE for p in engine.parts for e in p.entries())  # (TE's scales: not saved)

    try:
        rec["gpu"] = run.load(path, fmt, engine, gpu, seen)
    except Exception as exc:  # Megatron-Core's own, alike without offload (the test says so)
        if engine is not None:
            engine.close()
        return {"error": f"{type(exc).__name__}: {exc}"}
    rec["error"] = None
    run.generation = STEPS
    rec["loaded"] = run.model_space()
    if engine is not None:
        rec["on host"] = engine.on_host()
        rec["views kept"] = views(engine) == rec["views"]
        rec["bound to views"] = all(part.bindings.get(e) is not None
                                    and part.bindings.get(e).data_ptr() == e.host.data_ptr()
                                    for part in engine.parts for e in part.entries())
    for _ in range(MORE):
        run.step(engine)
    rec["resumed"] = snapshot(run.dist)
    if engine is not None:
        engine.close()
    return rec


def views(engine):
    return {(p.index, i): e.host.data_ptr() for p in engine.parts for i, e in enumerate(p.entries())}


def _sharded_tensors(tree, padding=False):
    """(ShardedTensor, whether it is dp_reshardable's padding between parameters) in `tree`."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(tree, dict):
        flag = tree.get("padding")
        padding = padding or (isinstance(flag, LocalNonpersistentObject) and flag.unwrap() is True)
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _sharded_tensors(t, padding)]
    return [(tree, padding)] if isinstance(tree, ShardedTensor) else []


def _same_space(a, b):
    """Two ranks' model-space records (Run.model_space) alike."""
    return a.keys() == b.keys() and all(
        a[n] == b[n] if n == "group step" else
        (a[n].keys() == b[n].keys()
         and all(a[n][k][:2] == b[n][k][:2] and _equal(a[n][k][2], b[n][k][2]) for k in a[n]))
        for n in a)


def _worker(rank, world, port, out_dir, root, roles):
    """A spawned rank: Megatron-Core's groups over gloo, then each role (checkpoints under `root`); its
    results to out_dir."""
    from support import te_free

    te_free.install()
    with gloo_group(rank, world, port), frozen_heap(), dp.gpu_on_cpu() as gpu:
        dp.initialize()
        try:
            results = {role: _role(role, root, world, gpu) for role in roles}
        finally:
            dp.destroy()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write("{}")  # what run_ranks_with reads back


def _role(role, out, world, gpu):
    if role == "save":
        return save_all(out, world, gpu)
    return resume_all(out, world, int(role.split()[-1]), gpu)  # "resume from 1"


@contextlib.contextmanager
def frozen_heap():
    """Megatron-Core's checkpoint code calls gc.collect() several times per save and load: 0.4 s each
    over the objects of a process that imported Megatron. What exists is set aside from collection
    (gc.freeze) meanwhile, again before each case (refreeze); all is collectable again after."""
    refreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def refreeze():
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def one_rank(store_dir):
    """This process as a world of one (gloo), Megatron-Core's groups over it; all undone after."""
    store = dist.FileStore(os.path.join(str(store_dir), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        with frozen_heap(), dp.gpu_on_cpu() as gpu:
            dp.initialize()
            try:
                yield gpu
            finally:
                dp.destroy()
    finally:
        dist.destroy_process_group()


# -- the runs, once for the module ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One rank saves; two ranks save, resume their own checkpoints and the one rank's; one rank resumes
    the two ranks' checkpoints. Every rank's record, by world and role."""
    out = tmp_path_factory.mktemp("dp")
    with one_rank(out) as gpu:
        one = {"save": save_all(out, 1, gpu)}
    ranks = out / "ranks"
    ranks.mkdir()
    # (a rank imports Megatron-Core first thing, in dp.initialize(): preloaded with its own module)
    run_ranks_with(_worker, ranks, str(out), ["save", "resume from 2", "resume from 1"], world=2,
                   preload=["test_agree", "test_resume_dp", "megatron.core.parallel_state"])
    two = [torch.load(ranks / f"rank{r}.pt", weights_only=False) for r in range(2)]
    with one_rank(out) as gpu:
        one["resume from 2"] = resume_all(out, 1, 2, gpu)
    return {1: [one], 2: two}


def assemble(spaces):
    """Each rank's model-space record put together: every element of every state from the rank that
    owns it (each element exactly once), the per-parameter step (torch) and the group steps."""
    out = {}
    for space in spaces:
        for name, states in space.items():
            if name == "group step":
                out.setdefault(name, set()).update(states)
                continue
            numel = torch.Size(dp.SHAPES[name]).numel()
            for key, (start, end, values) in states.items():
                if values.dim() == 0:  # torch AdamW's step
                    out.setdefault((name, key), set()).add(float(values))
                    continue
                full, seen = out.setdefault((name, key),
                                            (torch.zeros(numel), torch.zeros(numel, dtype=torch.int)))
                full[start:end] = values
                seen[start:end] += 1
    for key, value in out.items():
        if isinstance(value, tuple):
            assert bool((value[1] == 1).all()), f"{key}: not every element owned by exactly one rank"
            out[key] = value[0]
    return out


def _assert_same_space(got, want):
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], torch.Tensor):
            assert torch.equal(got[key], want[key]), key
        else:
            assert got[key] == want[key], key


def _skip_if_megatron_core_cannot(records, case, fmt):
    """A format this Megatron-Core cannot save at all fails alike with and without offload."""
    errors = {(r[case][fmt, "offload"]["error"], r[case][fmt, "plain"]["error"]) for r in records}
    (offload, plain), = errors
    assert offload == plain
    if plain is not None:
        pytest.skip(f"megatron-core {MCORE} cannot save {fmt} at all (with or without offload): {plain[:200]}")


# -- the tests -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(dp.CASES))
def test_the_streamed_step_with_data_parallelism_equals_megatron_cores_own(runs, world, case):
    assert all(r["save"][case]["streamed"] for r in runs[world])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case, fmt", ALL)
def test_a_save_under_offload_puts_no_state_on_the_gpu(runs, world, case, fmt):
    """What the optimizer's sharded_state_dict puts on the GPU for a save: nothing under offload, but
    for the gathers of fully_reshardable and dp_zero_gather_scatter, which stage each bucket's shards
    there as Megatron-Core does without offload."""
    records = [r["save"] for r in runs[world]]
    _skip_if_megatron_core_cannot(records, case, fmt)
    for rank, rec in enumerate(records):
        offload, plain = rec[case][fmt, "offload"], rec[case][fmt, "plain"]
        why = (rank, offload["gpu"], plain["gpu"], offload["calls"][:8], plain["calls"][:8])
        if fmt in ("fully_reshardable", "dp_zero_gather_scatter"):
            assert 0 < offload["gpu"] <= plain["gpu"], why
            assert {c[0] for c in offload["calls"]} <= {"cuda()", "zeros"}, why  # the staging only
            # (precision-aware, without offload TE's state_dict also unscales every state on the GPU)
            assert offload["gpu"] == plain["gpu"] or "precision-aware" in case, why
        else:
            assert offload["gpu"] == 0, why


@pytest.mark.parametrize("saved_by, world", [(2, 2), (2, 1), (1, 2)], ids=["2-to-2", "2-to-1", "1-to-2"])
@pytest.mark.parametrize("case, fmt", ALL)
def test_a_resume_loads_into_host_memory_and_steps_bit_identically(runs, saved_by, world, case, fmt):
    _skip_if_megatron_core_cannot([r["save"] for r in runs[saved_by]], case, fmt)
    role = f"resume from {saved_by}"
    records = [r[role][case, fmt] for r in runs[world]]
    errors = {(r["offload"]["error"], r["plain"]["error"]) for r in records}
    if errors != {(None, None)}:  # Megatron-Core cannot load it here: alike with and without offload
        (offload, plain), = errors
        assert offload == plain
        pytest.skip(f"megatron-core {MCORE} cannot load {fmt} into {case} (with or without offload): {plain[:200]}")
    saved = assemble([r["save"][case]["saved"] for r in runs[saved_by]])
    for rank, rec in enumerate(records):
        plain, offload = rec["plain"], rec["offload"]
        # Megatron-Core's load made nothing on the GPU: the states were there, in their host views
        # (without offload it makes every state there, torch.empty on the GPU, before torch_dist fills it;
        # TE holding the masters makes its states anew where its parameter, the model's shard, is)
        made = [c for phase in ("sharded_state_dict", "load_state_dict") for c in offload["gpu"][phase + " calls"]]
        assert not made, made[:6]
        assert plain["gpu"]["sharded_state_dict"] > 0  # (the instrument sees what it should)
        assert offload["gpu"]["torch_dist"] == 0
        assert offload["on host"] and offload["views kept"] and offload["bound to views"]
        if fmt == "dp_reshardable" and case != TE_MASTERS:  # (TE: unscaled fp32 copies, made on the host)
            # torch_dist writes straight into the pinned buffer: one filled tensor per master and state there
            assert offload["filled in the buffer"] == offload["entries"] and offload["filled elsewhere"] == 0
            # and reads each straight in, from the file (a reshard: parts of saved tensors), none as torch does
            straight, as_torch = offload["gpu"]["straight"]
            assert straight >= offload["filled in the buffer"] and as_torch == 0, (straight, as_torch)
        assert plain["gpu"]["straight"] is None
        assert _same_space(offload["loaded"], plain["loaded"]), rank
        assert _equal(offload["resumed"], plain["resumed"]), rank
        if saved_by == world:
            assert _equal(offload["resumed"], runs[world][rank]["save"][case]["uninterrupted"]), rank
    # what loaded is what was saved, every element of every state, over all ranks (a reshard included)
    _assert_same_space(assemble([r["offload"]["loaded"] for r in records]), saved)
