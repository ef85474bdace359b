"""chunk_mb=auto (engine/sizing.py) and gpu_budget_gib (engine/budget.py), chosen once from what the
first streamed step measured (engine/firststep.py). The figures a GPU would give are given here; the
plan, the re-cut and the steps after it are the engine's own, against Megatron-Core's real
DistributedOptimizer step (the rig of test_streamed.py)."""
from __future__ import annotations

import logging

import pytest

from bridge_fgo.engine import budget, sizing
from bridge_fgo.engine.firststep import FirstStep, margin
from bridge_fgo.engine.streamed import StreamedEngine
from test_streamed import OPTIMIZERS, assert_same, engine_for, make, measured, snapshot, step

MIB = 2**20
GIB = 2**30


def window_of(size, slots=2, total=12 * GIB):
    """A plan of `total` bytes of 4 MiB bundles: the window is `slots` chunks (at most one per chunk)."""
    chunks = -(-total // size)
    return min(slots, chunks) * size, size, chunks


def test_the_window_grows_into_the_headroom_up_to_the_cap():
    first = FirstStep(before=5 * GIB, backward=10 * GIB, base=4 * GIB, step=10 * GIB)
    size, slots, why = sizing.choose(window_of, first, 12 * GIB)
    assert size == sizing.MAX_CHUNK_MB * MIB  # 6 GiB of headroom: a 2 GiB window fits, the cap holds
    # then as many slots of 1 GiB as the headroom holds: each a chunk that may come in before the update
    assert slots == 5 and 5 * GIB <= first.headroom() < 6 * GIB
    assert "1024 MB, 5 slots" in why and "the first forward-backward's peak 10.00 GiB" in why


def test_the_window_stops_where_the_headroom_ends():
    first = FirstStep(before=5 * GIB, backward=10 * GIB, base=9 * GIB, step=10 * GIB)
    room = first.headroom()
    assert room == GIB - margin(10 * GIB)
    size, slots, why = sizing.choose(window_of, first, 12 * GIB)
    assert 2 * size <= room < 2 * (size + sizing.STEP_MB * MIB) and slots == 2
    assert f"{size // MIB} MB, 2 slots" in why


def test_where_the_step_sets_the_peak_the_window_stays_where_it_was():
    """Full recomputation: the first step raised the run's peak above forward-backward's."""
    first = FirstStep(before=5 * GIB, backward=6 * GIB, base=5.6 * GIB, step=6.3 * GIB, window=512 * MIB,
                      largest_chunk=256 * MIB)
    assert first.scratch(256 * MIB) == int(6.3 * GIB - 5.6 * GIB - 512 * MIB)  # measured, not the contract's
    size, slots, why = sizing.choose(window_of, first, 12 * GIB)
    assert (size, slots) == (256 * MIB, 2) and "256 MB, the least window: every window would raise the peak" in why


def test_scratch_comes_from_the_contract_unless_measured():
    first = FirstStep(before=5 * GIB, backward=10 * GIB, base=4 * GIB, step=10 * GIB, scratch_per_byte=0.5)
    assert first.scratch(GIB) == GIB // 2
    # torch's foreach temporaries count: a window of two chunks and half a chunk of scratch in 2 GiB
    first = FirstStep(before=5 * GIB, backward=7 * GIB, base=5 * GIB, step=7 * GIB, scratch_per_byte=0.5)
    size, slots, _ = sizing.choose(window_of, first, 12 * GIB)
    assert 2.5 * size <= first.headroom() < 2.5 * (size + sizing.STEP_MB * MIB) and size < sizing.MAX_CHUNK_MB * MIB


def test_slots_never_outnumber_the_chunks():
    first = FirstStep(before=5 * GIB, backward=40 * GIB, base=4 * GIB, step=10 * GIB)
    size, slots, _ = sizing.choose(lambda size, n: window_of(size, n, 3 * GIB), first, 3 * GIB)
    assert size == GIB and slots == 3  # three chunks of 1 GiB: a fourth slot would hold nothing


def test_a_slot_that_leaves_the_window_as_large_still_counts():
    """Chunks of unequal sizes (2, 1, 1, 2 units) give a window of 4 units with two slots and with three
    (slot i takes chunks i, i + n, ...): the third slot is a chunk that can come in early, for nothing."""
    sizes = [2 * GIB, GIB, GIB, 2 * GIB]

    def uneven(size, n):
        ring = [0] * min(n, len(sizes))
        for i, c in enumerate(sizes):
            ring[i % n] = max(ring[i % n], c)
        return sum(ring), max(sizes), len(sizes)

    first = FirstStep(before=5 * GIB, backward=40 * GIB, base=4 * GIB, step=10 * GIB)
    assert uneven(GIB, 2)[0] == uneven(GIB, 3)[0] == 4 * GIB
    assert sizing.slots(uneven, first, GIB) == 4


def test_nothing_measured_and_small_plans_keep_the_first_window():
    assert sizing.choose(window_of, FirstStep(), 12 * GIB) == (256 * MIB, 2, "256 MB: nothing measured (no GPU)")
    first = FirstStep(before=5 * GIB, backward=10 * GIB, base=4 * GIB, step=10 * GIB)
    assert sizing.choose(window_of, first, 100 * MIB)[0] == 256 * MIB


def test_the_bound_is_the_runs_peak_when_setup_set_it():
    first = FirstStep(before=12 * GIB, backward=12 * GIB, base=4 * GIB, step=12 * GIB)
    assert not first.set_by_backward and "the run's peak before it 12.00 GiB" in first.describe()


def test_a_budget_plans_from_the_allocated_peak():
    bundles = [type("B", (), dict(nbytes=n * MIB, entries=[1], resident=False))() for n in (900, 700, 500, 300)]
    first = FirstStep(before=5 * GIB, backward=10 * GIB, base=4 * GIB, step=10 * GIB)
    kept = budget.choose(bundles, 12 * GIB, first)
    room = 12 * GIB - 10 * GIB - margin(12 * GIB)
    assert sum(b.nbytes for b in kept) <= room and [b.nbytes // MIB for b in kept] == [900, 700, 300]
    assert budget.choose(bundles, 10 * GIB, first) is None


def test_a_budget_counts_the_window_the_kept_states_take_off_the_step():
    """Where the step sets the peak (full recomputation), keeping the largest parameter shrinks the step's
    window: that room is used too, and the planned peak never passes the budget less its margin."""
    sizes = (3 * GIB, *[GIB] * 6, GIB // 2)
    bundles = [type("B", (), dict(nbytes=n, entries=[1], resident=False))() for n in sizes]

    def step_with(kept):  # base 10 GiB, a window of two slots of the largest bundle left, no scratch
        left = [b.nbytes for b in bundles if b not in kept]
        return 10 * GIB + 2 * max(left, default=0)

    first = FirstStep(before=9 * GIB, backward=11 * GIB, base=10 * GIB, step=16 * GIB)
    budget_bytes = int(20.5 * GIB)
    bound = budget_bytes - margin(budget_bytes)
    old = budget.choose(bundles, budget_bytes, first)
    assert [b.nbytes for b in old] == [3 * GIB, 1 * GIB]  # the room above the all-offloaded 16 GiB
    kept = budget.choose(bundles, budget_bytes, first, step_with, chunk_bytes=GIB // 2)
    # kept 3 GiB: the window falls from 6 to 2 GiB, then to 1 GiB once only the 0.5 GiB one is left; that
    # one would pass the bound
    assert [b.nbytes for b in kept] == [3 * GIB, *[GIB] * 6]
    assert budget.planned(first, kept, step_with) <= bound < budget.planned(first, kept + [bundles[-1]], step_with)
    assert budget.planned(first, kept, None) == first.step + sum(b.nbytes for b in kept)


@pytest.fixture
def small_units(monkeypatch):
    """The rig's states are kilobytes: its "MB" is a byte, so 256 "MB" windows cut it into chunks."""
    monkeypatch.setattr(sizing, "MIB", 1)


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te", "apex"])
def test_auto_recuts_after_the_first_step_says_so_and_stays_exact(kind, small_units, caplog):
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        engine = engine_for(opt, 256, auto=True)
        before = len(engine.chunks)
        # plenty of headroom: forward-backward reached 1 GiB over a base of 1 KiB
        engine.probe = measured(before=GIB // 2, backward=GIB, base=1024, step=GIB)
        for _ in range(4):
            step(base)
            step(opt, engine)
            assert_same(snapshot(base), snapshot(opt))
    assert engine.plan.chunk_bytes == min(sizing.MAX_CHUNK_MB, engine.bytes) and len(engine.chunks) < before
    notes = [m for m in caplog.messages if "window sized from the first step" in m]
    assert len(notes) == 1 and engine.window_note in notes[0] and f"{len(engine.chunks)} chunk(s)" in notes[0]


def test_auto_with_a_budget_keeps_resident_then_sizes_the_rest(small_units):
    base, opt = make(), make()
    full = engine_for(make()).bytes
    # the budget leaves room for half the states above the 1 GiB peak and its 64 MiB margin
    engine = StreamedEngine([opt], 256, GIB + 64 * MIB + full // 2, auto=True)
    engine.prepare()
    engine.probe = measured(before=0, backward=GIB, base=1024, step=GIB)
    for _ in range(3):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))
    assert 0 < engine.resident_bytes <= full // 2 and engine.bytes == full - engine.resident_bytes
    assert "keep their states on the GPU" in engine.budget_note and "1.00 GiB" in engine.budget_note
    assert engine.window_note and engine.plan.chunk_bytes == min(sizing.MAX_CHUNK_MB, engine.bytes)


def test_auto_without_a_gpu_keeps_the_first_window(small_units):
    opt = make()
    engine = engine_for(opt, 256, auto=True)
    cut = [c.nbytes for c in engine.chunks]
    for _ in range(2):
        step(opt, engine)
    assert [c.nbytes for c in engine.chunks] == cut and "nothing measured (no GPU)" in engine.window_note


def test_a_given_chunk_mb_keeps_its_size_and_takes_the_slots_the_headroom_holds(small_units, caplog):
    base, opt = make(), make()
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        engine = engine_for(opt, 600)
        cut = [c.nbytes for c in engine.chunks]
        # room for the whole plan: every chunk may have its own slot
        engine.probe = measured(before=GIB // 2, backward=GIB, base=1024, step=GIB)
        for _ in range(3):
            step(base)
            step(opt, engine)
            assert_same(snapshot(base), snapshot(opt))
    assert [c.nbytes for c in engine.chunks] == cut and engine.plan.chunk_bytes == 600
    assert engine.plan.slots == len(cut) and engine.window_bytes == sum(cut)
    assert "as chunk_mb gives" in engine.window_note and f"{len(cut)} slots within the headroom" in engine.window_note


def test_a_given_chunk_mb_without_headroom_keeps_two_slots_and_says_they_exceed_it(small_units):
    opt = make()
    engine = engine_for(opt, 600)
    engine.probe = measured(before=GIB, backward=GIB, base=GIB, step=GIB)  # the step added nothing: no room
    step(opt, engine)
    assert engine.plan.slots == 2 and "2 slots (the least: even two exceed the headroom)" in engine.window_note


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te", "apex"])
def test_a_budget_that_fails_half_way_leaves_whole_bundles_and_stays_exact(kind, small_units):
    """Out of GPU memory while the budget moves states back: the bundles moved whole stay resident, the
    one it failed in goes back to its host views whole, the chunks are cut from what is not resident,
    and training that goes on (the exception caught, a restart in process) stays exact."""
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    full = engine_for(make(**OPTIMIZERS[kind])).bytes
    engine = StreamedEngine([opt], 256, GIB + 64 * MIB + full, auto=True)  # room for every state
    engine.prepare()
    engine.probe = measured(before=0, backward=GIB, base=1024, step=GIB)
    real, calls = engine.transfers.to_device, []

    def to_device(part, b, e):
        calls.append(e)
        if len(calls) == 5:  # inside the second bundle (each has a master and two moments)
            raise RuntimeError("CUDA out of memory (a stand-in)")
        real(part, b, e)

    engine.transfers.to_device = to_device
    step(base)
    with pytest.raises(RuntimeError, match="a stand-in"):
        step(opt, engine)
    engine.transfers.to_device = real
    bundles = [bd for part in engine.parts for bd in part.bundles]
    resident = [bd for bd in bundles if bd.resident]
    assert len(resident) == 1 and resident[0].entries[0] is calls[0]
    streamed = {id(bd) for c in engine.chunks for bd in c.bundles}
    assert all((id(bd) in streamed) != bd.resident for bd in bundles)
    part = engine.parts[0]
    assert all(part.bindings.get(e).data_ptr() == e.host.data_ptr()
               for bd in bundles if not bd.resident for e in bd.entries)
    assert_same(snapshot(base), snapshot(opt))  # the step itself was whole before the budget ran
    for _ in range(2):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))


def test_a_budget_under_recomputation_uses_the_window_it_frees(small_units):
    """The rig's largest parameter (1 KiB of states) sets a window slot: with it kept, the step's window
    falls from 1.5 to 1 KiB, and the budget keeps a 512-byte parameter more in that room."""
    base, opt = make(), make()
    engine = engine_for(make(), 256)
    assert engine.window_bytes == 1536 and max(bd.nbytes for p in engine.parts for bd in p.bundles) == 1024
    engine = StreamedEngine([opt], 256, GIB + 64 * MIB + 1536 + 1024)
    engine.prepare()
    # the step set the run's peak: the all-offloaded step took base + its 1.5 KiB window
    engine.probe = measured(before=0, backward=GIB, base=GIB, step=GIB + 1536)
    for _ in range(3):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))
    kept = [bd.nbytes for p in engine.parts for bd in p.bundles if bd.resident]
    assert sorted(kept) == [512, 1024] and engine.window_bytes == 1024  # planned from the all-offloaded: [1024]
    assert f"planned with them {(GIB + 1024 + 1536) / GIB:.2f} GiB" in engine.budget_note


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te", "apex"])
def test_the_states_a_budget_keeps_are_updated_in_chunk_sized_pieces(kind, monkeypatch):
    """One inner step() over every resident parameter would allocate the optimizer's scratch for all of
    them at once (torch's foreach AdamW: a temporary as large as their masters), where the window was
    sized for a chunk's: they go in pieces of at most a chunk (a larger parameter alone), exactly."""
    from bridge_fgo.engine import subset

    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    full = sum(bd.nbytes for bd in engine_for(make(**OPTIMIZERS[kind])).parts[0].bundles)
    engine = StreamedEngine([opt], 600, GIB + 64 * MIB + full)  # room for every state
    engine.prepare()
    engine.probe = measured(before=0, backward=GIB, base=1024, step=GIB)
    real, calls = subset.step_subset, []

    def step_subset(inner, state, by_group):
        stepped = {id(p) for ps in by_group.values() for p in ps}
        calls.append(sum(bd.nbytes for bd in engine.parts[0].bundles if id(bd.param) in stepped))
        return real(inner, state, by_group)

    monkeypatch.setattr(subset, "step_subset", step_subset)
    for _ in range(3):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))
    bundles = engine.parts[0].bundles
    assert all(bd.resident for bd in bundles) and not engine.chunks
    passes = calls[-len(engine.parts[0].resident_pieces(600)):]
    assert len(passes) > 1 and all(n <= 600 or n == max(bd.nbytes for bd in bundles) for n in passes)
    assert sum(passes) == sum(bd.nbytes for bd in bundles)
    assert engine.fitting.window_at(600)[1] == engine.parts[0].largest_piece(600) == max(passes)


