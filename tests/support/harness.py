"""Run Megatron-Bridge's real train_step with CPU stand-ins, as Bridge's own unit tests do.

Stand-ins replace only what needs a GPU or a cluster: the model chunk, the optimizer's step, the
forward-backward schedule (it calls finalize_model_grads_func exactly as Megatron-Core's schedules
do), and the rerun state machine / microbatch calculator. The DistributedOptimizer is a real
subclass instance of Megatron-Core's class (its constructor, which needs a GPU model, is skipped),
and the param-buffer copy goes through Bridge's real _handle_mxfp8_param_buffer_copy.

Every stand-in appends what it does to `events`, so the call order can be read back.

Releases differ in what train_step takes and calls; the rig reads that from the real function, never
from a version string: its arguments are built from `inspect.signature(train_step)` (0.3.x has no
`p2p_communicator`), and the single-rank stand-ins below replace only the module-level collectives
its code names (0.3.x builds its own P2PCommunicator and calls the model-parallel reductions
unconditionally; later releases guard them with cfg.train flags this rig turns off).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Callable, List, Optional
from unittest import mock

TRAIN_MODULE = "megatron.bridge.training.train"
# One process: no groups. The attributes exist because some releases read them unconditionally.
PG_COLLECTION = types.SimpleNamespace(name="pg_collection", pp=None, mp=None, dp_cp=None)

# Collectives (and the P2P communicator) as one rank sees them; applied only where the real
# train_step's code names them (inspect.unwrap(train_step).__code__.co_names).
SINGLE_RANK = {
    "logical_and_across_model_parallel_group": lambda value, mp_group=None: value,
    "reduce_max_stat_across_model_parallel_group": lambda stat, mp_group=None: stat,
    "is_pp_last_stage": lambda pp_group=None: False,  # skips the loss all-reduce, as the p2p stand-in does
    "P2PCommunicator": lambda pp_group=None, config=None: types.SimpleNamespace(is_pp_last_stage=False),
}


class Recorder(list):
    def add(self, event: str) -> None:
        self.append(event)


class ModelChunk:
    def __init__(self, config, events: Recorder):
        self.config = config
        self.events = events
        # a registered forward pre-hook: Bridge's copy helper then does the param-buffer copy
        self.remove_forward_pre_hook_handles = {"hook": object()}

    def zero_grad_buffer(self):
        self.events.add("zero_grad_buffer")


OPTIMIZERS = ("torch", "te", "apex")  # what Megatron-Core builds: torch AdamW, TE's or apex's FusedAdam


def make_distributed_optimizer(events: Recorder, with_tensors: bool = False, seed: int = 0,
                               shapes=((8, 8), (4, 8)), foreach=None, device="cpu", optimizer: str = "torch",
                               precision_aware: bool = False, groups: int = 1, model_params=None,
                               quantized: Optional[str] = None, **te_kw):
    """A real megatron.core DistributedOptimizer instance without its GPU-bound constructor.

    with_tensors: give it what the engines read, laid out as Megatron-Core does: bf16 model params
    (`shapes`) as views of one param buffer, fp32 master shards that own their storage, an fp32 model
    param whose shard aliases it, the inner optimizer over the shards, and the range maps
    Megatron-Core's own step_with_ready_grads / _copy_main_params_to_model_params read.
    optimizer: "torch" (a real torch AdamW, `foreach` passed through), "te" or "apex" (the stand-ins of
    support/fused_adam.py, built with the arguments Megatron-Core gives them; `te_kw` adds
    exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders, capturable).
    precision_aware: Megatron-Core's use_precision_aware_optimizer (TE only): the optimizer steps the
    bf16 parameter shards themselves, keeps the fp32 masters in its state (master_param) and reads
    gradients from `decoupled_grad`; shard_fp32_from_float16_groups holds None.
    groups: param groups (parameters dealt round-robin), as Megatron-Core makes them for weight decay
    and learning-rate multipliers.
    device: where the "GPU" tensors live (cpu in the tests; cuda in scripts/check_streamed_cuda.py).
    model_params: a model's own bf16 parameters instead of `shapes` (support/attention.py): their data is
    moved into the param buffer, values kept, as Megatron-Core's DDP does.
    Each bf16 model param gets `main_param` (its master, None under the precision-aware optimizer) and
    `main_param_sharded`, as Megatron-Core's _build_model_and_main_param_groups sets them.
    quantized: every other bf16 parameter a stand-in FP8 ("delayed", "tensorwise") or NVFP4 ("nvfp4")
    parameter (support/quantized.py; its cast installed by quantized.installed), with
    cfg.ddp.fp8_param_gather or fp4_param_gather set."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    class StandInDistributedOptimizer(DistributedOptimizer):
        def __init__(self):  # noqa: D401 - the real one needs a model and a GPU
            self.events = events
            self.precision_aware = False

        def _copy_main_params_to_param_buffer(self):
            self.events.add("param-buffer copy")

        def step_states(self):
            """What ChainedOptimizer.step does once grads are ready: gradients attached to the masters
            (made up, deterministic, as prepare_grads attaches the reduced ones), then Megatron-Core's
            real step_with_ready_grads: the inner AdamW step and the master -> param-buffer copy."""
            import torch

            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    g = torch.arange(p.numel(), dtype=torch.float32, device=p.device).view(p.shape)
                    g = torch.sin(g * 0.37 + self._gen)
                    if self.precision_aware:
                        p.decoupled_grad = g  # Megatron-Core attaches the fp32 main-grad shard so
                    else:
                        p.grad = g.to(p.dtype)
            self._gen += 1
            if "step" not in vars(self.optimizer):  # no streamed update armed (its passes: checked_passes)
                _no_released_storage(self.optimizer, dict(enumerate(g["params"] for g in self.optimizer.param_groups)))
            return self.step_with_ready_grads()

    opt = StandInDistributedOptimizer()
    opt.with_tensors = with_tensors
    if with_tensors:
        import torch

        ns = types.SimpleNamespace
        g = torch.Generator().manual_seed(seed)
        if model_params is not None:
            shapes = [tuple(p.shape) for p in model_params]
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        param_buffer = torch.randn(sum(sizes), generator=g).bfloat16().to(device)
        model16, start = [], 0
        for i, (shape, n) in enumerate(zip(shapes, sizes)):
            view = param_buffer[start:start + n].view(shape)
            if model_params is not None:
                view.copy_(model_params[i].detach())
                model_params[i].data = view
                view = model_params[i]
            model16.append(view)
            start += n
        fp32_buffer = torch.randn(16, generator=g).to(device)
        fp32_model = torch.nn.Parameter(fp32_buffer.view(16))

        def ranges(begin, end):
            return {"param": Range(0, end - begin), "gbuf_world_in_bucket": Range(begin, end),
                    "gbuf_world": Range(begin, end), "gbuf_local": Range(begin, end)}

        opt.buffers = [ns(param_data=param_buffer, grad_data=torch.zeros(sum(sizes), device=device),
                          buckets=[ns(param_data=param_buffer)], params=list(model16)),
                       ns(param_data=fp32_buffer, grad_data=torch.zeros(16, device=device),
                          buckets=[ns(param_data=fp32_buffer)], params=[fp32_model])]
        opt.model_param_gbuf_map = {**{p: (0, torch.bfloat16, 0) for p in model16}, fp32_model: (1, torch.float32, 0)}
        param_map, start = {}, 0
        for p, n in zip(model16, sizes):
            param_map[p] = ranges(start, start + n)
            start += n
        opt.gbuf_ranges = [{torch.bfloat16: [{"param_map": param_map}]},
                           {torch.float32: [{"param_map": {fp32_model: ranges(0, 16)}}]}]
        opt.model_float16_groups = [model16]
        opt.model_fp32_groups = [[fp32_model]]
        opt.shard_float16_groups = [[p.detach().view(-1) for p in model16]]
        opt.shard_fp32_groups = [[fp32_model.detach().view(-1)[:16]]]  # aliases the model parameter
        if precision_aware:  # the optimizer holds the masters
            opt.shard_fp32_from_float16_groups = [[None for _ in model16]]
            mains = [*opt.shard_float16_groups[0], *opt.shard_fp32_groups[0]]
        else:
            opt.shard_fp32_from_float16_groups = [[p.detach().view(-1).clone().float() for p in model16]]
            mains = [*opt.shard_fp32_from_float16_groups[0], *opt.shard_fp32_groups[0]]
        for model_param, master in zip(model16, opt.shard_fp32_from_float16_groups[0]):
            model_param.main_param, model_param.main_param_sharded = master, True
        param_groups = [{"params": mains[i::groups], "wd_mult": 1.0 / (i + 1)} for i in range(groups)]
        # what DistributedOptimizer.__init__ builds for its checkpoint readers: model param -> (group, index)
        opt.model_param_group_index_map = {model: (j % groups, j // groups)
                                           for j, model in enumerate([*model16, fp32_model])}
        opt.optimizer = _inner_optimizer(optimizer, param_groups, foreach, precision_aware, te_kw)
        opt.precision_aware = precision_aware
        opt.config = ns(timers=None, reuse_grad_buf_for_mxfp8_param_ag=False, barrier_with_L1_time=False,
                        use_precision_aware_optimizer=precision_aware,
                        use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware)
        opt.ddp_config = ns(overlap_param_gather=True, use_megatron_fsdp=False, fp8_param_gather=False,
                            fp4_param_gather=False)
        if quantized is not None:
            from support import quantized as stand_in

            for model_param in model16[::2]:
                stand_in.attach(model_param, quantized)
            opt.ddp_config.fp4_param_gather = quantized == "nvfp4"
            opt.ddp_config.fp8_param_gather = not opt.ddp_config.fp4_param_gather
        opt.is_stub_optimizer = False
        opt.data_parallel_group = None  # megatron-core 0.16 passes it to its fp8 cast, a no-op without fp8 params
        opt._gen = 0
    return opt


def _inner_optimizer(kind, param_groups, foreach, precision_aware, te_kw):
    """The inner optimizer as Megatron-Core builds it (megatron/core/optimizer/__init__.py)."""
    import torch

    from support import fused_adam

    common = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    if kind == "torch":
        return torch.optim.AdamW(param_groups, foreach=foreach, **common)
    # "apex-real" / "te-real": the installed classes themselves (scripts/check_streamed_cuda.py, on a GPU)
    if kind in ("apex", "apex-real"):
        if kind == "apex-real":
            from apex.optimizers import FusedAdam as cls
        else:
            cls = fused_adam.ApexFusedAdam
        return cls(param_groups, adam_w_mode=True, **common)
    if kind not in ("te", "te-real"):
        raise ValueError(f"unknown optimizer {kind!r}; one of {OPTIMIZERS} (or apex-real, te-real)")
    if kind == "te-real":
        from transformer_engine.pytorch.optimizers import FusedAdam as cls
    else:
        cls = fused_adam.TEFusedAdam
    kw = dict(adam_w_mode=True, **te_kw)
    if precision_aware:
        kw.update(master_weights=True, use_decoupled_grad=True, master_weight_dtype=torch.float32)
    return cls(param_groups, **common, **kw)


def _no_released_storage(inner, params_by_group):
    """Every update, whole or one pass of it, reads only whole storage: the parameters it steps and
    their states."""
    def whole(t):  # a DTensor's memory is its local tensor's; one with no elements needs none
        t = getattr(t, "_local_tensor", t)
        return t.numel() == 0 or t.untyped_storage().nbytes() > 0

    for params in params_by_group.values():
        for p in params:
            assert whole(p), "the optimizer step read a released parameter"
            for v in inner.state.get(p, {}).values():
                if v.dim():
                    assert whole(v), "the optimizer step read a released state"


@contextlib.contextmanager
def checked_passes():
    """The streamed engine's passes (subset.step_subset: one chunk, or the resident parameters) each
    checked for released storage before they run. Not a step hook: those fire once per optimizer step,
    around all of its passes, when the masters waiting for their chunk have no storage."""
    from bridge_fgo.engine import subset

    real = subset.step_subset

    def checked(inner, state, params_by_group):
        _no_released_storage(inner, params_by_group)
        return real(inner, state, params_by_group)

    with mock.patch.object(subset, "step_subset", checked):
        yield


@contextlib.contextmanager
def model_parallel():
    """Megatron-Core's process groups (parallel_state) over one gloo rank, taken down again after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@contextlib.contextmanager
def cuda_buffers_on_cpu():
    """Bridge's calc_params_l2_norm and Megatron-Core's local multi_tensor_l2norm make their few small
    buffers with torch.tensor / torch.zeros(..., device="cuda"): without a GPU those are made on the CPU,
    nothing else changes."""
    import torch

    def on_cpu(make):
        def made(*args, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return make(*args, **kwargs)

        return made

    with mock.patch.multiple(torch, tensor=on_cpu(torch.tensor), zeros=on_cpu(torch.zeros)):
        yield


class ChainedOptimizer:
    """The outer optimizer train_step sees (Bridge builds Megatron-Core's ChainedOptimizer)."""

    def __init__(self, chained, events: Recorder, config=None, step_result=(True, 1.0, 0)):
        self.chained_optimizers = list(chained)
        self.events = events
        self.config = config
        self.step_result = step_result

    def zero_grad(self, set_to_none=True):
        self.events.add("zero_grad")

    def step(self):
        self.events.add("step")
        if self.step_result[0]:
            for opt in self.chained_optimizers:
                if getattr(opt, "with_tensors", False):
                    opt.step_states()
        return self.step_result


def finalize_recorder(events: Recorder):
    """Bridge's setup binds partial(finalize_model_grads, pg_collection=...); so does this."""

    def finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        events.add(f"finalize(pg_collection={getattr(pg_collection, 'name', pg_collection)})")

    return functools.partial(finalize_model_grads, pg_collection=PG_COLLECTION)


def forward_backward_func(events: Recorder, fail: Optional[BaseException] = None, forward: Optional[Callable] = None):
    """`forward(model)`: what the model's own forward leaves behind (TE's attention: its max logits)."""
    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 decoder_seq_length=None, forward_only=False, adjust_tensor_shapes_fn=None, p2p_communicator=None,
                 pg_collection=None, **_):
        events.add("forward-backward")
        if fail is not None:
            raise fail
        if forward is not None:
            forward(model)
        config = model[0].config
        # Megatron-Core's schedules call it exactly so (pipeline_parallel/schedules.py)
        if config.finalize_model_grads_func is not None and not forward_only:
            config.finalize_model_grads_func(model, None, pg_collection=pg_collection, force_all_reduce=False)
        return [{}]

    return schedule


def optimizer_config(**overrides):
    """Bridge's real OptimizerConfig (Megatron-Core's subclass), adam + distributed optimizer."""
    from megatron.bridge.training.config import OptimizerConfig

    cfg = OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True)
    for key, value in overrides.items():
        setattr(cfg, key, value)  # offload_optimizer_states too, where Megatron-Core has no such field
    return cfg


