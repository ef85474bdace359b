"""Megatron-FSDP as a run holds it, for scripts/bench_offload.py run --fsdp: what the optimizer's parameters
and states are (DTensors, their local tensors, whose storage), how they sit in Megatron-FSDP's flat buffers,
the gradients, and the digest of each rank's shards (masters, model weights, FP8 data and scales).

`describe(model, optimizer)` is what --dump-layout writes, before the first step and after it; `digest(model,
optimizer)` replaces the bench's parameter digest under Megatron-FSDP, where the module's raw parameters
between steps are views of gather buckets that may be freed.
"""
import hashlib

GIB = 2**30


def _inner(optimizer):
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [(o, getattr(o, "optimizer", None)) for o in chain]


def _storage(t):
    try:
        s = t.untyped_storage()
        return {"ptr": s.data_ptr(), "nbytes": s.nbytes()}
    except Exception as e:  # meta or wrapper tensors
        return {"error": f"{type(e).__name__}: {e}"}


def _tensor(t, buffers=()):
    import torch
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    out = {"type": type(t).__name__, "dtype": str(t.dtype), "device": str(t.device), "shape": list(t.shape)}
    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(t, DTensor):
        out["placements"] = [str(p) for p in t.placements]
        out["local"] = {"type": type(local).__name__, "dtype": str(local.dtype), "device": str(local.device),
                        "shape": list(local.shape), "storage_offset": local.storage_offset(),
                        "is_contiguous": local.is_contiguous()}
    out["storage"] = _storage(local)
    ptr = local.data_ptr() if local.numel() else None
    for name, buf in buffers:
        data = getattr(buf, "data", None)
        if ptr is not None and isinstance(data, torch.Tensor) and data.numel():
            lo = data.data_ptr()
            if lo <= ptr < lo + data.numel() * data.element_size():
                out["in_buffer"] = {"name": name, "element_offset": (ptr - lo) // data.element_size()}
    return out


def describe(model, optimizer) -> dict:
    """Every model chunk's parameter groups and buffers; the first parameters of each inner optimizer with
    their gradients and states; the memory allocated now."""
    import torch

    chunks = []
    bufs = []
    for ci, chunk in enumerate(model):
        pgb = getattr(chunk, "param_and_grad_buffer", None)
        if pgb is None:
            chunks.append({"type": type(chunk).__name__, "fsdp": False})
            continue
        groups = []
        for gi, g in enumerate(pgb.parameter_groups):
            row = {"params": len(g.params), "dtype": str(g.dtype), "is_expert": g.is_expert_param}
            for attr in ("model_weight_buffer", "transpose_weight_buffer", "main_weight_buffer", "main_grad_buffer",
                         "hfsdp_helper_wbuf"):
                b = getattr(g, attr, None)
                if b is None:
                    continue
                d = getattr(b, "data", None)
                row[attr] = {"dtype": str(b.dtype), "distributed": b.is_data_distributed, "data_size": b.data_size,
                             "data": None if d is None else {"device": str(d.device), "numel": d.numel(),
                                                             **_storage(d)}}
                bufs.append((f"chunk{ci}.group{gi}.{attr}", b))
            groups.append(row)
        first = next(iter(chunk.module.parameters()), None) if hasattr(chunk, "module") else None
        chunks.append({"type": type(chunk).__name__, "fsdp": True,
                       "strategy": getattr(chunk, "data_parallel_sharding_strategy", None),
                       "is_param_fsdp_distributed": getattr(chunk, "is_param_fsdp_distributed", None),
                       "groups": groups, "module_param0": _tensor(first, bufs),
                       "dist_main_weight_locals_share_optimizer_params": _shares(pgb)})
    optimizers = []
    for opt, inner in _inner(optimizer):
        row = {"type": f"{type(opt).__module__}.{type(opt).__qualname__}",
               "inner": None if inner is None else f"{type(inner).__module__}.{type(inner).__qualname__}",
               "has_shard_fp32_from_float16_groups": hasattr(opt, "shard_fp32_from_float16_groups"),
               "use_megatron_fsdp": getattr(getattr(opt, "ddp_config", None), "use_megatron_fsdp", None)}
        if inner is not None:
            row["defaults"] = {k: repr(v) for k, v in inner.defaults.items()}
            for attr in ("master_weights", "use_decoupled_grad", "store_param_remainders", "capturable"):
                if hasattr(inner, attr):
                    row[attr] = repr(getattr(inner, attr))
            row["groups"] = [{"params": len(g["params"]), **{k: repr(v) for k, v in g.items() if k != "params"}}
                             for g in inner.param_groups]
            params = [p for g in inner.param_groups for p in g["params"]]
            row["n_params"] = len(params)
            row["params"] = []
            for p in params[:6]:
                st = inner.state.get(p, {})
                row["params"].append({
                    "param": _tensor(p, bufs), "grad": _tensor(p.grad, bufs),
                    "decoupled_grad": _tensor(getattr(p, "decoupled_grad", None), bufs),
                    "has_orig_param": hasattr(p, "orig_param"),
                    "state": {k: _tensor(v, bufs) if isinstance(v, torch.Tensor) else repr(v) for k, v in st.items()},
                    "scales": {k: _tensor(v) for k, v in (getattr(inner, "_scales", {}).get(p) or {}).items()},
                })
        optimizers.append(row)
    return {"allocated_gib": torch.cuda.memory_allocated() / GIB,
            "max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "chunks": chunks, "optimizers": optimizers}


def _shares(pgb):
    """Whether Megatron-FSDP's dist_main_weight DTensors are the optimizer's parameters, or other objects over
    the same storage."""
    from torch.distributed.tensor import DTensor

    named = dict(getattr(pgb, "optimizer_named_parameters", None) or [])
    dmw = getattr(pgb, "dist_main_weight", None) or {}
    for name, dt in dmw.items():
        p = named.get(name)
        if p is None or not isinstance(dt, DTensor):
            continue
        return {"same_object": p is dt, "same_local_object": p._local_tensor is dt._local_tensor,
                "same_ptr": p._local_tensor.data_ptr() == dt._local_tensor.data_ptr()}
    return None


def is_fsdp(model) -> bool:
    return any(getattr(c, "param_and_grad_buffer", None) is not None and hasattr(c.param_and_grad_buffer,
                                                                               "parameter_groups") for c in model)


def digest(model, optimizer) -> str:
    """sha256 of this rank's shards: every optimizer parameter's local tensor (the fp32 masters), every
    group's model-weight and transpose buffers (bf16 weights or FP8 data), the FP8 parameters' scales (TE's
    fp8_meta: bench_run.fp8_meta_digest)."""
    import torch
    from torch.distributed.tensor import DTensor

    from bench_run import feed

    h = hashlib.sha256()
    for _, inner in _inner(optimizer):
        for g in inner.param_groups:
            for p in g["params"]:
                local = p._local_tensor if isinstance(p, DTensor) else p
                if local.numel():
                    feed(h, local.reshape(-1))
    for chunk in model:
        pgb = chunk.param_and_grad_buffer
        for g in pgb.parameter_groups:
            for b in (g.model_weight_buffer, g.transpose_weight_buffer,  # (HSDP: the helpers hold the shards)
                      getattr(g, "hfsdp_helper_wbuf", None), getattr(g, "hfsdp_helper_wtbuf", None)):
                if b is not None and getattr(b, "data", None) is not None and b.data.numel():
                    feed(h, b.data)
            for p in g.params:
                for f in ("_scale_inv", "_rowwise_scale_inv", "_columnwise_scale_inv"):
                    t = getattr(p, f, None)
                    if isinstance(t, torch.Tensor) and t.numel():
                        feed(h, t.reshape(-1))
                q = getattr(p, "_quantizer", None)
                for t in (getattr(q, "scale", None), getattr(q, "amax", None)):
                    if isinstance(t, torch.Tensor) and t.numel():
                        feed(h, t.reshape(-1))
    return h.hexdigest()