# -- the first step's window (chunk_mb=auto) ------------------------------------------------------------------------
def test_the_first_window_stays_where_it_fits():
    first = FirstStep(before=5 * GIB, backward=10 * GIB, base=4 * GIB)
    assert sizing.first(window_of, first, 256 * MIB) == (256 * MIB, 2, "")
    assert sizing.first(window_of, FirstStep(), 256 * MIB) == (256 * MIB, 2, "")  # nothing measured: as it starts


def test_the_first_window_shrinks_under_the_runs_peak_so_far():
    """Full recomputation: forward-backward is small, setup set the run's peak; 300 MiB of headroom hold two
    slots of 128 MB chunks and the contract's scratch (torch's foreach: half a chunk), not of 256 MB."""
    first = FirstStep(before=7 * GIB, backward=7 * GIB, base=7 * GIB - margin(7 * GIB) - 300 * MIB,
                      scratch_per_byte=0.5)
    size, slots, why = sizing.first(window_of, first, 256 * MIB)
    assert (size, slots) == (96 * MIB, 2) and sizing.fits(window_of, first, size, 2)
    assert not sizing.fits(window_of, first, size + sizing.STEP_MB * MIB, 2)
    assert "96 MB chunks, not 256" in why and "would raise the run's peak so far" in why