def config_container(optimizer_cfg=None, mxfp8_copy=True, **sections):
    ns = types.SimpleNamespace
    cfg = ns(
        train=ns(micro_batch_size=1, empty_unused_memory_level=0, check_optimizer_step_success=False,
                 skip_sync_grad_norm_across_mp=True),
        optimizer=optimizer_cfg if optimizer_cfg is not None else optimizer_config(),
        ddp=ns(overlap_param_gather=True, use_megatron_fsdp=False),
        dist=ns(use_decentralized_pg=True, use_megatron_fsdp=False),
        model=ns(seq_length=8, cuda_graph_impl="none", cuda_graph_scope=None),
        dataset=ns(dataloader_type="single"),
        data_parallel_size=1,
    )
    # take the copy helper's real param-buffer copy path (the streamed step refuses it: mxfp8_copy=False)
    cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag = mxfp8_copy
    for name, value in sections.items():
        setattr(cfg, name, value)
    return cfg


class LaterQueue:
    """Bridge's async_calls_queue as the call sites and the tests use it: each scheduled request (a callable)
    runs when the queue is finalized blocking, a writer working at its own pace in this process."""

    def __init__(self):
        self.pending = []

    def schedule_async_request(self, request):
        self.pending.append(request)

    def get_num_unfinalized_calls(self):
        return len(self.pending)

    def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
        while blocking and self.pending:
            self.pending.pop(0)()


