"""The mode grammar of scripts/bench_offload.py `all`: MODE[:CHUNK_MB][+key=value...], one run each, and
the values resolved from earlier runs of the same call (budget=half, fraction=moved). Imports no torch.
"""
import re

# the extras of a mode, MODE[:CHUNK_MB]+key=value: key -> (the modes it applies to, how it reaches the run)
ENGINE_KEYS = {
    # bridge_fgo's builtin engine: a GPU memory budget in GiB (states that fit stay on the GPU)
    "budget": (("builtin",), ("env", "BRIDGE_FGO_GPU_BUDGET_GIB")),
    # the share offloaded: Megatron-Core's chunked line (parameter bundles whose states go to the host), or
    # Megatron-Core's CPU optimizer (optimizer_offload_fraction: parameters Adam updates on the host)
    "fraction": (("flag", "auto", "cpu"), ("arg", "--offload-fraction")),
    # Megatron-Core's fine-grained activation offloading (act=1), beside whatever the mode offloads
    "act": (("base", "builtin"), ("switch", "--act-offload")),
}


# base: no offload; builtin: bridge_fgo's engine; flag/auto: Megatron-Core's own offloader (dev lines);
# cpu: Megatron-Core's CPU optimizer (optimizer_cpu_offload, HybridDeviceOptimizer), the peer users compare
MODES = ("base", "builtin", "flag", "auto", "cpu")


_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")


# Values resolved from the runs before them in the same call (issue 17's benchmark): budget=half is
# halfway between the no-offload run's whole-iteration peak and the full-offload streamed run's;
# fraction=moved is the share of the state bytes the first budget run still moved each step.
SYMBOLIC = {"budget": "half", "fraction": "moved"}


_TAG = re.compile(r"[A-Za-z0-9._-]+")


def parse_modes(text):
    """'base,builtin:256,builtin:256+budget=16.2,dev-auto:256+fraction=0.5' -> one dict per run: tag,
    mode, chunk_mb, dev, env (variables for that run), args (extra `run` arguments), extras. A mode may
    repeat (A/B/A/B), then its tags get a run number. dev-: Megatron-Core from --dev-mcore. Raises
    ValueError on anything else. Tags are file-name safe: letters, digits, '.', '_', '-'."""
    tokens = [t.strip() for t in text.split(",")]
    out = []
    for i, token in enumerate(tokens):
        head, *extras = token.split("+")
        name, colon, mb = head.partition(":")
        dev = name.startswith("dev-")
        mode = name[4:] if dev else name
        if mode not in MODES:
            raise ValueError(f"{token!r}: unknown mode {mode!r}; modes: {', '.join(MODES)}, each optionally dev-")
        if colon and not mb.isdigit():
            raise ValueError(f"{token!r}: CHUNK_MB must be a whole number of MB")
        run = {"tag": name + mb, "mode": mode, "chunk_mb": int(mb) if mb else None, "dev": dev, "env": {},
               "args": [], "extras": {}, "group": token}
        for extra in extras:
            key, eq, value = extra.partition("=")
            if key not in ENGINE_KEYS:
                raise ValueError(f"{token!r}: unknown key {key!r}; keys: {', '.join(ENGINE_KEYS)}")
            modes, (kind, target) = ENGINE_KEYS[key]
            if mode not in modes:
                raise ValueError(f"{token!r}: {key}= applies to mode {' or '.join(modes)}, not {mode}")
            symbolic = value == SYMBOLIC.get(key)
            if kind == "switch":
                if value != "1":
                    raise ValueError(f"{token!r}: {key}= is a switch: {key}=1")
            elif not symbolic and (not eq or not _NUMBER.fullmatch(value) or float(value) <= 0):
                raise ValueError(f"{token!r}: {key}= needs a number > 0 (or {SYMBOLIC[key]}), got {value!r}")
            if key == "fraction" and not symbolic and float(value) > 1:
                raise ValueError(f"{token!r}: fraction= is a share of the states, at most 1")
            if key in run["extras"]:
                raise ValueError(f"{token!r}: {key}= given twice")
            run["extras"][key] = value
            if kind == "env":
                run["env"][target] = value
            elif kind == "switch":
                run["args"] += [target]
            else:
                run["args"] += [target, value]
            run["tag"] += f"_{key}" if kind == "switch" else f"_{key}{value}"
        if tokens.count(token) > 1:
            run["tag"] += f"_{i}"
        if not _TAG.fullmatch(run["tag"]):
            raise ValueError(f"{token!r}: tag {run['tag']!r} is not file-name safe")
        out.append(run)
    tags = [r["tag"] for r in out]
    clash = sorted({t for t in tags if tags.count(t) > 1})
    if clash:
        raise ValueError(f"two different modes give the same tag {clash}")
    return out


def streamed_tag(default_mb):
    """The full-offload streamed run the targets judge: `builtin` (chunk_mb auto) or builtin<MB>."""
    return "builtin" if default_mb in (None, "auto") else f"builtin{default_mb}"


def resolve_symbolic(run, results, default_mb) -> bool:
    """Replace budget=half / fraction=moved by numbers from the runs already made (False: cannot)."""
    for key, word in SYMBOLIC.items():
        if run["extras"].get(key) != word:
            continue
        if key == "budget":
            base, full = results.get("base"), results.get(streamed_tag(default_mb))
            if not (base and full):
                return False
            value = f"{(base['steady_iter_peak_gib'] + full['steady_iter_peak_gib']) / 2:.3f}"
        else:
            budgeted = next((r for t, r in results.items() if "_budget" in t), None)
            sess = budgeted and budgeted.get("sessions")
            if not sess:
                return False
            moved, resident = sum(s.get("bytes", 0) for s in sess), sum(s.get("resident_bytes") or 0 for s in sess)
            value = f"{moved / (moved + resident):.4f}" if moved + resident else "1"
        run["extras"][key] = value
        kind, target = ENGINE_KEYS[key][1]
        if kind == "env":
            run["env"][target] = value
        else:
            run["args"] = [a if a != word else value for a in run["args"]]
    return True
