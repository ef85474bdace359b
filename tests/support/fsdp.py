"""Megatron-FSDP's optimizer layout on CPU, as megatron-core 0.19.2 builds it on a GPU (measured on two
H200s, docs/design.md#megatron-fsdp).

Real parts: megatron_fsdp's ParameterGroup and DataParallelBuffer (the flat buffers, their index and
get_item), its ParamAndGradBuffer.copy_main_weights_to_model_weights (the master -> model copy, called
unbound on the stand-in buffer object, which holds only what it reads), Megatron-Core's
DistributedOptimizer (its FSDP branches of step_with_ready_grads and _copy_main_params_to_model_params),
torch's DTensor over a one-rank gloo mesh, torch AdamW or the TE FusedAdam stand-in of support/fused_adam.py.
Stand-ins: the module (Megatron-FSDP's wrapper is CUDA-bound: its hooks gather and reduce on the GPU),
the gradient reduction (each step's gradients are made up, deterministic, and attached as
update_main_grads attaches them: fp32 DTensors of their own storage), the optimizer's constructor.

The optimizer's parameters are nn.Parameter(DTensor) whose local tensors are views of each group's
main-weight buffer; Megatron-FSDP's dist_main_weight holds other DTensors over the same storage.

make_optimizer_on_real_buffer: the same optimizer over Megatron-FSDP's own ParamAndGradBuffer, constructed on
CPU (real_buffer): its constructor makes the groups, the flat buffers, the DTensors and the optimizer
parameters; the one stand-in is Tensor.cuda during the constructor. One rank only (no parameter without
elements); megatron-core 0.17.1 to 0.19.2.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from support import harness

SHAPES = (((96, 64), (64,), (32, 64)), ((64, 96), (96,)))  # per Megatron-FSDP parameter group (an FSDP unit)
# a parameter with no elements on this rank (Megatron-FSDP shards each group's flat, not each parameter): its
# local tensor is an empty view of the flat, as on rank 1 of two for a parameter wholly in rank 0's shard
EMPTY_SHAPES = (((96, 64), (0, 64), (32, 64)), ((64, 96), (96,)))


def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _dtensor(local_tensor, shape, m):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local_tensor.view(shape), m, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


class Module:
    """Megatron-FSDP's module wrapper (MegatronFSDP) as a checkpoint reaches it: its own methods that swap the
    module's parameters between the raw ones and the optimizer's DTensors, run over a plain torch module that
    holds the raw parameters, with MegatronFSDP's state_dict pre-hook (megatron_fsdp.py)."""

    def __init__(self, pgb, origs_by_name):
        from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

        for name in ("_replace_param_with_distributed_if_needed", "_replace_param_with_raw_if_needed",
                     "_reestablish_shared_weights"):
            setattr(self, name, getattr(MegatronFSDP, name).__get__(self))
        self.module = torch.nn.Module()
        for name, p in origs_by_name.items():
            unit, leaf = name.split(".")
            if not hasattr(self.module, unit):
                self.module.add_module(unit, torch.nn.Module())
            getattr(self.module, unit).register_parameter(leaf, p)
        self.raw_param = dict(self.module.named_parameters())
        self.param_and_grad_buffer = pgb
        self.is_param_fsdp_distributed = False
        for m in self.module.modules():
            m.register_state_dict_pre_hook(lambda *a, **k: self._replace_param_with_distributed_if_needed())
        self._replace_param_with_distributed_if_needed()  # as MegatronFSDP.__init__ leaves it


class Chunk:
    """A model chunk as the optimizer and train_step reach it: its Megatron-FSDP buffer and module,
    zero_grad_buffer and start_param_sync (recorded)."""

    def __init__(self, pgb, events, module=None):
        self.param_and_grad_buffer = pgb
        self.module = module
        self.config = types.SimpleNamespace(num_moe_experts=None)
        self.events = events
        self.remove_forward_pre_hook_handles = {"hook": object()}

    def named_parameters(self):
        return self.module.module.named_parameters()

    def zero_grad_buffer(self):
        self.events.add("zero_grad_buffer")

    def start_param_sync(self, *unused, **kw):
        self.events.add("start_param_sync")