class _Timer:
    def start(self, barrier=False):
        pass

    def stop(self):
        pass


class Rig:
    """Everything one call of the real train_step needs."""

    def __init__(self, cfg=None, events: Optional[Recorder] = None, fail: Optional[BaseException] = None,
                 step_result=(True, 1.0, 0), with_tensors: bool = False, model: Optional[Callable] = None,
                 forward: Optional[Callable] = None, **optimizer_kw):
        """model(model_config, events): the model chunk (support/attention.py), whose bf16 parameters the
        optimizer then holds, in reverse order as Megatron-Core's param buffer does; forward: as for
        forward_backward_func."""
        self.events = events if events is not None else Recorder()
        self.cfg = cfg if cfg is not None else config_container()
        self.model_config = types.SimpleNamespace(
            finalize_model_grads_func=finalize_recorder(self.events), seq_length=8, bf16=True)
        chunk = (model or ModelChunk)(self.model_config, self.events)
        self.model = [chunk]
        if model is not None:
            optimizer_kw["model_params"] = list(chunk.parameters())[::-1]
        self.dist_optimizer = make_distributed_optimizer(self.events, with_tensors=with_tensors, **optimizer_kw)
        self.optimizer = ChainedOptimizer([self.dist_optimizer], self.events, step_result=step_result)
        self.scheduler = types.SimpleNamespace(step=lambda increment: self.events.add("scheduler.step"))
        self.global_state = types.SimpleNamespace(cfg=self.cfg, timers=lambda *a, **k: _Timer())
        self.forward_backward_func = forward_backward_func(self.events, fail, forward)
        self.p2p = types.SimpleNamespace(is_pp_last_stage=False)  # skips the loss all-reduce

    def kwargs(self):
        """train_step's arguments by name, for the parameters the installed release's train_step has."""
        import megatron.bridge.training.train as train_module

        values = {"forward_step_func": lambda *a, **k: None, "data_iterator": iter(()), "model": self.model,
                  "optimizer": self.optimizer, "scheduler": self.scheduler, "global_state": self.global_state,
                  "pg_collection": PG_COLLECTION, "forward_backward_func": self.forward_backward_func,
                  "p2p_communicator": self.p2p}
        out = {}
        for name, param in inspect.signature(train_module.train_step).parameters.items():
            if name in values:
                out[name] = values[name]
            elif param.default is inspect.Parameter.empty:  # a release with an argument the rig lacks
                raise TypeError(f"the rig has no value for train_step's parameter {name!r}")
        return out

    def args(self):
        return tuple(self.kwargs().values())


