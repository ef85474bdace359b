"""Options defined once (options.OPTIONS): patch(), the BRIDGE_FGO_* variables, bridge-fgo-run's and
bridge-fgo status's flags; chunk_mb as the proof. The commands' rough edges (--version, usage,
import noise, --disable winning over --strict), and what the wheel carries."""
import inspect
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import bridge_fgo
from bridge_fgo import BridgeFGOOptionError, options
from bridge_fgo.cli import launcher, status as cli
from bridge_fgo.instrument import diagnose as diagnose_mod
from bridge_fgo.options import DEFAULT_CHUNK_MB, Options
from support import harness
from conftest import BRIDGE, ROOT, pythonpath

BIN = os.path.dirname(sys.executable)
USERDIR = os.path.join(ROOT, "tests", "userdir")
BAD_CHUNK_MB = [-1, True, False, 1.5, 256.0, "256"]  # negative, bool, float, not an integer


def command(args, env=None, timeout=180):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("BRIDGE_FGO_", "FGO_TEST_"))}
    full.update({"PYTHONPATH": pythonpath(USERDIR), "PYTHONWARNINGS": "ignore", **(env or {})})
    return subprocess.run([os.path.join(BIN, args[0]), *args[1:]], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# -- one definition per option -------------------------------------------------------------------

def test_every_option_reaches_patch_the_environment_and_both_commands():
    names = [o.name for o in options.OPTIONS]
    assert names == ["offload", "strict", "disable", "chunk_mb", "gpu_budget_gib"]
    assert [f.name for f in __import__("dataclasses").fields(Options)] == names
    assert options.known_env() == ("BRIDGE_FGO_OFFLOAD", "BRIDGE_FGO_STRICT", "BRIDGE_FGO_DISABLE",
                                   "BRIDGE_FGO_CHUNK_MB", "BRIDGE_FGO_GPU_BUDGET_GIB")
    # patch() takes every option but disable (the escape hatch lives in the environment and the launcher)
    assert set(inspect.signature(bridge_fgo.patch).parameters) == set(names) - {"disable"}
    run_flags = {a.option_strings[0] for a in launcher.parser()._actions if a.option_strings}
    assert {"--offload", "--strict", "--disable", "--chunk-mb", "--gpu-budget-gib"} <= run_flags
    _, status = cli.parsers()
    status_flags = {a.option_strings[0] for a in status._actions if a.option_strings}
    assert {"--offload", "--strict", "--chunk-mb", "--gpu-budget-gib"} <= status_flags
    assert "--disable" not in status_flags


def test_chunk_mb_default_and_values():
    assert DEFAULT_CHUNK_MB == "auto" and Options().chunk_mb == "auto"
    assert options.first_chunk_mb("auto") == options.FIRST_CHUNK_MB == 256 and options.first_chunk_mb(64) == 64
    for raw in ("auto", " AUTO ", "Auto"):
        assert options.from_env({"BRIDGE_FGO_CHUNK_MB": raw}).chunk_mb == "auto"
    assert bridge_fgo.patch(chunk_mb="auto").chunk_mb == "auto"
    bridge_fgo.unpatch()
    assert bridge_fgo.patch(chunk_mb=0).chunk_mb == 0
    bridge_fgo.unpatch()
    assert options.from_env({"BRIDGE_FGO_CHUNK_MB": " 64 "}).chunk_mb == 64
    assert options.from_env({"BRIDGE_FGO_CHUNK_MB": "64"}, chunk_mb=8).chunk_mb == 8  # the argument wins


@pytest.mark.parametrize("bad", BAD_CHUNK_MB, ids=repr)
def test_bad_chunk_mb_in_patch(bad):
    with pytest.raises(BridgeFGOOptionError, match=r"chunk_mb=.* is not a window size in MB; allowed: 'auto' \(sized "
                                                   r"from the run\), or an integer >= 0 \(0 = one window\)") as err:
        bridge_fgo.patch(chunk_mb=bad)
    assert isinstance(err.value, ValueError) and not bridge_fgo.is_patched()


@pytest.mark.parametrize("raw", ["-1", "1.5", "big", "", "0x10", "--5"])
def test_bad_chunk_mb_in_the_environment(raw, monkeypatch):
    monkeypatch.setenv("BRIDGE_FGO_CHUNK_MB", raw)
    with pytest.raises(BridgeFGOOptionError, match="BRIDGE_FGO_CHUNK_MB=.* is not a window size in MB"):
        bridge_fgo.patch()


def test_chunk_mb_and_budget_reach_the_builtin_engine():
    bridge_fgo.patch(offload="builtin", chunk_mb=64, gpu_budget_gib=1.5)
    rig = harness.Rig(cfg=harness.config_container(mxfp8_copy=False), with_tensors=True)
    harness.run_steps(rig, steps=1)
    session = next(iter(bridge_fgo.instrument.patcher._current.callsites.registry.sessions()))
    engine = session.adapter.engine
    assert session.adapter.chunk_mb == 64 and engine.plan.chunk_bytes == 64 * 2**20
    assert engine.fitting.budget_bytes == int(1.5 * 2**30) and len(engine.parts) == 1


def test_gpu_budget_values():
    assert Options().gpu_budget_gib is None
    assert options.from_env({"BRIDGE_FGO_GPU_BUDGET_GIB": " 16.5 "}).gpu_budget_gib == 16.5
    assert options.from_env({"BRIDGE_FGO_GPU_BUDGET_GIB": "40"}).gpu_budget_gib == 40.0
    for bad in (0, -1, True, "8", float("inf"), float("nan")):
        with pytest.raises(BridgeFGOOptionError, match=r"gpu_budget_gib=.* is not a GPU memory budget; allowed: a "
                                                       r"number of GiB > 0"):
            bridge_fgo.patch(gpu_budget_gib=bad)
    for raw in ("0", "-2", "lots", "", "1e999"):
        with pytest.raises(BridgeFGOOptionError, match="BRIDGE_FGO_GPU_BUDGET_GIB=.* is not a GPU memory budget"):
            options.from_env({"BRIDGE_FGO_GPU_BUDGET_GIB": raw})
    with pytest.raises(BridgeFGOOptionError, match="needs the streamed step"):
        options.from_env({"BRIDGE_FGO_GPU_BUDGET_GIB": "8", "BRIDGE_FGO_CHUNK_MB": "0"})
    assert not bridge_fgo.is_patched()


def test_launcher_exports_and_refuses_the_budget(tmp_path):
    proc = command(["bridge-fgo-run", "--gpu-budget-gib", "12.5", "--print-env"])
    assert proc.returncode == 0 and "export BRIDGE_FGO_GPU_BUDGET_GIB=12.5" in proc.stdout.splitlines()
    marker = tmp_path / "ran"
    proc = command(["bridge-fgo-run", "--gpu-budget-gib", "-1", "python", "-c",
                    "open(__import__('sys').argv[1], 'w')", str(marker)])
    assert proc.returncode == 2 and "is not a GPU memory budget" in proc.stderr and not marker.exists()


def test_status_shows_the_window(train_module):
    report = diagnose_mod.diagnose(Options(chunk_mb=0))
    assert report.to_dict()["chunk_mb"] == 0
    assert "builtin engine window 0 (one window)" in " ".join(str(report).split())
    assert "builtin engine window 512 MB" in " ".join(str(diagnose_mod.diagnose(Options(chunk_mb=512))).split())
    assert "builtin engine window auto" in " ".join(str(diagnose_mod.diagnose(Options())).split())


def test_launcher_exports_and_refuses_chunk_mb(tmp_path):
    proc = command(["bridge-fgo-run", "--chunk-mb", "64", "--print-env"])
    assert proc.returncode == 0 and "export BRIDGE_FGO_CHUNK_MB=64" in proc.stdout.splitlines()
    proc = command(["bridge-fgo-run", "--chunk-mb", "auto", "--print-env"])
    assert proc.returncode == 0 and "export BRIDGE_FGO_CHUNK_MB=auto" in proc.stdout.splitlines()
    marker = tmp_path / "ran"
    for args, env in ((["--chunk-mb", "-3"], {}), (["--chunk-mb", "1.5"], {}), ([], {"BRIDGE_FGO_CHUNK_MB": "x"})):
        proc = command(["bridge-fgo-run", *args, "python", "-c", "open(__import__('sys').argv[1], 'w')",
                        str(marker)], env=env)
        assert proc.returncode == 2, proc.stderr
        assert ("is not a window size in MB; allowed: 'auto' (sized from the run), or an integer >= 0 (0 = one window)"
                in proc.stderr)
        assert not marker.exists()


# -- the commands' rough edges --------------------------------------------------------------------

def test_version_on_both_commands():
    for cmd in ("bridge-fgo", "bridge-fgo-run"):
        proc = command([cmd, "--version"])
        assert (proc.returncode, proc.stdout.strip()) == (0, f"{cmd} {bridge_fgo.__version__}")


def test_status_bogus_prints_the_status_usage():
    proc = command(["bridge-fgo", "status", "--bogus"])
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: bridge-fgo status [-h] [--json]")
    assert "bridge-fgo status: error: unrecognized arguments: --bogus" in proc.stderr


def test_status_holds_back_third_party_noise_unless_verbose():
    quiet = command(["bridge-fgo", "status", "--json"], env={"PYTHONWARNINGS": "default::UserWarning"})
    assert quiet.returncode == 1 and json.loads(quiet.stdout)["versions"]["megatron-bridge"] == BRIDGE
    (line,) = quiet.stderr.splitlines()  # one line, and no Megatron/Bridge warning or traceback
    assert line.startswith("bridge-fgo status: held back ") and "traceback(s)); --verbose shows them" in line
    tracebacks = int(line.split(" traceback(s)")[0].rsplit("(warnings, ", 1)[1])
    loud = command(["bridge-fgo", "status", "--json", "--verbose"], env={"PYTHONWARNINGS": "default::UserWarning"})
    assert loud.returncode == 1 and json.loads(loud.stdout)["mode"] == "auto"
    assert "UserWarning" in loud.stderr and loud.stderr.count("Traceback (most recent call last)") == tracebacks
    assert "held back" not in loud.stderr


def test_disable_wins_over_strict_where_bridge_fgo_cannot_be_imported(tmp_path):
    base = getattr(sys, "_base_executable", None)
    probe = subprocess.run([base, "-c", "import wrapt"], capture_output=True) if base else None
    if probe is None or probe.returncode == 0:
        pytest.skip("no interpreter at hand that lacks bridge_fgo's dependencies")
    marker = tmp_path / "ran"
    code = "import sys; open(sys.argv[1], 'w').close()"
    proc = command(["bridge-fgo-run", "--strict", "--disable", base, "-c", code, str(marker)])
    assert proc.returncode == 0 and marker.exists(), proc.stderr
    assert "BRIDGE_FGO_DISABLE is set: nothing patched; bridge_fgo cannot be imported by" in proc.stderr
    marker.unlink()
    proc = command(["bridge-fgo-run", "--strict", base, "-c", code, str(marker)])  # not disabled: strict stops it
    assert proc.returncode == 2 and not marker.exists()
    assert "BRIDGE_FGO_STRICT is set: stopping (exit status 2)" in proc.stderr


# -- the wheel ------------------------------------------------------------------------------------

def test_wheel_carries_the_package_and_no_test_rig(tmp_path):
    src = tmp_path / "src"
    keep = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("bridge_fgo", "tests"):
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=keep)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "out"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "out").iterdir()
    files = zipfile.ZipFile(wheel).namelist()
    code = sorted(f for f in files if ".dist-info/" not in f)
    expected = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "bridge_fgo"))
                      if "__pycache__" not in d for f in fs if f.endswith(".py"))
    assert code == expected
    assert "bridge_fgo/cli/bootstrap/sitecustomize.py" in code and "bridge_fgo/envflags.py" in code
    assert not any(f.startswith(("tests/", "support/")) or "/support/" in f for f in files)
