"""Megatron-Core's data-parallel stack in CPU processes joined by gloo: the real
DistributedDataParallel over a small bf16 model, the real DistributedOptimizer that
get_megatron_optimizer builds over it (each rank its shard of every bucket, parameters split between
ranks), its real update (ChainedOptimizer.step) and torch_dist checkpoints, built as Bridge's save and
load build them and written and read by Megatron-Core's dist_checkpointing.

Stand-ins, only for what needs a GPU:
- `gpu_on_cpu()`: the GPU played by the CPU. What Megatron-Core creates on the GPU (`device='cuda'`,
  a device index, `torch.cuda.current_device()`, `.cuda()`) is created on the CPU and marked, and so
  is what any op makes from a marked tensor (`empty_like`, a cast, arithmetic), as it would be on the
  GPU; `Tensor.type()` names the CUDA type (Megatron-Core checks parameters by it), and
  `torch.cuda.synchronize()` does nothing. The bytes marked in a phase are what it put on the GPU.
- the inner optimizer: torch AdamW, as Megatron-Core builds it without Transformer Engine or apex, or
  the stand-ins of their FusedAdam (support/fused_adam.py) in its place, with Megatron-Core's module
  flags as they are when TE or apex is installed (`megatron_core_with`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")

# bf16 parameters, as Megatron's models have them, in buckets of at least BUCKET elements. Megatron-Core
# lays them out in reverse order, each start padded to 64 elements: e [0, 150), d [192, 256) | c [256, 406),
# b [448, 512) | a [512, 632), the last bucket padded to 640 (a multiple of 128). So each of two ranks owns
# part of every bucket (Megatron-Core's dp_reshardable asserts that), e, c and a are split between the
# ranks, one rank or two lay out the same buffer (the data-parallel reshard), and the 1-D parameters
# form the second param group (no weight decay). Only the last bucket is padded at its end: Megatron-Core's
# fully_reshardable save misplaces every bucket after a padded one ("param range exceeds unpadded
# buffer ... data corruption", its issue #504), with or without offload.
SHAPES = {"a": (120,), "b": (4, 16), "c": (150,), "d": (4, 16), "e": (10, 15)}
BUCKET = 200

# Each inner optimizer Megatron-Core builds, as OptimizerConfig fields set on top of the run's. The
# precision-aware optimizer (bf16 moments) twice: as Bridge's bf16_mixed configures it (an fp8 recipe is
# set, so Megatron-Core keeps the fp32 masters and steps them with TE), and with TE holding the masters
# (no fp8 recipe: TE steps the bf16 parameter shards themselves).
PRECISION_AWARE = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
                       exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=False)
CASES = {
    "torch": {},
    "apex": {},
    "te": {},
    "te-precision-aware": dict(PRECISION_AWARE, fp8_recipe="tensorwise",
                               use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
    "te-precision-aware-te-masters": dict(PRECISION_AWARE, use_precision_aware_optimizer_no_fp8_or_ds_fp8=True),
}
# What Bridge writes (dp_reshardable, the default; fully_reshardable with dist_ckpt_optim_fully_reshardable)
# and what older checkpoints carry (Bridge's load reads the format from the checkpoint's metadata).
FORMATS = ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter", "fully_sharded_model_space")

CUDA_TYPE = {torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float16: "torch.cuda.HalfTensor",
             torch.float32: "torch.cuda.FloatTensor"}


def _names_gpu(device) -> bool:
    if device is None or isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a device index, as torch.cuda.current_device() gives
    return torch.device(device).type == "cuda"


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


def _storage(t):
    return t.untyped_storage()._cdata


# Ops whose result is on the host whatever their input: copies out of the GPU
TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item}


class GpuOnCpu(TorchFunctionMode):
    """The GPU, played by the CPU: what Megatron-Core (or an optimizer) makes on the GPU is made on the
    CPU and marked as on the GPU, and so is what any op makes from a marked tensor without naming
    another device (a `*_like`, a copy, arithmetic), as on a GPU. `bytes` counts what was made there.
    Marks go with the storage and are dropped when the tensor that made it goes. Not seen: a device
    taken from a tensor on the GPU (`x.to(device=param.device)`) reads as the host here."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = []
        self._gpu = set()  # storages on the "GPU"

    def take(self):
        """(bytes, calls) made on the GPU since the last take."""
        out = (self.bytes, self.calls)
        self.bytes, self.calls = 0, []
        return out

    def on_gpu(self, t) -> bool:
        return _storage(t) in self._gpu

    def _mark(self, what, t, inputs=()):
        key = _storage(t)
        if key in self._gpu or key in {_storage(i) for i in inputs}:
            return  # a view, or an op in place
        self._gpu.add(key)
        weakref.finalize(t, self._gpu.discard, key)
        self.bytes += t.untyped_storage().nbytes()
        self.calls.append((what, tuple(t.shape), str(t.dtype)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return CUDA_TYPE.get(args[0].dtype) or func(*args)
        if func is torch.Tensor.cuda:
            if self.on_gpu(args[0]):
                return args[0]
            out = args[0].clone()
            self._mark("cuda()", out)
            return out
        named = [kwargs.get("device")]
        if func is torch.Tensor.to:  # x.to(device), x.to(device, dtype)
            named += [a for a in args[1:] if isinstance(a, (str, int, torch.device)) and not isinstance(a, bool)]
        if any(_names_gpu(d) for d in named):
            args = tuple("cpu" if i and func is torch.Tensor.to and not isinstance(a, (bool, torch.Tensor, torch.dtype))
                         and isinstance(a, (str, int, torch.device)) and _names_gpu(a) else a
                         for i, a in enumerate(args))
            out = func(*args, **dict(kwargs, device="cpu") if "device" in kwargs else kwargs)
            for t in _tensors(out):
                self._mark(name, t, _tensors(args))
            return out
        out = func(*args, **kwargs)
        outs = _tensors(out)
        if not outs:
            return out  # (most calls: shapes, pointers, in-place ops returning nothing new)
        if func in TO_HOST or any(d is not None for d in named):
            # another device named: the host. A copy out of the GPU is a copy here too
            if isinstance(out, torch.Tensor) and self.on_gpu(out):
                out = out.clone()
                self._gpu.discard(_storage(out))
            return out
        inputs = _tensors(args) + _tensors(kwargs)
        if any(self.on_gpu(t) for t in inputs):
            for t in outs:
                self._mark(name, t, inputs)
        return out


@contextlib.contextmanager
def gpu_on_cpu():
    with mock.patch.object(torch.cuda, "current_device", lambda: 0), \
            mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None), GpuOnCpu() as mode:
        yield mode


@contextlib.contextmanager
def megatron_core_with(kind: str):
    """Megatron-Core as it is with this inner optimizer installed: its Adam class and module flags
    (TE or apex), or torch AdamW with scripts/resume_fix.py (Megatron-Core's own torch-AdamW resume
    fails without it, with or without offload)."""
    from megatron.core import optimizer as optimizer_module
    from megatron.core.optimizer import distrib_optimizer

    from support import fused_adam

    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import resume_fix

    with contextlib.ExitStack() as stack:
        if kind == "torch":
            resume_fix.install()
            stack.callback(resume_fix.uninstall)
        else:
            kind = kind.split("-")[0]
            cls = fused_adam.TEFusedAdam if kind == "te" else fused_adam.ApexFusedAdam
            # megatron-core 0.18 and older check the inner optimizer against distrib_optimizer's own Adam
            for module, name, value in ((optimizer_module, "Adam", cls), (distrib_optimizer, "Adam", cls),
                                        (optimizer_module, "USING_PYTORCH_OPTIMIZER", False),
                                        (distrib_optimizer, "HAVE_APEX_OR_TE", True),
                                        (distrib_optimizer, "USING_TE_OPTIMIZER", kind == "te"),
                                        (distrib_optimizer, "USING_APEX_OPTIMIZER", kind == "apex")):
                stack.enter_context(mock.patch.object(module, name, value, create=True))
            if kind == "te":  # the stand-in is TE 2.x's FusedAdam; megatron-core 0.16 asks TE's version
                stack.enter_context(mock.patch.object(optimizer_module, "is_te_min_version",
                                                      lambda *a, **k: True, create=True))
        yield


def initialize(tp: int = 1):
    """Megatron-Core's process groups over the default (gloo) group: `tp` tensor-parallel ranks, data
    parallelism the rest of the world."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def destroy():
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def model(seed: int = 0, shapes=SHAPES, dtype=torch.bfloat16):
    """(its TransformerConfig, a MegatronModule of parameters `shapes` in `dtype`, seeded)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=dtype == torch.bfloat16,
                               fp16=dtype == torch.float16, params_dtype=dtype)

    class Model(MegatronModule):
        def __init__(self):
            super().__init__(config=config)
            g = torch.Generator().manual_seed(seed)
            for name, shape in shapes.items():
                self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)))

    return config, Model()