def test_the_first_window_takes_the_least_where_nothing_fits():
    first = FirstStep(before=7 * GIB, backward=7 * GIB, base=7 * GIB)
    size, slots, why = sizing.first(window_of, first, 256 * MIB)
    assert (size, slots) == (sizing.MIN_CHUNK_MB * MIB, 2) and "the least: even those raise the run's peak" in why


def test_the_engines_first_step_fits_under_the_runs_peak_and_the_window_stays_there(small_units, caplog):
    """The engine's first streamed step, chunk_mb=auto: re-cut at gradient finalization to fit the headroom the
    run's peak so far leaves (full recomputation: setup set it), exact; after it the window grows no further,
    the step having set no higher peak to grow into."""
    base, opt = make(), make()
    engine = engine_for(opt, 4096, auto=True)
    assert len(engine.chunks) == 1  # 4096 "MB" hold every state: the first window would be all of them
    scratch = engine.parts[0].contract.step_scratch  # torch's foreach temporaries
    window, largest, _ = engine.fitting.window_at(4096, 2)
    room = window + int(scratch * largest) - 1  # one byte short of it
    bound = GIB
    engine.probe = measured(before=bound, backward=bound, base=bound - margin(bound) - room, step=bound)
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))
    first = engine.probe.first
    assert first.window + int(scratch * first.largest_chunk) <= room and len(engine.chunks) > 1
    assert any("the first step's window: " in m and "not 4096" in m for m in caplog.messages)
    first_size = engine.plan.chunk_bytes
    for _ in range(2):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))
    assert engine.plan.chunk_bytes == first_size and engine.window_bytes == first.window
    assert f"{first_size} MB, 2 slots" in engine.window_note


