"""Checkpoint saves in scripts/bench_offload.py (issue 24): what a save costs the training loop.

`run` (with --save): every call of Bridge's save_checkpoint is timed on the training thread (the stall,
the call's wall time: with async_save, building the state dict, the writer's copy and handing the
request to the worker; without, the whole write), with the host's memory before and after it (this
process's RSS, the node's MemAvailable, /dev/shm in use); so is every finalize of Bridge's queue that
found a save pending. Each iteration records the same host figures.

`all --save-every N`: every mode runs once per save kind (--save-kinds, default sync then async), tags
TAG_sync / TAG_async, saving every N iterations; each run's checkpoint at --compare-at (default N:
later updates rewrite the host buffer while an asynchronous save of it is pending) is compared entry by
entry with the first run's (scripts/check_checkpoint.py), and then removed unless --keep-checkpoints
(a checkpoint of the 887M model is about 12.4 GB). The checks report per run the stall per save, the
iterations right after a save against the steady ones, the host memory, and whether the streamed step's
asynchronous stall is within the one without offload.

Setup and loads (issue 43, every run; instrument_setup / setup_figures): Bridge's own timers
"model-and-optimizer-setup" and "load-checkpoint" (Megatron-Core's Timer, whatever it prints), each of
bridge_fgo's buffers freed while one runs (the landing block unpinned at the construction's end), each of
bridge_fgo's hostmem.pin calls (bytes, seconds, the timer running meanwhile: the construction's landing
block during setup, the host buffer during a load or at the first step) and each deferred registration
waited for, the host's RSS and /dev/shm after setup and after the load. BENCH_SYNC_AT=I[,J]: in a run with
--async-save, the saves at these iterations are synchronous (async_save off for that call only), so one
run measures both kinds; each save records whether a save was pending when it started.
BENCH_LOAD_THREADS=N: torch's intra-op threads are N during Bridge's "load-checkpoint" timer (restored at its
stop), recorded as load_threads (with the count before): torchrun starts each rank with OMP_NUM_THREADS=1, and
with offload the load's copies land in host memory through torch's CPU copy (docs/benchmarks.md#gpu-2026-11-28e).
BENCH_PROFILE_LOAD=N: the training thread is profiled (cProfile) while Bridge's "load-checkpoint" timer runs,
and the N functions of most cumulative and of most own time are recorded as load_profile: where a load's
seconds go, with offload and without (issue 43). It slows the load a little in both: not for timed runs.
BENCH_LOAD_REGISTER=before|beside|after: the host buffer a load prepares is registered (cudaHostRegister) before
the load (bridge_fgo's pin(defer=True) called without defer), beside its reads, or after them (the engine's
register_after_load, its default since 2026-11-29): where does the registration cost a load least? (issue 43;
recorded as load_register). BENCH_LOAD_TOUCH=before|skip: that buffer's pages are faulted in before the load
from several threads, or not (the load's copies fault them in as they write; a page is zeroed by the kernel once
either way, and the touch writes it once more); unset: the engine's choice, skip where the load brings the
states and the registration runs after it (since 2026-11-29). Recorded as load_touch. (issue 43)
BENCH_LOAD_READS=torch: what a load reads for the host buffer goes through torch's own FileSystemReader.read_data
(torch.load into fresh memory, then a copy), as before 2026-12-01, instead of straight into the buffer
(bridge_fgo/instrument/reads.py); recorded as load_reads, with what was read straight in (load_straight).
The first iteration after a load (issue 43: where its time goes beyond the same iteration without offload):
setup_figures records its phases (before forward-backward, forward-backward, the rest: finalization, reload,
update) beside the steady ones. BENCH_WARM=skip: the engine's one DMA pass over a new buffer (Transfers.warm,
queued by the first step's offload after a load) is not made, only the registration it waits for.
BENCH_HEAD=off: the first streamed step does not record the allocator's trace at all (Head: no prefetch during
any backward then); BENCH_HEAD=whole: it records from the step's start, through every microbatch, as the engine
did until 2026-11-29 (since, from the last backward's first hook). Both recorded (warm, head), for variants that
isolate what each costs.

Importing this module imports neither torch nor Megatron.
"""
import contextlib
import os
import re
import shutil
import statistics
import time
from unittest import mock

