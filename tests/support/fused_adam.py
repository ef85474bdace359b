"""CPU stand-ins for the fused Adam optimizers Megatron-Core builds, reproducing their contract with
an engine that moves their states (the elementwise kernel is plain torch arithmetic on CPU):

- TEFusedAdam follows Transformer Engine 2.x transformer_engine/pytorch/optimizers/fused_adam.py
  (TE main at 04912bf0, the 2.20 line): `group["step"]` advanced once per step() per non-empty
  group (an int, or a device tensor in place when capturable); states created inside step() by
  initialize_state() when a parameter has none; `exp_avg`/`exp_avg_sq` in `exp_avg_dtype`/
  `exp_avg_sq_dtype` (fp32, bf16, fp16) with a [1]-shaped fp32 scale in `_scales[p][name]` for every
  non-fp32 state (used for fp16: state = unscaled / scale); `master_param` in the state when
  `master_weights` (fp32, or int16 remainders with `store_param_remainders` for bf16 parameters); the
  gradient read from `p.decoupled_grad` when `use_decoupled_grad`; the model parameter written by
  the step itself; get_unscaled_state / set_scaled_state for checkpoints, and TE's state_dict /
  load_state_dict overrides (states out unscaled in fp32; in, every state made anew and scaled).
  Difference kept on purpose: the remainder here is the low 16 bits of a master truncated (not
  rounded) to the bf16 parameter, so it reconstructs exactly with plain bit operations; TE rounds.
  Same dtype, shape and role.
- ApexFusedAdam follows apex/optimizers/fused_adam.py (main 6424da3b): `param_groups_master` paired
  with `param_groups` by position, empty groups skipped, `group["step"]`, fp32 moments created in
  step() for parameters that have a gradient.

Their module and class names are the real ones, as Megatron-Core imports them, so bridge_fgo's
contracts recognise them exactly as they recognise the real classes.
"""
import torch


def _adam(p32, g, m, v, lr, b1, b2, eps, step, wd, adam_w, bias_correction):
    """One elementwise Adam(W) update in fp32 (what multi_tensor_adam computes per element)."""
    if not adam_w and wd:
        g = g + wd * p32
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bc1 = 1 - b1 ** step if bias_correction else 1.0
    bc2 = 1 - b2 ** step if bias_correction else 1.0
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if adam_w and wd:
        update = update + wd * p32
    p32.add_(update, alpha=-lr)


def _to_bits(x):
    return x.contiguous().view(torch.int32)


class TEFusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, bias_correction=True,
                 adam_w_mode=True, capturable=False, master_weights=False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False,
                 store_param_remainders=False):
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self._scales = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = store_param_remainders and master_weights and master_weight_dtype == torch.float32

    # -- TE's state helpers --------------------------------------------------------------------
    def _initialize_state(self, param, state_name, zero_buffer, store_param_remainders=False):
        # (TE 2.x's signature, names included: bridge_fgo's shadow of it checks them, contracts.Contract.made_in)
        dtype = self.name_to_dtype_map[state_name]
        data = (torch.zeros_like(param, dtype=torch.int16) if store_param_remainders
                else torch.empty_like(param, dtype=dtype))
        if zero_buffer:
            data.zero_()
        self.state[param][state_name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones([1], dtype=torch.float32, device=param.device)

    def initialize_state(self, param, store_param_remainders=False):
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False,
                                   store_param_remainders=store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    def get_unscaled_state(self, param, name):
        state = self.state[param][name]
        dtype = self.name_to_dtype_map[name]
        if dtype == torch.float16:
            return state.float().mul_(self._scales[param][name])
        if dtype == torch.bfloat16:
            return state.float()
        return state

    def set_scaled_state(self, param, name, unscaled):
        if name not in self.state[param]:  # (TE: remainders only for the master of a bf16 parameter)
            self._initialize_state(param, name, False, self.store_param_remainders and name == "master_param"
                                   and param.dtype == torch.bfloat16)
        dtype = self.name_to_dtype_map[name]
        if dtype != torch.float32:
            self._apply_scale(name, unscaled, self.state[param][name], self._scales[param][name])
        else:
            self.state[param][name].copy_(unscaled)

    def _apply_scale(self, name, unscaled, scaled, scale):
        if scaled.dtype == torch.bfloat16:
            scaled.copy_(unscaled.bfloat16())
            return
        absmax = unscaled.abs().max().to(torch.float32)
        scale.copy_((absmax / (torch.finfo(torch.float16).max / 2.0)).reshape(1))  # written in place, as TE does
        rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        scaled.copy_(unscaled * rscale)

    # -- checkpoints: TE's overrides (every state unscaled to fp32 out; new states, scaled, in) -----
    def _id_map(self, saved_groups):
        import itertools

        return dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                        itertools.chain.from_iterable(g["params"] for g in self.param_groups)))

    def state_dict(self):
        state_dict = super().state_dict()
        id_map = self._id_map(state_dict["param_groups"])
        for k, v in state_dict["state"].items():
            if k in id_map:
                state_dict["state"][k] = {name: self.get_unscaled_state(id_map[k], name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        id_map = self._id_map(state_dict["param_groups"])
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}  # TE makes every state anew
                for name, value in v.items():
                    if value is None:
                        continue
                    if self.store_param_remainders and name == "master_param" and param.dtype == torch.bfloat16:
                        self.set_scaled_state(param, name, value)
                    else:
                        self.set_scaled_state(param, name, value.float())

    # -- step ----------------------------------------------------------------------------------
    def step(self, closure=None):
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            device = group["params"][0].device
            if "step" in group:
                group["step"] += 1 if not self.capturable else torch.ones(1, dtype=torch.int, device=device)
            else:
                group["step"] = 1 if not self.capturable else torch.tensor([1], dtype=torch.int, device=device)
            step = int(group["step"]) if self.capturable else group["step"]
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                remainders = self.store_param_remainders and p.dtype == torch.bfloat16
                if len(state) == 0:
                    self.initialize_state(p, remainders)
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                m = self.get_unscaled_state(p, "exp_avg").float().clone()
                v = self.get_unscaled_state(p, "exp_avg_sq").float().clone()
                if self.master_weights and remainders:
                    high = _to_bits(p.detach().float()) & ~0xFFFF
                    low = state["master_param"].to(torch.int32) & 0xFFFF
                    p32 = (high | low).view(torch.float32).clone()
                elif self.master_weights:
                    p32 = self.get_unscaled_state(p, "master_param").float().clone()
                else:
                    p32 = p.detach().float().clone()
                _adam(p32, grad.float(), m, v, group["lr"], b1, b2, group["eps"], step, group["weight_decay"],
                      self.adam_w_mode, group["bias_correction"])
                for name, value in (("exp_avg", m), ("exp_avg_sq", v)):
                    if self.name_to_dtype_map[name] == torch.float32:
                        state[name].copy_(value)
                    else:
                        self._apply_scale(name, value, state[name], self._scales[p][name])
                if self.master_weights and remainders:
                    bits = _to_bits(p32)
                    state["master_param"].copy_((bits & 0xFFFF).to(torch.int16))
                    p.data.copy_((bits & ~0xFFFF).view(torch.float32).to(p.dtype))  # exact: low bits are zero
                elif self.master_weights:
                    self.set_scaled_state(p, "master_param", p32)
                    p.data.copy_(p32.to(p.dtype))
                else:
                    p.data.copy_(p32.to(p.dtype))
        return None


TEFusedAdam.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"
TEFusedAdam.__qualname__ = TEFusedAdam.__name__ = "FusedAdam"


class ApexFusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self.param_groups_master = [{"params": [p.clone().detach().float() if master_weights else None
                                                for p in g["params"]]} for g in self.param_groups]

    def step(self, closure=None):
        for group, group_master in zip(self.param_groups, self.param_groups_master):
            if len(group["params"]) == 0:
                continue
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
            b1, b2 = group["betas"]
            for p, _master in zip(group["params"], group_master["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p.data).float()
                    state["exp_avg_sq"] = torch.zeros_like(p.data).float()
                p32 = p.detach().float().clone()
                _adam(p32, p.grad.float(), state["exp_avg"], state["exp_avg_sq"], group["lr"], b1, b2, group["eps"],
                      group["step"], group["weight_decay"], self.adam_w_mode, group["bias_correction"])
                p.data.copy_(p32)
        return None


ApexFusedAdam.__module__ = "apex.optimizers.fused_adam"
ApexFusedAdam.__qualname__ = ApexFusedAdam.__name__ = "FusedAdam"


def count_own_states(monkeypatch, inner) -> list:
    """The state names TE's own _initialize_state makes from here on (its signature kept, so bridge_fgo's
    shadow of it, contracts.Contract.made_in, still applies)."""
    made, real = [], type(inner)._initialize_state

    def counted(self, param, state_name, zero_buffer, store_param_remainders=False):
        made.append(state_name)
        return real(self, param, state_name, zero_buffer, store_param_remainders)

    monkeypatch.setattr(type(inner), "_initialize_state", counted)
    return made
