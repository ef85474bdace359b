"""python -m bridge_fgo status: the same as `bridge-fgo status`."""
import sys

from .cli.status import main

sys.exit(main(prog="python -m bridge_fgo"))
