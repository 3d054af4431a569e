"""Plots drawn from what the labs logged, never from numbers typed into a cell.

    fig = plots.scaling(scaling.table("runs/scaling"))      # throughput, speedup, efficiency vs K
    fig = plots.curves({"K=1": "k1.jsonl", "K=2": "k2.jsonl"})           # test accuracy vs time
    fig = plots.stacked_split({"K=2": {"forward": 3.1, "backward": 5.2, "allreduce": 2.0}})

Each function returns its matplotlib Figure and never calls ``plt.show()``: a notebook shows
the figure when the cell ends, a script saves it (``fig.savefig("fig.png")``), under Agg too.
``ax`` draws into an existing Axes (or, for ``scaling``, a Figure or three Axes) instead.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from dpcourse.lab.errors import CourseError
from dpcourse.lab.metrics import read_log

COLORS = {"strong": "C0", "weak": "C1"}
PHASES = ("data", "forward", "backward", "allreduce", "optimizer")
LABELS = {"elapsed_s": "seconds of training", "epoch": "epoch", "step": "step",
          "test_accuracy": "test accuracy", "test_loss": "test loss", "train_loss": "train loss",
          "samples_per_s": "samples per second", "lr": "learning rate"}


def scaling(rows: list[dict], ax=None):
    """Throughput, speedup and efficiency vs K, strong and weak, from
    ``dpcourse.explore.scaling.table``.

    Dashed: the ideal (throughput K × T(1), speedup K, efficiency 1). Hollow markers and the
    grey band: oversubscribed runs (more threads than cores). Incomplete runs are left out.
    """
    rows = [r for r in rows if r["complete"] and r["samples_per_s"]]
    if not rows:
        raise CourseError("Nothing to plot: no run of the study is complete yet.")
    if ax is None:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.9), layout="constrained")
    elif hasattr(ax, "subplots"):  # a Figure
        fig, axes = ax, ax.subplots(1, 3)
    else:
        axes = list(ax)
        fig = axes[0].figure
    ks = sorted({r["workers"] for r in rows})
    fits = max(1, rows[0]["cores"] // rows[0]["threads"])  # workers the cores hold
    for mode in COLORS:
        series = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["workers"])
        if not series:
            continue
        k = [r["workers"] for r in series]
        batch = (f"global batch {series[0]['global_batch']}" if mode == "strong"
                 else f"{series[0]['batch_size']} per worker")
        for a, key in zip(axes, ("samples_per_s", "speedup", "efficiency")):
            y = [r[key] for r in series]
            if None in y:  # no K=1 run: no speedup or efficiency
                continue
            a.plot(k, y, color=COLORS[mode], label=f"{mode} ({batch})")
            for r, v in zip(series, y):
                a.plot(r["workers"], v, "o", color=COLORS[mode],
                       mfc="none" if r["oversubscribed"] else COLORS[mode])
        t1 = next((r["samples_per_s"] for r in series if r["workers"] == 1), None)
        if t1:
            axes[0].plot(ks, [k_ * t1 for k_ in ks], "--", color=COLORS[mode], alpha=0.5, lw=1)
    axes[1].plot(ks, ks, "k--", lw=1)
    axes[2].axhline(1.0, color="k", ls="--", lw=1)
    titles = ("throughput (samples/s, all workers)", "speedup  T(K) / T(1)",
              "efficiency  T(K) / (K · T(1))")
    for a, title in zip(axes, titles):
        a.set(xlabel="workers K", title=title, xticks=ks)
        a.grid(alpha=0.3)
        if ks[-1] > fits:
            a.axvspan(fits + 0.5, ks[-1] + 0.5, color="0.9", zorder=0)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(0, max(1.1, *[r["efficiency"] * 1.1 for r in rows if r["efficiency"]]))
    handles, _ = axes[0].get_legend_handles_labels()
    handles.append(Line2D([], [], color="k", ls="--", lw=1, label="ideal"))
    if any(r["oversubscribed"] for r in rows):
        handles.append(Line2D([], [], marker="o", mfc="none", color="0.4", ls="none",
                              label=f"oversubscribed: K × threads > {rows[0]['cores']} cores"))
    axes[2].legend(handles=handles, loc="lower left", fontsize=8)
    r0 = rows[0]
    where = r0["cuda_device"] or r0["cpu"]
    threads = f"{r0['threads']} thread{'s' if r0['threads'] > 1 else ''} per worker"
    fig.suptitle(f"{r0['lab']} on {r0['host']}: {r0['cores']} cores ({where}), {threads}")
    return fig


def curves(logs: dict, x: str = "elapsed_s", y: str = "test_accuracy", ax=None):
    """One line per log (label → JSON-lines path, or a list of records): y against x, from the
    records that have both (accuracy vs time or vs epoch, loss, learning rate)."""
    fig, ax = _axes(ax, (6, 3.6))
    drawn = 0
    for label, log in logs.items():
        records = log if isinstance(log, list) else read_log(log)
        points = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
        if points:
            ax.plot(*zip(*points), marker=".", label=label)
            drawn += 1
    if not drawn:
        raise CourseError(f"Nothing to plot: no record in these logs has both {x!r} and {y!r} "
                          "(was the run launched with --no-eval?).")
    ax.set(xlabel=LABELS.get(x, x), ylabel=LABELS.get(y, y))
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def stacked_split(rows: dict, ax=None):
    """Horizontal stacked bars of one training step's time (ms) split into phases, one bar per
    label (``{label: {phase: ms}}``), with the all-reduce's share written at each bar's end."""
    fig, ax = _axes(ax, (8, 0.55 * len(rows) + 1.4))
    labels = list(rows)
    phases = [p for p in PHASES if any(p in r for r in rows.values())]
    phases += [p for r in rows.values() for p in r if p not in phases]  # any other phase, last
    left = [0.0] * len(labels)
    for i, phase in enumerate(phases):
        widths = [rows[label].get(phase, 0.0) for label in labels]
        ax.barh(labels, widths, left=left,
                color=f"C{PHASES.index(phase) if phase in PHASES else i}", label=phase)
        left = [a + b for a, b in zip(left, widths)]
    for y, (label, total) in enumerate(zip(labels, left)):
        share = rows[label].get("allreduce", 0.0) / total if total else 0.0
        ax.text(total, y, f"  all-reduce {share:.0%}", va="center", fontsize=9)
    ax.margins(x=0.18)
    ax.invert_yaxis()
    ax.set(xlabel="ms per step")
    # beside the bars: never on a label
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    return fig


def _axes(ax, size):
    if ax is None:
        return plt.subplots(figsize=size, layout="constrained")
    return ax.figure, ax
