"""A patch that acts on nothing touches nothing (issue 44: Megatron-Bridge's own unit tests under patch()).

Each cause Bridge's own training tests found, with Bridge-like mocks and no process group:
- in auto on a Megatron-Core without an offloader (every release), and in off, the wrappers call through
  without looking at their arguments (a Mock optimizer's chained_optimizers is no chain);
- a refusal words any cfg.optimizer.optimizer value, never a TypeError;
- a checkpoint save with no session runs no collective;
- masters made on the host at construction go back to the GPU, said once, when the optimizer is stepped
  outside Bridge's train() (NeMo-RL's loop).
"""
from __future__ import annotations

import logging
import types
from unittest import mock

import pytest
import torch

import bridge_fgo
from bridge_fgo import BridgeFGOConfigError
from bridge_fgo.engine import adoption, construction, tensors
from bridge_fgo.instrument import agree, decide, patcher, refusals
from support import dp
from test_resume_dp import one_rank

ns = types.SimpleNamespace


class Untouchable:
    """An argument that must not be looked at: any attribute read fails the test."""

    def __getattribute__(self, name):
        raise AssertionError(f"bridge_fgo looked at {name!r} of an argument it had no business reading")


def _sites():
    return patcher._current.callsites


def _cfg(**optimizer):
    return ns(optimizer=ns(**optimizer), checkpoint=ns(save="/ckpt", save_optim=True, async_save=True, load=None,
                                                       use_persistent_ckpt_worker=False),
              ddp=None, dist=None, model=None, logger=None)


def test_a_chain_is_a_list_or_tuple():
    opt = mock.Mock()  # its chained_optimizers is a Mock: no chain
    assert decide.inner_optimizers(opt) == [opt]
    a, b, c = object(), object(), object()
    assert decide.inner_optimizers(ns(chained_optimizers=[a, ns(chained_optimizers=(b, c))])) == [a, b, c]


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_an_inert_patch_never_looks_at_the_arguments(train_module, mode):
    """auto on a Megatron-Core without an offloader (every release), and off: every wrapper calls through."""
    bridge_fgo.patch(offload=mode)
    sites = _sites()
    assert sites.inert
    called = []

    def wrapped(*args, **kwargs):
        called.append((args, kwargs))
        return "result"

    optimizer, state = Untouchable(), Untouchable()
    assert sites.load_checkpoint("load_checkpoint", wrapped, None, (state, None, optimizer), {}) == "result"
    assert sites.save_checkpoint("save_checkpoint", wrapped, None, (state, None, optimizer), {}) == "result"
    # train() and train_step() read only the config, for their once-only line
    global_state = ns(cfg=_cfg(offload_optimizer_states=False))
    index = sites.index["train_step"]
    args = [None] * (max(index.values()) + 1)
    args[index["optimizer"]], args[index["global_state"]] = optimizer, global_state
    assert sites.train_step("train_step", wrapped, None, tuple(args), {}) == "result"
    assert [a for a, _ in called] == [(state, None, optimizer)] * 2 + [tuple(args)]
    assert not sites.registry.sessions()


def test_auto_still_says_the_config_flag_does_nothing_here(train_module, caplog):
    bridge_fgo.patch(offload="auto")
    sites = _sites()
    index = sites.index["train"]
    args = [None] * (max(index.values()) + 1)
    args[index["optimizer"]] = Untouchable()
    args[index["global_state"]] = ns(cfg=_cfg(offload_optimizer_states=True))
    with caplog.at_level(logging.WARNING, logger="bridge_fgo"):
        sites.train("train", lambda *a, **k: None, None, tuple(args), {})
        sites.train("train", lambda *a, **k: None, None, tuple(args), {})
    said = [m for m in caplog.messages if "has no optimizer-state offload" in m]
    assert len(said) == 1, caplog.messages


@pytest.mark.parametrize("name", [mock.Mock(), None, 3, ("adam",)], ids=["Mock", "None", "int", "tuple"])
def test_a_refusal_words_any_optimizer_name(name):
    found = refusals.problems(_cfg(optimizer=name, use_distributed_optimizer=True), [], [], "the builtin engine",
                              served=("adam", "muon", "dist_muon"))
    assert [f for f in found if f.startswith(f"cfg.optimizer.optimizer={name!r}: the builtin engine supports only")]


