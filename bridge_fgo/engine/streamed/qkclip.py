"""qk_clip (cfg.model.qk_clip) served by the streamed step.

Bridge's train_step calls Megatron-Core's clip_qk(model) right after optimizer.step(): it all-reduces
each attention layer's max logits (MAX over data and context parallel), keeps the largest for logging,
and calls each layer's clip_qk(), which rescales the query/key rows of the layer's weight and of its
fp32 master (`weight.main_param`). After a streamed update the masters are on the host again (their
last copies possibly in flight), or, for a skipped step, bound to storage-less GPU tensors. So:

- at gradient finalization, which every rank reaches in the same order (defer), Megatron-Core's own
  clip_qk(model) runs with each attention's clip_qk() shadowed by a recorder: the all-reduces and the
  logged max are Megatron-Core's, and the logits stay in place (a MAX all-reduce again changes nothing);
- in the update's pass over a chunk (in_pass), right after Megatron-Core's master -> model copy and
  before the chunk's device-to-host copy, each recorded layer whose masters are all in that chunk gets
  its real clip_qk() over its masters only: each clipped weight stands in as its master (the module's
  parameter entry, for that call), so Megatron-Core's own code scales the master in the window once;
- Bridge's clip_qk(model) (finish) then, in Megatron-Core's order, clips the model weights of those
  layers, each standing in as itself without its master, where Megatron-Core clips them: after the whole
  step, so after a parameter all-gather inside it (dist_muon's layer-wise optimizer gives each rank the
  matrices other ranks updated, unclipped, as without offload); and clips the other recorded layers
  whole (masters kept on the GPU by a budget, spread over chunks, absent; every layer of a skipped
  step), each one's streamed masters brought to the GPU and back on the engine's copy streams. It
  returns the max.

A layer's masters: those of the weights of the submodules its clip_qk names (SelfAttention: linear_qkv;
MLA: its query and key/value up-projections), read from the installed code; where it names none, every
parameter of the layer, clipped whole after the step.

Where Megatron-Core cannot clip, the same error: released Megatron-Core (0.16 to 0.19) views the master
as the whole weight (_clip_linear_qkv) and copies the 2-D result into it, but the distributed
optimizer's master is a flat shard, so as soon as a head's max logit exceeds qk_clip_threshold it raises
(RuntimeError, part of the master already scaled), with or without offload; a rank without a shard of
the weight (or the precision-aware optimizer) has main_param None (AttributeError). An error in a pass
ends the clipping, as Megatron-Core's loop ends, the update completes, and the exception is raised
where Bridge calls clip_qk. The passes follow the chunks, not clip_qk's layer order: which layer raises
first (and which were scaled before it) may differ from the run without offload, which fails as well.
An error of Megatron-Core's clip_qk at finalization waits there too.
"""
from __future__ import annotations

import functools
import logging
from typing import Dict, List, Optional

from ...codenames import code_names
from ...log import once, rank_prefix
from .. import subset
from ..tensors import MASTER
from .norms import Norms
from .plan import Plan
from .transfers import Transfers


def clip_children(attn) -> list:
    """The submodules whose weight attn.clip_qk() rewrites (with its master): those its code names, with a
    registered `weight` parameter (what clip_as stands in for)."""
    names = code_names(type(attn).clip_qk)
    return [c for name, c in attn.named_children() if name in names and c._parameters.get("weight") is not None]


def clip_as(attn, children, stand_in, keep_logits: bool) -> None:
    """attn.clip_qk() reading each child's weight as stand_in(weight) (its master, or itself without its
    master), so Megatron-Core's own clip scales that tensor alone. keep_logits: the max logits it resets
    are put back, for the clip of the weights after the step."""
    logits = attn.core_attention.current_max_attn_logits
    held = [c._parameters["weight"] for c in children]
    try:
        for c, w in zip(children, held):
            c._parameters["weight"] = stand_in(w)
        attn.clip_qk()
    finally:
        for c, w in zip(children, held):
            c._parameters["weight"] = w
        if keep_logits:
            attn.core_attention.current_max_attn_logits = logits


