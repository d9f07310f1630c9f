"""``mpirun dimd bench-allreduce``: nccl-tests/OSU-style table of every allreduce algorithm."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from dimd.allreduce.api import STANDALONE
from dimd.allreduce.bench import COPY_ROW, DEVICES, DTYPE_NAMES, PEERS, BenchConfig
from dimd.commands.mpi_job import mpi_command
from dimd.options import (SIZE, NameListType, RegistryChoice, build_config, config_option, json_option,
                          stall_timeout_option)


def idle_ranks(mpi_setup) -> str:
    """How waiting ranks behave, as set for this run: only a remedy the running MPI honours is named."""
    if mpi_setup.progress_throttle:
        return "progress throttle on"
    if mpi_setup.yield_when_idle:
        return "mpi_yield_when_idle on"
    return "idle ranks poll"


def cuda_problem() -> str | None:
    """Why this rank cannot time device buffers, or None."""
    import torch

    if not torch.cuda.is_available():
        return (f"--device cuda: no CUDA device on {socket.gethostname()} "
                f"(torch {torch.__version__}); time host buffers without --device cuda")
    return None


def device_name() -> str:
    import torch

    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL " + ".".join(
        map(str, torch.cuda.nccl.version()))


def _columns() -> str:
    return (f"{'bytes':>10} {'count':>10} {'dtype':>7} {'algorithm':>18} {'time(us)':>10} "
            f"{'min(us)':>10} {'max(us)':>10} {'algbw':>7} {'busbw':>7} {'vs mpi':>7} {'#wrong':>6}")


def _line(row) -> str:
    ratio = f"{row.vs_mpi:.2f}x" if row.vs_mpi is not None else "-"
    wrong = str(row.wrong) if row.wrong is not None else "-"
    return (f"{row.bytes:>10} {row.count:>10} {row.dtype:>7} {row.algorithm:>18} {row.time_us:>10.1f} "
            f"{row.min_us:>10.1f} {row.max_us:>10.1f} {row.algbw_gbs:>7.2f} {row.busbw_gbs:>7.2f} "
            f"{ratio:>7} {wrong:>6}")


@click.command("bench-allreduce")
@config_option(BenchConfig, "algorithms", "--algorithms", "-a", type=NameListType(lambda: STANDALONE, "algorithm"),
               default="all", show_default=True,
               help=f"Comma list of algorithms, or 'all' ({', '.join(STANDALONE)}).")
@config_option(BenchConfig, "min_bytes", "--min-bytes", "-b", type=SIZE, help="Smallest message (8, 64K, 1M...).")
@config_option(BenchConfig, "max_bytes", "--max-bytes", "-e", type=SIZE, help="Largest message.")
@config_option(BenchConfig, "factor", "--factor", "-f", help="Multiply the size by this each step.")
@config_option(BenchConfig, "iters", "--iters", "-n",
               help="Timed iterations per size [default: 200, fewer above 640 KiB so a row moves about "
                    "128 MiB, at least 5].")
@config_option(BenchConfig, "warmup", "--warmup", "-w",
               help="Untimed iterations before each timing [default: iters/10, at least 2].")
@config_option(BenchConfig, "dtype", "--dtype", "-d", type=click.Choice(DTYPE_NAMES), help="Element type.")
@config_option(BenchConfig, "colors", help="multicolor: number of colours (trees); fewer when there are fewer ranks.")
@config_option(BenchConfig, "segment_bytes", type=SIZE,
               help="multicolor and ring-root: pipeline segment size [default: sized from the message: 1/8 "
                    "of a colour's chunk for multicolor, at least 512 KiB; 1/16 of the message for "
                    "ring-root, at least 256 KiB].")
@config_option(BenchConfig, "check", "--check", "-c",
               help="Before timing each row, run once on per-rank values with a known sum and count "
                    "the wrong elements (summed over ranks) in #wrong; exit 1 if any.")
@config_option(BenchConfig, "peer", type=click.Choice(PEERS),
               help="Also time torch.distributed all_reduce (gloo backend) in the same job.")
@config_option(BenchConfig, "device", type=click.Choice(DEVICES),
               help=f"cuda: buffers in each rank's GPU (one per rank of a node): NCCL's allreduce in device memory, "
                    f"the copy to pinned host memory and back alone ({COPY_ROW}), and each algorithm with those "
                    f"copies around it, what a GPU rank pays for a host allreduce. Without CUDA: one line, exit 2.")
@click.option("--model", type=RegistryChoice("dimd.train.models:MODELS"), default=None,
              help="Also time a message of this model's gradient size (float32, as `dimd train` "
                   "allreduces it; `dimd train --list-models`).")
@click.option("--classes", type=click.IntRange(min=2), default=None,
              help="--model's output classes [default: 1000 for ImageNet-style models, 10 for the others].")
@stall_timeout_option(BenchConfig, "a row (its warm-up and timed loop: raise it for rows that take longer)")
@json_option("parameters, MPI set-up, versions and every row (rank 0)")
@mpi_command("serialized")   # the stall watchdog's thread may end the job
def bench_allreduce(json_path: Path | None, model: str | None, classes: int | None, comm, mpi_setup,
                    **fields: Any) -> None:
    """Time allreduce algorithms over message sizes, like nccl-tests and osu_allreduce.

    For each size (min-bytes, x factor, ... up to max-bytes) every algorithm
    runs WARMUP untimed, then ITERS timed in-place sums of a buffer of that
    many bytes. Time: each rank's wall time of the timed loop (after a
    barrier) divided by ITERS; the table shows the average over ranks with
    the minimum and maximum. algbw = bytes / time; busbw = algbw x 2(P-1)/P
    (nccl-tests' bus bandwidth). "vs mpi" is the time over the MPI library's
    own MPI_Allreduce at that size, measured in the same run.

    \b
    Examples:
      mpirun -n 4 dimd bench-allreduce --check
      mpirun -n 2 dimd bench-allreduce -a mpi,ring,multicolor -b 64K -e 64M --peer gloo --json ar.json
      mpirun -n 3 dimd bench-allreduce -b 64K -e 16M -f 4 --model resnet20 --json ar-P3.json
      mpirun -n 8 dimd bench-allreduce --device cuda -a mpi,ring,multicolor -b 1M -e 256M --json gpu.json
    """
    from dimd.allreduce.bench import run_bench
    from dimd.errors import DimdError
    from dimd.report import result_document, write_json

    if classes is not None and model is None:
        raise click.UsageError("--classes goes with --model")
    gradient_bytes = None
    if model is not None:  # the allreduce package knows no models: the size comes from here
        import numpy as np

        from dimd.train.plan.measure import model_gradient_bytes

        gradient_bytes = model_gradient_bytes(model, classes)
        # an odd count of float32 gradients is no whole number of 8-byte elements
        if gradient_bytes % np.dtype(fields["dtype"]).itemsize:
            raise click.BadParameter(f"{model}'s gradients ({gradient_bytes} bytes of float32) are not a whole "
                                     f"number of {fields['dtype']} elements; time them with --dtype float32, "
                                     f"as dimd train allreduces them", param_hint="'--model'")
    config = build_config(BenchConfig, extra_sizes=(gradient_bytes,) if gradient_bytes is not None else (),
                          **fields)
    if config.device == "cuda":
        from dimd.train.hardware import pick_device

        missing = comm.allgather(cuda_problem())   # MPI: every rank's own GPU, or the first rank's reason
        if any(missing):
            raise click.UsageError(next(problem for problem in missing if problem))   # every rank: exit 2, one line
        pick_device("cuda", comm)   # MPI: one GPU per rank of a node, by node-local rank
    root = comm.Get_rank() == 0
    size = comm.Get_size()
    library = " ".join(mpi_setup.library_version.split())

    def header() -> None:   # after the memory check: a size beyond memory is one line, no table
        if not root:
            return
        click.echo(f"# dimd bench-allreduce: {size} ranks, {library}, thread level "
                   f"{mpi_setup.thread_level_provided}, {idle_ranks(mpi_setup)}, {mpi_setup.local_ranks} "
                   f"rank(s) on {mpi_setup.cores} cores")
        click.echo(f"# time: per-iteration mean of each rank's timed loop; avg/min/max over ranks. "
                   f"busbw = algbw x 2(P-1)/P. colors {min(config.colors, size)}, segment "
                   f"{config.segment_bytes or 'auto'}")
        if model is not None:
            click.echo(f"# {model}'s gradients: {gradient_bytes} bytes, timed with the sweep")
        if config.device == "cuda":
            click.echo(f"# device buffers ({device_name()}): nccl sums in device memory; {COPY_ROW} is the copy "
                       f"to pinned host memory and back alone; every other row includes those copies")
        click.echo(_columns())

    def on_row(row) -> None:
        if root:
            click.echo(_line(row))
            sys.stdout.flush()

    result = replace(run_bench(config, comm, on_row, on_start=header), model=model, gradient_bytes=gradient_bytes)
    if root:
        if config.check:
            click.echo(f"# check: {result.wrong_total} wrong elements in {len(result.rows)} rows")
        if json_path is not None:
            write_json(json_path, result_document("bench-allreduce", config, result, mpi=mpi_setup.as_dict()))
    if result.wrong_total:
        raise DimdError(f"--check: {result.wrong_total} elements differ from the known sum")