GIB = 2**30
KINDS = ("sync", "async")
PHASES = ("pre_s", "fwdbwd_s", "post_s")  # an iteration's (bench_run.py): before forward-backward, it, the rest


# -- in the training process ---------------------------------------------------------------------------

def host_figures():
    """This process's resident memory and its peak, the node's MemAvailable, /dev/shm in use (GiB)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            status = f.read()
        for key, name in (("VmRSS", "rss_gib"), ("VmHWM", "rss_peak_gib")):
            m = re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE)
            if m:
                out[name] = int(m.group(1)) * 1024 / GIB
        with open("/proc/meminfo") as f:
            m = re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.MULTILINE)
        if m:
            out["mem_available_gib"] = int(m.group(1)) * 1024 / GIB
    except OSError:
        pass
    try:
        out["shm_used_gib"] = shutil.disk_usage("/dev/shm").used / GIB
    except OSError:
        pass
    return out


def instrument(saves, finalizes):
    """Time Bridge's save_checkpoint and, when a save is pending, its finalize of the async queue, as
    the training loop calls them (module globals of megatron.bridge.training.checkpointing, and the
    same functions bound elsewhere, e.g. `from ... import save_checkpoint`). Appends one dict per call."""
    import sys

    import megatron.bridge.training.checkpointing as ckpt

    sync_at = {int(i) for i in os.environ.get("BENCH_SYNC_AT", "").split(",") if i.strip()}

    def timed_save(*args, **kwargs):
        state = args[0] if args else kwargs.get("state")
        ckpt = getattr(getattr(state, "cfg", None), "checkpoint", None)
        iteration = getattr(getattr(state, "train_state", None), "step", None)
        queue = getattr(state, "async_calls_queue", None)
        pending = queue.get_num_unfinalized_calls() if queue is not None else 0
        forced = bool(ckpt is not None and ckpt.async_save and iteration in sync_at)
        if forced:  # this save synchronous: async_save off for the call only (the queue stays as it was)
            ckpt.async_save = False
        before = host_figures()
        finishing = []  # the time the save spent finishing pending saves (the queue finalized inside the call)
        finalize_calls = getattr(queue, "maybe_finalize_async_calls", None) if pending else None

        def timed_calls(*a, **k):
            t = time.perf_counter()
            try:
                return finalize_calls(*a, **k)
            finally:
                finishing.append(time.perf_counter() - t)

        with contextlib.ExitStack() as stack:
            if finalize_calls is not None:
                stack.enter_context(mock.patch.object(queue, "maybe_finalize_async_calls", timed_calls))
            t0 = time.perf_counter()
            try:
                out = save(*args, **kwargs)
            finally:
                save_s = time.perf_counter() - t0
                if forced:
                    ckpt.async_save = True
        record = {"iteration": iteration, "async": bool(getattr(ckpt, "async_save", False)) and not forced,
                  "pending_before": pending, "save_s": save_s,
                  "finishing_pending_s": sum(finishing)}
        record.update({f"{k}_before": v for k, v in before.items()})
        record.update({f"{k}_after": v for k, v in host_figures().items()})
        saves.append(record)
        return out

    def timed_finalize(*args, **kwargs):
        state = kwargs.get("global_state", args[0] if args else None)
        queue = getattr(state, "async_calls_queue", None)
        pending = queue.get_num_unfinalized_calls() if queue is not None else 0
        t0 = time.perf_counter()
        out = finalize(*args, **kwargs)
        if pending:
            finalizes.append({"iteration": getattr(getattr(state, "train_state", None), "step", None),
                              "blocking": bool(kwargs.get("blocking", args[2] if len(args) > 2 else False)),
                              "pending": pending, "finalize_s": time.perf_counter() - t0, **host_figures()})
        return out

    save, finalize = ckpt.save_checkpoint, ckpt.maybe_finalize_async_save
    for name, original, timed in (("save_checkpoint", save, timed_save),
                                  ("maybe_finalize_async_save", finalize, timed_finalize)):
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("megatron.bridge") and vars(mod).get(name) is original:
                setattr(mod, name, timed)


def instrument_setup(held):
    """Bridge's setup and load timers, bridge_fgo's pinning (held["timers"], held["pins"], held["host"])."""
    from megatron.core import timers

    held.update(timers={}, pins=[], host={}, running=[])
    start, stop = timers.Timer.start, timers.Timer.stop
    load_threads = os.environ.get("BENCH_LOAD_THREADS")
    if load_threads is not None and not (load_threads.isdigit() and int(load_threads) > 0):
        raise SystemExit(f"BENCH_LOAD_THREADS={load_threads!r}: a positive integer (torch's threads during a load)")
    register = os.environ.get("BENCH_LOAD_REGISTER")
    if register not in (None, "before", "beside", "after"):
        raise SystemExit(f"BENCH_LOAD_REGISTER={register!r}: 'before', 'beside' or 'after' (or unset: bridge_fgo's "
                         "default, after the load's reads)")
    from bridge_fgo.engine.streamed.engine import StreamedEngine

    if register in ("beside", "after"):  # for this process: where the run's engine registers a load's buffer
        StreamedEngine.register_after_load = register == "after"
    held["load_register"] = register or ("after" if StreamedEngine.register_after_load else "beside")
    touch = os.environ.get("BENCH_LOAD_TOUCH")
    if touch not in (None, "before", "skip"):
        raise SystemExit(f"BENCH_LOAD_TOUCH={touch!r}: 'before' or 'skip' (or unset: the engine's choice)")
    if touch == "skip" and register in ("before", "beside"):  # that registration would fault the pages in itself
        raise SystemExit(f"BENCH_LOAD_TOUCH=skip needs the registration after the load, not BENCH_LOAD_REGISTER={register}")
    load_reads(held)
    profile_top = os.environ.get("BENCH_PROFILE_LOAD")
    if profile_top is not None and not (profile_top.isdigit() and int(profile_top) > 0):
        raise SystemExit(f"BENCH_PROFILE_LOAD={profile_top!r}: a positive integer (how many functions to record)")
    first_step_knobs(held)

    def timed_start(self, barrier=False):
        held["running"].append(self.name)
        if load_threads and self.name == "load-checkpoint":
            import torch

            held["load_threads"] = {"before": torch.get_num_threads(), "during": int(load_threads)}
            torch.set_num_threads(int(load_threads))
        out = start(self, barrier)
        if profile_top and self.name == "load-checkpoint":
            import cProfile

            held["profiler"] = cProfile.Profile()
            held["profiler"].enable()
        return out

    def timed_stop(self, barrier=False):
        before = self._elapsed
        if self.name == "load-checkpoint" and "profiler" in held:
            held["profiler"].disable()
            held["load_profile"] = profile_lines(held.pop("profiler"), int(profile_top))
        try:
            out = stop(self, barrier)
        finally:
            if load_threads and self.name == "load-checkpoint" and "load_threads" in held:
                import torch

                torch.set_num_threads(held["load_threads"]["before"])
        held["timers"][self.name] = held["timers"].get(self.name, 0.0) + self._elapsed - before
        if self.name in held["running"]:
            held["running"].remove(self.name)
        if self.name in ("model-and-optimizer-setup", "load-checkpoint"):
            held["host"][self.name] = host_figures()
        return out

    timers.Timer.start, timers.Timer.stop = timed_start, timed_stop
    try:
        from bridge_fgo import hostmem
        from bridge_fgo.hostmem import pinning
    except ImportError:
        return
    pin, wait, free = hostmem.pin, pinning.PinnedHost.wait, pinning.PinnedHost.free

    def timed_pin(nbytes, **kw):
        if kw.get("defer"):  # a load's buffer
            if touch:
                kw["touch"] = touch == "before"
            if register == "before":  # pinned at once: touched, registered here
                kw = {k: v for k, v in kw.items() if k not in ("start", "touch")}
                kw["defer"] = False
            held["load_touch"] = "before" if kw.get("touch", True) else "skip"
        t0 = time.perf_counter()
        buf = pin(nbytes, **kw)
        held["pins"].append({"bytes": nbytes, "pin_s": time.perf_counter() - t0, "deferred": bool(kw.get("defer")),
                             "during": held["running"][-1] if held["running"] else "first step",
                             "method": buf.method})
        return buf

    def timed_wait(self):
        pending = self.pending
        out = wait(self)
        if pending:
            held["pins"].append({"bytes": self.nbytes, "register_s": self.register_s, "waited_s": self.waited_s,
                                 "during": held["running"][-1] if held["running"] else "after the load",
                                 "deferred_wait": True})
        return out

    def timed_free(self):  # the construction's landing block is unregistered at its end, inside setup
        t0 = time.perf_counter()
        out = free(self)
        if held["running"]:
            held["pins"].append({"bytes": self.nbytes, "free_s": time.perf_counter() - t0,
                                 "during": held["running"][-1], "released": True})
        return out

    hostmem.pin, pinning.PinnedHost.wait, pinning.PinnedHost.free = timed_pin, timed_wait, timed_free


def load_reads(held):
    """BENCH_LOAD_READS=torch|straight (the module's docstring); what a load read straight in, recorded."""
    how = os.environ.get("BENCH_LOAD_READS")
    if how not in (None, "torch", "straight"):
        raise SystemExit(f"BENCH_LOAD_READS={how!r}: 'torch' or 'straight' (or unset: straight into the buffer)")
    from bridge_fgo.instrument import reads

    straight_into = reads.straight_into

    @contextlib.contextmanager
    def recorded(buffers):
        with straight_into(buffers if how != "torch" else []) as r:
            yield r
        held["load_straight"] = {"tensors": r.tensors, "bytes": r.nbytes, "seconds": round(r.seconds, 4),
                                 "threads": r.threads, "as_torch": r.as_torch}

    reads.straight_into = recorded
    held["load_reads"] = how or "straight"


def first_step_knobs(held):
    """BENCH_WARM=skip, BENCH_HEAD=off (the module's docstring), checked before anything is patched."""
    warm, head = os.environ.get("BENCH_WARM"), os.environ.get("BENCH_HEAD")
    if warm not in (None, "skip"):
        raise SystemExit(f"BENCH_WARM={warm!r}: 'skip' (or unset: the engine's warm pass)")
    if head not in (None, "off", "whole"):
        raise SystemExit(f"BENCH_HEAD={head!r}: 'off' or 'whole' (or unset: the first step records the last backward)")
    from bridge_fgo.engine.streamed.head import Head
    from bridge_fgo.engine.streamed.transfers import Transfers

    if warm == "skip":
        def no_warm(self, wait=True):
            self.ready()  # what the warm pass waited for, and every later copy waits for anyway

        Transfers.warm = no_warm
    if head == "off":
        begin = Head.begin_step

        def unmeasured(self, measure):
            return begin(self, False)

        Head.begin_step = unmeasured
    elif head == "whole":
        arm = Head._arm

        def from_the_start(self):
            arm(self)
            if self.state == "armed":
                self._start_trace()

        Head._arm = from_the_start
    held["warm"], held["head"] = warm or "made", head or "measured"


def profile_lines(profiler, top):
    """The `top` functions of most cumulative and of most own time: [calls, own s, cumulative s, where]."""
    import pstats

    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, own, cumulative, callers)
    rows = [[nc, round(tt, 4), round(ct, 4), f"{os.path.basename(f)}:{line}({name})"]
            for (f, line, name), (_, nc, tt, ct, _) in stats.items()]
    return {"cumulative": sorted(rows, key=lambda r: -r[2])[:top], "own": sorted(rows, key=lambda r: -r[1])[:top]}