class QKClip:
    def __init__(self, plan: Plan, transfers: Transfers, norms: Norms):
        self.plan, self.transfers, self.norms = plan, transfers, norms
        self.reset()

    def reset(self) -> None:
        self.model: Optional[List[int]] = None  # ids of the model chunks clip_qk was deferred for
        self.layers: List[object] = []  # recorded attentions, in Megatron-Core's order
        self.children: Dict[int, list] = {}  # id(attention) -> clip_children(attention)
        self.masters: Dict[int, list] = {}  # id(attention) -> its masters that clip_qk rewrites
        self.by_chunk: Dict[int, list] = {}  # chunk index -> the attentions clipped in its pass
        self.done: set = set()  # id(attention) of those whose masters a pass clipped (or gave up on)
        self.max_logit = None
        self.error: Optional[Exception] = None

    def defer(self, model, clip_qk) -> None:
        """Gradient finalization: Megatron-Core's clip_qk(model), every attention's clip_qk() recorded."""
        self.reset()
        recorded: list = []
        shadows = subset.Shadows()
        try:
            for chunk in model:
                for m in chunk.modules() if callable(getattr(chunk, "modules", None)) else ():
                    if callable(getattr(type(m), "clip_qk", None)):
                        shadows.set(m, "clip_qk", functools.partial(recorded.append, m))
            try:
                self.max_logit = clip_qk(model)
            except Exception as exc:  # Megatron-Core raises it after the step, where Bridge calls clip_qk
                self.error = exc
        finally:
            shadows.restore()
        self.model, self.layers = [id(c) for c in model], recorded
        chunk_of = {id(e.param): c.index for c in self.plan.chunks for bd in c.bundles for e in bd.entries
                    if e.kind == MASTER and not e.dropped}
        for attn in recorded:
            children = self.children[id(attn)] = clip_children(attn)
            weights = [c.weight for c in children] or list(attn.parameters())
            masters = [getattr(w, "main_param", None) for w in weights]
            self.masters[id(attn)] = masters
            chunks = {chunk_of.get(id(m)) if m is not None else None for m in masters}
            if children and len(chunks) == 1 and None not in chunks:
                self.by_chunk.setdefault(chunks.pop(), []).append(attn)

    def in_pass(self, index: int) -> None:
        """The pass over chunk `index`: its master -> model copy done, its copy to the host not begun."""
        for attn in self.by_chunk.pop(index, ()):
            if self.error is None:
                try:
                    clip_as(attn, self.children[id(attn)], lambda w: w.main_param, keep_logits=True)
                except Exception as exc:  # raised where Bridge calls clip_qk, the update completed
                    self.error = exc
            self.done.add(id(attn))

    def finish(self, model) -> Optional[float]:
        """Bridge's clip_qk(model) after the step: the weights of the layers whose masters a pass clipped,
        the other recorded layers whole, then the max logit (or the error a clip raised); None when nothing
        was deferred for this model."""
        if self.model is None or self.model != [id(c) for c in model]:
            return None
        try:
            for attn in self.layers:
                if self.error is not None:
                    break
                if id(attn) in self.done:  # its masters clipped in a pass: its weights alone now
                    clip_as(attn, self.children[id(attn)], lambda w: w.detach(), keep_logits=False)
                else:
                    self._clip_outside(attn)
            if self.error is not None:
                raise self.error
            return self.max_logit
        finally:
            self.reset()

    def _clip_outside(self, attn) -> None:
        streamed = self.plan.streamed_masters()
        entries = [streamed[id(m)] for m in self.masters[id(attn)] if m is not None and id(m) in streamed]
        if not entries:  # nothing of it moves: its masters are on the GPU, or it has none
            attn.clip_qk()
            return
        once(("qk-outside",), logging.INFO, "%sqk_clip: a layer's masters (%d bytes) were brought to the GPU and back to "
             "clip it after the update (a skipped step, or masters not in one chunk of it); said once",
             rank_prefix(), sum(e.nbytes for e in entries))
        try:
            with self.transfers.on_device(entries, write_back=True) as views:
                attn.clip_qk()
                self.norms.take(views)
        except BaseException:
            self.norms.forget(entries)
            raise
