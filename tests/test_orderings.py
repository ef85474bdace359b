"""Every patch/import ordering, each in a fresh process: the targets end wrapped exactly once."""
import os

import pytest

from conftest import SCRIPTS, run_python

SCENARIOS = ["import-then-patch", "patch-then-import", "patch-twice", "patch-unpatch-patch",
             "pretrain-imported-before-patch", "pretrain-imported-after-patch"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ordering(scenario):
    proc = run_python([os.path.join(SCRIPTS, "ordering.py"), scenario])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"OK {scenario}" in proc.stdout


def test_import_is_light():
    proc = run_python(
        "import sys, bridge_fgo\n"
        "r = bridge_fgo.patch()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "assert not bad, bad\n"
        "assert r.outcome == 'pending', r\n"
        "print('light')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "light" in proc.stdout
