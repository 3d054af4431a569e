"""LARS, the layer-wise adaptive rate of You, Gitman and Ginsburg (2017), in a few lines.

With very large batches the linearly scaled learning rate is too large for some layers and too
small for others: the ratio ‖update‖ / ‖weight‖ differs a lot from layer to layer. LARS gives each
layer its own rate, ``trust · lr`` with ``trust = eta · ‖w‖ / (‖g‖ + weight_decay · ‖w‖)``, so every
layer moves by about the same fraction of its weights per step. Biases and normalisation weights
(1-D tensors) are left out of the adaptation and the weight decay, as in the paper's ImageNet runs.
LAMB (You et al., 2019) is the same idea on top of Adam's update.

Also the one batch-and-rate policy of every training lab, ``scaled_lr`` (each lab states the
global batch its --lr is tuned for), and their one schedule, ``warmup_then_decay``, which notebook
08's explorer draws too.
"""
from __future__ import annotations

import math

import torch

RULES = ("none", "linear", "sqrt")  # --lr-scaling


def scaled_lr(lr: float, global_batch: int, rule: str, reference_batch: int) -> float:
    """The rate for ``global_batch``, from ``lr``, the rate tuned for ``reference_batch``:
    ``none`` keeps it; ``linear`` multiplies it by global_batch / reference_batch (Goyal et al.,
    2017: k times the batch, k times the rate); ``sqrt`` by the square root of that (Krizhevsky,
    2014; Hoffer et al., 2017). One optimizer step averages the gradients of the global batch,
    whatever the number of workers that computed them: that batch sets the rate."""
    if rule not in RULES:
        raise ValueError(f"--lr-scaling {rule!r}: one of {', '.join(RULES)}")
    ratio = global_batch / reference_batch
    return lr if rule == "none" else lr * (ratio if rule == "linear" else math.sqrt(ratio))


def warmup_then_decay(total: int, warmup: int, decay: str = "linear"):
    """The labs' schedule, as ``LambdaLR``'s factor of the peak rate at each step (counted from 0):
    a linear climb over the first ``warmup`` steps (the peak at step ``warmup - 1``; Goyal et al.,
    2017), then a linear or cosine decay to 0 at step ``total``. A warm-up as long as the run or
    longer climbs all the run and never decays (the peak at the last step only if they are equal);
    after the last step, 0. No division by zero, whatever the two numbers."""
    if decay not in ("linear", "cosine"):
        raise ValueError(f"decay must be 'linear' or 'cosine', not {decay!r}")
    total, warmup = max(1, total), max(0, warmup)

    def factor(step: int) -> float:
        if step >= total:
            return 0.0
        if step < warmup:
            return (step + 1) / warmup
        if decay == "linear":  # 1 at the end of the warm-up, then down (warmup <= step < total)
            return (total - step) / (total - warmup)
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    return factor


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
                    # fresh or dead layer
                    trust = torch.where((w_norm > 0) & (g_norm > 0), trust, 1.0)
                    g = g.add(p, alpha=group["weight_decay"]).mul_(trust)
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(g)
                p.add_(buf, alpha=-group["lr"])
        return loss


def optimizer_by_name(name: str, params, lr: float, weight_decay: float,
                      lars_eta: float = 0.001) -> torch.optim.Optimizer:
    """The FashionMNIST labs' --optimizer: ``sgd`` (Nesterov momentum 0.9), ``adamw``, or ``lars``
    (a rate per layer, for very large batches; notebook 08)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True,
                               weight_decay=weight_decay)
    if name == "lars":
        return LARS(params, lr=lr, momentum=0.9, weight_decay=weight_decay, eta=lars_eta)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"no optimizer {name!r}: sgd, adamw or lars")
