"""Megatron-Bridge's in-process restart (cfg.inprocess_restart: nvidia-resiliency-ext's real Wrapper
as Bridge's inprocess_restart() builds it) of a training under the streamed step that faults in
iteration 3, in forward-backward, inside the optimizer step (torn states), or on a peer rank while this
one is inside the optimizer step (RankShouldRestart raised asynchronously there): the restarted run finds
nothing of the failed one (no pinned memory, no session, its optimizer and engine gone, no finalize
wrapper held, the patch applied once), pins exactly its own buffer, and ends bit-identical to a fresh
resume from the same checkpoint and to the uninterrupted run.

One process, CPU (tests/scripts/inprocess_restart.py says what stands in for what). Not exercised
here: several processes (the peer's fault is its store record, written from this process), the
asynchronous RankShouldRestart landing elsewhere than inside a pass (e.g. in bridge_fgo's own cleanup
at the end of train(), which it would cut short), nvidia-resiliency-ext's CUDA finalize thread and
health checks, and a real GPU's copies in flight at the fault.
"""
import json
import os

import pytest

from conftest import SCRIPTS, run_python


@pytest.mark.parametrize("fault", ["backward", "step", "peer"])
def test_in_process_restart_after_a_fault_in_iteration_3_resumes_as_a_fresh_run(fault):
    proc = run_python([os.path.join(SCRIPTS, "inprocess_restart.py"), fault], timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(lines[-1][len("RESULT "):])
    failed, restarted = out["attempts"]
    if fault == "step":
        assert failed["error"].startswith("BridgeFGOError: ") and "failed in chunk 1 of 1" in failed["error"]
        assert failed["torn"] and "RuntimeError: fault in iteration 3" in failed["torn"]
    elif fault == "peer":  # passed on as it is, for the wrapper to restart; the mark and an ERROR line
        assert failed["error"].startswith("RankShouldRestart: ")
        assert failed["torn"] and "failed in chunk 1 of 1 (RankShouldRestart" in failed["torn"]
        assert [failed["torn"] in m for m in out["torn_error_lines"]] == [True]
    else:
        assert failed["error"] == "RuntimeError: fault in iteration 3" and failed["torn"] is None
    assert failed["pinned_after_failure"] == 0  # parked: unpinned at the end of the failed train()
    # what the restarted attempt found
    assert restarted["pinned_bytes"] == 0 and restarted["live_buffers"] == 0
    assert restarted["sessions"] == 0 and restarted["finalizers_held"] == 0
    assert restarted["failed_optimizer_alive"] is False and restarted["failed_engine_alive"] is False
    assert restarted["targets_wrapped_once"] and restarted["finalize_wrapped_once"]
    assert restarted["finalize_is_ours"] is False  # put back when the failed train() ended
    # what it held while training: its own buffer, once
    assert restarted["pinned_during"] == restarted["engine_pinned_bytes"] > 0 and restarted["live_buffers_during"] == 1
    assert restarted["pinned_after"] == 0
    assert out["checkpoints"] == [2] and restarted["resumed_from"] == 2
    assert restarted["result"] == out["fresh"] == out["uninterrupted"]
    assert out["ready_lines"] == out["offload_active_lines"] == 3  # failed, restarted, fresh: each as a new run
