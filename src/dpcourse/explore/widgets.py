"""ipywidgets explorers for the notebooks. Each draws from a pure function that the tests call
directly, so what the sliders show is tested without a browser; each draws ``with drawing(out):``,
so that under test an error in its drawing fails the notebook's cell.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

# UNDER_TEST is defined without torch, for make check's own process
from dpcourse.explore import UNDER_TEST
from dpcourse.lab.optim import RULES, scaled_lr, warmup_then_decay  # the labs' own (notebook 08)

BATCH_SIZES = (1, 4, 16, 64, 256, 1024, 4096)


def under_test() -> bool:
    """Whether this process runs under the course's tests rather than in front of a learner."""
    return bool(os.environ.get(UNDER_TEST) or os.environ.get("PYTEST_CURRENT_TEST"))


def drawing(out):
    """``with drawing(out):`` in place of ``with out:`` for an explorer's drawing, so that it
    can fail.

    In a kernel, ipywidgets' ``Output`` shows an error raised inside it in its output area and
    swallows it: what a learner moving a slider needs (a slider's callback has no cell to show the
    error in), but a notebook's explorer cell then passes nbval and ``make course`` whatever its
    drawing raised. Under test (``under_test()``) the error is shown as before, then raised.
    """
    return _Drawing(out)


class _Drawing:
    def __init__(self, out):
        self.out = out

    def __enter__(self):
        self.out.__enter__()
        return self.out

    def __exit__(self, kind, error, tb):
        # shows the error in the output area (in a kernel)
        swallowed = self.out.__exit__(kind, error, tb)
        return bool(swallowed) and not under_test()