def test_the_first_window_never_shrinks_below_the_largest_parameters_states_and_takes_one_slot_where_that_fits():
    """An untied embedding and output layer (786 MB of states each) are chunks alone whatever the size: below them
    the window shrinks no further, so the first step keeps its chunks, through one slot where two would pass the
    run's peak so far (full recomputation, H100, 2026-11-27: two 786 MB slots and torch's scratch put the first
    iteration at 7.27 GiB over setup's 6.60 GiB; 16 MB chunks gained nothing and made 67 chunks)."""
    big = 786 * MIB

    def with_embedding(size, slots=2, total=12 * GIB):
        largest = max(size, big)
        chunks = -(-total // size)
        return min(slots, chunks) * largest, largest, chunks

    one_fits = FirstStep(before=7 * GIB, backward=7 * GIB, base=7 * GIB - margin(7 * GIB) - 1200 * MIB,
                         scratch_per_byte=0.5)
    size, slots, why = sizing.first(with_embedding, one_fits, 256 * MIB)
    assert (size, slots) == (256 * MIB, 1) and "256 MB chunks through one slot" in why
    none_fits = FirstStep(before=7 * GIB, backward=7 * GIB, base=7 * GIB - margin(7 * GIB) - 300 * MIB)
    size, slots, why = sizing.first(with_embedding, none_fits, 256 * MIB)
    assert (size, slots) == (256 * MIB, 2) and "the least: even those raise the run's peak" in why
    size, slots, _ = sizing.first(with_embedding, none_fits, 1024 * MIB)
    assert (size, slots) == (big, 2)
    # after the first step: the least size, and one slot where only that fits
    measured_first = FirstStep(before=7 * GIB, backward=7 * GIB, base=7 * GIB - margin(7 * GIB) - 1200 * MIB,
                               step=7 * GIB, scratch_per_byte=0.5)
    size, slots, why = sizing.choose(with_embedding, measured_first, 12 * GIB)
    assert (size, slots) == (256 * MIB, 1) and "256 MB, one slot, the least" in why


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te", "apex", "te-precision-aware-bf16"])
def test_the_engine_steps_exactly_through_one_slot(kind):
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    engine = engine_for(opt, 600)
    engine.fitting.window_at(600, 1)
    assert len(engine.transfers.window.slots) == 1 and len(engine.chunks) > 2
    for _ in range(3):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))


