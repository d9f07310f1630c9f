"""``mpirun dimd shuffle``: partitioned in-memory load and timed group shuffles (thin wrapper)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import click

from dimd.commands.mpi_job import mpi_command
from dimd.options import (OUTPUT_DIR, SIZE, build_config, config_option, json_option, quiet_option,
                          stall_timeout_option)
from dimd.shuffle.rounds import ShuffleConfig
from dimd.units import format_bytes


def _memory(rss: list[int]) -> str:
    return " ".join(format_bytes(b) for b in rss)


@click.command("shuffle")
@click.argument("dataset", type=click.Path(path_type=Path))
@config_option(ShuffleConfig, "groups", "--groups", "-g",
               help="Split the ranks into G groups of consecutive ranks; each group holds the whole "
                    "set, its ranks one share each. G = number of ranks: everyone holds everything.")
@config_option(ShuffleConfig, "rounds", "--rounds", "-r", help="Shuffles to run and time.")
@config_option(ShuffleConfig, "seed",
               help="Placement seed: round r puts the records where shuffle(seed, r) always puts them.")
@config_option(ShuffleConfig, "verify",
               help="After the load and every round, check per group that the multiset of "
                    "(name, crc32) is unchanged (every record once, bytes intact); fail loudly if not.")
@config_option(ShuffleConfig, "save_order", type=OUTPUT_DIR, metavar="DIR",
               help="Each rank k writes the global record indices it holds after round r to "
                    "DIR/round{r}_rank{k}.npy.")
@config_option(ShuffleConfig, "memory_limit", type=SIZE, metavar="SIZE",
               help="Refuse to load more than this per rank (e.g. 8G), besides the node's available memory.")
@stall_timeout_option(ShuffleConfig, "a round's exchange, its check or its figures")
@json_option("the figures (rank 0)")
@quiet_option()
@mpi_command("serialized")   # the stall watchdog's thread may end the job
def shuffle_command(dataset: Path, json_path: Path | None, quiet: bool, comm, mpi_setup,
                    **fields: Any) -> None:
    """Load a packed DATASET into the memory of the MPI ranks and shuffle it between them.

    Each rank reads its contiguous share of DATASET (the stem given to `dimd
    pack -o`) with a few large reads; then every round moves the records
    between the ranks of each group with one MPI_Alltoallv, so that every rank
    holds a fresh random share of the same size (+-1). Prints, per round, the
    time (max over ranks), bytes moved, bandwidth and each rank's resident
    memory, then the load time and a summary.

    \b
    Examples:
      mpirun -n 8 dimd shuffle /scratch/in1k/train --verify
      mpirun -n 32 dimd shuffle /scratch/in22k/train --groups 4 --rounds 3 --json shuffle.json
    """
    from dimd.console import progress
    from dimd.report import result_document, write_json
    from dimd.shuffle.rounds import run_shuffle

    root = comm.Get_rank() == 0
    config = build_config(ShuffleConfig, dataset=dataset, **fields)
    share = _share_estimate(dataset, comm.Get_size() // config.groups) if root else None

    bar = contextlib.ExitStack()
    advance = bar.enter_context(progress(share, "load", unit="B", enabled=root and not quiet))

    def on_load(run) -> None:
        bar.close()  # the load is over: its last progress line comes before the table
        if root:
            click.echo(f"shuffle {dataset}: {run.records} records, {format_bytes(run.data_bytes)}, "
                       f"{run.world_size} ranks in {run.groups} group(s) of {run.group_size}, "
                       f"seed {config.seed}" + (", verifying" if config.verify else ""))
            click.echo(f"{'round':>5} {'seconds':>9} {'records moved':>14} {'bytes moved':>12} "
                       f"{'GB/s':>7} {'verified':>8}  resident memory per rank")

    def on_round(r) -> None:
        if root:
            click.echo(f"{r.round:>5} {r.seconds:>9.4f} {r.records_moved:>14} "
                       f"{format_bytes(r.bytes_moved):>12} {r.gb_per_s:>7.3f} "
                       f"{'ok' if r.verified else '-':>8}  {_memory(r.resident_bytes)}")

    with bar:
        run = run_shuffle(config, comm, advance_load=advance, on_load=on_load, on_round=on_round)
    summary = run.summary()
    if root:
        click.echo(f"load: {run.load_seconds:.3f} s (max over ranks), {run.load_reads} reads, "
                   f"{summary['load_gb_per_s'] or 0:.3f} GB/s, resident memory per rank "
                   f"{_memory(run.load_resident_bytes)}" + (", verified" if run.load_verified else ""))
        if run.rounds:
            click.echo(f"summary: {summary['rounds']} rounds, median {summary['seconds_median']:.4f} s "
                       f"(min {summary['seconds_min']:.4f}, max {summary['seconds_max']:.4f}), "
                       f"median {format_bytes(summary['bytes_moved_median'])} moved at "
                       f"{summary['gb_per_s_median']:.3f} GB/s"
                       + ("; every round verified" if config.verify else ""))
        if json_path is not None:
            write_json(json_path, result_document("shuffle", config, run.figures(), mpi=mpi_setup.as_dict()))


def _share_estimate(dataset: Path, group_size: int) -> int | None:
    """Bytes rank 0 will read (for its progress bar); None when the pair cannot be opened here.

    The load itself reports a missing or mismatched pair, on every rank.
    """
    from dimd.errors import DimdError
    from dimd.format import PackedDataset
    from dimd.shares import balanced_bounds

    try:
        packed = PackedDataset(dataset, check_size=False)
    except DimdError:
        return None
    begin, end = packed.byte_range(0, int(balanced_bounds(len(packed), max(group_size, 1))[1]))
    return end - begin
