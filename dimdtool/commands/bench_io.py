"""``dimd bench-io``: images/s of the in-memory loader, a file-based DataLoader and the decode limit."""

from __future__ import annotations

from pathlib import Path

import click

from dimd.commands.mpi_job import mpi_command
from dimd.options import OUTPUT_FILE



@click.command("bench-io")
@click.argument("dataset", type=click.Path(path_type=Path))
@click.option("--tree", required=True, type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="The folder DATASET was packed from (the original image files).")
@click.option("--workers", default=2, show_default=True,
              help="Decoding threads (dimd) and worker processes (DataLoader).")
@click.option("--batch-size", default=32, show_default=True)
@click.option("--image-size", default=224, show_default=True)
@click.option("--images", type=int,
              help="Images per measurement, in whole batches [default: every record once]. More than "
                   "the records cycle through further epochs; a multiple of the record count keeps "
                   "the DataLoader's workers from being stopped mid-epoch.")
@click.option("--repeats", default=3, show_default=True, help="Runs of each method; medians are reported.")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", type=OUTPUT_FILE, metavar="PATH", help="Write the figures as JSON to PATH.")
@mpi_command("funneled")
def bench_io(dataset: Path, tree: Path, workers: int, batch_size: int, image_size: int,
             images: int | None, repeats: int, seed: int, json_path: Path | None, comm, mpi_setup) -> None:
    """Measure training-batch throughput (images/s) three ways on the same images.

    \b
      dimd   the in-memory BatchLoader over the packed DATASET (threads, draft decode)
      torch  torch.utils.data.DataLoader over the original files in --tree, Pillow
             decode + RandomResizedCrop-style crop/resize + flip (worker processes)
      limit  decode_train in a bare single-threaded loop over the in-memory bytes

    All use random-resized crop (scale 0.08-1, ratio 3/4-4/3) to --image-size
    and a random flip, with the same --workers. Prints each run, the medians
    and the ratios dimd/torch (aim >= 1.3) and dimd per worker / limit (aim
    >= 0.8), also per CPU-second (user + system time of all threads and
    worker processes), which other jobs on a shared machine disturb less.
    Runs in one process (no mpirun).

    \b
    Example:
      dimd bench-io demo/train --tree demo/images/train --workers 2 --json bench-io.json
    """
    from dimd.report import result_document, write_json
    from dimd.shuffle.bench_io import BenchIoConfig, run_bench_io

    config = BenchIoConfig(dataset=dataset, tree=tree, workers=workers, batch_size=batch_size,
                           image_size=image_size, images=images, repeats=repeats, seed=seed)

    def on_measurement(m) -> None:
        click.echo(f"run {m.repeat}  {m.method:<6} {m.images:>6} images {m.seconds:>8.2f} s "
                   f"{m.images_per_s:>9.1f} images/s {m.images_per_cpu_s:>9.1f} images/CPU-s")

    result = run_bench_io(config, comm, on_measurement=on_measurement)
    click.echo(f"{'method':<7} {'median img/s':>13} {'min':>9} {'max':>9} {'img/CPU-s':>10}")
    for method, figures in result["methods"].items():
        click.echo(f"{method:<7} {figures['images_per_s_median']:>13.1f} {figures['images_per_s_min']:>9.1f} "
                   f"{figures['images_per_s_max']:>9.1f} {figures['images_per_cpu_s_median']:>10.1f}")
    ratios = result["ratios"]
    click.echo(f"dimd / torch DataLoader: {ratios['dimd_over_torch']:.2f}x (aim >= 1.3); "
               f"dimd per worker / decode limit: {ratios['dimd_per_worker_over_limit']:.2f}x (aim >= 0.8), "
               f"{workers} worker{'s' if workers != 1 else ''}, {mpi_setup.cores} cores")
    click.echo(f"per CPU-second (robust to other load): dimd / torch {ratios['cpu_dimd_over_torch']:.2f}x, "
               f"dimd / decode limit {ratios['cpu_dimd_over_limit']:.2f}x")
    if json_path is not None:
        write_json(json_path, result_document("bench-io", config, result, mpi=mpi_setup.as_dict()))