def bench_model():
    """The plan of the bench's 4-layer model on one GPU, the real layout: TE FusedAdam's fp32 master and moments,
    the untied embedding and output layer (750 MiB of states each) at either end of the buffer.
    (window_of, the bytes of one of those)."""
    from bridge_fgo.engine import layout
    from bridge_fgo.engine.tensors import MASTER, STATE, Entry

    hidden, ffn, vocab = 2048, 5632, 32000
    layer = [hidden * 4096, hidden * hidden, hidden, 2 * ffn * hidden, ffn * hidden, hidden]  # qkv, proj, norm, fc1, ...
    numels = [vocab * hidden] + layer * 4 + [hidden, vocab * hidden]

    def bundle(n):
        return layout.Bundle(0, 0, None, [Entry(MASTER, None, None, (n,), None, 4 * n)]
                             + [Entry(STATE, None, k, (n,), None, 4 * n) for k in ("exp_avg", "exp_avg_sq")])

    bundles = [bundle(n) for n in numels]
    layout.place(bundles)

    def window_of(size, slots=2):
        chunks = layout.chunks_of(bundles, size)
        return sum(layout.window_sizes(chunks, slots)), max(c.nbytes for c in chunks), len(chunks)

    return window_of, 12 * vocab * hidden


def test_the_first_window_grows_where_a_larger_cut_puts_the_largest_states_in_one_slot():
    """The bench's model (H200, 2026-11-29): cut at 256 MB the embedding's and output layer's states fall into
    both slots, a 1500 MiB window over 1287 MiB of headroom, so the first step went through one slot; cut at
    384 MB they share one (930 MiB), the window the steady step took."""
    real, big = bench_model()
    assert real(256 * MIB)[0] == 2 * big  # both slots hold one of them
    first = FirstStep(before=3.23 * GIB, backward=3.23 * GIB, base=1.91 * GIB)  # TE: no scratch of its own
    assert 2 * big > first.headroom() > big + 128 * MIB
    size, slots, why = sizing.first(real, first, 256 * MIB)
    assert slots == 2 and size > 256 * MIB and sizing.fits(real, first, size, 2)
    assert all(not sizing.fits(real, first, s * MIB, 2) for s in range(256, size // MIB, sizing.STEP_MB))
    assert f"{size // MIB} MB chunks, not 256" in why and "share a slot" in why
    assert real(size)[0] < real(256 * MIB)[0] and real(size)[1] == big
    # where no larger cut fits either, one slot, as before
    tight = FirstStep(before=3.23 * GIB, backward=3.23 * GIB, base=3.23 * GIB - margin(3.23 * GIB) - big - 200 * MIB)
    assert sizing.first(real, tight, 256 * MIB)[:2] == (256 * MIB, 1)


def test_where_every_window_raises_the_peak_the_one_that_raises_it_least():
    """Megatron-FSDP on one H200 (2026-11-29): the step's measured scratch left no window under the peak, and 256
    MB chunks with two slots (1500 MiB) raised it most; the least window is a cut where the largest states share
    a slot, not the least chunk size."""
    real, big = bench_model()
    first = FirstStep(before=2.5 * GIB, backward=2.5 * GIB, base=1.29 * GIB, step=3.21 * GIB, window=big,
                      largest_chunk=big)
    assert not sizing.fits(real, first, 256 * MIB, 1)
    size, slots, why = sizing.choose(real, first, 3838009344, floor=256 * MIB)
    assert slots == 2 and real(size)[0] < real(256 * MIB)[0]
    assert all(sizing.need(real, first, size, 2) <= sizing.need(real, first, s * MIB, 2) for s in range(256, 1025, 32))
    assert f"{size // MIB} MB, the least window: every window would raise the peak" in why


def make_shaped(shapes, **kw):
    from support import harness

    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True, shapes=shapes, **kw)
    opt.per_bucket_numel = opt.per_bucket_numel_unpadded = [{}]
    return opt


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te", "apex"])
def test_the_engines_first_step_takes_a_larger_cut_where_it_shares_the_largest_states_slot(monkeypatch, caplog, kind):
    """The engine's own plan: two large parameters around three small ones. Cut at 128 "MB" (a "MB" of 16 bytes
    here) the large ones go into both slots, at 160 too, at 192 they share one; the first step takes 192,
    exact, under the headroom, with torch's AdamW and TE's and apex's FusedAdam (their contracts' stand-ins)."""
    monkeypatch.setattr(sizing, "MIB", 16)
    shapes = ((32, 32), (8, 8), (8, 8), (8, 8), (32, 32))
    base, opt = make_shaped(shapes, **OPTIMIZERS[kind]), make_shaped(shapes, **OPTIMIZERS[kind])
    engine = engine_for(opt, 128 * 16, auto=True)
    scratch = engine.parts[0].contract.step_scratch
    narrow, _, _ = engine.fitting.window_at(192 * 16, 2)
    assert engine.fitting.window_at(160 * 16, 2)[0] > narrow  # both cut the large ones into both slots
    wide, largest, _ = engine.fitting.window_at(128 * 16, 2)
    assert wide > narrow
    room = (wide + narrow) // 2 + int(scratch * largest)
    engine.probe = measured(before=GIB, backward=GIB, base=GIB - margin(GIB) - room, step=GIB)
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        for _ in range(3):
            step(base)
            step(opt, engine)
            assert_same(snapshot(base), snapshot(opt))
    first = engine.probe.first
    assert first.largest_chunk == largest and first.window + int(scratch * largest) <= room
    assert any("the first step's window: 192 MB chunks, not 128" in m for m in caplog.messages)