def setup_figures(held, recs):
    """The summary's part about setup and loads."""
    pins = held.get("pins", [])
    t = held.get("timers", {})
    steady = [r["step_s"] for r in recs[1:]]
    loaded = bool(recs) and t.get("load-checkpoint") is not None  # recs[0]: the first iteration after a load
    return {
        "setup_s": t.get("model-and-optimizer-setup"), "load_s": t.get("load-checkpoint"),
        "load_threads": held.get("load_threads"),
        "load_profile": held.get("load_profile"),
        "load_register": held.get("load_register"),
        "load_touch": held.get("load_touch"),
        "load_reads": held.get("load_reads"), "load_straight": held.get("load_straight"),
        "pins": pins,
        "setup_pin_s": sum(p.get("pin_s", 0.0) for p in pins if p["during"] == "model-and-optimizer-setup"),
        "setup_unpin_s": sum(p.get("free_s", 0.0) for p in pins if p["during"] == "model-and-optimizer-setup"),
        "load_pin_s": sum(p.get("pin_s", 0.0) + p.get("waited_s", 0.0) for p in pins
                          if p["during"] == "load-checkpoint"),
        "host_after_setup": held.get("host", {}).get("model-and-optimizer-setup"),
        "host_after_load": held.get("host", {}).get("load-checkpoint"),
        "first_iter_after_load_s": recs[0]["step_s"] if loaded else None,
        "steady_after_first_median_s": statistics.median(steady) if steady else None,
        # each phase of the first iteration after a load, and its median over the steady ones (bench_run.py's)
        "first_iter_after_load_phases": {k: recs[0].get(k) for k in PHASES} if loaded else None,
        "steady_phases_median": {k: statistics.median(r[k] for r in recs[1:]) for k in PHASES
                                 if all(k in r for r in recs[1:])} if recs[1:] else None,
        "warm": held.get("warm"), "head": held.get("head"),
    }


