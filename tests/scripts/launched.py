"""Run under bridge-fgo-run by tests/test_launcher.py: prints (as JSON, on stdout) what the bootstrap
did in this process, echoes stdin, and exits with FGO_TEST_EXIT."""
import json
import logging
import os
import runpy
import sys

import wrapt.importer

import bridge_fgo
import sitecustomize
from bridge_fgo.cli.bootstrap import DIRECTORY

TRAIN = "megatron.bridge.training.train"


def hooks():
    return len(getattr(wrapt.importer, "_post_import_hooks", {}).get(TRAIN) or [])


before = bridge_fgo.status()
handlers = list(logging.getLogger("bridge_fgo").handlers)
hooks_before = hooks()
# The bootstrap running a second time in this process (a reload, an import under another name).
runpy.run_path(os.path.join(DIRECTORY, "sitecustomize.py"), run_name="sitecustomize_again")
after = bridge_fgo.status()

print(json.dumps({
    "argv": sys.argv,
    "pid": os.getpid(),
    "executable": sys.executable,
    "outcome": before.outcome,
    "mode": before.mode,
    "strict": before.strict,
    "pythonpath": os.environ.get("PYTHONPATH"),
    "env": {k: v for k, v in os.environ.items() if k.startswith("BRIDGE_FGO_")},
    "sitecustomize_file": getattr(sitecustomize, "__file__", None),
    "user_sitecustomize_ran": getattr(sitecustomize, "USER_SITECUSTOMIZE_RAN", False),
    "user_sitecustomize_saw_bootstrap": getattr(sitecustomize, "BOOTSTRAP_WAS_RUNNING", None),
    "sys_path_has_bootstrap": DIRECTORY in sys.path,
    "heavy_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron")),
    "handlers": [type(h).__name__ for h in handlers],
    "logger_propagates": logging.getLogger("bridge_fgo").propagate,
    "again": {"outcome": after.outcome, "handlers_unchanged": logging.getLogger("bridge_fgo").handlers == handlers,
              "hooks_before": hooks_before, "hooks_after": hooks()},
    "stdin": sys.stdin.read(),
}))
sys.stdout.flush()
sys.exit(int(os.environ.get("FGO_TEST_EXIT", "0")))