def test_builtin_refuses_a_mock_optimizer_by_name_not_by_type_error(train_module):
    bridge_fgo.patch(offload="builtin")
    state = ns(cfg=_cfg(optimizer=mock.Mock(), use_distributed_optimizer=True))
    with pytest.raises(BridgeFGOConfigError, match="the optimizer holds no DistributedOptimizer"):
        _sites().load_checkpoint("load_checkpoint", lambda *a, **k: None, None, (state, None, mock.Mock()), {})


def test_a_save_without_a_session_runs_no_collective(train_module, mocker):
    """An asynchronous save of optimizer state under the streamed step, before any optimizer has a session:
    neither the pending save's verdict nor the watch is gathered across ranks."""
    bridge_fgo.patch(offload="builtin")
    gather = mocker.patch.object(agree, "gather", side_effect=AssertionError("a collective without a session"))
    state = ns(cfg=_cfg(optimizer="adam", use_distributed_optimizer=True), async_calls_queue=None)
    assert _sites().save_checkpoint("save_checkpoint", lambda *a, **k: "saved", None, (state,), {}) == "saved"
    gather.assert_not_called()


# -- masters made on the host, never adopted -------------------------------------------------------------

def test_a_staged_master_goes_back_to_the_device_it_was_made_on():
    class Master:  # what restore() uses of a tensor: its device, and `data` to rebind (no GPU here)
        def __init__(self, device):
            self.device, self.data = device, self

        def to(self, device):
            return Master(device)

    t = Master("cpu")
    construction.stage(t, "cuda:3")
    construction.restore(t)
    assert t.data.device == "cuda:3" and not construction.is_staged(t)
    moved = t.data
    construction.restore(t)  # once only
    assert t.data is moved


def _masters_and_steps(run, steps=3):
    out = []
    for _ in range(steps):
        run.step()
        out.append([p.detach().clone() for p in run.model.module.parameters()])
    return out


def test_masters_made_on_the_host_go_back_when_no_session_adopts_them(train_module, tmp_path, caplog):
    """An optimizer built under the patch (the streamed step) and stepped outside Bridge's train(), as NeMo-RL's
    Megatron policy steps it: before its first step its masters go back to the device they were made on, one
    line says so, and the steps are those of an optimizer built without the patch."""
    with one_rank(tmp_path):
        base = _masters_and_steps(dp.Run("torch"))
        bridge_fgo.patch(offload="builtin", chunk_mb=1)
        run = dp.Run("torch")
        masters = tensors.masters(run.dist)
        assert masters and all(construction.is_staged(m) for m in masters)
        assert "step" in vars(run.dist)  # guarded
        with caplog.at_level(logging.WARNING, logger="bridge_fgo"):
            got = _masters_and_steps(run)
        assert not any(construction.is_staged(m) for m in masters)
        assert not [n for n in adoption.GUARDED if n in vars(run.dist)]  # the guards are gone
        said = [m for m in caplog.messages if "went back to the device they were made on" in m]
        # the chain's step reaches the part through prepare_grads() first
        assert len(said) == 1 and "DistributedOptimizer.prepare_grads() was called" in said[0], caplog.messages
        assert not _sites().registry.sessions()
    for a, b in zip(base, got):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_a_session_adopts_the_masters_and_drops_the_guards(train_module, tmp_path):
    """The optimizer Bridge's train() takes: no guard left for the engine's own readers' guards to meet."""
    from bridge_fgo.engine import build

    with one_rank(tmp_path):
        bridge_fgo.patch(offload="builtin", chunk_mb=1)
        run = dp.Run("torch")
        assert "step" in vars(run.dist)
        build([run.dist], patcher._current.options)
        assert not [n for n in adoption.GUARDED if n in vars(run.dist)]
        assert all(construction.is_staged(m) for m in tensors.masters(run.dist))  # the engine's to take


def test_other_modes_guard_nothing(train_module, tmp_path):
    with one_rank(tmp_path):
        for options in (dict(offload="builtin", chunk_mb=0), dict(offload="auto")):
            bridge_fgo.patch(**options)
            run = dp.Run("torch")
            assert not [n for n in adoption.GUARDED if n in vars(run.dist)], options
            bridge_fgo.unpatch()
