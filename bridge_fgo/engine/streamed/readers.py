"""Who reads or writes the optimizer states between updates, and what they are allowed to see.

- Megatron-Core's DistributedOptimizer methods that read or write optimizer state from the host side
  (READERS) are wrapped on the instances while the last update's device-to-host copies (the tail)
  are in flight: the first call waits for them, then every guard goes.
- Torn states (an update failed after it had begun writing): the guards stay, checkpoint saves and
  optimizer steps (the inner optimizers' and Megatron-Core's own entry points) are refused until a
  checkpoint load has made the states whole again: every part of a chain loaded, none failed since.
- Loads write into the host views: each inner optimizer's load_state_dict and the DistributedOptimizer's
  reload_model_params are hooked from prepare() to close() (load_hooks), keeping whatever was bound
  before them.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import Callable, Optional

from ...errors import BridgeFGOError
from ...log import logger, rank_prefix
from .. import subset
from ..uninterrupted import each
from ..fsdp import local as fsdp_local
from ..tensors import MASTER, kind_of, same
from .plan import Plan
from .transfers import Transfers

READERS = ("state_dict", "load_state_dict", "sharded_state_dict", "save_parameter_state",
           "load_parameter_state", "get_parameter_state_dp_reshardable", "get_parameter_state_dp_zero",
           "get_parameter_state_fs_bucket_space", "load_parameter_state_from_dp_reshardable",
           "load_parameter_state_from_dp_zero", "load_parameter_state_from_fs_bucket_space",
           "reload_model_params", "_copy_model_params_to_main_params", "offload_to_cpu", "restore_from_cpu",
           "get_parameters")
# Of those, what saves and what loads a checkpoint, for torn states. sharded_state_dict saves, or with
# is_loading builds what a load fills; Bridge's load then always calls load_state_dict
SAVES = ("state_dict", "save_parameter_state", "get_parameter_state_dp_reshardable", "get_parameter_state_dp_zero",
         "get_parameter_state_fs_bucket_space")
LOADS = ("load_state_dict", "load_parameter_state", "load_parameter_state_from_dp_reshardable",
         "load_parameter_state_from_dp_zero", "load_parameter_state_from_fs_bucket_space")
# Megatron-Core's own ways into an optimizer step of a DistributedOptimizer (a ChainedOptimizer's step
# calls them on each part): refused while torn, with the inner optimizer's step()
STEPS = ("step", "prepare_grads", "step_with_ready_grads")
TORN_FIX = ("Fix: resume from the last checkpoint (restart the run from it, or load it into this optimizer: a "
            "checkpoint load clears this)")


def _is_loading(method, opt, args, kwargs) -> bool:
    """sharded_state_dict(..., is_loading=...) as called (ChainedOptimizer passes it by position)."""
    try:
        bound = inspect.signature(method).bind(opt, *args, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    return bool(bound.arguments.get("is_loading"))


def _bind_back(pair) -> None:
    p, data = pair
    p.data = data


def _hook(readers_ref, method: str, name: str, owner_ref, prior, *args, **kwargs):
    """A hook on the optimizer method `name`: Readers' `method`, or, once the engine is gone, what was
    bound before it (the class's own method when nothing was)."""
    readers = readers_ref()
    if readers is not None:
        return getattr(readers, method)(owner_ref, prior, *args, **kwargs)
    if prior is not None:
        return prior(*args, **kwargs)
    owner = owner_ref()
    return getattr(type(owner), name)(owner, *args, **kwargs)


class Readers:
    def __init__(self, plan: Plan, transfers: Transfers, synchronize: Callable[[], None]):
        self.plan = plan
        self.transfers = transfers
        self._synchronize = synchronize  # the engine's: waits for the tail, marks torn if that fails
        self.guards = subset.Shadows()  # READERS wrapped while the tail is in flight or states torn
        self._loaders = subset.Shadows()  # load hooks, from prepare() to close()
        # Why the states are torn (an update failed after it had begun writing): until a checkpoint is
        # loaded into every part, no step and no checkpoint save
        self._torn: Optional[str] = None
        self._loaded: set = set()  # indices of the parts a load went through since the states tore
        self._loading = False  # inside a load reader while torn: Megatron-Core's own nested calls pass
        # a load of the model only is coming: states made from the parameters (TE's master_param) must
        # be made from the loaded ones, after it
        self.states_after_load = False

    @property
    def torn(self) -> Optional[str]:
        return self._torn

    @torn.setter
    def torn(self, why: Optional[str]) -> None:
        self._torn, self._loaded = why, set()

    # -- guards between updates -------------------------------------------------------------------
    def guard(self) -> None:
        """READERS wrapped on the instances (and, while torn, the inner optimizers' step())."""
        self.guards.restore()
        for part in self.plan.parts:
            opt = part.opt
            for name in READERS:
                if callable(getattr(type(opt), name, None)):
                    # the optimizer holds the guard: the guard holds it weakly
                    self.guards.set(opt, name, functools.partial(self._guarded, weakref.ref(opt), name))
            if self.torn is not None:
                self.guards.set(part.inner, "step", self._torn_step)
                for name in STEPS:
                    if callable(getattr(type(opt), name, None)):
                        self.guards.set(opt, name, self._torn_step)

    def drop_guards(self) -> None:
        if self.torn is None:  # torn states keep their guards until a load
            self.guards.restore()

    def _guarded(self, opt_ref, name, *args, **kwargs):
        opt = opt_ref()
        if self.torn is None:
            self._synchronize()  # drops every guard: later calls go straight to Megatron-Core
            return getattr(opt, name)(*args, **kwargs)
        method = getattr(type(opt), name)
        if self._loading:  # Megatron-Core's own calls inside a load (sharded_state_dict calls state_dict)
            return method(opt, *args, **kwargs)
        loads = name in LOADS or (name == "sharded_state_dict" and _is_loading(method, opt, args, kwargs))
        if not loads and (name in SAVES or name == "sharded_state_dict"):
            raise self.refusal(f"{type(opt).__name__}.{name}(), a checkpoint save of the optimizer states,")
        self._synchronize()
        if not loads:
            return method(opt, *args, **kwargs)
        self._loading = True
        try:
            out = method(opt, *args, **kwargs)
        finally:
            self._loading = False
        if name in LOADS:  # sharded_state_dict(is_loading=True) only builds what the load then fills
            self._loaded_into(opt, name)
        return out

    def _loaded_into(self, opt, name: str) -> None:
        """A load into one part returned: the mark goes once every part of the chain has loaded (a part's
        load that raises leaves it, and the parts loaded before it, torn)."""
        index = self.plan.part_of(opt).index
        self._loaded.add(index)
        left = len(self.plan.parts) - len(self._loaded)
        if left:
            logger.info("%s%s.%s() loaded a checkpoint into optimizer %d of the chain; the states stay torn until "
                        "the other %d load too", rank_prefix(), type(opt).__name__, name, index, left)
            return
        self.torn = None
        self.guards.restore()
        logger.info("%s%s.%s() loaded a checkpoint: the optimizer states are whole again", rank_prefix(),
                    type(opt).__name__, name)

    def _torn_step(self, *args, **kwargs):
        raise self.refusal("an optimizer step")

    def refusal(self, what: str) -> BridgeFGOError:
        return BridgeFGOError(f"{rank_prefix()}{what} refused: {self.torn}. {TORN_FIX}")

    # -- loads into the host views ----------------------------------------------------------------
    def hook_loads(self) -> None:
        """Each inner optimizer's load_state_dict and each DistributedOptimizer's reload_model_params,
        keeping what was bound there before (e.g. Bridge's memory-efficient loader). The optimizers
        hold these hooks, the hooks hold these readers and the optimizers weakly."""
        me = weakref.ref(self)
        for part in self.plan.parts:
            hooks = [(part.inner, "load_state_dict", "_inner_load"),
                     (part.opt, "reload_model_params", "_reload_model_params")]
            if kind_of(part.opt).inits_on_load and callable(part.opt.__dict__.get("init_state_fn")):
                hooks.append((part.opt, "init_state_fn", "_init_states"))
            if part.fsdp is not None and hasattr(type(part.opt), "_init_optimizer_states_with_dummy_values"):
                hooks.append((part.opt, "_init_optimizer_states_with_dummy_values", "_dummy_states"))
            for owner, name, method in hooks:
                prior = owner.__dict__.get(name)
                self._loaders.set(owner, name, functools.partial(_hook, me, method, name, weakref.ref(owner), prior))

    def unhook_loads(self) -> None:
        self._loaders.restore()

    def _inner_load(self, inner_ref, prior, *args, **kwargs):  # through _hook
        """The inner optimizer's load_state_dict, then its states back in their host views at once.
        Transformer Engine's loader makes every state anew (where the parameter is: the host), and
        Megatron-Core builds the sharded tensors torch_dist fills right after its own round trip
        through it (sharded_state_dict with is_loading): so the load writes into the pinned buffer."""
        inner = inner_ref()
        self.plan.writes += 1  # the load writes the masters (here, or in the same DistributedOptimizer load)
        try:
            with self._params_on_host(inner), self._fsdp_states_on_host(inner), self._made_in_views(inner):
                result = (prior(*args, **kwargs) if prior is not None
                          else type(inner).load_state_dict(inner, *args, **kwargs))
        except BaseException:
            # what the load bound before it raised goes into the host views too, so no later release frees it
            with contextlib.suppress(BridgeFGOError):  # one unlike the plan stays; adopt() refuses it then
                self._take_loaded()
            raise
        self._take_loaded()
        return result

    def _init_states(self, opt_ref, prior, inner, *args, **kwargs):  # through _hook
        """Megatron-Core's init_state_fn, which a Float16OptimizerWithFloat16Params calls before a load builds
        what torch_dist fills (zeros like each parameter, where its master is: the host, pageable), run over
        one parameter at a time, whose states go into their host views before the next is made: torch_dist
        then writes into the pinned buffer, and the load takes one parameter's states beside it
        (Plan.made_on_load, counted by the host-memory check), not a second copy of them all."""
        part = self.plan.part_of(opt_ref())
        if inner is not part.inner:
            return prior(inner, *args, **kwargs)
        b = part.bindings
        for bundle in part.bundles:
            if inner.state.get(bundle.param):
                continue  # made already: init_state_fn leaves it
            groups = [dict(g, params=[bundle.param] if gi == bundle.group else [])
                      for gi, g in enumerate(inner.param_groups)]
            with subset.narrowed(inner, groups):
                prior(inner, *args, **kwargs)
            for e in () if bundle.resident else bundle.entries:  # (resident: made on the GPU, where they stay)
                t = b.get(e)
                if not e.dropped and t is not None and not same(t, e.host):
                    self.transfers.take(part, b, e, t)

    def _dummy_states(self, opt_ref, prior, *args, **kwargs):  # through _hook
        """Megatron-Core's _init_optimizer_states_with_dummy_values, before an fsdp_dtensor load builds what
        it fills: it makes the states by one inner step over zero gradients, which would step the masters
        where they are (the host). Instead each missing state is made as the optimizer's first step makes
        it (contracts.py), one parameter at a time, and taken into its host view: the load then writes into
        the pinned buffer (Megatron-FSDP, engine/fsdp.py)."""
        part = self.plan.part_of(opt_ref())
        with part.contract.made_in(part.inner, part.view_of()):
            self._dummy_states_of(part)
        # the dummy step's count, which the load then overwrites: without it the state dict the load fills has no
        # `step` in its groups, and a resumed run would start its bias correction again from 1
        part.contract.advance_step(part.inner)

    def _dummy_states_of(self, part) -> None:
        inner, b = part.inner, part.bindings
        for bundle in part.bundles:
            p = bundle.param
            # made already (materialized before the load, or stepped); or no elements on this rank, which the dummy
            # step gives no gradient: TE's makes its (empty) states anyway (no entries: nothing moves), and every
            # rank's state dict must hold the same DTensors, or the fsdp_dtensor load's per-tensor collectives pair
            # up wrongly and hang (2xH200, 2026-11-27)
            if inner.state.get(p) or (fsdp_local(p).numel() == 0 and not part.contract.states_without_grad):
                continue
            part.contract.create(inner, p, inner.param_groups[bundle.group], self.plan.device)
            for e in () if bundle.resident else bundle.entries:
                t = b.get(e)
                if not e.dropped and t is not None and not same(t, e.host):
                    self.transfers.take(part, b, e, t)

    def _take_loaded(self) -> None:
        """The states a load bound, copied into their host views. Never freed here: they are the load's
        or the caller's own tensors (torch's load keeps a state dict's tensor that needs no cast)."""
        if self.transfers.buffer is not None:
            self.transfers.take_all(free=False)

    @contextlib.contextmanager
    def _params_on_host(self, inner):
        """During the inner optimizer's load, each of its parameters that stays on the GPU and whose
        states move (the model's own shard: TE holding the masters, an fp32 parameter) is presented as
        an untouched host tensor of its shape: torch's load_state_dict casts the loaded states to the
        parameter's device, and Transformer Engine makes its states there (empty_like), so both are made
        on the host instead of the GPU, and taken into their views right after. Nothing reads the
        parameter's values during a load; its own storage is back when the load returns or raises."""
        import torch

        swapped = []
        try:
            if self.transfers.buffer is not None:
                for part in self.plan.parts:
                    if part.inner is not inner:
                        continue
                    for bundle in part.bundles:
                        p = bundle.param
                        if (bundle.resident or not bundle.entries
                                or any(e.kind == MASTER or e.dropped for e in bundle.entries)):
                            # kept on the GPU on purpose; a master (bound to its host view); nothing
                            # that moves, or a state left where the optimizer made it: made there again
                            continue
                        swapped.append((p, p.data))
                        # (pages never touched are never committed: this costs no host memory)
                        p.data = torch.empty(p.shape, dtype=p.dtype, device="cpu")
            yield
        finally:  # every parameter back on its own storage, an interrupt between two of them included
            each(swapped, _bind_back)

    def _made_in_views(self, inner):
        """During the inner load of a distributed optimizer's part, the states its loader makes anew (TE's) are
        made in their host views (contracts.Contract.made_in): no fresh memory, no second copy into the buffer."""
        part = next((p for p in self.plan.parts if p.inner is inner), None)
        if part is None or self.transfers.buffer is None:
            return contextlib.nullcontext()
        return part.contract.made_in(inner, part.view_of())

    @contextlib.contextmanager
    def _fsdp_states_on_host(self, inner):
        """During the inner load of a Megatron-FSDP optimizer (engine/fsdp.py), whose parameters are DTensors on
        the GPU over host masters: torch's load_state_dict casts each loaded state to its parameter's device,
        and Transformer Engine's remakes each with DTensor.from_local, which moves a host local tensor to the
        mesh's device; either would hold every state on the GPU at once until the load returns. So a loaded
        DTensor state whose local tensor is on the host stays there (the cast keeps its device), and each state
        TE makes is taken into its host view as soon as it is set (set_scaled_state): the GPU holds one
        state at a time."""
        part = next((p for p in self.plan.parts if p.inner is inner and p.fsdp is not None), None)
        if part is None or self.transfers.buffer is None:
            yield
            return
        from torch.optim import Optimizer

        from .. import fsdp

        params = {id(bd.param) for bd in part.bundles}
        cast = Optimizer.__dict__["_process_value_according_to_param_policy"]

        def kept_where_it_is(param, value, param_id, param_groups, key=None):
            if (id(param) in params and key != "step" and fsdp.is_dtensor(value)
                    and fsdp.local(value).device.type == "cpu"):
                return value.to(dtype=param.dtype) if param.is_floating_point() else value
            return cast.__func__(param, value, param_id, param_groups, key)

        by_param = {}
        for bd in part.bundles:
            if not bd.resident:
                by_param[id(bd.param)] = [e for e in bd.entries if e.kind != MASTER and not e.dropped]
        b = part.bindings
        prior = inner.__dict__.get("set_scaled_state")
        set_scaled = getattr(type(inner), "set_scaled_state", None)

        def set_and_take(param, name, *args, **kwargs):
            out = prior(param, name, *args, **kwargs) if prior is not None else set_scaled(inner, param, name, *args,
                                                                                           **kwargs)
            for e in by_param.get(id(param), ()):
                t = b.get(e)
                if (e.key == name and t is not None and not same(t, e.host) and tuple(t.shape) == e.shape
                        and t.dtype == e.dtype):
                    self.transfers.take(part, b, e, t)  # made by the optimizer just now: its memory goes
            return out

        shadows = subset.Shadows()
        Optimizer._process_value_according_to_param_policy = staticmethod(kept_where_it_is)
        try:
            if set_scaled is not None:
                shadows.set(inner, "set_scaled_state", set_and_take)
            yield
        finally:
            Optimizer._process_value_according_to_param_policy = cast
            shadows.restore()

    def _reload_model_params(self, opt_ref, prior, *args, **kwargs):  # through _hook
        """Megatron-Core's reload_model_params (Bridge calls it after a load without optimizer state:
        finetuning, a release or HF checkpoint): the masters it holds are refreshed from the loaded
        weights where they are, the host views; states the optimizer derives from the parameters and
        Megatron-Core does not reload (TE's master_param) are made again as its first step makes them."""
        opt = opt_ref()
        part = self.plan.part_of(opt)
        self.plan.writes += 1
        result = prior(*args, **kwargs) if prior is not None else type(opt).reload_model_params(opt, *args, **kwargs)
        inner = part.inner
        for bundle in part.bundles:
            if inner.state.get(bundle.param):
                part.contract.reload_from_param(inner, bundle.param)
        return result

    def after_load(self) -> None:
        """A checkpoint load ran: what it bound elsewhere than the host views (Transformer Engine's
        loader makes new tensors) is copied into them now, and its memory freed."""
        self._synchronize()
        self.plan.writes += 1
        self.transfers.take_all()
        if self.states_after_load:
            self.states_after_load = False
            self.transfers.materialize()
