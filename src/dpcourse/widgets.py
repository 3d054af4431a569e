"""ipywidgets explorers for the notebooks. Each draws from a pure function that the tests call
directly, so what the sliders show is tested without a browser.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH_SIZES = (1, 4, 16, 64, 256, 1024, 4096)


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
        with out:
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