@contextlib.contextmanager
def cpu_train_module(reruns: int = 1, checkpoint_and_exit=(False, False, 0)):
    """Patch what train_step needs a cluster for: microbatches and the rerun state machine."""
    import megatron.bridge.training.train as train_module

    state = {"left": reruns}

    def should_run_forward_backward(data_iterator):
        state["left"] -= 1
        return state["left"] >= 0

    machine = types.SimpleNamespace(
        should_run_forward_backward=should_run_forward_backward,
        should_checkpoint_and_exit=lambda: checkpoint_and_exit,
    )

    def reset(n: int = 1):
        state["left"] = n

    names = inspect.unwrap(train_module.train_step).__code__.co_names
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(train_module, "get_num_microbatches", lambda: 1))
        stack.enter_context(mock.patch.object(train_module, "get_rerun_state_machine", lambda: machine))
        for name, stand_in in SINGLE_RANK.items():
            if name in names and name in vars(train_module):
                stack.enter_context(mock.patch.object(train_module, name, stand_in))
        yield reset


def run_steps(rig: Rig, steps: int = 1, reruns: int = 1, train_step: Optional[Callable] = None,
              checkpoint_and_exit=(False, False, 0)) -> List[tuple]:
    """Call the (possibly patched) real train_step `steps` times; returns its results."""
    import megatron.bridge.training.train as train_module

    out = []
    with cpu_train_module(reruns, checkpoint_and_exit) as reset:
        for _ in range(steps):
            reset(reruns)
            fn = train_step or train_module.train_step
            out.append(fn(*rig.args()))
    return out


def engine_step(opt, engine=None, wait=True):
    """One optimizer step through a streamed engine's sites, as the patched train_step drives them; `wait`:
    then read directly, as a test's snapshot does (a direct reader synchronizes first)."""
    if engine is not None:
        engine.offload()
        engine.release()
    finish_step(opt, engine, wait)


def finish_step(opt, engine=None, wait=True):
    """engine_step from gradient finalization on: for a test that ran its own backward after release()."""
    if engine is not None:
        engine.reload()
    try:
        opt.step_states()
    finally:
        if engine is not None:
            engine.settle()
            if wait:
                engine.synchronize()
