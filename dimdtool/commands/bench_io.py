"""``dimd bench-io``: images/s of the in-memory loader, a file-based DataLoader and the decode limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dimd.commands.mpi_job import mpi_command
from dimd.options import build_config, config_option, json_option
from dimd.shuffle.bench_io import BenchIoConfig


@click.command("bench-io")
@click.argument("dataset", type=click.Path(path_type=Path))
@config_option(BenchIoConfig, "tree", required=True, type=click.Path(file_okay=False, exists=True, path_type=Path),
               help="The folder DATASET was packed from (the original image files).")
@config_option(BenchIoConfig, "workers",
               help="Decoders per method, the same count for a fair comparison: dimd's decoding workers "
                    "and the DataLoader's worker processes.")
@config_option(BenchIoConfig, "batch_size")
@config_option(BenchIoConfig, "image_size")
@config_option(BenchIoConfig, "images",
               help="Images per measurement, in whole batches [default: every record once]. More than "
                    "the records cycle through further epochs; a multiple of the record count keeps "
                    "the DataLoader's workers from being stopped mid-epoch.")
@config_option(BenchIoConfig, "repeats", help="Runs of each method; medians are reported.")
@config_option(BenchIoConfig, "seed")
@json_option()
@mpi_command("funneled")
def bench_io(dataset: Path, json_path: Path | None, comm, mpi_setup, **fields: Any) -> None:
    """Measure training-batch throughput (images/s) three ways on the same images.

    \b
      dimd   the in-memory BatchLoader over the packed DATASET (worker processes, draft decode)
      torch  torch.utils.data.DataLoader over the original files in --tree, Pillow
             decode + RandomResizedCrop-style crop/resize + flip (worker processes)
      limit  decode_train in a bare single-threaded loop over the in-memory bytes

    All use random-resized crop (scale 0.08-1, ratio 3/4-4/3) to --image-size
    and a random flip, with the same --workers. Prints each run, the medians
    and the ratios dimd/torch and dimd per worker / limit, also per CPU-second
    (user + system time of all threads and worker processes), which other
    jobs on a shared machine disturb less.
    Runs in one process (no mpirun).

    \b
    Example:
      dimd bench-io demo/train --tree demo/images/train --workers 2 --json bench-io.json
    """
    from dimd.report import result_document, write_json
    from dimd.shuffle.bench_io import run_bench_io

    config = build_config(BenchIoConfig, dataset=dataset, **fields)

    def on_measurement(m) -> None:
        click.echo(f"run {m.repeat}  {m.method:<6} {m.images:>6} images {m.seconds:>8.2f} s "
                   f"{m.images_per_s:>9.1f} images/s {m.images_per_cpu_s:>9.1f} images/CPU-s")

    result = run_bench_io(config, comm, on_measurement=on_measurement)
    click.echo(f"{'method':<7} {'median img/s':>13} {'min':>9} {'max':>9} {'img/CPU-s':>10}")
    for method, figures in result.methods.items():
        rate = figures["images_per_s"]
        click.echo(f"{method:<7} {rate['median']:>13.1f} {rate['min']:>9.1f} {rate['max']:>9.1f} "
                   f"{figures['images_per_cpu_s']['median']:>10.1f}")
    ratios = result.ratios
    click.echo(f"dimd / torch DataLoader: {ratios['dimd_over_torch']:.2f}x; "
               f"dimd per worker / decode limit: {ratios['dimd_per_worker_over_limit']:.2f}x, "
               f"{config.workers} worker{'s' if config.workers != 1 else ''}, {mpi_setup.cores} cores")
    click.echo(f"per CPU-second (robust to other load): dimd / torch {ratios['cpu_dimd_over_torch']:.2f}x, "
               f"dimd / decode limit {ratios['cpu_dimd_over_limit']:.2f}x")
    if json_path is not None:
        write_json(json_path, result_document("bench-io", config, result, mpi=mpi_setup.as_dict()))
