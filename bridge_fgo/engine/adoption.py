"""Masters made on the host at construction wait for a session to adopt them; unadopted, they go back.

Under the streamed step the fp32 masters are made on the host as Megatron-Core builds an optimizer
(construction.py), whether or not a Bridge train(), train_step() or load_checkpoint() will ever adopt
that optimizer into a session: a program that builds through Bridge's setup() and steps in a loop of
its own (NeMo-RL's Megatron policy) would otherwise step masters that nobody brings back.

So an optimizer built with staged masters is guarded (await_session): its methods that read or write
the masters, Megatron-Core's steps and readers (readers.py lists them), are shadowed on the instance.
A session that adopts it drops the guards first (adopted). A guarded call that comes before any
session puts the masters back on the device they were made on, says so in one line, drops the guards,
and calls through: the caller sees the optimizer Megatron-Core built, with nothing offloaded.
"""
from __future__ import annotations

import functools
import weakref
from typing import Iterable, Optional

from ..log import logger, rank_prefix
from . import construction, fsdp, fsdp_construction, tensors
from .streamed.readers import READERS, STEPS

# what reads or writes the masters besides the readers: the copies between masters and model parameters
COPIES = ("_copy_main_params_to_model_params", "_copy_main_params_to_param_buffer",
          "_copy_model_grads_to_main_grads")
GUARDED = tuple(dict.fromkeys((*STEPS, *READERS, *COPIES)))
_MARK = "_bridge_fgo_awaiting_session"  # on each shadowing function, to recognise ours


def _staged(opt) -> list:
    if fsdp.serves(opt):  # made on the host with Megatron-FSDP's buffers, before the optimizer (fsdp_construction.py)
        return fsdp_construction.staged(opt)
    return [m for m in tensors.masters(opt) if construction.is_staged(m)]


def await_session(opt, built_s: Optional[float] = None) -> bool:
    """Guard `opt` when masters of it were made on the host; True if it was. `built_s`: its whole construction's
    time, said beside the masters' own line (issue 43: what setup takes besides the masters)."""
    if not _staged(opt):
        return False
    if built_s is not None and not fsdp.serves(opt):  # (Megatron-FSDP's masters were made with the model)
        logger.info("%sMegatron-Core's %s built in %.2f s, its fp32 masters' construction among it", rank_prefix(),
                    type(opt).__name__, built_s)
    ref = weakref.ref(opt)  # the optimizer holds its guards: they hold it weakly
    for name in GUARDED:
        if callable(getattr(type(opt), name, None)) and name not in vars(opt):
            guard = functools.partial(_unadopted, ref, name)
            setattr(guard, _MARK, True)
            setattr(opt, name, guard)
    return True


def adopted(optimizers: Iterable[object]) -> None:
    """A session takes these optimizers: their masters are its to move; the guards go."""
    for opt in optimizers:
        _drop(opt)


def _drop(opt) -> None:
    for name in GUARDED:
        if getattr(vars(opt).get(name), _MARK, False):  # only ours: something set after us stays
            del opt.__dict__[name]


def _unadopted(ref, name, *args, **kwargs):
    opt = ref()
    masters = _staged(opt)
    if fsdp.serves(opt):  # Megatron-FSDP's buffers made again on the GPU, the masters views of them
        fsdp_construction.restore(opt)
    for m in masters:
        construction.restore(m)
    _drop(opt)
    if masters:
        logger.warning(
            "%s%s.%s() was called before any Bridge train(), train_step() or load_checkpoint() took this optimizer: "
            "its %d fp32 master(s) made on the host at construction (offload=builtin, the streamed step) went back to "
            "the device they were made on, and nothing of it is offloaded. bridge_fgo offloads inside Bridge's "
            "training loop; a loop of your own steps the optimizer as Megatron-Core built it",
            rank_prefix(), type(opt).__name__, name, len(masters))
    return getattr(opt, name)(*args, **kwargs)
