"""A model of real Megatron-Core attention layers on CPU, for clip_qk and the parameter norm.

Megatron-Core's clip_qk(model) reads `model_chunk.module.module.decoder.layers[i].self_attention`, and
Bridge's calc_params_l2_norm(model, ...) every parameter of every chunk. The chunk here has exactly that
path, with plain modules standing in for DDP, Float16Module, GPTModel and TransformerLayer (they need a
GPU or more than these tests use), over real SelfAttention modules of Megatron-Core's local spec with
bf16 parameters. Transformer Engine's attention sets `core_attention.current_max_attn_logits` during
forward (TE >= 2.9); `logits()` sets it instead, as the harness's forward_backward_func calls it.

Megatron-Core's process groups are needed (SelfAttention's construction, clip_qk's all-reduce, the
norm's): harness.model_parallel().
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from support import harness

HIDDEN, HEADS, GROUPS = 256, 4, 2  # qkv 512 x 256: a master of 0.5 MB, with Adam's moments 1.5 MB a bundle
THRESHOLD = 10.0


def flat_master_attention():
    """Megatron-Core's SelfAttention, whose clip_qk also writes a master that is the whole weight flattened
    (the distributed optimizer's shard on a rank holding all of it). No released Megatron-Core does: its
    _clip_linear_qkv returns the weight's 2-D shape, which copy_ cannot write into the flat master
    (bridge_fgo/engine/streamed/qkclip.py); this is the one change, so that the clip's effect on the
    masters can be compared with and without offload."""
    from megatron.core.transformer.attention import SelfAttention

    class FlatMasterSelfAttention(SelfAttention):
        def _clip_linear_qkv(self, weight):
            if weight.dim() == 1:
                return super()._clip_linear_qkv(weight.view(self.linear_qkv.weight.shape)).view(-1)
            return super()._clip_linear_qkv(weight)

    return FlatMasterSelfAttention


class _Holder(torch.nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class Chunk(torch.nn.Module):
    """One model chunk as train_step and clip_qk see it (harness.ModelChunk's calls, and the module path)."""

    def __init__(self, config, events, layers):
        super().__init__()
        self.config, self.events = config, events
        self.remove_forward_pre_hook_handles = {"hook": object()}
        decoder = _Holder(layers=torch.nn.ModuleList(_Holder(self_attention=a) for a in layers))
        self.module = _Holder(module=_Holder(decoder=decoder))

    zero_grad_buffer = harness.ModelChunk.zero_grad_buffer

    def attentions(self):
        return [layer.self_attention for layer in self.module.module.decoder.layers]


def attentions(layers: int = 2, attention=None, seed: int = 0):
    """(their TransformerConfig, `layers` attentions: Megatron-Core's SelfAttention, or `attention`), their
    parameters drawn from `seed`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, qk_clip=True, qk_clip_threshold=THRESHOLD,
                               qk_clip_alpha=0.5, use_cpu_initialization=True, bf16=True,
                               params_dtype=torch.bfloat16)
    spec = get_gpt_layer_local_spec().submodules.self_attention
    if attention is not None:
        spec = dataclasses.replace(spec, module=attention)
    built = [build_module(spec, config=config, layer_number=i + 1) for i in range(layers)]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in built:
            attn.core_attention.current_max_attn_logits = None  # as TE's attention starts (qk_clip set)
            for p in attn.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return config, built


def model(layers: int = 2, attention=None, seed: int = 0):
    """A harness.Rig `model` factory: a Chunk of attentions(layers, attention, seed)."""
    def make(model_config, events):
        return Chunk(model_config, events, attentions(layers, attention, seed)[1])

    return make


def megatron_module(seed: int = 0, layers: int = 2):
    """(its TransformerConfig, a MegatronModule of attentions(layers) for Megatron-Core's
    DistributedDataParallel, on the path clip_qk reads below the DDP: `.module.decoder.layers`)."""
    from megatron.core.transformer.module import MegatronModule

    config, built = attentions(layers, seed=seed)

    class Model(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            self.module = _Holder(decoder=_Holder(layers=torch.nn.ModuleList(_Holder(self_attention=a)
                                                                             for a in built)))

    return config, Model()


def logits(pattern):
    """A harness forward: every forward-backward folds `pattern(n, layer)` (a list of HEADS floats, or None:
    nothing) into each layer's per-head max logits, as TE's attention does, n counting the calls."""
    steps = itertools.count()

    def forward(model):
        step = next(steps)
        for chunk in model:
            for i, attn in enumerate(chunk.attentions()):
                values = pattern(step, i)
                if values is None:
                    continue
                now, seen = torch.tensor(values, dtype=torch.float32), attn.core_attention.current_max_attn_logits
                attn.core_attention.current_max_attn_logits = now if seen is None else torch.maximum(seen, now)

    return forward
