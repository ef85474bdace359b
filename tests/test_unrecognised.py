"""A Megatron-Bridge whose loop bridge_fgo does not recognise, made from the installed release's real
train module: patch() and `bridge-fgo status` name the installed version and the reason, nothing is
patched (all targets or none, so training runs as Bridge's own and never fails inside a half-patched
loop), and strict=True raises instead."""
import inspect
import logging

import pytest

import bridge_fgo
from bridge_fgo import BridgeFGOError
from bridge_fgo.instrument import diagnose
from bridge_fgo.options import Options
from conftest import BRIDGE

TARGETS = ("train", "train_step", "_handle_mxfp8_param_buffer_copy")


def forwarding(real, drop=()):
    """A train_step with the real one's parameters minus `drop` that calls the real one; its own code
    does not name the copy helper (as a release that moved the copy elsewhere would look)."""
    params = [p for n, p in inspect.signature(real).parameters.items() if n not in drop]

    def train_step(*args, **kwargs):
        return real(*args, **kwargs)

    train_step.__signature__ = inspect.Signature(params)
    return train_step


def no_helper(m, mp):
    mp.delattr(m, "_handle_mxfp8_param_buffer_copy")


def no_train_step(m, mp):
    mp.delattr(m, "train_step")


def helper_not_called(m, mp):
    mp.setattr(m, "train_step", forwarding(m.train_step))


def no_forward_backward_func(m, mp):
    mp.setattr(m, "train_step", forwarding(m.train_step, drop=("forward_backward_func",)))


def optimizer_renamed(m, mp):
    mp.setattr(m, "train_step", forwarding(m.train_step, drop=("optimizer",)))


def train_without_train_step(m, mp):
    mp.setattr(m, "train", lambda *a, model=None, optimizer=None, global_state=None, **k: None)


LAYOUTS = [
    (no_helper, "megatron.bridge.training.train._handle_mxfp8_param_buffer_copy is missing"),
    (no_train_step, "megatron.bridge.training.train.train_step is missing"),
    (helper_not_called, "train_step() no longer calls _handle_mxfp8_param_buffer_copy"),
    (no_forward_backward_func, "train_step() has no parameter(s) forward_backward_func"),
    (optimizer_renamed, "train_step() has no parameter(s) optimizer"),
    (train_without_train_step, "train() no longer calls train_step"),
]


@pytest.mark.parametrize("make,reason", LAYOUTS, ids=[f.__name__ for f, _ in LAYOUTS])
def test_unrecognised_layout_is_named_and_nothing_patched(make, reason, monkeypatch, train_module, caplog_fgo):
    make(train_module, monkeypatch)
    before = {n: vars(train_module).get(n) for n in TARGETS}
    report = bridge_fgo.patch()
    assert (report.patched, report.outcome) == (False, "not-patched")
    assert {n: vars(train_module).get(n) for n in TARGETS} == before  # all or none
    warnings = [r.getMessage() for r in caplog_fgo.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0] == report.reason
    assert report.reason.startswith(f"megatron-bridge {BRIDGE} has a training loop bridge_fgo does not recognise")
    assert reason in report.reason and "bridge_fgo patches nothing" in report.reason

    status = diagnose.diagnose(Options())  # what `bridge-fgo status` prints
    assert status.offload_ready is False and diagnose.exit_code(status) == 1
    assert status.versions["megatron-bridge"] == BRIDGE and reason in status.reason
    assert status.reason.startswith(f"megatron-bridge {BRIDGE} ")
    assert status.verdict.startswith("offload will not run") and reason.split(" (")[0] in status.verdict

    bridge_fgo.unpatch()
    with pytest.raises(BridgeFGOError) as err:
        bridge_fgo.patch(strict=True)
    assert str(err.value).startswith(f"megatron-bridge {BRIDGE} ") and reason in str(err.value)
    assert {n: vars(train_module).get(n) for n in TARGETS} == before
