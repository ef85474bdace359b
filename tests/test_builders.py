"""Every optimizer Megatron-Core's builder makes through Bridge's real setup_optimizer, on a tiny model on
CPU (support/muon.py), for each name Bridge's recipes use x precision x the distributed optimizer on or off
(emerging-optimizers installed, as Bridge's Muon recipes need it): under offload="builtin" each one the
builder makes is either offloaded (every master and state off the GPU in forward-backward, through
Bridge's real train_step) or refused before the first step with BridgeFGOConfigError, with the streamed
step and with the one window; never neither."""
import itertools

import pytest

import bridge_fgo
from bridge_fgo.errors import BridgeFGOConfigError
from support import harness, muon

# (cfg.optimizer.optimizer, muon_scalar_optimizer: what Muon's builder gives the vectors, Adam or Lion)
NAMES = (("adam", "adam"), ("sgd", "adam"), ("muon", "adam"), ("muon", "lion"), ("dist_muon", "adam"),
         ("dist_muon", "lion"), ("adaptive_muon", "adam"), ("lion", "adam"), ("soap", "adam"))
PRECISIONS = ("bf16", "fp16", "fp32")


def _outcome(names, precision, distributed, chunk_mb):
    """'not built: ...' (the builder refuses it), 'refused', 'offloaded', 'fails: ...' or 'neither: ...'."""
    from test_muon import on_gpu

    try:
        run = muon.Run(*names, distributed=distributed, precision=precision)
    except Exception as exc:  # Megatron-Core's or Bridge's own refusal to build it
        return f"not built: {type(exc).__name__}: {str(exc)[:80]}"
    seen = []

    def forward(model):
        seen.append(on_gpu(run))
        run.grads()

    rig = harness.Rig(cfg=harness.config_container(optimizer_cfg=run.config, mxfp8_copy=False), forward=forward)
    rig.optimizer = run.optimizer
    bridge_fgo.patch(offload="builtin", chunk_mb=chunk_mb)
    try:
        harness.run_steps(rig, steps=2)
        sessions = bridge_fgo.status().sessions
    except BridgeFGOConfigError:
        return "refused"
    except Exception as exc:  # (served, and then the steps failed)
        return f"fails: {type(exc).__name__}: {str(exc)[:80]}"
    finally:
        bridge_fgo.unpatch()
    states = [n for n, _ in run.states() if ".master" not in n]
    if sessions and states and seen[1:] == [[]]:  # from step 2 every state exists, and none is on the GPU
        return "offloaded"
    return f"neither: {len(sessions)} session(s), {len(states)} state(s), on the GPU in forward-backward {seen[1:]}"


@pytest.mark.skipif(not muon.have_emerging_optimizers(), reason="emerging-optimizers is not installed (Megatron-Core "
                    "builds Muon from it; it needs Python >= 3.12)")
@pytest.mark.parametrize("chunk_mb", [0, 1], ids=["one-window", "streamed"])
def test_every_optimizer_the_builder_makes_is_offloaded_or_refused(tmp_path, chunk_mb):
    from test_resume_dp import one_rank

    with one_rank(tmp_path):
        outcomes = {case: _outcome(*case, chunk_mb)
                    for case in itertools.product(NAMES, PRECISIONS, (False, True))}
    assert not {case: o for case, o in outcomes.items() if o.startswith(("neither", "fails"))}, outcomes
    # the walk reached what is served and what is not
    adam, _, muon_ = NAMES[:3]
    assert outcomes[adam, "bf16", True] == "offloaded" and outcomes[adam, "bf16", False] == "refused", outcomes
    assert outcomes[muon_, "bf16", False] == "offloaded", outcomes
