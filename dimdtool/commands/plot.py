"""``dimd plot``: training runs' metrics files as one PNG."""

from __future__ import annotations

from pathlib import Path

import click

from dimd.options import OUTPUT_FILE


@click.command("plot")
@click.argument("metrics", metavar="METRICS.jsonl...", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", type=OUTPUT_FILE, required=True, metavar="PNG", help="The figure to write.")
@click.option("--label", "labels", multiple=True,
              help="A run's name in the legend, once per METRICS file in order [default: the file's name, or its "
                   "folder's where the names are the same].")
@click.option("--title", default=None, help="The figure's title [default: the runs' names].")
def plot_command(metrics: tuple[Path, ...], out: Path, labels: tuple[str, ...], title: str | None) -> None:
    """Draw the loss, top-1 and rate of `dimd train --metrics` files, by epoch and by wall time.

    Training curves are solid, validation ones dashed, one colour per run:
    several files on one figure compare recipes or synchronisations. Needs
    matplotlib (`make plots-setup` installs it without plain Pillow).

    \b
    Example:
      dimd plot demo/metrics.jsonl -o demo/run.png
      dimd plot ssgd/metrics.jsonl sma/metrics.jsonl --label S-SGD --label SMA -o compare.png
    """
    import importlib.util

    from dimd.errors import BadInput
    from dimd.run_plot import plot_runs, read_runs

    if len(labels) > len(metrics):
        raise click.BadParameter(f"{len(labels)} labels for {len(metrics)} files", param_hint="'--label'")
    runs = read_runs(list(metrics), list(labels))
    if importlib.util.find_spec("matplotlib") is None:
        raise BadInput("dimd plot needs matplotlib: `make plots-setup` installs it (without plain Pillow)")
    plot_runs(runs, out, title=title)
    click.echo(f"wrote {out}: {len(runs)} run(s), {sum(len(r.epochs) for r in runs)} epochs")
