"""``dimd plot``: training runs' ``--metrics`` files as one figure, drawn with :mod:`dimd.plotting`.

Rows: the loss, the top-1, and beneath them the learning rate (at each epoch's end); columns: against epochs
and against wall time (seconds since the run started, loading included). One colour per run; training
solid, validation dashed. Several runs on one figure compare recipes or algorithms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dimd.errors import BadInput

#: One strong colour per run, told apart in print too (matplotlib's first tab10 colours).
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
#: What a metrics line must hold to be drawn (dimd.train.results.EpochMetrics).
FIELDS = ("epoch", "elapsed", "train_loss", "val_loss", "train_top1", "val_top1", "lr")


@dataclass(frozen=True)
class Run:
    """One run's epochs, as its metrics file has them (a resumed run's superseded epochs are already gone)."""

    label: str
    epochs: list[dict[str, Any]]

    def column(self, name: str) -> list[float]:
        return [float(e[name]) for e in self.epochs]


def read_runs(paths: list[Path], labels: list[str]) -> list[Run]:
    """Each metrics file as a run (labelled by ``labels`` in order, else by the file's name); one line for a
    file that is missing or holds no epoch records."""
    runs = []
    for i, path in enumerate(paths):
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise BadInput(f"{path}: cannot read it ({exc.strerror or exc})") from None
        epochs = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:
                raise BadInput(f"{path}:{number}: not a JSON line (a `dimd train --metrics` file?)") from None
            missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
            if missing:
                raise BadInput(f"{path}:{number}: no {missing[0]!r}: not a `dimd train --metrics` line")
            epochs.append(record)
        if not epochs:
            raise BadInput(f"{path}: no epoch in it (a `dimd train --metrics` file, written after each epoch)")
        runs.append(Run(labels[i] if i < len(labels) else _default_label(Path(path), paths), epochs))
    return runs


def _default_label(path: Path, paths: list[Path]) -> str:
    """The file's stem, or its folder's name where every file has the same stem (demo/ssgd/metrics.jsonl...)."""
    stems = {Path(p).stem for p in paths}
    return path.parent.name or path.stem if len(stems) < len(paths) else path.stem


def plot_runs(runs: list[Run], out: Path, *, title: str | None = None) -> Path:
    """Draw ``runs`` to the PNG ``out``."""
    from dimd import plotting

    fig, axes = plotting.figure(3, 2, width=5.2, height=3.0)
    rows = (("loss", "train_loss", "val_loss", "cross-entropy loss (log scale)"),
            ("top-1", "train_top1", "val_top1", "top-1 accuracy (%)"))
    for index, run in enumerate(runs):
        colour = RUN_COLORS[index % len(RUN_COLORS)]
        for col, x_name in enumerate(("epoch", "elapsed")):
            x = run.column(x_name)
            for row, (_, train_key, val_key, _) in enumerate(rows):
                scale = 100.0 if row == 1 else 1.0
                ax = axes[row][col]
                ax.plot(x, [v * scale for v in run.column(train_key)], color=colour, marker="o", markersize=2.5,
                        label=f"{run.label}: training")
                ax.plot(x, [v * scale for v in run.column(val_key)], color=colour, linestyle="--", marker="s",
                        markersize=2.5, label=f"{run.label}: validation")
            axes[2][col].plot(x, run.column("lr"), color=colour, marker="o", markersize=2.5,
                              label=f"{run.label}: learning rate")
    for col, x_label in enumerate(("epoch", "wall time since the start (s)")):
        for row, (name, _, _, y_label) in enumerate(rows):
            axes[row][col].set_ylabel(y_label)
            axes[row][col].set_title(f"{name} by {'epoch' if col == 0 else 'wall time'}")
        axes[0][col].set_yscale("log")   # the first epochs' validation loss can be tens of times the last
        axes[1][col].set_ylim(0, 100)
        axes[2][col].set_ylabel("learning rate (at the epoch's end)")
        axes[2][col].set_title(f"learning rate by {'epoch' if col == 0 else 'wall time'}")
        axes[2][col].set_ylim(bottom=0)
        for row in range(3):
            axes[row][col].set_xlabel(x_label)
    plotting.shared_legend(fig, axes[0][0], width=0.09 + 0.0045 * max(len(r.label) for r in runs))
    shown = ", ".join(r.label for r in runs)
    return plotting.save(fig, Path(out), {}, title=title or f"dimd train: {shown}",
                         footnote="solid: training (the epoch's steps), dashed: validation (after each epoch)")
