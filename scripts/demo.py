#!/usr/bin/env python3
"""Demo: patch the real installed Megatron-Bridge and run its real train_step on CPU.

Stand-ins replace only what needs a GPU or a cluster (tests/support/harness.py). Shows:
1. offload=auto with cfg.optimizer.offload_optimizer_states=True on a Megatron-Core without
   offload (every release): one warning, nothing moved;
2. offload=builtin: bridge_fgo's engine moves the optimizer's fp32 master weights and Adam moments
   each step; the calls in order, the report, and final parameters identical to an unpatched run.
"""
import logging
from unittest import mock

import torch

logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
logging.getLogger("bridge_fgo").setLevel(logging.INFO)

import os  # noqa: E402
import sys  # noqa: E402

# the CPU harness lives with the tests, outside the installed package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
from support import harness, te_free  # noqa: E402

te_free.install()  # this machine has no Transformer Engine
import bridge_fgo  # noqa: E402


def params(rig):
    return [p.clone() for g in rig.dist_optimizer.optimizer.param_groups for p in g["params"]]


print("== 1. offload=auto, cfg.optimizer.offload_optimizer_states=True")
print(bridge_fgo.patch())
rig = harness.Rig(cfg=harness.config_container(harness.optimizer_config(offload_optimizer_states=True)))
harness.run_steps(rig, steps=2)
print("calls, step 1:", rig.events[: len(rig.events) // 2])
bridge_fgo.unpatch()

print("\n== 2. offload=builtin: the engine, through Bridge's real train_step")
baseline = harness.Rig(with_tensors=True)
harness.run_steps(baseline, steps=3)
bridge_fgo.patch(offload="builtin")
rig = harness.Rig(with_tensors=True)
from bridge_fgo.adapters.builtin import BuiltinAdapter  # noqa: E402


def recorded(name):
    real = getattr(BuiltinAdapter, name)

    def call(self, *a, **k):  # note each engine call in the stand-ins' event list, then do it
        rig.events.add(f"engine.{name}")
        return real(self, *a, **k)

    return call


with mock.patch.multiple(BuiltinAdapter, **{n: recorded(n) for n in ("offload", "release", "reload", "wait_reload")}):
    harness.run_steps(rig, steps=3)
per_step = len(rig.events) // 3
for i in range(3):
    print(f"calls, step {i + 1}:", rig.events[i * per_step:(i + 1) * per_step])
print("\n" + str(bridge_fgo.status()))
same = all(torch.equal(a, b) for a, b in zip(params(baseline), params(rig)))
print("\nfinal parameters identical to the unpatched run:", same)
bridge_fgo.unpatch()
if not same:
    raise SystemExit(1)