def summarize(recs, saves, finalizes):
    """The summary's part about saves: each save and finalize, the stall, the iterations after a save."""
    saved_at = {s["iteration"] for s in saves}
    after = [r["step_s"] for r in recs if r["iter"] - 1 in saved_at]
    stalls = [s["save_s"] for s in saves]
    return {
        "saves": saves, "finalizes": finalizes,
        "save_stall_median_s": statistics.median(stalls) if stalls else None,
        # issue 43: the first asynchronous save, the next one (beside the first, or finishing it first, where pending),
        # the synchronous ones (BENCH_SYNC_AT)
        "async_stalls_s": [s["save_s"] for s in saves if s.get("async")],
        "async_finishing_s": [s.get("finishing_pending_s") for s in saves if s.get("async")],  # of each stall
        "sync_saves_s": [s["save_s"] for s in saves if not s.get("async", True)],
        "save_stall_max_s": max(stalls) if stalls else None,
        "after_save_step_median_s": statistics.median(after) if after else None,
        "finalize_wait_max_s": max((f["finalize_s"] for f in finalizes), default=None),
        # host memory while saves were pending: the lowest MemAvailable and the most /dev/shm in use seen
        "min_mem_available_gib": min((v for r in [*saves, *recs] for k, v in r.items()
                                      if k.startswith("mem_available_gib")), default=None),
        "max_shm_used_gib": max((v for r in [*saves, *recs] for k, v in r.items()
                                 if k.startswith("shm_used_gib")), default=None),
    }


