"""Selective Adam: Adam over named [N, ...] Gaussian tensors that updates only the visible rows.

A Gaussian no camera of the step saw gets a zero gradient; plain Adam would still move it (its first moment
decays but is not zero) and would decay its moments. Here its parameters and moments stay untouched, as in
gsplat's ``SelectiveAdam`` (the Taming 3DGS optimizer), including its update rule without bias correction:
``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, ``p -= lr m / (sqrt(v) + eps)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SelectiveAdam:
    """One learning rate per named tensor; ``params`` is shared with the caller (densification edits it)."""

    def __init__(self, params: dict[str, Tensor], lrs: dict[str, float], *, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-15) -> None:
        missing = sorted(set(params) - set(lrs))
        if missing:
            raise ValueError(f"SelectiveAdam: no learning rate for {missing}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"SelectiveAdam: betas must be in [0, 1), got {betas}")
        self.params = params
        self.lrs = {k: float(lrs[k]) for k in params}
        self.betas, self.eps = betas, eps
        self.state: dict[str, dict[str, Tensor]] = {
            k: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for k, p in params.items()}

    @torch.no_grad()
    def step(self, visible: Tensor | None = None) -> None:
        """Update every tensor with a gradient; only rows where ``visible`` [N] is True when given."""
        b1, b2 = self.betas
        for name, p in self.params.items():
            g = p.grad
            if g is None:
                continue
            st = self.state[name]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            if m.shape != p.shape:
                raise RuntimeError(f"SelectiveAdam: moments of {name!r} have shape {list(m.shape)}, the tensor "
                                   f"{list(p.shape)}; densification must edit both")
            m_new = m * b1 + g * (1.0 - b1)
            v_new = v * b2 + g * g * (1.0 - b2)
            upd = m_new / (v_new.sqrt() + self.eps) * self.lrs[name]
            if visible is None:
                m.copy_(m_new)
                v.copy_(v_new)
                p.sub_(upd)
                continue
            mask = visible.view(-1, *([1] * (p.dim() - 1)))
            m.copy_(torch.where(mask, m_new, m))
            v.copy_(torch.where(mask, v_new, v))
            p.sub_(torch.where(mask, upd, torch.zeros_like(upd)))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict:
        return {"lrs": dict(self.lrs), "betas": self.betas, "eps": self.eps,
                "state": {k: {n: t.detach().clone() for n, t in s.items()} for k, s in self.state.items()}}

    def load_state_dict(self, d: dict) -> None:
        if set(d["state"]) != set(self.params):
            raise ValueError(f"SelectiveAdam: state for {sorted(d['state'])}, parameters {sorted(self.params)}")
        for k, s in d["state"].items():
            for n, t in s.items():
                if t.shape != self.params[k].shape:
                    raise ValueError(f"SelectiveAdam: saved {n} of {k!r} is {list(t.shape)}, the tensor "
                                     f"{list(self.params[k].shape)}")
        self.lrs, self.betas, self.eps = dict(d["lrs"]), tuple(d["betas"]), d["eps"]
        dev = next(iter(self.params.values())).device
        # copies: the moments are updated in place, and the caller's state dict must not change under them
        self.state = {k: {n: t.to(dev, copy=True) for n, t in s.items()} for k, s in d["state"].items()}
