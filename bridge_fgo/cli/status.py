"""`bridge-fgo status` (also `python -m bridge_fgo status`): will offload run here, and if not, why."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from typing import Iterator, List, Optional, Sequence

from .. import __version__, options as options_mod
from ..errors import BridgeFGOOptionError

EXIT_CODES = """\
exit status:
  0  offload will run in the chosen mode (auto: Megatron-Core has its own offloader; builtin: the
     training loop is recognised)
  1  it will not; the verdict says why and what to change
  2  a bad option or BRIDGE_FGO_* value
"""


def add_option_flags(p: argparse.ArgumentParser, status: bool = False) -> None:
    """One command-line flag per option in options.OPTIONS (for `bridge-fgo status`: those it judges
    with). Unset flags stay None, so the BRIDGE_FGO_* variables fill them in."""
    for opt in options_mod.OPTIONS:
        if status and not opt.in_status:
            continue
        if opt.is_flag:
            p.add_argument(opt.flag, action="store_true", default=None, help=opt.help)
            continue
        default = f"(default: {opt.env}, else {opt.default})"
        if opt.choices:  # argparse names the value and every choice
            p.add_argument(opt.flag, choices=opt.choices, help=f"{opt.help} {default}")
            continue

        def parse(text, opt=opt):
            try:
                return opt.parse(opt, text, opt.flag)
            except BridgeFGOOptionError as err:
                raise argparse.ArgumentTypeError(str(err)) from None

        p.add_argument(opt.flag, type=parse, metavar=opt.metavar, help=f"{opt.help} {default}")


def options_from(args: argparse.Namespace, env=None) -> options_mod.Options:
    """The options a command line gives, the BRIDGE_FGO_* variables filling the rest."""
    return options_mod.from_env(env, **{o.name: getattr(args, o.name, None) for o in options_mod.OPTIONS})


@contextlib.contextmanager
def third_party_output(verbose: bool, prog: str, hint: str = "; --verbose shows them") -> Iterator[None]:
    """Keep what importing Megatron and Bridge prints (their warnings, Megatron-Core's tracebacks
    for a missing Transformer Engine) out of the report: held back and summarised in one line on
    stderr, or with `verbose` shown on stderr as it was. Captures the file descriptors too, as some
    of it comes from C extensions."""
    if verbose:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the report (--json)
            yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+", buffering=1) as held:
        try:
            os.dup2(held.fileno(), 1)
            os.dup2(held.fileno(), 2)
            with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
                yield
        except BaseException:
            _restore(saved)
            held.seek(0)
            sys.stderr.write(held.read())  # it may explain the failure
            raise
        _restore(saved)
        held.seek(0)
        lines = [line for line in held.read().splitlines() if line.strip()]
    if lines:
        tracebacks = sum("Traceback (most recent call last)" in line for line in lines)
        sys.stderr.write(f"{prog}: held back {len(lines)} line(s) that importing Megatron-Bridge printed "
                         f"(warnings, {tracebacks} traceback(s)){hint}\n")


def _restore(saved: List[int]) -> None:
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)


def print_status(opts: options_mod.Options, as_json: bool = False, verbose: bool = False,
                 prog: str = "bridge-fgo status") -> int:
    """Diagnose, print the report (table or JSON) on stdout; returns the exit status (0 or 1)."""
    from ..instrument.diagnose import diagnose, exit_code

    with third_party_output(verbose, prog):
        report = diagnose(opts)
    sys.stdout.write((report.to_json() if as_json else str(report)) + "\n")
    sys.stdout.flush()
    return exit_code(report)


def add_verbose(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument("--verbose", action="store_true",
                   help=f"{what}show what importing Megatron and Bridge prints (by default held back and "
                        "summarised in one line)")


def parsers(prog: Optional[str] = None):
    """(the top-level parser, the `status` subparser)."""
    p = argparse.ArgumentParser(prog=prog or "bridge-fgo",
                                description="bridge_fgo: optimizer-state offload for Megatron-Bridge training.",
                                epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser(
        "status", help="versions, Megatron-Core's offload generation, patch targets, and the verdict",
        description="Diagnose this environment: versions, Megatron-Core's offload generation and what it\n"
                    "means, whether Megatron-Bridge wires offload itself, each patch target, and the verdict:\n"
                    "offload will run, or why not and what to change. Imports Megatron-Bridge; patches nothing.\n"
                    f"Defaults come from {', '.join(options_mod.known_env())}.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--json", action="store_true", help="the report as JSON")
    add_option_flags(s, status=True)
    add_verbose(s)
    return p, s


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    p, s = parsers(prog)
    args, extra = p.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if args.command != "status":
        p.print_help(sys.stderr)
        return 2
    if extra:  # argparse would blame the top-level command; the user typed them after `status`
        s.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        opts = options_from(args)
    except BridgeFGOOptionError as err:
        sys.stderr.write(f"{s.prog}: error: {err}\n")
        return 2
    return print_status(opts, as_json=args.json, verbose=args.verbose, prog=s.prog)


if __name__ == "__main__":
    sys.exit(main())