class Run:
    """One rank's model (DDP) and optimizer (a ChainedOptimizer of one DistributedOptimizer)."""

    def __init__(self, case: str, seed: int = 0):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config, module = model(seed)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                   overlap_param_gather=False, grad_reduce_in_fp32=True,
                                                   bucket_size=BUCKET)
        self.model = DistributedDataParallel(config, ddp_config, module)
        opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                                     bf16=True, use_distributed_optimizer=True, clip_grad=1.0)
        # set after construction (as OptimizerConfig.__post_init__ derives them): it checks TE's FusedAdam
        # signature, and TE is absent here
        for key, value in CASES[case].items():
            setattr(opt_config, key, value)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        (self.dist,) = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        self.generation = 0

    # -- the update ----------------------------------------------------------------------------------
    def grads(self) -> None:
        """Reduced gradients as backward and the reduce-scatter leave them in the grad buffer: made up,
        deterministic, the same for every data-parallel size."""
        for i, (_, p) in enumerate(self.model.module.named_parameters()):
            index = torch.arange(p.numel(), dtype=torch.float32).view(p.shape)
            p.main_grad.copy_(torch.sin(index * 0.37 + self.generation + 3 * i))
        self.generation += 1

    def step(self, engine=None, wait: bool = True) -> None:
        """One optimizer step, with the engine's call sites where the patched train_step has them:
        offload and release before forward-backward, reload at gradient finalization, settle after.
        The step is Megatron-Core's ChainedOptimizer.step (grad norm over the data-parallel group,
        clipping, the inner step, the master-to-model copy, the parameters' all-gather). `wait`: for the
        last device-to-host copies, as a direct reader does (train_step returns without)."""
        if engine is not None:
            engine.offload()
            engine.release()
        self.grads()
        if engine is not None:
            engine.reload()
        try:
            self.optimizer.step()
        finally:
            if engine is not None:
                engine.settle()
                if wait:
                    engine.synchronize()

    # -- what a reader sees ---------------------------------------------------------------------------
    def names(self):
        return {p: name for name, p in self.model.module.named_parameters()}

    def model_space(self):
        """Every state of this rank in model space, as Megatron-Core's checkpoint readers take it
        (_get_main_param_and_optimizer_states: the master and each state, unscaled): {name: {key:
        (start, end, values)}} over the rank's range of each parameter, and the group-level step."""
        out = {}
        names = self.names()
        for param, (gbuf, dtype, bucket) in self.dist.model_param_gbuf_map.items():
            rng = self.dist.gbuf_ranges[gbuf][dtype][bucket]["param_map"][param]["param"]
            tensors = self.dist._get_main_param_and_optimizer_states(param)
            out[names[param]] = {k: (rng.start, rng.end, v.detach().float().view(-1).clone() if v.dim() else v.clone())
                                 for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        from bridge_fgo.engine import contracts

        inner = self.dist.optimizer
        steps = {g["step"] for g in inner.param_groups if "step" in g and g["params"]}
        out["group step"] = sorted(float(s) for s in steps) if contracts.of(inner).group_step else []
        return out

    # -- checkpoints, as Bridge's save_checkpoint and load_checkpoint make them --------------------------
    def state_dict(self, fmt: str, is_loading: bool):
        """The torch_dist state dict of the model and the optimizer as Bridge's generate_state_dict
        builds it, with the metadata of Bridge's _build_sharded_state_dict_metadata (the sharding type as
        Bridge chooses it, or as an older checkpoint records it). (Bridge itself is not imported here: it
        would add its import time to every process.)"""
        from megatron.core import parallel_state

        metadata = {"distrib_optim_sharding_type": fmt, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True,
                    "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        if fmt == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False  # Bridge 0.6.2 allows no other
        state = {"checkpoint_version": 3.0, "iteration": 1,
                 "model": self.model.module.sharded_state_dict(metadata=metadata)}
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
        return state

    def save(self, directory: str, fmt: str, gpu=None, write: bool = True):
        """Bridge's synchronous torch_dist save, each data-parallel rank writing its part
        (fully_parallel_save, Bridge's default); `write=False`: the state dict only. Returns (bytes,
        calls) the optimizer's sharded_state_dict put on the GPU (with `gpu`, the GpuOnCpu in force;
        torch_dist's own writer is not counted: on the CPU it copies views it would not copy on a GPU)."""
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        strategy = FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy("torch_dist", 1),
            parallel_state.get_data_parallel_group(with_context_parallel=True))
        os.makedirs(directory, exist_ok=True)
        torch.distributed.barrier()
        if gpu is not None:
            gpu.take()
        state = self.state_dict(fmt, is_loading=False)
        made = gpu.take() if gpu is not None else None
        if write:
            dist_checkpointing.save(state, directory, strategy)
        return made

    def load(self, directory: str, fmt: str, engine=None, gpu=None, seen=None):
        """Bridge's load: the state dict built for loading (in it, Megatron-Core's round trip through
        load_state_dict), torch_dist filling it, the model's weights, then the optimizer's
        load_state_dict. With `engine`, prepared before (as the patched load_checkpoint does) and told
        after. `seen(state_dict)`: what torch_dist is about to fill. Returns what each phase put on
        the GPU, in bytes (with `gpu`, the GpuOnCpu in force), and under "straight" (with `engine`) the
        items torch_dist read straight into the pinned buffer and those of it read as torch reads them."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

        from bridge_fgo.instrument import reads

        phases = {}

        def phase(name):
            if gpu is not None:
                phases[name], phases[name + " calls"] = gpu.take()

        if engine is not None:
            engine.prepare()
        phase("before")
        loading = self.state_dict(fmt, is_loading=True)
        phase("sharded_state_dict")
        if seen is not None:
            seen(loading)
        # what the patched load_checkpoint reads straight into the pinned buffer (instrument/reads.py)
        with (reads.straight_into([engine.buffer]) if engine is not None else contextlib.nullcontext()) as straight:
            state = dist_checkpointing.load(loading, directory, TorchDistLoadShardedStrategy())
        phase("torch_dist")
        phases["straight"] = (straight.tensors, straight.as_torch) if straight is not None else None
        self.model.module.load_state_dict(state["model"])  # Bridge unwraps the model (DDP) for both
        self.optimizer.load_state_dict(state["optimizer"])
        phase("load_state_dict")
        if engine is not None:
            engine.after_load()
        return phases
