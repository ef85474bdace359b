"""bridge-fgo-run [OPTIONS] COMMAND [ARGS...]: run an unchanged launch command with bridge_fgo's patch
in every Python process it starts.

torchrun and srun start fresh worker processes, so a patch() in the launching shell never reaches
them. Like ddtrace-run and opentelemetry-instrument, this puts a directory holding a sitecustomize.py
first on PYTHONPATH, exports the options as BRIDGE_FGO_* variables, and execs the command: same PID,
argv, signals and exit status. Each Python process the command starts (torchrun's agent, every
worker) then registers the patch's import hook at startup.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Mapping, Optional, Sequence

from .. import __version__, options as options_mod
from .status import add_option_flags, add_verbose, options_from
from ..errors import BridgeFGOOptionError

PROG = "bridge-fgo-run"

EPILOG = f"""\
examples:
  {PROG} torchrun --nproc-per-node 8 scripts/training/run_recipe.py --recipe ... KEY=VALUE
  {PROG} --offload builtin python -m torch.distributed.run --nproc-per-node 8 pretrain.py
  {PROG} pretrain.py ARGS            (a path ending in .py runs with this Python)
  {PROG} --check [--json]            (what would happen here; runs nothing)

Everything from COMMAND on is passed through untouched, options included.

environment (each option sets one, so every rank reads the same value):
  {'   '.join(f"{o.env}={'1' if o.is_flag else ('{' + ','.join(o.choices) + '}') if o.choices else o.metavar}"
             for o in options_mod.OPTIONS)}
  PYTHONPATH gets bridge_fgo's bootstrap directory first (once).

not reached: python -E and -I ignore PYTHONPATH, python -S skips sitecustomize; a process started
with an environment that drops PYTHONPATH. For srun / multi-node launches put {PROG} inside the
per-node command (srun {PROG} torchrun ...), or export PYTHONPATH and the BRIDGE_FGO_* variables
yourself (`{PROG} --print-env` shows them).

exit status: the command's own; 2 for a bad option or BRIDGE_FGO_* value (nothing is run);
127 when COMMAND is not found, 126 when it cannot be executed.
With --check: 0 when offload will run in the chosen mode, 1 when it will not (the verdict says why),
2 for a bad option.
"""


def bootstrap_dir() -> str:
    from .bootstrap import DIRECTORY

    return DIRECTORY


def _same_path(a: str, b: str) -> bool:
    return bool(a) and os.path.realpath(a) == os.path.realpath(b)


def python_path(existing: Optional[str], directory: Optional[str] = None) -> str:
    """PYTHONPATH with `directory` first and nowhere else; the other entries keep their order.
    An empty entry means the working directory to Python, so one is never added, only kept."""
    directory = directory or bootstrap_dir()
    if not existing:
        return directory
    rest = [p for p in existing.split(os.pathsep) if not _same_path(p, directory)]
    return os.pathsep.join([directory, *rest])


def child_env(args: argparse.Namespace, base: Mapping[str, str]) -> dict:
    """`base` with each option given on the command line exported as its BRIDGE_FGO_* variable."""
    env = dict(base)
    for opt in options_mod.OPTIONS:
        value = getattr(args, opt.name)
        if value is not None:
            env[opt.env] = opt.to_env(value)
    env["PYTHONPATH"] = python_path(env.get("PYTHONPATH"))
    return env


def command_argv(command: Sequence[str]) -> List[str]:
    """A script path ending in .py runs with this interpreter; anything else as given."""
    if command[0].endswith(".py") and os.path.isfile(command[0]):
        return [sys.executable, *command]
    return list(command)


def unreachable_python_flags(argv: Sequence[str]) -> List[str]:
    """Which of -I, -E, -S a `python ...` command line sets (each stops the bootstrap)."""
    name = os.path.basename(argv[0]).lower()
    if not name.startswith("python"):
        return []
    found: List[str] = []
    rest = iter(argv[1:])
    for arg in rest:
        if arg in ("-", "--") or not arg.startswith("-"):
            break  # the script: options end
        if arg.startswith("--"):
            continue  # --version and the like
        for i, ch in enumerate(arg[1:], start=1):
            if ch in "IES" and f"-{ch}" not in found:
                found.append(f"-{ch}")
            if ch in "cm":  # what follows is the code or the module: options end
                return found
            if ch in "WX":  # takes a value, attached or as the next argument
                if i == len(arg) - 1:
                    next(rest, None)
                break
    return found


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [OPTIONS] COMMAND [ARGS...]",
        description="Run COMMAND with bridge_fgo's optimizer-state offload patch in every Python process\n"
                    "it starts (torchrun workers included).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_option_flags(p)
    p.add_argument("--check", action="store_true",
                   help="print the status report for this environment and exit (0: offload will run, 1: it will "
                        "not); COMMAND, if given, is not run")
    p.add_argument("--json", action="store_true", help="with --check: the report as JSON")
    add_verbose(p, "with --check: ")
    p.add_argument("--print-env", action="store_true",
                   help="print the variables the command would get (PYTHONPATH, BRIDGE_FGO_*) as shell exports "
                        "and exit: for launchers that cannot take a wrapper")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                   help="the command to run, with its own arguments")
    return p


def _error(msg: str) -> None:
    sys.stderr.write(f"{PROG}: error: {msg}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    for flag in ("json", "verbose"):
        if getattr(args, flag) and not args.check:
            p.error(f"--{flag} goes with --check")
    if not command and not (args.check or args.print_env):
        p.error("COMMAND is required (or --check)")

    env = child_env(args, os.environ)
    # Every rank would fail on a bad value; say it once, here, before anything runs.
    try:
        opts = options_from(args, env)
    except BridgeFGOOptionError as err:
        _error(str(err))
        return 2
    for name in options_mod.unknown_env(env):
        sys.stderr.write(f"{PROG}: warning: {name} is not a bridge_fgo variable and is ignored "
                         f"(known: {', '.join(options_mod.known_env())})\n")

    if args.check:
        from .status import print_status

        if command:
            sys.stderr.write(f"{PROG}: --check: {command[0]} is not run\n")
        return print_status(opts, as_json=args.json, verbose=args.verbose, prog=f"{PROG} --check")
    if args.print_env:
        import shlex

        for key in ("PYTHONPATH", *options_mod.known_env()):
            if key in env:
                sys.stdout.write(f"export {key}={shlex.quote(env[key])}\n")
        return 0

    argv_out = command_argv(command)
    flags = unreachable_python_flags(argv_out)
    if flags:
        msg = (f"{' '.join(flags)} on the python command line: python -E/-I ignore PYTHONPATH and -S skips "
               "sitecustomize, so bridge_fgo's bootstrap cannot reach this process; drop the flag or call "
               "bridge_fgo.patch() in the script")
        if opts.strict:
            _error(msg)
            return 2
        sys.stderr.write(f"{PROG}: warning: {msg}\n")

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv_out[0], argv_out, env)  # returns only on failure
    except FileNotFoundError:
        _error(f"command not found: {argv_out[0]}")
        return 127
    except OSError as err:
        _error(f"cannot run {argv_out[0]}: {err.strerror or err}")
        return 126
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
