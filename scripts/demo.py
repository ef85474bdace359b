#!/usr/bin/env python3
"""Demo: patch the real installed Megatron-Bridge and run its real train_step on CPU.

Stand-ins replace only what needs a GPU or a cluster (tests/support/harness.py). Shows:
1. offload=auto with cfg.optimizer.offload_optimizer_states=True on a Megatron-Core without
   offload (every release): one warning, nothing moved;
2. offload=builtin: bridge_fgo's engine keeps the optimizer's fp32 master weights and Adam moments
   in host memory between steps and streams them through the update chunk by chunk; the calls in
   order, the report, and final parameters identical to an unpatched run.
"""
import logging
import os
import sys
from unittest import mock

logging.basicConfig(level=logging.WARNING, format="  log: %(name)s %(levelname)s: %(message)s")
logging.getLogger("bridge_fgo").setLevel(logging.INFO)

# the CPU harness lives with the tests, outside the installed package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
from support import harness, te_free  # noqa: E402

te_free.install()  # this machine has no Transformer Engine
import bridge_fgo  # noqa: E402
from bridge_fgo.cli.status import third_party_output  # noqa: E402

ENGINE_CALLS = ("offload", "release", "reload", "settle")


def say(text=""):
    print(text, flush=True)


def params(rig):
    return [p.clone() for g in rig.dist_optimizer.optimizer.param_groups for p in g["params"]]


say("bridge_fgo patches Megatron-Bridge's training loop so that the optimizer's states leave the GPU")
say("during forward-backward and come back for the optimizer step. Below, Bridge's real train_step")
say("runs on CPU; each step's calls are listed in order.\n")
with third_party_output(verbose=False, prog="demo", hint=""):  # Bridge's and Megatron's import-time warnings
    import megatron.bridge.training.train  # noqa: F401
import torch  # noqa: E402  (loaded by Bridge above)

say("== 1. offload=auto, cfg.optimizer.offload_optimizer_states=True, on megatron-core "
    f"{bridge_fgo.status().versions['megatron-core']} (no release has an offloader)")
report = bridge_fgo.patch()
say(f"patch(): {report.outcome}, mode {report.mode}; Megatron-Core offload generation: {report.generation}")
say("Expected: one warning that the flag has nothing to call, and no offload/release/reload calls.")
rig = harness.Rig(cfg=harness.config_container(harness.optimizer_config(offload_optimizer_states=True)))
harness.run_steps(rig, steps=2)
say(f"calls, step 1: {rig.events[: len(rig.events) // 2]}")
bridge_fgo.unpatch()

say("\n== 2. offload=builtin: bridge_fgo's own engine, no config flag needed")
BIG = ((512, 1024), (600, 600), (1000,), (300, 700))  # 1-7 MB per parameter with its two moments
cfg = harness.config_container(mxfp8_copy=False)
baseline = harness.Rig(cfg=cfg, with_tensors=True, shapes=BIG)
harness.run_steps(baseline, steps=3)  # the same training, unpatched, to compare with
report = bridge_fgo.patch(offload="builtin", chunk_mb=1)  # the default is 256 MB; 1 MB shows chunks here
say(f"patch(offload='builtin', chunk_mb=1): {report.outcome}, mode {report.mode}")
say("Expected: engine.offload and engine.release before forward-backward (step 1 moves the masters")
say("to pinned host memory; from then on they and the Adam moments live there between steps),")
say("engine.reload at gradient finalization (the first chunk's copy to the GPU starts), then inside")
say("the optimizer step one update per chunk of parameters, and engine.settle as train_step returns.")
rig = harness.Rig(cfg=cfg, with_tensors=True, shapes=BIG)
from bridge_fgo.engine import BuiltinAdapter, subset  # noqa: E402

step_subset = subset.step_subset


def one_pass(inner, state, params_by_group):  # note each pass of the update (a chunk), then run it
    rig.events.add(f"update({sum(len(ps) for ps in params_by_group.values())} param)")
    return step_subset(inner, state, params_by_group)


def recorded(name):
    real = getattr(BuiltinAdapter, name)

    def call(self, *a, **k):  # note each engine call in the stand-ins' event list, then do it
        rig.events.add(f"engine.{name}")
        return real(self, *a, **k)

    return call


with mock.patch.multiple(BuiltinAdapter, **{n: recorded(n) for n in ENGINE_CALLS}), \
        mock.patch.object(subset, "step_subset", one_pass):
    harness.run_steps(rig, steps=3)
per_step = len(rig.events) // 3
steps = [rig.events[i * per_step:(i + 1) * per_step] for i in range(3)]
say(f"calls, step 1: {steps[0]}")
say("steps 2 and 3: " + ("the same calls" if steps[1] == steps[0] == steps[2] else f"{steps[1]} / {steps[2]}"))
say("\nbridge_fgo.status() after the three steps:\n" + str(bridge_fgo.status()))
# the last update's device-to-host copies may still be in flight: Megatron-Core's own readers
# (state_dict, sharded_state_dict, ...) wait for them; reading master weights directly, wait first
bridge_fgo.synchronize()
same = all(torch.equal(a, b) for a, b in zip(params(baseline), params(rig)))
say(f"\nfinal parameters identical to the unpatched run: {same}")
bridge_fgo.unpatch()
if not same:
    raise SystemExit(1)