def sgd_softmax(X: torch.Tensor, y: torch.Tensor, lr: float, batch_size: int, samples: int,
                seed: int = 0, points: int = 40) -> dict:
    """Mini-batch SGD on softmax regression for a fixed number of *samples seen*.

    Returns ``samples_seen`` and ``train_loss`` (on a fixed 2,000-example probe of ``X``) at up to
    ``points`` moments, plus ``steps``. A loss that turns NaN/inf stops the run: it diverged.
    """
    g = torch.Generator().manual_seed(seed)
    n, d = X.shape
    classes = int(y.max()) + 1
    W = torch.zeros(d, classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    probe = torch.randperm(n, generator=g)[:2000]
    steps = max(1, samples // batch_size)
    every = max(1, steps // points)
    seen, losses = [], []

    def probe_loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(X[probe] @ W + b, y[probe]).item()

    seen.append(0)
    losses.append(probe_loss())
    for step in range(1, steps + 1):
        idx = torch.randint(0, n, (batch_size,), generator=g)
        loss = F.cross_entropy(X[idx] @ W + b, y[idx])
        gW, gb = torch.autograd.grad(loss, (W, b))
        with torch.no_grad():
            W -= lr * gW
            b -= lr * gb
        if step % every == 0 or step == steps:
            seen.append(step * batch_size)
            losses.append(probe_loss())
            if not torch.isfinite(torch.tensor(losses[-1])) or losses[-1] > 1e3:
                break
    return {"samples_seen": seen, "train_loss": losses, "steps": step}


def lr_batch_explorer(X: torch.Tensor, y: torch.Tensor, samples: int = 30_000):
    """Sliders for learning rate (log scale) and batch size; the loss curve redraws on release."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    lr = w.FloatLogSlider(value=0.1, base=10, min=-4, max=1, step=0.25, description="lr",
                          continuous_update=False)
    bs = w.SelectionSlider(options=BATCH_SIZES, value=64, description="batch size",
                           continuous_update=False)
    out = w.Output()

    def draw(*_):
        run = sgd_softmax(X, y, lr.value, bs.value, samples)
        with drawing(out):
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.plot(run["samples_seen"], run["train_loss"], marker=".")
            ax.set(xlabel="samples seen", ylabel="training loss", yscale="log",
                   title=f"lr={lr.value:.3g}, batch={bs.value}: {run['steps']} steps")
            ax.grid(alpha=0.3)
            plt.show()

    lr.observe(draw, "value")
    bs.observe(draw, "value")
    draw()
    box = w.VBox([w.HBox([lr, bs]), out])
    display(box)
    return box


# ---------------------------------------------------------------- notebook 08: learning-rate rules
TRAIN_IMAGES = 60_000  # FashionMNIST's training set
LR_RULES = RULES
REFERENCE_BATCH = 128  # the FashionMNIST labs' (tests/test_schedule.py holds them equal)


def peak_lr(rule: str, base_lr: float, global_batch: int,
            reference_batch: int = REFERENCE_BATCH) -> float:
    """``base_lr`` (tuned for ``reference_batch``) scaled for ``global_batch``: unchanged (none),
    times G / reference (linear, Goyal et al. 2017), or times its square root (sqrt)."""
    return scaled_lr(base_lr, global_batch, rule, reference_batch)


def lr_schedule(rule: str, base_lr: float, batch: int, world_size: int, warmup_epochs: float,
                epochs: int, steps_per_epoch: int | None = None) -> list[float]:
    """The learning rate of every step of ``fashion_ddp.py``'s schedule.

    ``batch`` is one worker's, so the global batch is ``batch × world_size``. The peak is
    ``peak_lr(rule, ...)``; the rate climbs linearly to it over ``warmup_epochs`` (gradual
    warm-up), then falls linearly to 0 at the end of ``epochs``. ``lrs[s]`` is the rate of step
    ``s`` (counted from 0), which is what the lab logs as ``lr`` in a record with ``"step": s``;
    there are ``epochs × steps_per_epoch + 1`` values, the last one 0. ``steps_per_epoch``
    defaults to the lab's: 60,000 images shared by the workers, the tail dropped.
    """
    if steps_per_epoch is None:
        steps_per_epoch = TRAIN_IMAGES // world_size // batch
    if steps_per_epoch < 1:
        raise ValueError(f"a global batch of {batch * world_size:,} is more than the "
                         f"{TRAIN_IMAGES:,} training images: not one step per epoch")
    peak = peak_lr(rule, base_lr, batch * world_size)
    total = max(1, epochs * steps_per_epoch)
    # the lab's LambdaLR
    factor = warmup_then_decay(total, max(1, round(warmup_epochs * steps_per_epoch)))
    return [peak * factor(step) for step in range(total + 1)]


def lr_rules_explorer(base_lr: float = 0.15, epochs: int = 3, warmup_epochs: float = 0.75):
    """Sliders for the per-worker batch, the workers and the warm-up; two panels: the learning
    rate of every step under each rule (as ``fashion_ddp.py`` runs it), and the peak rate of
    each rule against the global batch."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    # labels not cut off
    wide = {"style": {"description_width": "initial"}, "continuous_update": False}
    batch = w.SelectionSlider(options=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096), value=512,
                              description="batch per worker", **wide)
    workers = w.SelectionSlider(options=(1, 2, 4, 8, 16, 32, 64), value=2,
                                description="workers", **wide)
    warmup = w.FloatSlider(value=warmup_epochs, min=0.0, max=epochs - 0.25, step=0.25,
                           description="warm-up (epochs)", **wide)
    out = w.Output()

    def draw(*_):
        G = batch.value * workers.value
        spe = max(1, TRAIN_IMAGES // G)  # beyond 60,000 images per step: one step per epoch
        with drawing(out):
            out.clear_output(wait=True)
            fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
            for i, rule in enumerate(LR_RULES):
                lrs = lr_schedule(rule, base_lr, batch.value, workers.value, warmup.value,
                                  epochs, spe)[:-1]  # not the final 0
                left.plot([s / spe for s in range(len(lrs))], lrs, color=f"C{i}",
                          label=f"{rule}: peak {max(lrs):.3g}")
            left.set(xlabel="epoch", ylabel="learning rate", yscale="log",
                     title=f"{workers.value} × {batch.value} = global batch {G:,}: "
                           f"{spe:,} steps per epoch")
            left.legend(fontsize=8)
            gs = [2 ** k for k in range(4, 19)]
            for i, rule in enumerate(LR_RULES):
                right.plot(gs, [peak_lr(rule, base_lr, g) for g in gs], color=f"C{i}", label=rule)
                right.plot(G, peak_lr(rule, base_lr, G), "o", color=f"C{i}")
            right.axvline(REFERENCE_BATCH, color="0.6", ls=":",
                          label=f"reference batch {REFERENCE_BATCH}")
            right.set(xscale="log", yscale="log", xlabel="global batch",
                      ylabel="peak learning rate",
                      title=f"--lr {base_lr:g} is tuned for a global batch of {REFERENCE_BATCH}")
            right.legend(fontsize=8)
            for ax in (left, right):
                ax.grid(alpha=0.3)
            plt.show()

    for slider in (batch, workers, warmup):
        slider.observe(draw, "value")
    draw()
    box = w.VBox([w.HBox([batch, workers, warmup]), out])
    display(box)
    return box


# ----------------------------------------------------------- notebook 04: the all-reduce cost model
def allreduce_explorer(alpha: float = 5e-5, beta: float = 1e-9, gamma: float = 0.0):
    """Sliders for P, M, α and β (γ stays as given): the model time of every algorithm over
    message size, the winner at M drawn thick (notebook 04). Everything it draws comes from
    ``allreduce.model_table`` and ``allreduce.winner``, which the tests check."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from dpcourse.lab.allreduce import cost, fmt_bytes, model_table, winner

    style = dict(continuous_update=False, style={"description_width": "80px"})
    P = w.IntSlider(value=4, min=2, max=64, description="P", **style)
    M = w.FloatLogSlider(value=2**20, base=2, min=2, max=30, step=1,
                         description="M (bytes)", **style)
    a = w.FloatLogSlider(value=alpha, base=10, min=-7, max=-2, step=0.1,
                         description="α (s)", **style)
    b = w.FloatLogSlider(value=beta, base=10, min=-12, max=-7, step=0.1,
                         description="β (s/B)", **style)
    out = w.Output()
    sizes = [2.0 ** k for k in range(2, 31)]

    def draw(*_):
        table = model_table(P.value, sizes, a.value, b.value, gamma)
        best = winner(P.value, M.value, a.value, b.value, gamma)
        with drawing(out):
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3.6))
            for name, ts in table.items():
                ax.loglog(sizes, ts, label=name, lw=3 if name == best else 1.2)
            ax.axvline(M.value, color="k", ls=":")
            ax.set(xlabel="message size M (bytes)", ylabel="model time (s)",
                   title=f"P={P.value}, M={fmt_bytes(M.value)}: {best} wins "
                         f"({cost(best, P.value, M.value, a.value, b.value, gamma) * 1e3:.3g} ms)")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3, which="both")
            plt.show()

    for s in (P, M, a, b):
        s.observe(draw, "value")
    draw()
    box = w.VBox([w.HBox([P, M]), w.HBox([a, b]), out])
    display(box)
    return box


# ---------------------------------------------------------------- notebook 13: memory per worker
def memory_explorer(model: str = "ViT-L/16", world_size: int = 8, gpu: str = "A100 40 GB",
                    precision: str = "fp32"):
    """Model, workers, precision and GPU; bars of what one worker holds under DDP and each ZeRO
    stage (weights, gradients, optimizer state, stacked on a linear axis, each bar's total written
    on it), the GPU's memory as a line, and one line per stage saying whether it fits and what
    it sends per step (notebook 13); the figures come from ``dpcourse.explore.memory``."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from dpcourse.explore.memory import (
        BYTES,
        GPUS,
        MODELS,
        STAGE_NAMES,
        STAGES,
        explain,
        human,
        per_worker,
    )

    wide = {"style": {"description_width": "initial"}}
    preset = w.Dropdown(options=list(MODELS), value=model, description="model", **wide)
    billions = w.FloatLogSlider(value=MODELS[model] / 1e9, base=10, min=-2, max=3, step=0.05,
                                description="parameters (billions)",
                                continuous_update=False, **wide)
    workers = w.SelectionSlider(options=[2 ** k for k in range(11)], value=world_size,
                                description="workers", continuous_update=False, **wide)
    precision = w.ToggleButtons(options=list(BYTES), value=precision,
                                description="precision", **wide)
    device = w.Dropdown(options=list(GPUS), value=gpu, description="GPU", **wide)
    out = w.Output()

    def draw(*_):
        params, P = billions.value * 1e9, workers.value
        with drawing(out):
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
            names = [STAGE_NAMES[s] for s in STAGES]
            bottom = [0.0] * len(STAGES)
            for part, color in (("weights", "C0"), ("grads", "C1"), ("optimizer", "C2")):
                gb = [per_worker(params, P, s, precision.value)[part] / 1e9 for s in STAGES]
                ax.bar(names, gb, bottom=bottom, color=color, label=part)
                bottom = [b + g for b, g in zip(bottom, gb)]
            for x, total in enumerate(bottom):
                ax.annotate(human(total * 1e9), (x, total), ha="center", va="bottom", fontsize=8)
            ax.axhline(GPUS[device.value] / 1e9, color="k", ls="--", label=device.value)
            ax.set(ylabel="GB per worker (model states)",
                   ylim=(0, 1.15 * max(max(bottom), GPUS[device.value] / 1e9)),
                   title=f"{params / 1e9:.3g} B parameters, {precision.value}, {P} workers")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            plt.show()
            print("\n".join(explain(params, P, device.value, precision.value)))

    def pick(change):
        billions.value = MODELS[change["new"]] / 1e9  # redraws through billions' observer

    preset.observe(pick, "value")
    for widget in (billions, workers, precision, device):
        widget.observe(draw, "value")
    draw()
    box = w.VBox([w.HBox([preset, device, precision]), w.HBox([billions, workers]), out])
    display(box)
    return box


def interval_explorer(save_s: float = 30.0, restart_s: float = 300.0, gpus: int = 512):
    """GPUs, the save's time and the restart's; the fraction of the job lost against the interval
    between two saves (saves plus work done again after failures), its minimum at Young's
    √(2·C·M), and the interval for 8, 512 and 16,384 GPUs (notebook 14); the figures come from
    ``dpcourse.explore.checkpoints``, the failure rate from Llama 3's pre-training."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    import numpy as np
    from IPython.display import display

    from dpcourse.explore.checkpoints import human_s, mtbf_s, waste, young_daly_s

    wide = {"style": {"description_width": "initial"}, "continuous_update": False}
    count = w.SelectionSlider(options=[2 ** k for k in range(3, 15)], value=gpus,
                              description="GPUs", **wide)
    save = w.FloatLogSlider(value=save_s, base=10, min=-2, max=3, step=0.1,
                            description="save time C (s)", **wide)
    restart = w.FloatLogSlider(value=restart_s, base=10, min=0, max=4, step=0.1,
                               description="restart time R (s)", **wide)
    out = w.Output()

    def draw(*_):
        M, C, R = mtbf_s(count.value), save.value, restart.value
        best = young_daly_s(C, M)
        with drawing(out):
            out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
            taus = np.logspace(math.log10(C) - 0.5, math.log10(M), 200)
            least = 100 * waste(best, C, M, R)
            ax.loglog(taus, [100 * waste(t, C, M, R) for t in taus], lw=2.5, label="lost, in all")
            ax.loglog(taus, [100 * C / t for t in taus], ":", label="saving (C / τ)")
            ax.loglog(taus, [100 * (t / 2 + R) / M for t in taus], "--",
                      label="failures ((τ/2 + R) / M)")
            ax.axvline(best, color="k", lw=0.8)
            ax.annotate(f" √(2CM) = {human_s(best)}: {least:.2g} % lost", (best, least / 2),
                        fontsize=8)
            ax.set(xlabel="interval between two saves τ (s)", ylabel="% of the job lost (log)",
                   ylim=(least / 5, 100),
                   title=f"{count.value:,} GPUs: a failure every {human_s(M)}")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
            plt.show()
            for g in (8, 512, 16_384):
                t = young_daly_s(C, mtbf_s(g))
                print(f"{g:>6,} GPUs: a failure every {human_s(mtbf_s(g)):>10}; save every "
                      f"{human_s(t):>10}, losing {100 * waste(t, C, mtbf_s(g), R):.2g} %")

    for widget in (count, save, restart):
        widget.observe(draw, "value")
    draw()
    box = w.VBox([w.HBox([count, save, restart]), out])
    display(box)
    return box
