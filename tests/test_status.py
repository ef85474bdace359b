"""Saying what happens: `bridge-fgo status` / `bridge-fgo-run --check` against the real installed
Megatron-Bridge and Megatron-Core, and the run-time log lines of the stand-in training loop."""
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
from unittest import mock

import pytest

import bridge_fgo
from bridge_fgo.cli import status as cli
from bridge_fgo import versions as versions_mod
from bridge_fgo.instrument import diagnose as diagnose_mod, generations, targets
from bridge_fgo.instrument.generations import chunked
from bridge_fgo.errors import BridgeFGOError
from bridge_fgo.options import Options
from support import harness
from conftest import BRIDGE, MCORE, ROOT, pythonpath

BIN = os.path.dirname(sys.executable)
USERDIR = os.path.join(ROOT, "tests", "userdir")
HELPER = "_handle_mxfp8_param_buffer_copy"
PRETRAIN_ALIAS = "megatron.bridge.training.pretrain.train"
# derived from the target table (test_targets.py pins the table itself)
ALL_TARGETS = {**{t.name: True for t in targets.TARGETS}, **{a.qualname: True for a in targets.ALIASES}}


def run(args, simulate=None, env=None, timeout=180):
    """A console script (or python) of the venv, in a fresh process, Bridge loadable without TE."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("BRIDGE_FGO_", "FGO_TEST_"))}
    full.update({"PYTHONPATH": pythonpath(USERDIR), "PYTHONWARNINGS": "ignore", **(env or {})})
    if simulate:
        full["FGO_TEST_SIMULATE"] = simulate
    return subprocess.run([os.path.join(BIN, args[0]), *args[1:]], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def flat(text):
    return " ".join(text.split())  # the table wraps long values


# -- subprocesses against the real installed packages ------------------------------------------------

def test_status_json_real_environment():
    proc = run(["bridge-fgo", "status", "--json"])
    assert proc.returncode == 1, proc.stderr[-3000:]  # auto on megatron-core without offload: will not run
    r = json.loads(proc.stdout)  # all of stdout: Bridge's import-time prints went to stderr
    v = r["versions"]
    assert v["megatron-core"] == MCORE and v["megatron-bridge"] == BRIDGE
    assert v["torch"] == importlib.metadata.version("torch") and v["wrapt"] == importlib.metadata.version("wrapt")
    assert v["python"] == platform.python_version() and v["bridge-fgo"] == bridge_fgo.__version__
    assert r["generation"] == "none"
    assert r["generation_meaning"] == ("this Megatron-Core has no optimizer-state offload; bridge_fgo's builtin "
                                       "engine can provide it")
    assert r["chunk_mb"] == "auto"
    assert r["native_wiring"] == [] and r["problems"] == []
    assert r["targets"] == ALL_TARGETS
    assert "the same function as megatron.bridge.training.train.train" in r["target_notes"][PRETRAIN_ALIAS]
    assert (r["mode"], r["strict"], r["predicted"], r["patched"], r["outcome"]) == ("auto", False, True, False,
                                                                                      "patched")
    assert r["offload_ready"] is False
    assert f"megatron-core {MCORE} has no optimizer-state offload" in r["verdict"]
    assert "bridge-fgo-run --offload builtin" in r["verdict"] and "BRIDGE_FGO_OFFLOAD=builtin" in r["verdict"]
    assert os.path.realpath(r["executable"]) == os.path.realpath(sys.executable)


def test_check_builtin_through_the_launcher_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    proc = run(["bridge-fgo-run", "--offload", "builtin", "--strict", "--check", "--json",
                "python", "-c", "import sys; open(sys.argv[1], 'w').close()", str(marker)])
    r = json.loads(proc.stdout)
    assert not marker.exists() and "--check: python is not run" in proc.stderr
    assert (r["mode"], r["strict"], r["targets"]) == ("builtin", True, ALL_TARGETS)
    assert proc.returncode == 0 and r["offload_ready"] is True
    assert r["verdict"].startswith("offload will run (mode builtin)")


def test_status_names_a_missing_target():
    proc = run(["python", "-m", "bridge_fgo", "status"], simulate="no-copy-helper")
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = flat(proc.stdout)
    assert f"target {HELPER} MISSING: not in megatron.bridge.training.train" in out
    assert "outcome not-patched (what patch() would do here)" in out
    assert f"megatron-bridge {BRIDGE} " in out  # the version row
    assert f"reason megatron-bridge {BRIDGE} has a training loop bridge_fgo does not recognise: " \
           f"megatron.bridge.training.train.{HELPER} is missing" in out
    assert f"verdict offload will not run: nothing would be patched, because megatron.bridge.training.train.{HELPER} " \
           "is missing" in out
    assert "target train_step found" in out


def test_status_bridge_not_importable():
    proc = run(["bridge-fgo", "status", "--json"], simulate="no-bridge")
    assert proc.returncode == 1, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["targets"] == {} and r["offload_ready"] is False and r["outcome"] == "not-patched"
    assert "megatron.bridge.training.train cannot be imported (ModuleNotFoundError: No module named " \
           "'megatron.bridge" in r["reason"]
    assert r["verdict"].startswith(f"offload will not run: megatron-bridge {BRIDGE} is installed but")
    assert r["generation"] == "none"  # Megatron-Core itself is still there


def test_bad_options_exit_2():
    proc = run(["bridge-fgo", "status", "--offload", "sometimes"])
    assert proc.returncode == 2 and "'sometimes'" in proc.stderr and "'builtin'" in proc.stderr
    proc = run(["bridge-fgo", "status"], env={"BRIDGE_FGO_OFFLOAD": "sometimes"})
    assert proc.returncode == 2
    assert "BRIDGE_FGO_OFFLOAD='sometimes' is not an offload mode; allowed: auto, builtin, off" in proc.stderr
    proc = run(["bridge-fgo-run", "--check"], env={"BRIDGE_FGO_DISABLE": "perhaps"})
    assert proc.returncode == 2 and "BRIDGE_FGO_DISABLE='perhaps'" in proc.stderr
    proc = run(["bridge-fgo"])
    assert proc.returncode == 2 and "status" in proc.stderr
    proc = run(["bridge-fgo", "status", "--help"])
    assert proc.returncode == 0
    assert all(s in flat(proc.stdout) for s in ("exit status:", "0 offload will run", "1 it will not", "2 a bad"))


# -- diagnose() in this process: every verdict ---------------------------------------------------------

def test_verdict_auto_on_this_megatron_core(train_module):
    report = diagnose_mod.diagnose(Options())
    assert report.offload_ready is False and diagnose_mod.exit_code(report) == 1
    assert report.verdict.startswith(f"offload will not run in mode auto: megatron-core {MCORE} ")
    text = flat(str(report))
    assert "megatron-core offload none: this Megatron-Core has no optimizer-state offload" in text
    assert "bridge wires offload itself no" in text and "target train found" in text


def test_verdict_three_method(three_method):
    report = diagnose_mod.diagnose(Options())
    assert report.generation == "three-method" and report.offload_ready
    assert report.verdict.startswith("offload will run (mode auto) through Megatron-Core's three-method offloader")


def test_verdict_chunked(mocker, train_module):
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    for m in chunked.METHODS:
        mocker.patch.object(MegatronOptimizer, m, create=True, new=lambda self, *a, **k: None)
    report = diagnose_mod.diagnose(Options())
    assert report.generation == "chunked" and report.offload_ready
    assert report.verdict.startswith("offload will run (mode auto) through Megatron-Core's chunked offloader")


def test_verdict_builtin_off_disable(train_module):
    builtin = diagnose_mod.diagnose(Options(offload="builtin"))
    assert builtin.offload_ready is True and builtin.verdict.startswith("offload will run (mode builtin)")
    off = diagnose_mod.diagnose(Options(offload="off"))
    assert not off.offload_ready and "offload=off patches but never offloads" in off.verdict
    disabled = diagnose_mod.diagnose(Options(disable=True))
    assert not disabled.offload_ready and disabled.reason == "disabled" and "BRIDGE_FGO_DISABLE" in disabled.verdict


def test_verdict_native_wiring(monkeypatch, train_module):
    real = train_module.train_step

    def train_step(*args, **kwargs):  # a Bridge that wires offload itself
        args[3].offload_states()
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", train_step)
    auto = diagnose_mod.diagnose(Options())
    assert auto.outcome == "stepped-aside" and auto.native_wiring == ["offload_states"] and auto.offload_ready
    builtin = diagnose_mod.diagnose(Options(offload="builtin"))
    assert not builtin.offload_ready and "offload=builtin has no effect" in builtin.verdict


def test_verdict_pretrain_bypass(monkeypatch, train_module):
    import megatron.bridge.training.pretrain as pretrain

    monkeypatch.setattr(pretrain, "train", lambda *a, **k: None)
    report = diagnose_mod.diagnose(Options(offload="builtin"))
    assert not report.offload_ready and report.targets[PRETRAIN_ALIAS] is False
    assert "runs started through pretrain() (Bridge's recipes) would bypass the patch" in report.verdict


def test_verdict_bridge_not_installed(monkeypatch):
    fake_versions = {**versions_mod.versions(), "megatron-bridge": None}
    monkeypatch.setattr(versions_mod, "versions", lambda: fake_versions)
    missing = "ModuleNotFoundError: No module named 'megatron.bridge'"
    monkeypatch.setattr(diagnose_mod, "_import", lambda name: (None, missing))
    report = diagnose_mod.diagnose(Options())
    assert report.reason == "megatron-bridge is not installed" and not report.offload_ready
    assert report.verdict.startswith("offload will not run: megatron-bridge is not installed in this Python")
    assert "megatron-bridge not installed" in flat(str(report))


def test_diagnose_in_a_patched_process_reports_the_real_patch(train_module):
    bridge_fgo.patch()
    report = diagnose_mod.diagnose(Options())
    assert (report.predicted, report.patched, report.outcome) == (False, True, "patched")
    assert "(this process only inspects)" not in str(report)


def test_cli_in_process(capsys, monkeypatch, train_module):
    assert cli.main(["status", "--offload", "off"]) == 1
    out = capsys.readouterr().out
    assert flat(out).startswith("patched no (this process only inspects) outcome patched")
    assert "offload mode" in out and "verdict" in out
    monkeypatch.setenv("BRIDGE_FGO_STRICT", "perhaps")
    assert cli.main(["status"]) == 2
    assert "BRIDGE_FGO_STRICT='perhaps'" in capsys.readouterr().err


# -- run-time evidence: the log lines of a (stand-in) training run -------------------------------------

def train_through_the_wrapper(rig, steps):
    """Bridge's train() wrapper around a stand-in loop that calls the real (patched) train_step: the
    real train() needs a cluster, the wrapper's start/end logic does not."""
    loop_site = bridge_fgo.instrument.patcher._current.callsites.site(targets.target("train"))

    def loop(**kwargs):
        harness.run_steps(rig, steps=steps)

    return loop_site(loop, None, (), {"model": rig.model, "optimizer": rig.optimizer, "global_state": rig.global_state})


def messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "bridge_fgo" and r.levelno == level]


def test_first_step_and_summary_lines_carry_the_rank(three_method, caplog_fgo, monkeypatch):
    monkeypatch.setenv("RANK", "3")  # torch.distributed is not up: the launcher's RANK names the rank
    bridge_fgo.patch()
    rig = harness.Rig(cfg=harness.config_container(harness.optimizer_config(offload_optimizer_states=True)))
    train_through_the_wrapper(rig, steps=2)
    info = [m for m in messages(caplog_fgo, logging.INFO) if "offload active" in m or "offload summary" in m]
    assert info == [
        "[rank 3] offload active: mode=three-method, 1 optimizer(s), ? tensor(s), ? bytes offloaded per step",
        "[rank 3] offload summary: mode=three-method, steps=2, offload=2 release=2 reload=2 calls, "
        "unknown bytes offloaded, unknown bytes reloaded",  # Megatron-Core's offloader does not say
    ]
    assert messages(caplog_fgo, logging.WARNING) == []


def test_zero_offloads_warns_and_strict_raises(three_method, caplog_fgo, train_module):
    def run_without_release_site(steps):
        # a loop that no longer reaches the release site: steps run, nothing is offloaded
        rig = harness.Rig(cfg=harness.config_container(harness.optimizer_config(offload_optimizer_states=True)))
        helper = getattr(train_module, HELPER)
        with mock.patch.object(train_module, HELPER, helper.__wrapped__):
            train_through_the_wrapper(rig, steps=steps)

    bridge_fgo.patch()
    run_without_release_site(2)
    (warning,) = messages(caplog_fgo, logging.WARNING)
    assert warning == ("[rank 0] offload was requested (mode=three-method) but no offload happened in 2 "
                       "training step(s)")
    bridge_fgo.unpatch()
    bridge_fgo.patch(strict=True)
    with pytest.raises(BridgeFGOError, match="no offload happened in 1 training step"):
        run_without_release_site(1)