# -- in `all` ------------------------------------------------------------------------------------------

def parse_kinds(text):
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad or len(set(kinds)) != len(kinds):
        raise ValueError(f"save kinds {text!r}: a comma-separated list of {', '.join(KINDS)}, each once")
    return kinds


def expand(runs, kinds, every, out_dir):
    """Each run once per save kind: tag TAG_KIND, saving every `every` iterations into
    OUT/ckpt_TAG_KIND (asynchronously for async)."""
    if every is None:
        return runs
    if every < 1:
        raise ValueError(f"--save-every must be >= 1, got {every}")
    out = []
    for run in runs:
        for kind in kinds:
            tag = f"{run['tag']}_{kind}"
            extra = ["--save", os.path.join(out_dir, f"ckpt_{tag}"), "--save-interval", str(every)]
            out.append({**run, "tag": tag, "group": f"{run.get('group', run['tag'])}_{kind}", "save": kind,
                        "args": [*run["args"], *extra]
                        + (["--async-save"] if kind == "async" else [])})
    return out


def iteration_path(out_dir, tag, iteration):
    return os.path.join(out_dir, f"ckpt_{tag}", f"iter_{iteration:07d}")


def compare_and_prune(out_dir, tag, reference, iteration, keep):
    """This run's checkpoint at `iteration` against the reference run's, entry by entry; then every
    checkpoint of this run removed (the reference's kept but the compared one), unless `keep`."""
    import check_checkpoint

    path = iteration_path(out_dir, tag, iteration)
    row = {"iteration": iteration, "reference": reference}
    if not os.path.exists(os.path.join(path, ".metadata")):
        row["error"] = f"no torch_dist checkpoint at {path}"
    elif tag == reference:
        row.update(identical=True, **check_checkpoint.contents(path))
    else:
        diff = check_checkpoint.differing(iteration_path(out_dir, reference, iteration), path)
        row.update(identical=not diff, n_differing=len(diff), differing=diff[:10])
    if not keep:
        root = os.path.join(out_dir, f"ckpt_{tag}")
        for name in os.listdir(root) if os.path.isdir(root) else ():
            if tag != reference or name != os.path.basename(path):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return row


