"""bridge-fgo-run for real: the installed console script, in subprocesses, exec'ing real commands."""
import json
import os
import subprocess
import sys

import pytest

from bridge_fgo.cli import launcher
from bridge_fgo.cli.bootstrap import DIRECTORY as BOOTSTRAP
from conftest import BRIDGE, ROOT, SCRIPTS, pythonpath

BIN = os.path.dirname(sys.executable)
RUN = os.path.join(BIN, "bridge-fgo-run")
USERDIR = os.path.join(ROOT, "tests", "userdir")
USER_SITECUSTOMIZE = os.path.join(USERDIR, "sitecustomize.py")
LAUNCHED = os.path.join(SCRIPTS, "launched.py")


def env_for(extra=None):
    """The test process's environment without anything bridge_fgo or the tests set; the venv first on
    PATH, as in an activated venv (so `python` and `torchrun` are the venv's)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BRIDGE_FGO_", "FGO_TEST_")) and k != "PYTHONPATH"}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.setdefault("PYTHONWARNINGS", "ignore")
    extra = dict(extra or {})
    given = extra.pop("PYTHONPATH", None)
    env.update(extra)
    env["PYTHONPATH"] = pythonpath(*given.split(os.pathsep)) if given else pythonpath()
    return env


def launch(args, env=None, input=None, timeout=120):
    return subprocess.run([RUN, *args], env=env_for(env), input=input, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def report_of(proc):
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr  # the script's own line and nothing else
    return json.loads(lines[0])


# -- the command runs as if typed: same PID, argv, stdin/stdout, exit status -------------------------

def test_python_script_passthrough_and_user_sitecustomize():
    proc = subprocess.Popen(
        [RUN, "--strict", "python", LAUNCHED, "--strict", "-x", "a b", ""],
        env=env_for({"PYTHONPATH": os.pathsep.join([USERDIR, BOOTSTRAP, "/nonexistent/extra"]),
                     "FGO_TEST_EXIT": "7"}),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    out, err = proc.communicate("line one\nline two\n", timeout=120)
    assert proc.returncode == 7, err
    r = json.loads(out)
    assert r["pid"] == proc.pid  # exec'd, not a child: signals reach the command itself
    assert r["argv"] == [LAUNCHED, "--strict", "-x", "a b", ""]  # the command's own --strict untouched
    assert os.path.realpath(r["executable"]) == os.path.realpath(os.path.join(BIN, "python"))
    assert r["stdin"] == "line one\nline two\n"
    # the patch is registered, strict exported, and nothing heavy was imported to do it
    assert (r["outcome"], r["mode"], r["strict"]) == ("pending", "auto", True)
    assert r["env"] == {"BRIDGE_FGO_STRICT": "1"}
    assert r["heavy_modules"] == []
    # the bootstrap first on PYTHONPATH, once; the user's entries kept in order
    assert r["pythonpath"] == os.pathsep.join([BOOTSTRAP, USERDIR, "/nonexistent/extra", ROOT])
    assert r["sys_path_has_bootstrap"]
    # the user's own sitecustomize ran, from inside the bootstrap, and is the `sitecustomize` module
    assert r["user_sitecustomize_ran"] and r["user_sitecustomize_saw_bootstrap"]
    assert r["sitecustomize_file"] == USER_SITECUSTOMIZE
    # logging: one handler, so per-rank INFO lines show under the launcher; the lines still propagate
    # to whatever the user configures (test_log_lines_reach_the_users_root_handler_once)
    assert r["handlers"] == ["_UnlessTheUserLogs"] and r["logger_propagates"] is True
    # the bootstrap running twice in one process: no second hook, no second handler
    assert r["again"] == {"outcome": "pending", "handlers_unchanged": True, "hooks_before": 1, "hooks_after": 1}
    assert "bridge_fgo" not in err  # registering the hook is silent; the patch speaks when it applies


def test_dot_py_runs_with_this_python_and_option_beats_environment():
    proc = launch(["--offload", "builtin", LAUNCHED, "x"], env={"BRIDGE_FGO_OFFLOAD": "off"})
    assert proc.returncode == 0, proc.stderr
    r = report_of(proc)
    assert r["argv"] == [LAUNCHED, "x"]
    assert os.path.realpath(r["executable"]) == os.path.realpath(sys.executable)
    assert (r["outcome"], r["mode"], r["strict"]) == ("pending", "builtin", False)
    assert r["pythonpath"] == os.pathsep.join([BOOTSTRAP, ROOT])
    assert r["sitecustomize_file"] == os.path.join(BOOTSTRAP, "sitecustomize.py")  # none to chain to
    assert not r["user_sitecustomize_ran"]


def test_nested_launcher_and_disable():
    proc = launch(["--disable", RUN, "python", "-c",
                   "import os, bridge_fgo; "
                   "print(bridge_fgo.status().outcome, bridge_fgo.is_patched(), os.environ['PYTHONPATH'])"])
    assert proc.returncode == 0, proc.stderr
    # the inner launcher added no second entry
    assert proc.stdout.split() == ["not-patched", "False", os.pathsep.join([BOOTSTRAP, ROOT])]
    assert "bridge_fgo INFO: bridge_fgo disabled by BRIDGE_FGO_DISABLE: nothing patched" in proc.stderr


def test_failing_user_sitecustomize_is_reported_and_patch_still_registered():
    proc = launch(["python", "-c", "import bridge_fgo; print(bridge_fgo.status().outcome)"],
                  env={"PYTHONPATH": USERDIR, "FGO_TEST_SIMULATE": "raise"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "pending"
    assert (f"bridge_fgo ERROR: error in sitecustomize {USER_SITECUSTOMIZE}: RuntimeError: the user's "
            "sitecustomize failed (simulated)") in proc.stderr


# -- every rank of a real torchrun ---------------------------------------------------------------

def test_torchrun_two_workers_each_patched():
    proc = launch(["--offload", "builtin", "torchrun", "--standalone", "--nproc-per-node", "2",
                   os.path.join(SCRIPTS, "dist_worker.py")],
                  env={"PYTHONPATH": USERDIR, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    workers = [json.loads(line[len("WORKER "):]) for line in proc.stdout.splitlines() if line.startswith("WORKER ")]
    assert sorted(w["rank"] for w in workers) == [0, 1], proc.stdout
    for w in workers:
        assert w["env_rank"] == w["rank"] and w["world"] == 2 and w["all_reduce"] == 3.0
        assert w["pending_before_import"] == "pending"
        assert w["is_patched"] and w["outcome"] == "patched" and w["mode"] == "builtin", w
        assert w["wrapped_once"] and w["pretrain_reaches_wrapper"], w
    assert len({w["pid"] for w in workers}) == 2
    # one INFO line per worker process, naming its rank, once: importing Bridge's train module gives
    # the root logger Megatron's handler (megatron/training/log_handler.py, to stdout), so the line goes
    # there and the bootstrap's own handler steps back
    for rank in (0, 1):
        line = f"[rank {rank}] patched megatron-bridge {BRIDGE} "
        assert (proc.stdout + proc.stderr).count(line) == 1, proc.stdout[-3000:] + proc.stderr[-5000:]


# -- refusing before anything runs ---------------------------------------------------------------

MARKER_CODE = "import sys; open(sys.argv[1], 'w').close()"


@pytest.mark.parametrize("args,env,needles", [
    (["--offload", "bogus"], {}, ["'bogus'", "'auto'", "'builtin'", "'off'"]),
    ([], {"BRIDGE_FGO_OFFLOAD": "sometimes"}, ["BRIDGE_FGO_OFFLOAD='sometimes'", "allowed: auto, builtin, off"]),
    ([], {"BRIDGE_FGO_STRICT": "maybe"}, ["BRIDGE_FGO_STRICT='maybe'", "allowed: 1, true"]),
    (["--strict"], {"BRIDGE_FGO_DISABLE": "2"}, ["BRIDGE_FGO_DISABLE='2'", "allowed: 1, true"]),
], ids=["option", "env-offload", "env-strict", "env-disable"])
def test_bad_value_exits_2_before_running(tmp_path, args, env, needles):
    marker = tmp_path / "ran"
    proc = launch([*args, "python", "-c", MARKER_CODE, str(marker)], env=env)
    assert proc.returncode == 2, proc.stderr
    for needle in needles:
        assert needle in proc.stderr
    assert not marker.exists()


def test_usage_errors_and_unrunnable_commands(tmp_path):
    proc = launch([])
    assert proc.returncode == 2 and "usage: bridge-fgo-run [OPTIONS] COMMAND [ARGS...]" in proc.stderr
    proc = launch(["--json", "true"])
    assert proc.returncode == 2 and "--json goes with --check" in proc.stderr
    proc = launch(["no-such-command-bridge-fgo", "arg"])
    assert proc.returncode == 127 and "command not found: no-such-command-bridge-fgo" in proc.stderr
    proc = launch([str(tmp_path / "missing.py")])
    assert proc.returncode == 127 and "missing.py" in proc.stderr
    proc = launch([str(tmp_path)])
    assert proc.returncode == 126 and "cannot run" in proc.stderr
    proc = launch(["--help"])
    assert proc.returncode == 0
    for needle in ("--strict", "--disable", "--offload {auto,builtin,off}", "--check", "python -E", "srun",
                   "exit status", "127"):
        assert needle in proc.stdout


def test_python_flags_that_bypass_the_bootstrap(tmp_path):
    proc = launch(["python", "-I", "-c", "import sys; print(sys.flags.isolated)"])
    assert proc.returncode == 0 and proc.stdout.strip() == "1"
    assert "warning: -I on the python command line" in proc.stderr
    marker = tmp_path / "ran"
    proc = launch(["--strict", "python", "-Es", "-c", MARKER_CODE, str(marker)])
    assert proc.returncode == 2 and "error: -E on the python command line" in proc.stderr
    assert not marker.exists()


def test_unknown_variable_warns_and_runs():
    proc = launch(["python", "-c", "print('ran')"], env={"BRIDGE_FGO_OFLOAD": "builtin"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ran"
    assert "warning: BRIDGE_FGO_OFLOAD is not a bridge_fgo variable" in proc.stderr


def test_print_env_for_launchers_that_take_no_wrapper():
    proc = launch(["--strict", "--offload", "builtin", "--print-env"], env={"PYTHONPATH": USERDIR})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"export PYTHONPATH={os.pathsep.join([BOOTSTRAP, USERDIR, ROOT])}",
                                        "export BRIDGE_FGO_OFFLOAD=builtin", "export BRIDGE_FGO_STRICT=1"]


# -- the bootstrap without the launcher (PYTHONPATH exported by hand, e.g. on other nodes) -------------

def test_bootstrap_bad_environment_logs_and_only_strict_stops():
    code = "import bridge_fgo; print('ran', bridge_fgo.is_patched())"
    env = {"PYTHONPATH": BOOTSTRAP, "BRIDGE_FGO_OFFLOAD": "bogus"}
    proc = subprocess.run([sys.executable, "-c", code], env=env_for(env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split()[0] == "ran"
    assert ("bridge_fgo ERROR: BRIDGE_FGO_OFFLOAD='bogus' is not an offload mode; allowed: auto, builtin, off: "
            "this process is not patched") in proc.stderr
    proc = subprocess.run([sys.executable, "-c", code], env=env_for({**env, "BRIDGE_FGO_STRICT": "1"}),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "BRIDGE_FGO_STRICT is set: stopping (exit status 2)" in proc.stderr


# -- pieces, in process --------------------------------------------------------------------------

def test_python_path_entries():
    d = "/opt/boot"
    assert launcher.python_path(None, d) == d
    assert launcher.python_path("", d) == d
    sep = os.pathsep
    assert launcher.python_path(f"/a{sep}{d}{sep}{d}/{sep}/b", d) == sep.join([d, "/a", "/b"])
    assert launcher.python_path(f"/a{sep}{sep}/b", d) == sep.join([d, "/a", "", "/b"])


@pytest.mark.parametrize("argv,flags", [
    (["python", "-I", "x.py"], ["-I"]),
    (["python3.12", "-EsS", "x.py"], ["-E", "-S"]),
    (["/usr/bin/python", "-X", "dev", "-W", "ignore", "-S", "x.py"], ["-S"]),
    (["python", "-c", "-I"], []),
    (["python", "-m", "torch.distributed.run", "-E"], []),
    (["python", "x.py", "-I"], []),
    (["torchrun", "-I"], []),
    (["python", "-Wignore", "-I", "x.py"], ["-I"]),
])
def test_unreachable_python_flags(argv, flags):
    assert launcher.unreachable_python_flags(argv) == flags


def test_log_lines_reach_the_users_root_handler_once():
    """Under bridge-fgo-run: without a logging config the launcher's handler prints bridge_fgo's lines;
    with one (basicConfig, as Megatron and most jobs do) they reach the user's handler, each once."""
    code = ("import logging, sys\n"
            "log = logging.getLogger('bridge_fgo')\n"
            "log.warning('before config')\n"
            "logging.basicConfig(stream=sys.stdout, format='USER %(name)s %(message)s')\n"
            "log.warning('after config')\n")
    proc = launch(["python", "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "bridge_fgo WARNING: before config" in proc.stderr and "before config" not in proc.stdout
    assert proc.stdout.count("after config") == 1 and "USER bridge_fgo after config" in proc.stdout
    assert "after config" not in proc.stderr
