"""Megatron-Core's Muon as Megatron-Bridge builds it: Bridge's real setup_optimizer over the real
DistributedDataParallel of a small bf16 model (fp16 or fp32 where asked), in this process or a spawned
rank (gloo), with the GPU played by the CPU (support/dp.py). Needs emerging-optimizers (the test locks of Python 3.12 have it).

The model is support/dp.py's: b, d and e are matrices (Muon's, through Float16OptimizerWithFloat16Params:
whole, each data-parallel rank its own under dist_muon's LayerWiseDistributedOptimizer), a and c vectors
(muon_scalar_optimizer's: Adam or Lion, in a Float16OptimizerWithFloat16Params of the layer-wise
optimizer, or a DistributedOptimizer where the distributed optimizer is on).

EVEN: for two data-parallel ranks under the layer-wise optimizer, which gathers the updated parameters
with one all_gather of each rank's own: NCCL takes uneven sizes there, gloo does not, so every rank
owns as many elements.
"""
from __future__ import annotations

import torch

from support import dp

def have_emerging_optimizers() -> bool:
    try:
        import emerging_optimizers  # noqa: F401
    except ImportError:
        return False
    return True


EVEN = {"a": (64,), "b": (8, 8), "c": (64,), "d": (8, 8), "e": (8, 8), "f": (8, 8)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Run(dp.Run):
    """One rank's model (DDP) and the optimizer Bridge's setup_optimizer builds for `name` (any name it takes)
    in `precision` (bf16, fp16, fp32); support/dp.py's gradients, saves and loads (torch_dist, as Bridge's
    save_checkpoint and load_checkpoint build them). `tp`: the matrices marked as sharded over the
    tensor-parallel group, and Muon's Newton-Schulz gathering them there (muon_tp_mode='duplicated')."""

    def __init__(self, name: str = "dist_muon", scalar: str = "adam", distributed: bool = False, seed: int = 0,
                 shapes=dp.SHAPES, model=None, tp: bool = False, precision: str = "bf16"):
        """`model(seed)`: (its TransformerConfig, the module) in place of support/dp.py's of `shapes` (in
        `precision`)."""
        from megatron.bridge.training.config import OptimizerConfig, SchedulerConfig
        from megatron.bridge.training.optim import setup_optimizer
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import layer_wise_optimizer

        config, module = model(seed) if model is not None else dp.model(seed, shapes, DTYPES[precision])
        if tp:  # the matrices sharded over the tensor-parallel group, as Megatron's linear layers mark them
            for p in module.parameters():
                if p.dim() == 2:
                    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        module.cuda()  # where Megatron makes its parameters (the CPU playing the GPU: support/dp.py's gpu_on_cpu)
        # Bridge's model setup tags them where Megatron-Core routes buffers by it (0.19)
        tag = getattr(layer_wise_optimizer, "tag_params_for_buffer_routing", None)
        if tag is not None:
            tag([module])
        # Bridge's Muon recipes (distributed_muon_with_cosine_annealing) leave the distributed optimizer off
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, overlap_grad_reduce=True,
                                                   overlap_param_gather=False, grad_reduce_in_fp32=True,
                                                   bucket_size=dp.BUCKET)
        self.model = DistributedDataParallel(config, ddp_config, module)
        self.config = OptimizerConfig(optimizer=name, lr=1e-2, min_lr=0.0, weight_decay=0.1, bf16=precision == "bf16",
                                      fp16=precision == "fp16", use_distributed_optimizer=distributed, clip_grad=1.0,
                                      muon_scalar_optimizer=scalar, **({"muon_tp_mode": "duplicated"} if tp else {}))
        self.config.finalize()  # as Bridge's config validation does
        scheduler = SchedulerConfig(lr_decay_style="constant", start_weight_decay=0.1, end_weight_decay=0.1,
                                    weight_decay_incr_style="constant")
        # what Bridge's config validation derives from the training's iterations
        for key, value in dict(lr_warmup_steps=0, lr_decay_steps=100, wd_incr_steps=100, wsd_decay_steps=0).items():
            if hasattr(scheduler, key):
                setattr(scheduler, key, value)
        self.optimizer, self.scheduler = setup_optimizer(self.config, scheduler, [self.model])
        self.generation = 0

    def chain(self):
        """Every optimizer of the chain: Megatron-Core's, or torch's it leaves unwrapped (the layer-wise
        optimizer in fp32)."""
        from bridge_fgo.instrument import decide

        return decide.inner_optimizers(self.optimizer)

    def parts(self):
        """Those the engine moves."""
        from bridge_fgo.instrument import decide

        return decide.distributed_optimizers(self.chain())

    def owned(self):
        """The names of the model's parameters whose masters this rank's parts hold (whole: Muon's)."""
        names = {p: n for n, p in self.model.module.named_parameters()}
        return sorted(names[p] for part in self.parts() for g in getattr(part, "float16_groups", ()) for p in g)

    def states(self):
        """Every master and inner tensor state of every optimizer of the chain, as (name, tensor) in its
        order; not torch AdamW's 0-dim step counters (on the host already: they never move)."""
        from bridge_fgo.engine.tensors import inner_params, masters

        out = []
        for pi, part in enumerate(self.chain()):
            out += [(f"part{pi}.master{i}", m) for i, m in enumerate(masters(part))]
            inner = getattr(part, "optimizer", part)  # (a torch optimizer the layer-wise one left unwrapped)
            for gi, p in inner_params(inner):
                for k, v in (inner.state.get(p) or {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        out.append((f"part{pi}.group{gi}.{tuple(p.shape)}.{k}", v))
        return out

    def snapshot(self):
        """The model's weights and every state, cloned."""
        out = {f"model.{n}": p.detach().clone() for n, p in self.model.module.named_parameters()}
        out.update({n: t.detach().clone() for n, t in self.states()})
        return out
