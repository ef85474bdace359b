"""The head of the streamed update: its first chunks' host-to-device copies, started during the last
backward of the step, into memory that backward frees, so the update finds them on the GPU and the
link works while backward computes.

Only the last backward of a step (the last microbatch's) frees memory that stays free until the
update: what an earlier one frees, the next forward takes again. How much the head may hold, and
when, comes from that backward's allocation curve, measured once, in the first streamed step: at
every gradient-accumulation hook of the model's parameters (hook k), the memory allocated there
(`at`) and the most allocated from there to gradient finalization (`ahead`). At hook k of a later
step, window slots (copies.Window) are filled while what the head holds plus ahead[k] stays within
the bound the window was sized to (the run's peak through the first step, less a margin): no phase of
the iteration rises above it, and at gradient finalization the window's other slots are allocated as
before (update.py).

The curve comes from the allocator itself, over that one step: its allocated figure at each hook
(exact), and how far allocation rose between two hooks, read from its event trace
(torch.cuda.memory._record_memory_history) with a marker allocation at each hook (two allocations of
unusual sizes back to back). The recording starts at the hook where the last backward begins, not at
the step's start: recording forward-backward whole made the first iteration after a load 0.1 s longer
(0.134 s more than a steady step adds, against 0.037 s without any measurement; one H200, 2026-11-29,
docs/benchmarks.md#gpu-2026-11-29m). That hook is found without knowing the hooks per backward: each
parameter's hook fires once a backward, so the first parameter to fire twice shows where the second
backward began (hook k: k hooks a backward), and the last begins at (microbatches - 1) x k. Where a
schedule interleaves backwards (virtual pipeline stages) a parameter repeats no later than that, so the
recording starts early, never late. A curve that cannot be read turns the head off, with one INFO line:
the trace lost markers (cut short), the hooks do not fire the same number of times in every microbatch
(a parameter without a gradient in some), someone records memory history already, or the allocator
offers no trace. Each later step checks that it
follows the curve: at hook k, where more is allocated outside the head than the first step had there
(beyond the margin), that step prefetches no more; a step whose hook count is not the first step's
turns the head off; a step of another number of microbatches (a batch-size ramp) prefetches nothing.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Callable, List, Optional, Tuple

from ...log import logger, once, rank_prefix
from ..firststep import margin
from ..tensors import model_params

MARKS = (512 * 2039, 512 * 2029)  # bytes; small-pool sizes no model is likely to allocate back to back
TRACE_ENTRIES = 4_000_000  # the allocator's event ring for the measured step
BLOCK = 512  # the caching allocator's rounding: the trace gives requested sizes, allocated counts blocks


def _block(size: int) -> int:
    return max(1, -(-size // BLOCK)) * BLOCK


@dataclasses.dataclass
class Curve:
    """The last backward of the first streamed step, hook by hook (bytes allocated, absolute)."""

    at: List[int]
    ahead: List[int]
    first: int  # the step's hook index where the last backward begins
    hooks: int  # hooks per step
    microbatches: int
    recorded_from: int = 0  # the step's hook index where the recording began (at most `first`)


def read_curve(trace, samples: List[int], end: int, microbatches: int,
               hooks: Optional[int] = None) -> Tuple[Optional[Curve], str]:
    """The curve from the allocator's events over the end of one step's forward-backward (`trace`: dicts
    with action, addr, size) and the allocated figure the allocator gave at each hook recorded (`samples`,
    read before the hook's marker) and at the end (`end`); or (None, why). `hooks`: the step's, of which
    the recording held the last len(samples) (default: all of them).

    At each hook the allocator's own figure is exact. Between two hooks the trace gives how far
    allocation rose above where it was at the first of them: the trace records requested sizes, and a
    block the allocator hands out may be larger (512-byte rounding; a free block not split for a
    remainder under 1 MiB), so its absolute sums drift, its rises over a hook's interval hardly."""
    allocated, values, marks, skip = 0, [], [], set()
    i, n = 0, len(trace)
    while i < n:
        e = trace[i]
        action, size = e.get("action"), e.get("size", 0)
        if action == "alloc" and size == MARKS[0]:
            # the second marker is the next allocation or free; the allocator may note other things
            # between the two (a block of an earlier free completing: free_completed)
            j = i + 1
            while j < n and trace[j].get("action") not in ("alloc", "free_requested"):
                j += 1
            if j < n and trace[j].get("action") == "alloc" and trace[j].get("size") == MARKS[1]:
                marks.append((len(values), allocated))
                skip.update((e.get("addr"), trace[j].get("addr")))
                i = j + 1
                continue
        if action == "alloc":
            allocated += _block(size)
        elif action == "free_requested":
            if e.get("addr") in skip:
                skip.discard(e.get("addr"))
            else:
                allocated -= _block(size)
        values.append(allocated)
        i += 1
    hooks = len(samples) if hooks is None else hooks
    if len(marks) != len(samples):
        return None, (f"the allocator's trace holds {len(marks)} of the {len(samples)} hooks' markers: it was cut "
                      "short or missed events")
    if microbatches < 1:
        return None, "the number of microbatches is unknown (Megatron-Core's microbatch calculator is not set up)"
    if not marks or hooks % microbatches:
        return None, (f"the gradient hooks fired {hooks} times in {microbatches} microbatch(es): not the same "
                      "number in every backward")
    per = hooks // microbatches
    if per > len(marks):
        return None, (f"the recording began {per - len(marks)} hook(s) after the last backward's first: the hooks "
                      "do not fire once a parameter in every backward")
    first = len(marks) - per
    bounds = [v for v, _ in marks[first:]] + [len(values)]
    # how far allocation rose above each hook's figure before the next hook (never below the hook itself)
    rises = [max([at, *values[lo:hi]]) - at for (lo, hi), (_, at) in zip(zip(bounds, bounds[1:]), marks[first:])]
    ahead, most = [], end
    for k in range(per - 1, -1, -1):
        most = max(most, samples[first + k] + rises[k])
        ahead.append(most)
    return Curve(at=list(samples[first:]), ahead=ahead[::-1], first=hooks - per, hooks=hooks,
                 microbatches=microbatches), ""


def _microbatches() -> int:
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except Exception:  # not initialised (a bare optimizer), or another Megatron-Core layout
        return 0


class Head:
    def __init__(self, plan, transfers, allocated: Optional[Callable[[], int]] = None):
        self.plan, self.transfers = plan, transfers
        self._allocated = allocated  # tests give a GPU's figure; else torch.cuda.memory_allocated
        self._handles: list = []
        self.curve: Optional[Curve] = None
        self.state = "off"  # off, armed and measuring (the first streamed step), measured, on
        self.why_off: Optional[str] = None
        self.limit = 0  # bytes: what the head plus the rest may reach (the run's peak less a margin)
        self.offset = 0  # bytes kept on the GPU after the first step (gpu_budget_gib): on every phase
        self.hook = 0  # hooks fired in this step
        self.in_step = False
        self.stopped = False  # this step left the curve: no more prefetching
        self.microbatches = 0
        self._samples: List[int] = []  # the measured step: allocated at each hook recorded, before its marker
        self._seen: Optional[set] = None  # armed: the parameters whose hook fired, until one fires again
        self._starts: Optional[int] = None  # armed: the hook where the recording starts, once known
        self._recorded_from = 0
        self.prefetched: Optional[int] = None  # the last step's chunks whose copy began in its last backward
        self.step_note: dict = {}  # this step's: the most room seen, where it left the curve
        self.last_note: dict = {}

    # -- hooks on the model's parameters ----------------------------------------------------------
    def attach(self) -> None:
        """A gradient-accumulation hook on every model parameter the optimizers update (under Megatron-FSDP
        the module's own, after Megatron-FSDP's hooks on them: each fires once its gradient is taken)."""
        if self._handles:
            return
        me = weakref.ref(self)

        def fired(param):
            head = me()
            if head is not None:
                head._fired(param)

        for part in self.plan.parts:
            for p in model_params(part.opt, part.fsdp):
                if getattr(p, "requires_grad", False) and hasattr(p, "register_post_accumulate_grad_hook"):
                    self._handles.append(p.register_post_accumulate_grad_hook(fired))

    def detach(self) -> None:
        self._stop_recording()
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def _memory(self) -> int:
        if self._allocated is not None:
            return self._allocated()
        import torch

        return torch.cuda.memory_allocated(self.plan.device)

    # -- each step --------------------------------------------------------------------------------
    def begin_step(self, measure: bool) -> None:
        """Forward-backward begins (offload): count hooks from here; the first streamed step measures."""
        self.hook, self.in_step, self.stopped = 0, True, False
        self.step_note = {}
        self.microbatches = _microbatches()
        if self.state in ("armed", "measuring"):  # the measured step never reached gradient finalization: anew
            self._stop_recording()
        elif self.state == "measured":  # read at a step's exit, but no update followed it: a partial curve
            self.state, self.curve = "off", None
        if self.state == "on" and self.microbatches != self.curve.microbatches:
            self.stopped = True  # a batch-size ramp: not the measured step's shape
            self.step_note["microbatches"] = self.microbatches
            once(("head-microbatches", self.microbatches), logging.INFO,
                 "%sno prefetch during backward in steps of %d microbatch(es): the curve was measured in a step of "
                 "%d (a batch-size ramp?); steps of %d prefetch again", rank_prefix(), self.microbatches,
                 self.curve.microbatches, self.curve.microbatches)
        if measure and self.state == "off" and self.why_off is None:
            if self.attached:
                self._arm()
            else:
                self.off("no parameter the optimizers update takes a gradient-accumulation hook")

    def end_step(self) -> Optional[Curve]:
        """Gradient finalization (reload): the measured step's curve is read; a later step's count checked."""
        self.in_step = False
        if self.state == "armed":  # the recording never started
            self.off("no gradient hook fired in the measured step" if not self.hook else
                     f"the gradient hooks fired {self.hook} times in {self.microbatches} microbatch(es), no "
                     "parameter's twice: not the same number in every backward")
            return None
        if self.state == "measuring":
            try:
                return self._end_trace()
            except Exception as exc:  # never fail the training step for the measurement
                self.off(f"reading the allocator's trace failed ({type(exc).__name__}: {exc})")
                return None
        if self.state == "on":
            self.prefetched = len(self.transfers.started)
            self.last_note = self.step_note
            if self.hook != self.curve.hooks and not self.stopped:
                self.off(f"a step fired the gradient hooks {self.hook} times, the first step {self.curve.hooks}")
        return None

    def enable(self, limit: int, offset: int = 0) -> None:
        """After the first step: prefetch from the next one, within `limit` bytes allocated."""
        if self.state == "measured":
            self.state, self.limit, self.offset = "on", limit, offset

    def yield_to(self, why: str) -> None:
        """Never prefetch (said in status, not logged: the per-rank line says why)."""
        self.state, self.why_off, self.curve = "off", why, None

    def off(self, why: str) -> None:
        """No prefetch from here on (said once)."""
        self._stop_recording()
        if self.why_off is None:
            logger.info("%sno prefetch during backward: %s", rank_prefix(), why)
        self.state, self.why_off, self.curve = "off", why, None

    def _fired(self, param=None) -> None:
        if not self.in_step:
            return  # a backward outside train_step
        k = self.hook
        self.hook += 1
        try:
            if self.state == "armed" and self._last_backward_from(k, param):
                self._start_trace()
            if self.state == "measuring":
                import torch

                self._samples.append(self._memory())
                a = torch.empty(MARKS[0], dtype=torch.uint8, device=self.plan.device)
                b = torch.empty(MARKS[1], dtype=torch.uint8, device=self.plan.device)
                del a, b
            elif self.state == "on" and not self.stopped and k >= self.curve.first:
                self._prefetch(k - self.curve.first)
        except Exception as exc:  # inside autograd: never fail the training's backward for a prefetch
            what = "measuring backward's memory" if self.state in ("armed", "measuring") else "prefetch during backward"
            self._stop_recording()
            logger.warning("%s%s failed (%s: %s); the update copies its chunks in itself from here on",
                           rank_prefix(), what, type(exc).__name__, exc)
            self.why_off = self.why_off or f"it failed: {type(exc).__name__}"
            self.state, self.curve, self.stopped = "off", None, True

    def _prefetch(self, j: int) -> None:
        """Hook j of the last backward: fill the next slots while the curve allows."""
        c, t = self.curve, self.transfers
        window = t.window
        if j >= len(c.at):
            return
        now = self._memory() - window.held - self.offset
        if now > c.at[j] + margin(self.limit):
            self.stopped = True  # not where the first step was: prefetch nothing more this step
            self.step_note["left"] = (j, now, c.at[j])
            return
        room = self.limit - c.ahead[j]
        self.step_note["room"] = max(room, self.step_note.get("room", room))
        n = min(len(window.slots), len(self.plan.chunks))
        i = len(t.started)
        while i < n and i not in t.started:
            if window.held + window.slots[i].nbytes > room:
                break
            t.h2d(i)
            i += 1

    # -- the measurement (CUDA only) --------------------------------------------------------------
    def _arm(self) -> None:
        """The first streamed step begins: whether the allocator can be recorded is checked now; the recording
        starts at the last backward's first hook (the module's docstring)."""
        import torch

        record = getattr(torch.cuda.memory, "_record_memory_history", None)
        snapshot = getattr(torch.cuda.memory, "_snapshot", None)
        if record is None or snapshot is None:
            self.off("this torch's CUDA allocator offers no event trace to measure backward's memory from")
            return
        if any(snapshot().get("device_traces") or ()):
            self.off("this process records memory history already (a profiler?): measuring would end it")
            return
        self._samples, self._seen = [], set()
        self._starts = 0 if self.microbatches <= 1 else None
        self.state = "armed"

    def _last_backward_from(self, k: int, param) -> bool:
        """Armed, at hook k: whether the recording starts here (at the last backward's first hook, or earlier)."""
        if self._starts is None:
            key = id(param)
            if key in self._seen:  # a second backward began at hook k: k hooks a backward
                self._starts, self._seen = (self.microbatches - 1) * k, None
            else:
                self._seen.add(key)
        return self._starts is not None and k >= self._starts

    def _start_trace(self) -> None:
        import torch

        self._recorded_from = self.hook - 1  # (called at that hook, counted already)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=TRACE_ENTRIES)
        self.state = "measuring"

    def _stop_recording(self) -> None:
        """End the measured step's recording (never raises: its callers are failure paths too)."""
        if self.state == "armed":
            self.state, self._seen = "off", None
        if self.state == "measuring":
            self.state = "off"
            try:
                import torch

                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as exc:
                logger.warning("%sending the allocator's event recording failed (%s: %s)", rank_prefix(),
                               type(exc).__name__, exc)

    def _end_trace(self) -> Optional[Curve]:
        import torch

        device = self.plan.device
        end = self._memory()
        traces = torch.cuda.memory._snapshot().get("device_traces") or []
        self._stop_recording()
        index = device.index if device.index is not None else torch.cuda.current_device()
        curve, why = read_curve(traces[index] if index < len(traces) else [], self._samples, end, self.microbatches,
                                self.hook)
        self._samples = []
        if curve is None:
            self.off(why)
            return None
        curve.recorded_from = self._recorded_from
        self.curve, self.state = curve, "measured"
        return curve

    def describe(self) -> str:
        if self.state != "on":
            return f"no prefetch during backward: {self.why_off}" if self.why_off else "no prefetch during backward"
        c, gib = self.curve, 2**30
        text = (f"during the last backward up to {min(len(self.transfers.window.slots), len(self.plan.chunks))} "
                f"chunk(s) come in early, by the curve the first step measured ({c.hooks // c.microbatches} hooks a "
                f"backward, recorded from hook {c.recorded_from + 1} of {c.hooks}, allocated {c.at[0] / gib:.2f} -> "
                f"{c.at[-1] / gib:.2f} GiB, at most {(self.limit - c.ahead[-1]) / gib:.2f} GiB of room under "
                f"{self.limit / gib:.2f} GiB)")
        if self.prefetched is not None:
            n = self.last_note
            text += f"; the last step: {self.prefetched} chunk(s)"
            if "microbatches" in n:
                text += f" (a step of {n['microbatches']} microbatch(es), not the measured {c.microbatches})"
            if "room" in n:
                text += f", room up to {n['room'] / gib:.2f} GiB"
            if "left" in n:
                j, now, was = n["left"]
                text += (f", off the curve at hook {j + 1}: {now / gib:.2f} GiB allocated where the first step had "
                         f"{was / gib:.2f}")
        return text