def line(tag, s):
    """One run's line in `all` about its saves."""
    def sec(key):
        return "-" if s.get(key) is None else f"{s[key]:.3f} s"

    return (f"{tag}: {len(s.get('saves') or [])} save(s), stall median {sec('save_stall_median_s')} (max "
            f"{sec('save_stall_max_s')}), iteration after a save {sec('after_save_step_median_s')} (steady "
            f"{sec('steady_step_median_s')}), checkpoint at {s['checkpoint_compare'].get('iteration')} "
            f"identical to {s['checkpoint_compare'].get('reference')}'s: {s['checkpoint_compare'].get('identical')}")


def checks(runs):
    """Per run with saves: the stall per save, the iterations after a save against the steady ones,
    the host memory; the streamed step's asynchronous stall against the one without offload."""
    out = {}
    for tag, r in runs.items():
        if not r.get("saves"):
            continue
        out[tag] = {k: r.get(k) for k in ("save_stall_median_s", "save_stall_max_s", "after_save_step_median_s",
                                          "steady_step_median_s", "finalize_wait_max_s", "min_mem_available_gib",
                                          "max_shm_used_gib", "host_peak_rss_gib", "checkpoint_compare")}
        out[tag]["saves"] = len(r["saves"])
        if r.get("after_save_step_median_s") is not None:
            out[tag]["after_save_over_steady_s"] = r["after_save_step_median_s"] - r["steady_step_median_s"]
    base = out.get("base_async")
    for tag, entry in out.items():
        if tag.startswith("builtin") and tag.endswith("_async") and base and base["save_stall_median_s"]:
            entry["stall_over_base_async"] = entry["save_stall_median_s"] / base["save_stall_median_s"]
            entry["stall_within_base_async"] = entry["save_stall_median_s"] <= base["save_stall_median_s"]
    return out