def _stand_in_optimizer(events, pgb, chunk, optimizer: str, strategy: str, groups: int, foreach, te_kw):
    """Megatron-Core's DistributedOptimizer under use_megatron_fsdp over `pgb`'s optimizer parameters, as its
    constructor leaves it (the real one returns early under Megatron-FSDP, after needing a GPU model)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class StandInFSDPOptimizer(DistributedOptimizer):
        def __init__(self):
            self.events = events

        def step_states(self):
            """Gradients attached as update_main_grads does (fp32 DTensors like each parameter), then
            Megatron-Core's real step_with_ready_grads: the inner step, _copy_main_params_to_model_params
            (Megatron-FSDP's copy), start_param_sync."""
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    n = p._local_tensor.numel()
                    if n == 0:  # update_main_grads: a parameter with no elements on this rank gets none
                        p.grad = None
                        continue
                    g = torch.sin(torch.arange(n, dtype=torch.float32) * 0.37 + self._gen)
                    p.grad = _like(p, g.to(torch.bfloat16).float())
            self._gen += 1
            return self.step_with_ready_grads()

    params = [p for _, p in pgb.optimizer_named_parameters]
    param_groups = [{"params": params[i::groups], "wd_mult": 1.0 / (i + 1)} for i in range(groups)]
    opt = StandInFSDPOptimizer()
    opt.optimizer = harness._inner_optimizer(optimizer, param_groups, foreach, False, te_kw)
    ns = types.SimpleNamespace
    opt.config = ns(timers=None, reuse_grad_buf_for_mxfp8_param_ag=False, barrier_with_L1_time=False,
                    use_precision_aware_optimizer=False, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    opt.ddp_config = ns(overlap_param_gather=True, use_megatron_fsdp=True, fp8_param_gather=False,
                        fp4_param_gather=False, data_parallel_sharding_strategy=strategy)
    opt.model_chunks = [chunk]
    opt.is_stub_optimizer = False
    opt.with_tensors = True
    opt._gen = 0
    return opt


def _like(p, local_values):
    """A DTensor of `local_values` with p's mesh, placements, shape and stride (a gradient as Megatron-FSDP
    attaches it)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_values.view(p._local_tensor.shape), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


def make_optimizer(events, seed: int = 0, optimizer: str = "torch", strategy: str = "optim_grads_params",
                   groups: int = 2, shapes=SHAPES, foreach=None, **te_kw):
    """A real DistributedOptimizer under use_megatron_fsdp with the layout above; returns it (its model chunk
    in `model_chunks`)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import \
        DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (
        DataParallelBuffer, ParamAndGradBuffer, ParameterGroup)

    m = mesh()
    gen = torch.Generator().manual_seed(seed)
    ddp = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    world = torch.distributed.group.WORLD
    pgroups, named, dist_main_weight, param_to_name = [], [], {}, {}
    for gi, group_shapes in enumerate(shapes):
        origs = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in group_shapes]
        for i, p in enumerate(origs):
            param_to_name[p] = f"unit{gi}.p{i}"

        def buf(dtype, distributed=False):
            b = DataParallelBuffer(ddp, origs, is_data_distributed=distributed, bucket_id=gi, dtype=dtype,
                                   device=torch.device("cpu"), data_parallel_group=world, dp_rank=0)
            b.init_data(torch.zeros(b.data_size, dtype=dtype))
            return b

        wbuf, mbuf, gbuf = buf(torch.bfloat16), buf(torch.float32), buf(torch.bfloat16)
        for item_id, p in enumerate(origs):
            wbuf.set_item(item_id, p.data)
            p.data = wbuf.get_item(item_id).view(p.shape)  # the model weights live in the buffer
            mbuf.set_item(item_id, p.data.float())
        pgroups.append(ParameterGroup(params=origs, dtype=torch.bfloat16, model_weight_buffer=wbuf,
                                      main_weight_buffer=mbuf, main_grad_buffer=gbuf))
        for item_id, orig in enumerate(origs):
            name = param_to_name[orig]
            dist = _dtensor(mbuf.get_item(item_id), tuple(orig.shape), m)
            dist_main_weight[name] = dist
            p = torch.nn.Parameter(dist)  # a new DTensor over the same local storage, as Megatron-FSDP makes it
            p.orig_param = orig
            named.append((name, p))
    class Buffer:  # what of a ParamAndGradBuffer the optimizer and its copy read; the copy is the real method
        copy_main_weights_to_model_weights = ParamAndGradBuffer.copy_main_weights_to_model_weights

    pgb = Buffer()
    pgb.parameter_groups, pgb.optimizer_named_parameters = pgroups, named
    pgb.dist_main_weight, pgb.param_to_name = dist_main_weight, param_to_name
    chunk = Chunk(pgb, events, Module(pgb, {name: orig for orig, name in param_to_name.items()}))
    opt = _stand_in_optimizer(events, pgb, chunk, optimizer, strategy, groups, foreach, te_kw)
    opt._mesh = m  # (a test makes it say it is on the GPU)
    return opt


def real_buffer(module, strategy: str = "optim_grads_params", outer: Optional[str] = None, on_host=None):
    """Megatron-FSDP's own ParamAndGradBuffer over `module`, constructed on CPU in a one-rank gloo world with a
    (dp_shard, tp) mesh of one each: its parameter groups, flat buffers, main-weight DTensors and optimizer
    parameters as its constructor makes them. The one stand-in is torch.Tensor.cuda, an identity during the
    call (validate_uneven_dtensor moves a shape check there). None where the constructor takes no
    mixed_precision_policy (megatron-core 0.16.1; 0.17.1 to 0.19.2 construct it here).

    `outer` (HSDP, in a gloo world of several ranks): a (dp_outer, dp_shard, tp) mesh with every rank on the
    outer dimension, and Megatron-FSDP's outer_dp_sharding_strategy `outer` ("optim": the masters sharded over
    every data-parallel rank through its helper buffers, as Megatron-Bridge's Nemotron recipes set it;
    "no_shard": replicated over the outer dimension), as Megatron-Core's adapter builds it for
    num_distributed_optimizer_instances > 1.

    `on_host` (a construction.Built): the constructor run through fsdp_construction.build_on_host, its main-weight
    buffers made in host memory (the tests stand in the CPU for the GPU there: fsdp_construction._moves)."""
    import inspect

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from megatron.core.distributed.fsdp.src import megatron_fsdp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import (BucketingPolicy,
                                                                                       ParamAndGradBuffer)

    if "mixed_precision_policy" not in inspect.signature(ParamAndGradBuffer).parameters:
        return None
    if outer is None:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
        index = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1, 1), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
        index = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                                                   tp_dim="tp", hybrid_fsdp_group=dist.group.WORLD,
                                                   hsdp_outer_dp_shard=outer != "no_shard")
        config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy,
                                                             outer_dp_sharding_strategy=outer)
    policy = BucketingPolicy(suggested_bucket_size=None, fsdp_unit_modules=[], data_parallel_sharding_strategy=strategy)
    real_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    args = (config, module)
    kwargs = dict(bucketing_policy=policy, dist_index=index, device=torch.device("cpu"),
                  mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32))
    try:
        if on_host is None:
            return ParamAndGradBuffer(*args, **kwargs)
        import sys

        from bridge_fgo.engine import fsdp_construction

        pgb = ParamAndGradBuffer.__new__(ParamAndGradBuffer)
        fsdp_construction.build_on_host(sys.modules[ParamAndGradBuffer.__module__], pgb.__init__, pgb, args, kwargs,
                                        on_host)
        return pgb
    finally:
        torch.Tensor.cuda = real_cuda


