"""One torchrun worker under bridge-fgo-run (tests/test_launcher.py): joins a gloo group, imports the
real Megatron-Bridge train module, and prints one `WORKER {json}` line saying whether this rank is
patched."""
import json
import os
import runpy
import sys

import torch
import torch.distributed as dist

import bridge_fgo
from bridge_fgo.cli.bootstrap import DIRECTORY
from bridge_fgo.instrument.patcher import _Target
from bridge_fgo.instrument.targets import TARGETS

# The bootstrap a second time in this process: still one hook, the targets still wrapped once.
runpy.run_path(os.path.join(DIRECTORY, "sitecustomize.py"), run_name="sitecustomize_again")
pending = bridge_fgo.status().outcome

dist.init_process_group("gloo")
import megatron.bridge.training.pretrain as pretrain  # noqa: E402  (recipes start training through pretrain())
import megatron.bridge.training.train as train_module  # noqa: E402

total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
report = bridge_fgo.status()
wrapped_once = all(isinstance(t.raw(sys.modules[t.module]), _Target)
                   and not isinstance(t.raw(sys.modules[t.module]).__wrapped__, _Target) for t in TARGETS)
# one write(2) per line: two workers share the pipe, and print() may split a line in two writes
os.write(1, ("WORKER " + json.dumps({
    "rank": dist.get_rank(),
    "env_rank": int(os.environ["RANK"]),
    "world": dist.get_world_size(),
    "pid": os.getpid(),
    "pending_before_import": pending,
    "is_patched": bridge_fgo.is_patched(),
    "outcome": report.outcome,
    "mode": report.mode,
    "aliases": report.aliases,
    "wrapped_once": wrapped_once,
    "pretrain_reaches_wrapper": pretrain.train is train_module.train,
    "all_reduce": total.item(),
}) + "\n").encode())
dist.barrier()
dist.destroy_process_group()
# Leave without the interpreter's teardown: once in CI (2026-11-27, 0.4.2) a rank aborted there ("terminate
# called without an active exception", a C++ thread of torch's destroyed at exit) after every check above had
# passed. Everything this worker reports is written by now.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
