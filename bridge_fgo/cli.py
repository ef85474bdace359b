"""`bridge-fgo status` (also `python -m bridge_fgo status`): will offload run here, and if not, why."""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Optional, Sequence

from . import options as options_mod
from .errors import BridgeFGOOptionError

EXIT_CODES = """\
exit status:
  0  offload will run in the chosen mode (auto: Megatron-Core has its own offloader; builtin: the
     training loop is recognised)
  1  it will not; the verdict says why and what to change
  2  a bad option or BRIDGE_FGO_* value
"""


def print_status(opts: options_mod.Options, as_json: bool = False) -> int:
    """Diagnose, print the report (table or JSON) on stdout; returns the exit status (0 or 1)."""
    from .diagnose import diagnose, exit_code

    # Importing Bridge may write to stdout; it must not corrupt the report (--json is for machines).
    with contextlib.redirect_stdout(sys.stderr):
        report = diagnose(opts)
    sys.stdout.write((report.to_json() if as_json else str(report)) + "\n")
    sys.stdout.flush()
    return exit_code(report)


def parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or "bridge-fgo",
                                description="bridge_fgo: optimizer-state offload for Megatron-Bridge training.",
                                epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser(
        "status", help="versions, Megatron-Core's offload generation, patch targets, and the verdict",
        description="Diagnose this environment: versions, Megatron-Core's offload generation and what it\n"
                    "means, whether Megatron-Bridge wires offload itself, each patch target, and the verdict:\n"
                    "offload will run, or why not and what to change. Imports Megatron-Bridge; patches nothing.\n"
                    f"Defaults come from {', '.join(options_mod.known_env())}.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--json", action="store_true", help="the report as JSON")
    s.add_argument("--offload", choices=options_mod.OFFLOAD_MODES,
                   help=f"the mode to judge (default: {options_mod.env_name('offload')}, else auto)")
    s.add_argument("--strict", action="store_true", default=None, help="judge as with --strict")
    return p


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    p = parser(prog)
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command != "status":
        p.print_help(sys.stderr)
        return 2
    try:
        opts = options_mod.from_env(offload=args.offload, strict=args.strict)
    except BridgeFGOOptionError as err:
        sys.stderr.write(f"{p.prog} status: error: {err}\n")
        return 2
    return print_status(opts, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
