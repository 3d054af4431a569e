"""The JSON-lines run log every lab writes (rank 0 only).

One object per line; at least ``event``, ``epoch``, ``step``, ``world_size``, ``global_batch``,
``train_loss``, ``test_accuracy``, ``samples_per_s``, ``elapsed_s`` for training events
(DESIGN.md §4). Plots read these files, never numbers typed into a cell.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


class JsonLog:
    """Append-only JSON-lines writer; a no-op where ``path`` is None (the other ranks)."""

    def __init__(self, path: str | os.PathLike | None, append: bool = False,
                 elapsed_before: float = 0.0, **common):
        """``append`` keeps earlier records (a resumed run); ``elapsed_before`` is the time it
        had already trained, so ``elapsed_s`` goes on counting from there."""
        self.path = Path(path) if path else None
        self.common = common
        self.start = time.perf_counter() - elapsed_before
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not (append and self.path.exists()):
                self.path.write_text("")

    def elapsed(self) -> float:
        """Seconds since the clock started (plus ``elapsed_before``)."""
        return time.perf_counter() - self.start

    def write(self, event: str, **fields) -> dict:
        record = {"event": event, **self.common, **fields,
                  "elapsed_s": round(self.elapsed(), 4)}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def read_log(path: str | os.PathLike) -> list[dict]:
    """All records of a JSON-lines log."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