def make_optimizer_on_real_buffer(events, seed: int = 0, optimizer: str = "torch", groups: int = 2, foreach=None,
                                  strategy: str = "optim_grads_params", outer: Optional[str] = None, on_host=None,
                                  **te_kw):
    """make_optimizer's optimizer over Megatron-FSDP's real ParamAndGradBuffer (real_buffer) of a two-layer bf16
    module; None where real_buffer cannot make one."""
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)).bfloat16()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    pgb = real_buffer(module, strategy, outer, on_host)
    if pgb is None:
        return None
    chunk = Chunk(pgb, events, Module(pgb, {name: orig for orig, name in pgb.param_to_name.items()}))
    return _stand_in_optimizer(events, pgb, chunk, optimizer, strategy, groups, foreach, te_kw)


def snapshot(opt) -> dict:
    """Every value the step writes: masters, states (local tensors), model weights, step counts."""
    out = {}
    inner = opt.optimizer
    for gi, g in enumerate(inner.param_groups):
        out[f"group{gi}"] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
        for pi, p in enumerate(g["params"]):
            out[f"master{gi}.{pi}"] = p._local_tensor.detach().clone().cpu()
            for key, value in inner.state.get(p, {}).items():
                t = getattr(value, "_local_tensor", value)
                out[f"state{gi}.{pi}.{key}"] = t.detach().clone().cpu() if isinstance(t, torch.Tensor) else t
    for chunk in opt.model_chunks:
        for gi, g in enumerate(chunk.param_and_grad_buffer.parameter_groups):
            wbuf = g.model_weight_buffer  # each item's place in it (Megatron-FSDP's own buffer leaves padding unset)
            shard = wbuf.is_data_distributed  # (HSDP: sharded over every rank, its gathered bucket freed)
            out[f"weights{gi}"] = torch.cat([wbuf.get_item(i, only_shard=shard).flatten()
                                             for i in range(len(g.params))]).clone()
            for pi, p in enumerate(g.params):
                if p.untyped_storage().nbytes() < (p.storage_offset() + p.numel()) * p.element_size():
                    continue  # a view of a gathered bucket Megatron-FSDP has freed (its storage resized to 0)
                out[f"model{gi}.{pi}"] = p.detach().clone()
    return out


def checkpoint_state(opt, loading: bool = False) -> dict:
    """What Bridge's fsdp_dtensor save and load hand DCP (training/checkpointing.py, generate_state_dict and
    preprocess_fsdp_dtensor_state_dict): the module's state dict (Megatron-FSDP's pre-hook swaps the
    optimizer's DTensors in), Megatron-Core's real sharded_state_dict of the optimizer, each DTensor given its
    chunk metadata by megatron_fsdp's own preprocessing."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import \
        preprocess_state_dict_for_uneven_dtensor

    sd = {"model": opt.model_chunks[0].module.module.state_dict(),
          "optimizer": opt.sharded_state_dict({}, is_loading=loading,
                                              metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})}
    return preprocess_state_dict_for_uneven_dtensor(sd)
