"""Stand-ins, for CPU, of Transformer Engine's quantized parameters and of its master-weight cast, as
Megatron-Core's DistributedOptimizer reads and calls them (cfg.ddp.fp8_param_gather, fp4_param_gather).

The cast follows Transformer Engine 2.20.2's quantize_master_weights (tensor/utils.py), which
Megatron-Core's quantize_param_shard and quantize_nvfp4_param_shard call: each master is first cast to the
parameter's dtype; then, by the parameter's quantizer,
- "delayed": each shard cast with the scale it already has, its amax recorded; then one MAX reduction of
  every parameter's amax over the group and scale_inv = 1 / scale;
- "tensorwise" (current scaling), and "nvfp4" here through Megatron-Core's NVFP4 entry point: each shard's
  amax, one MAX reduction over the group, scale = max / amax, then each shard cast with it;
- "blockwise" and "mxfp8": the same per block of BLOCK elements of the whole parameter (MXFP8: the scale a
  power of two), every block's amax in the one reduction.
Every parameter of the optimizer comes in the one call, a master of None for a shard another rank owns.
The FP8 bytes are real E4M3 (saturated, round to nearest even); the reduction is recorded, not run (one
rank). Each call is recorded: (entry point, parameters, masters given, reductions).
"""
from __future__ import annotations

import contextlib
from typing import List
from unittest import mock

import torch

FP8_KINDS = ("delayed", "tensorwise", "blockwise", "mxfp8")
KINDS = (*FP8_KINDS, "nvfp4")
BLOCK = {"blockwise": 128, "mxfp8": 32}  # elements a scale covers (1-D here; TE's weights use 128x128 and 1x32)
E4M3_MAX = 448.0


class Quantizer:
    def __init__(self, kind: str):
        self.kind = kind
        self.scale = torch.full((1,), 2.0)  # delayed: from the amax history, known before the step
        self.amax = torch.zeros(1)


def attach(model_param, kind: str) -> None:
    """Make `model_param` (a bf16 view of the param buffer) a stand-in quantized parameter: its FP8
    bytes, scale_inv and quantizer beside it."""
    assert kind in KINDS, kind
    model_param._quantizer = Quantizer(kind)
    model_param._data = torch.zeros(model_param.numel(), dtype=torch.uint8)
    model_param._scale_inv = torch.ones(1)


def kind_of(t):
    q = getattr(t, "_quantizer", None)
    return q.kind if q is not None else None


def _cast(x, scale) -> torch.Tensor:
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


class Cast:
    """The recorded stand-in of quantize_master_weights."""

    def __init__(self):
        self.calls: List[tuple] = []

    def __call__(self, entry, model_params, main_params, start_offsets, group, fsdp_shard_model_params=None):
        assert fsdp_shard_model_params is None
        if not model_params:  # every implementation returns at once (megatron-core 0.16 calls it regardless)
            return
        reductions = 0
        mains = [None if m is None else m.to(p.dtype) for p, m in zip(model_params, main_params)]
        delayed = [(p, m, o) for p, m, o in zip(model_params, mains, start_offsets) if kind_of(p) == "delayed"]
        blocked = [(p, m, o) for p, m, o in zip(model_params, mains, start_offsets) if kind_of(p) in BLOCK]
        current = [(p, m, o) for p, m, o in zip(model_params, mains, start_offsets)
                   if kind_of(p) not in BLOCK and kind_of(p) != "delayed"]
        if delayed:
            for p, m, o in delayed:
                if m is None:
                    continue
                p._data[o:o + m.numel()] = _cast(m.view(-1), p._quantizer.scale)
                p._quantizer.amax = torch.maximum(p._quantizer.amax, m.float().abs().max().view(1))
            reductions += 1  # all_reduce(MAX) of every amax over the group
            for p, _, _ in delayed:
                p._scale_inv = torch.reciprocal(p._quantizer.scale)
        if current:
            amaxes = torch.zeros(len(current))
            for i, (_, m, _) in enumerate(current):
                if m is not None:
                    amaxes[i] = m.float().abs().max()
            reductions += 1  # all_reduce(MAX) over the group: every shard's amax before any cast
            for (p, m, o), amax in zip(current, amaxes):
                scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones(())).view(1)
                p._quantizer.amax, p._scale_inv = amax.view(1), torch.reciprocal(scale)
                if m is not None:
                    p._data[o:o + m.numel()] = _cast(m.view(-1), scale)
        if blocked:
            amaxes = [torch.zeros(-(-p.numel() // BLOCK[kind_of(p)])) for p, _, _ in blocked]
            for (p, m, o), amax in zip(blocked, amaxes):
                if m is not None:
                    b = BLOCK[kind_of(p)]
                    whole = torch.zeros(p.numel())
                    whole[o:o + m.numel()] = m.float().view(-1).abs()
                    amax.copy_(torch.nn.functional.pad(whole, (0, amax.numel() * b - p.numel())).view(-1, b).amax(1))
            reductions += 1  # all_reduce(MAX) of every block's amax over the group
            for (p, m, o), amax in zip(blocked, amaxes):
                scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones(()))
                if kind_of(p) == "mxfp8":
                    scale = torch.exp2(torch.floor(torch.log2(scale)))
                p._quantizer.amax, p._scale_inv = amax, torch.reciprocal(scale)
                if m is not None:
                    per_element = scale.repeat_interleave(BLOCK[kind_of(p)])[o:o + m.numel()]
                    p._data[o:o + m.numel()] = _cast(m.view(-1) * per_element, 1.0)
        self.calls.append((entry, len(model_params), sum(m is not None for m in main_params), reductions))

    def fp8(self, *args, **kwargs):
        return self("fp8", *args, **kwargs)

    def nvfp4(self, *args, **kwargs):
        return self("nvfp4", *args, **kwargs)


@contextlib.contextmanager
def installed(opt_class):
    """Megatron-Core's names for quantized parameters, as its distrib_optimizer module holds them,
    pointed at the stand-ins while the block runs; yields the recorded Cast."""
    from megatron.core.optimizer import distrib_optimizer as mod

    cast = Cast()
    names = {"quantize_param_shard": cast.fp8, "quantize_nvfp4_param_shard": cast.nvfp4,
             "is_float8tensor": lambda t: kind_of(t) in FP8_KINDS, "is_nvfp4tensor": lambda t: kind_of(t) == "nvfp4"}
    with contextlib.ExitStack() as stack:
        for name, value in names.items():
            if hasattr(mod, name):
                stack.enter_context(mock.patch.object(mod, name, value))
        if hasattr(mod.DistributedOptimizer, "_is_distopt_quantized_param"):
            stack.enter_context(mock.patch.object(
                opt_class, "_is_distopt_quantized_param", classmethod(lambda cls, t: kind_of(t) in FP8_KINDS)))
        yield cast


def snapshot(opt) -> dict:
    """Every quantized parameter's bytes, scale_inv, amax and scale."""
    out = {}
    for i, p in enumerate(opt.model_float16_groups[0]):
        if kind_of(p) is not None:
            q = p._quantizer
            out.update({f"{i}.data": p._data.clone(), f"{i}.scale_inv": p._scale_inv.clone(),
                        f"{i}.amax": q.amax.clone(), f"{i}.scale": q.scale.clone()})
    return out
