"""Test-only: stands for a user's own sitecustomize, which bridge-fgo-run's bootstrap must still run.

- Loads Megatron-Bridge without Transformer Engine (absent on the CPU test machine): te_free.
- Leaves a marker the test scripts check (USER_SITECUSTOMIZE_RAN, on this module).
- FGO_TEST_SIMULATE=no-bridge: megatron.bridge cannot be imported (as if it were not installed).
- FGO_TEST_SIMULATE=no-copy-helper: Bridge's train module loses _handle_mxfp8_param_buffer_copy
  right after its import (as a Bridge version without it would look).
- FGO_TEST_SIMULATE=raise: this sitecustomize fails (after leaving its marker).
"""
import importlib.abc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # tests/: support
from support import te_free

te_free.install()
USER_SITECUSTOMIZE_RAN = True
# Names the bootstrap at work: our module is imported while bridge_fgo's is out of sys.modules.
BOOTSTRAP_WAS_RUNNING = hasattr(sys, "_bridge_fgo_bootstrapped")

_simulate = os.environ.get("FGO_TEST_SIMULATE", "")


class _NoBridge(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "megatron.bridge" or name.startswith("megatron.bridge."):
            raise ModuleNotFoundError(f"No module named {name!r} (simulated)", name=name)
        return None


if _simulate == "no-bridge":
    sys.meta_path.insert(0, _NoBridge())
elif _simulate == "no-copy-helper":
    import wrapt

    def _drop_helper(module):
        del module._handle_mxfp8_param_buffer_copy

    wrapt.register_post_import_hook(_drop_helper, "megatron.bridge.training.train")
elif _simulate == "raise":
    raise RuntimeError("the user's sitecustomize failed (simulated)")
elif _simulate:
    raise RuntimeError(f"unknown FGO_TEST_SIMULATE={_simulate!r}")
