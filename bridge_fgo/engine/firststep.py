"""What the first streamed step measures of GPU memory; the window (chunk_mb=auto, sizing.py) and
gpu_budget_gib's resident states (budget.py) are chosen from it, once.

Every figure is allocated memory (torch.cuda.max_memory_allocated, memory_allocated), never what the
caching allocator holds: a run fits while its allocated peak does, and cached blocks are not in use.
Megatron-Core and Bridge never reset the peak; a benchmark that resets it between setup and the first
step hides setup from these figures, and one that resets it inside the first iteration makes them
wrong (scripts/bench_offload.py does not).

- before: the run's peak when the first forward-backward starts;
- backward: the run's peak right after the first backward. The bound the step may reach without
  raising the run's peak: forward-backward's own peak where it raised the run's (backward > before),
  else setup's or a load's;
- base: allocated right after backward, what the step starts from (weights, gradients, ...);
- step: the run's peak at the end of the first step, which used a window of `window` bytes.

The step takes base + window + scratch, scratch being what the inner optimizer allocates beyond the
states in the window: measured where the first step raised the run's peak, else the contract's
(contracts.Contract.step_scratch).
"""
from __future__ import annotations

import dataclasses

MIB = 2**20
GIB = 2**30


def margin(bound: int) -> int:
    """Kept free under a bound: the allocator rounds what it hands out (measured 4 MiB over a 12.24 GiB
    budget; H100, 2026-11-23). 1%, at least 64 MiB; nothing when nothing was measured."""
    return max(64 * MIB, bound // 100) if bound else 0


@dataclasses.dataclass
class FirstStep:
    before: int = 0
    backward: int = 0
    base: int = 0
    step: int = 0
    window: int = 0  # the first step's window, bytes
    largest_chunk: int = 0  # the first step's largest chunk, bytes
    scratch_per_byte: float = 0.0  # the contracts' (the largest of a chain)

    @property
    def measured(self) -> bool:
        return self.backward > 0

    @property
    def set_by_backward(self) -> bool:
        """Whether the first forward-backward set the bound (else setup or a load did)."""
        return self.backward > self.before

    def scratch(self, chunk_bytes: int) -> int:
        """The step's allocations beyond base and window, with chunks of at most chunk_bytes."""
        if self.step > self.backward and self.largest_chunk:  # the step raised the run's peak: measured
            measured = max(0, self.step - self.base - self.window)
            return measured * chunk_bytes // self.largest_chunk
        return int(self.scratch_per_byte * chunk_bytes)

    def headroom(self) -> int:
        """What the step may add to base without raising the bound."""
        return self.backward - self.base - margin(self.backward)

    def describe(self) -> str:
        if not self.measured:
            return "nothing measured (no GPU)"
        what = "the first forward-backward's peak" if self.set_by_backward else "the run's peak before it"
        return (f"{what} {self.backward / GIB:.2f} GiB allocated, the step starting from {self.base / GIB:.2f} GiB, "
                f"the first step's peak {self.step / GIB:.2f} GiB")


class Probe:
    """Reads the figures at the first streamed step's call sites (only on a GPU)."""

    def __init__(self):
        self.first = FirstStep()
        self.done = False

    @staticmethod
    def _cuda(device) -> bool:
        return device is not None and device.type == "cuda"

    def at_offload(self, device) -> None:
        if not self.done and self._cuda(device):
            import torch

            self.first.before = torch.cuda.max_memory_allocated(device)

    def at_reload(self, device) -> None:
        if not self.done and self._cuda(device):
            import torch

            self.first.backward = torch.cuda.max_memory_allocated(device)
            self.first.base = torch.cuda.memory_allocated(device)

    def at_step_end(self, device, window: int, largest_chunk: int, scratch_per_byte: float) -> FirstStep:
        f = self.first
        if self._cuda(device):
            import torch

            f.step = torch.cuda.max_memory_allocated(device)
        f.window, f.largest_chunk, f.scratch_per_byte = window, largest_chunk, scratch_per_byte
        self.done = True
        return f
