"""The ``dimd`` command group: an explicit registry of lazily imported commands.

Each command lives in ``dimd.commands.<module>`` as a thin click wrapper over a
library function. Modules load only when their command runs (or when help
lists them), so ``dimd --help`` is instant and ``dimd pack`` never starts MPI.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TextIO

import click

from dimd.errors import DimdError

#: name -> "module:attribute", in pipeline order; explicit, never discovered by walking packages.
COMMANDS: dict[str, str] = {
    "sample-data": "dimd.commands.sample_data:sample_data",
    "pack": "dimd.commands.pack:pack_command",
    "inspect": "dimd.commands.pack:inspect_command",
    "verify": "dimd.commands.pack:verify_command",
    "shuffle": "dimd.commands.shuffle:shuffle_command",
    "bench-io": "dimd.commands.bench_io:bench_io",
    "bench-allreduce": "dimd.commands.bench_allreduce:bench_allreduce",
    "train": "dimd.commands.train:train",
    "eval": "dimd.commands.eval_checkpoint:eval_command",
    "export": "dimd.commands.export:export_command",
    "predict": "dimd.commands.predict:predict_command",
    "plot": "dimd.commands.plot:plot_command",
    "plan-batch": "dimd.commands.plan_batch:plan_batch",
}


class LazyGroup(click.Group):
    """A click group that imports a command's module only when it is needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return getattr(importlib.import_module(module_name), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command with its whole first sentence (click would cut it at 45 characters)."""
        rows = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl([(name, command.get_short_help_str(limit=200)) for name, command in rows
                                if command is not None])

    def invoke(self, ctx: click.Context):
        from dimd import signals

        signals.install()  # SIGTERM (a scheduler's time limit) cleans up like Ctrl-C
        warnings.showwarning = _show_warning
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            from dimd.mpi import launched_ranks, launcher_rank, leaves_quietly
            from dimd.options import defers_output_checks

            failed = exc.ctx   # the command whose line it refused (click attaches it, its callback's too)
            if failed is not None and defers_output_checks(failed) and (launched_ranks() or 1) > 1:
                from dimd.commands.mpi_job import refuse_with_the_job

                # MPI: the other ranks may not share the error (mpiexec's A : B) and wait in MPI_Init for this one
                refuse_with_the_job(f"{exc.format_message()} Try '{failed.command_path} --help' for help.")
            if leaves_quietly(launcher_rank() in (0, None)):   # MPI: every rank parsed the same line
                ctx.exit(0)
            raise
        except DimdError as exc:
            from dimd.options import cli_message

            command = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            click.echo(f"dimd: error: {cli_message(str(exc), command.callback if command else None)}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            message, code = signals.interrupt_exit(exc)
            click.echo(f"dimd: {message}", err=True)
            ctx.exit(code)


_python_show_warning = warnings.showwarning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """dimd's warning about an untested version of a package as one line, from the launcher's first task only
    (every rank would say the same); any other warning as Python shows it."""
    from dimd.mpi import launcher_rank
    from dimd.private_apis import UntestedVersionWarning

    if not issubclass(category, UntestedVersionWarning):
        _python_show_warning(message, category, filename, lineno, file, line)
    elif launcher_rank() in (0, None):
        click.echo(f"dimd: warning: {message}", err=True)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"],
                                              "max_content_width": 100})
@click.version_option(package_name="dimd", prog_name="dimd")
def main() -> None:
    """dimd: feed and synchronise data-parallel training on HPC clusters.

    \b
    Stages chain through files:
      dimd pack imagenet/train -o /scratch/in1k/train
      mpirun -n 64 dimd shuffle /scratch/in1k/train --verify
      mpirun -n 64 dimd bench-allreduce --model resnet50 --json allreduce.json
      mpirun -n 64 dimd train /scratch/in1k/train --val /scratch/in1k/val --model resnet50
      mpirun -n 64 dimd train /scratch/in1k/train --val /scratch/in1k/val --sync sma --learners auto
      mpirun -n 64 dimd eval ckpt/checkpoint-e0090-s00450360.pt /scratch/in1k/val --tta flip
      dimd export ckpt/checkpoint-e0090-s00450360.pt -o model && dimd predict model photo.jpg
      dimd plan-batch solve --step step.json --comm comm.json --convergence conv.json
    """


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
