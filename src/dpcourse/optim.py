"""LARS, the layer-wise adaptive rate of You, Gitman and Ginsburg (2017), in a few lines.

With very large batches the linearly scaled learning rate is too large for some layers and too
small for others: the ratio ‖update‖ / ‖weight‖ differs a lot from layer to layer. LARS gives each
layer its own rate, ``trust · lr`` with ``trust = eta · ‖w‖ / (‖g‖ + weight_decay · ‖w‖)``, so every
layer moves by about the same fraction of its weights per step. Biases and normalisation weights
(1-D tensors) are left out of the adaptation and the weight decay, as in the paper's ImageNet runs.
LAMB (You et al., 2019) is the same idea on top of Adam's update.
"""
from __future__ import annotations

import torch


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step, per tensor, is scaled by the LARS trust ratio."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if p.ndim > 1:  # weights of conv and linear layers: decay and adapt
                    w_norm, g_norm = p.norm(), g.norm()
                    trust = group["eta"] * w_norm / (g_norm + group["weight_decay"] * w_norm)
                    trust = torch.where((w_norm > 0) & (g_norm > 0), trust, 1.0)  # fresh or dead layer
                    g = g.add(p, alpha=group["weight_decay"]).mul_(trust)
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(g)
                p.add_(buf, alpha=-group["lr"])
        return loss
