"""Quantized parameters (FP8, FP4: cfg.ddp.fp8_param_gather, fp4_param_gather) under the streamed step.

Megatron-Core quantizes the updated masters into the parameters in one call after the inner step
(_copy_main_params_to_model_params -> quantize_param_shard / quantize_nvfp4_param_shard, Transformer
Engine's quantize_master_weights): over every quantized parameter of the optimizer, with one amax
reduction over the data-parallel group. Under tensorwise current scaling each scale comes from the
global amax of the updated masters, so no parameter can be cast before every master is updated; the
streamed step cannot keep them all on the GPU until then.

The cast never reads the fp32 master itself: Transformer Engine's first act is
`master.to(model_param.dtype)` (quantize_master_weights in 2.2+; Megatron-Core's own casts for TE 1.x and
2.0-2.1 do the same), and every amax, scale and cast is taken from that. So each quantized master is kept
in the model's dtype (2 bytes an element) once its pass has updated it, in the storage of its own
gradient (4 bytes an element, consumed by then), and Megatron-Core's own call runs once after the last
pass over these copies: the same call over the same parameters, the same collectives, the same bits.
Delayed, current, blockwise and MXFP8 scaling and NVFP4 go through that one call alike.
"""
from __future__ import annotations

import copy
from typing import Dict, List

from ..errors import BridgeFGOError

_FLAGS = ("fp8_param_gather", "fp4_param_gather")


def in_use(opt) -> bool:
    """Megatron-Core quantizes masters into parameters after this optimizer's step (not the
    precision-aware optimizer's own kernel, which writes FP8 parameters itself under delayed scaling)."""
    ddp, config = getattr(opt, "ddp_config", None), getattr(opt, "config", None)
    if getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return False
    return any(getattr(ddp, f, False) for f in _FLAGS)


def is_quantized(opt, model_param) -> bool:
    """What Megatron-Core's copy skips because its quantization call casts it, by Megatron-Core's own
    predicates (the names its distrib_optimizer module holds, looked up when called)."""
    import sys

    mod = sys.modules[type(opt)._copy_main_params_to_model_params.__module__]
    check = getattr(type(opt), "_is_distopt_quantized_param", None) or getattr(mod, "is_float8tensor", None)
    nvfp4 = getattr(mod, "is_nvfp4tensor", None)
    return bool((check is not None and check(model_param)) or (nvfp4 is not None and nvfp4(model_param)))


def without_quantization(opt) -> dict:
    """Instance attributes under which Megatron-Core's copy of a subset's masters runs no quantization call
    over every quantized parameter: the quantization flags off (0.17 and later test them), and the list of
    FP8 parameters it gathers from its buffers empty (0.16 calls quantize_param_shard unconditionally, which
    returns at once for no parameters)."""
    ddp = copy.copy(opt.ddp_config)
    for f in _FLAGS:
        if hasattr(ddp, f):
            setattr(ddp, f, False)
    out = {"ddp_config": ddp}
    if hasattr(type(opt), "_get_fp8_params_and_shard_fp32_from_fp8"):
        out["_get_fp8_params_and_shard_fp32_from_fp8"] = lambda: ([], [], [])
    return out


class Kept:
    """One step's updated quantized masters, in the model's dtype, by id(master)."""

    def __init__(self):
        self.copies: Dict[int, object] = {}

    def keep(self, master, model_param) -> None:
        """After the pass that updated `master` (on the GPU, in a window slot or resident)."""
        import torch

        n = master.numel()
        grad = getattr(master, "grad", None)
        if (grad is not None and grad.device == master.device and grad.is_contiguous()
                and grad.numel() * grad.element_size() >= n * model_param.dtype.itemsize):
            # the gradient is read by no one after the inner step that consumed it (the next
            # iteration zeroes or replaces it); its bytes hold the copy
            out = grad.view(-1).view(torch.uint8)[:n * model_param.dtype.itemsize].view(model_param.dtype)
        else:
            out = torch.empty(n, dtype=model_param.dtype, device=master.device)
        out.copy_(master.view(-1))  # the rounding quantize_master_weights does first (round to nearest even)
        self.copies[id(master)] = out

    def groups(self, opt) -> tuple:
        """(masters, model params) per group for Megatron-Core's call: every quantized master of the
        optimizer as its kept copy, the model params beside them."""
        mains: List[list] = [[] for _ in opt.model_float16_groups]
        models: List[list] = [[] for _ in opt.model_float16_groups]
        for gi, (group_mains, group_models) in enumerate(zip(opt.shard_fp32_from_float16_groups,
                                                            opt.model_float16_groups)):
            for master, model_param in zip(group_mains, group_models):
                if master is None or not is_quantized(opt, model_param):
                    continue
                kept = self.copies.get(id(master))
                if kept is None:
                    raise BridgeFGOError("internal: a quantized parameter's master was not updated by any pass of "
                                         "the streamed step")
                mains[gi].append(kept.view(master.shape))
                models[gi].append(model_param)
        return mains, models

    def clear(self) -> None:
        self.copies = {}
