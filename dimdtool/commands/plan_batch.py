"""``dimd plan-batch``: choose the mini-batch size and the rank count from measurements (Perrone et al.).

A chain of steps that pass JSON files, each usable alone:

    mpirun -n 2 dimd plan-batch step-time --model resnet20 --image-size 32 --json step.json
    mpirun -n 2 dimd bench-allreduce --model resnet20 --json ar-P2.json   (and at P = 3, 4, ...)
    dimd plan-batch comm ar-P2.json ar-P3.json ar-P4.json --model resnet20 --json comm.json
    mpirun -n 2 dimd plan-batch convergence train --val val --model resnet20 --target-top1 0.8 \
        --batch-sizes 8,16,32,64,128,256 --json conv.json
    dimd plan-batch solve --step step.json --comm comm.json --convergence conv.json --json plan.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import click

from dimd.commands.mpi_job import mpi_command
from dimd.console import print_table
from dimd.options import (ALLREDUCE_ALGORITHM, INT_LIST, OUTPUT_FILE, SIZE, NameListType, build_config,
                          config_option, json_option, quiet_option, shared_option, stall_timeout_option)
from dimd.train.config import DEVICES, OPTIMIZERS, TrainConfig
from dimd.train.plan.config import (POWERS_OF_TWO_TO_1024, CommFitConfig, ConvergenceConfig, SolveConfig,
                                    StepTimeConfig)
from dimd.units import format_seconds as seconds


def modelled_algorithms() -> Any:
    """The allreduce algorithms with a cost model (dimd.train.plan.commmodel), loaded on first use."""
    from dimd.train.plan.commmodel import COST_MODELS

    return COST_MODELS


#: ``--algorithms`` of comm and solve: modelled algorithms, or ``all``; any other name is a usage error.
MODELLED_ALGORITHMS = NameListType(modelled_algorithms, "algorithm")


@click.group("plan-batch")
def plan_batch() -> None:
    """Choose the mini-batch size and rank count from measurements (Perrone et al.): step-time, comm,
    convergence, solve.

    T_C(M, P) = N_update(M) * (Gamma(M/P) + Delta(P)): the updates a global
    batch M needs to reach a target, times the seconds per update on P ranks.
    Each step measures or fits one factor and writes --json; `solve` combines
    them into the best M for each P, and the cost of strong and weak scaling.
    See docs/plan-batch.md.
    """


# ---------------------------------------------------------------------------- step-time
@plan_batch.command("step-time")
@shared_option(StepTimeConfig, "model", required=True)
@config_option(StepTimeConfig, "image_size", "--image-size", help="Square input size in pixels.")
@config_option(StepTimeConfig, "batch_sizes", "--batch-sizes", type=INT_LIST,
               help="Per-rank batch sizes to time (at least 2).")
@config_option(StepTimeConfig, "steps", "--steps", help="Timed steps per batch size.")
@config_option(StepTimeConfig, "warmup", "--warmup", help="Untimed steps before them.")
@config_option(StepTimeConfig, "classes", "--classes",
               help="Output classes [default: 1000 for ImageNet-style models, 10 for the others].")
@shared_option(StepTimeConfig, "device", type=click.Choice(DEVICES))
@shared_option(StepTimeConfig, "threads")
@config_option(StepTimeConfig, "seed", "--seed")
@config_option(StepTimeConfig, "data", "--data", type=click.Path(dir_okay=False),
               help="A packed training set (the stem dimd pack wrote): time steps on its batches from dimd "
                    "train's loader, its decoding workers running beside the step, and count the wait for each "
                    "batch; what training sees [default: synthetic inputs, compute only].")
@shared_option(StepTimeConfig, "decode_workers", when="With --data", default_from=TrainConfig)
@shared_option(StepTimeConfig, "crop_scale", when="With --data", default_from=TrainConfig)
@stall_timeout_option(StepTimeConfig, "a step (from its barrier) or a batch size's figures")
@json_option("c, gamma, M_T and the per-batch medians")
@quiet_option()
@mpi_command("serialized")   # the stall watchdog's thread may end the job
def step_time(json_path: Path | None, quiet: bool, comm, mpi_setup, **values: Any) -> None:
    """Time forward + backward + optimizer step per batch size and fit Gamma(m) = c + gamma * max(m, M_T).

    Run it under mpirun with the ranks per node you will train with: they
    share the node's cores as in training, and the torch threads per rank
    are set as `dimd train` sets them. The inputs are synthetic (random
    images and labels), so the times are compute only; with --data they are
    real batches from dimd train's loader, whose decoding workers compete with
    the step for the cores, and the wait for each batch counts. A step's time
    is its slowest rank's; the table shows the median over --steps with min
    and max, and the fit's relative residual.

    \b
    Example:
      mpirun -n 2 dimd plan-batch step-time --model resnet20 --image-size 32 \\
          --batch-sizes 1,2,4,8,16,32,64,128,256 --json step.json
    """
    from dimd.console import progress
    from dimd.report import result_document, write_json
    from dimd.train.plan.measure import measure_step_times, step_time_figures

    config = build_config(StepTimeConfig, **values)
    root = comm.Get_rank() == 0
    total = len(config.batch_sizes) * (config.steps + config.warmup)
    with progress(total, f"timing {config.model} steps", unit="steps", enabled=root and not quiet) as advance:
        measured = measure_step_times(config, comm, advance)
    figures = step_time_figures(measured)
    if not root:
        return
    click.echo(f"# {config.model} at {config.image_size} px, {measured.world_size} rank(s), "
               f"{measured.threads} torch thread(s) per rank, {measured.device}; inputs: {measured.inputs}; "
               f"a step: {figures['step']}")
    print_table("step time per batch size",
                ["batch/rank", "median", "min", "max", "images/s (all ranks)", "fit", "residual"],
                [[str(r["batch"]), seconds(r["seconds"]["median"]), seconds(r["seconds"]["min"]),
                  seconds(r["seconds"]["max"]), f"{r['images_per_s']:,.0f}", seconds(r["fit_s"]),
                  f"{100 * r['residual']:+.1f}%"] for r in figures["batches"]])
    knee = {"inside": "inside the measured range", "at-smallest": "at the smallest batch: no knee measured",
            "at-largest": "at the largest batch: no linear part measured"}[figures["knee"]]
    click.echo(f"Gamma(m) = c + gamma * max(m, M_T): c = {seconds(figures['overhead'])} per step, "
               f"gamma = {seconds(figures['gamma'])} per image, "
               f"M_T = {figures['m_t']:.3g} images per rank ({knee}); "
               f"rms residual {100 * figures['rms_relative_residual']:.1f}%")
    if json_path is not None:
        write_json(json_path, result_document("plan-batch step-time", config, figures, mpi=mpi_setup.as_dict()))


# ---------------------------------------------------------------------------- comm
@plan_batch.command("comm")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default=None,
              help="Predict Delta(P) for this model's gradients (float32) [default: the size the bench "
                   "results recorded with `bench-allreduce --model`].")
@click.option("--classes", type=click.IntRange(min=2), default=None,
              help="The model's output classes [default: 1000 for ImageNet-style models, 10 for the others].")
@click.option("--bytes", "nbytes", type=SIZE, default=None, help="Predict Delta(P) for this many bytes instead.")
@config_option(CommFitConfig, "holdout", "--holdout", type=INT_LIST,
               help="Rank counts to leave out of the fit and predict [default: the larger half measured].")
@config_option(CommFitConfig, "max_ranks", "--max-ranks", help="Predict Delta(P) for P = 1, 2, 4, ... up to this.")
@config_option(CommFitConfig, "algorithms", "--algorithms", "-a", type=MODELLED_ALGORITHMS,
               help="Comma list of algorithms to fit, or 'all' [default: every modelled one measured].")
@config_option(CommFitConfig, "statistic", "--statistic", type=click.Choice(["median", "min"]),
               help="How rows measured in several files (repeats at one P) combine: the median, or the "
                    "minimum (the least disturbed run, on a busy machine).")
@json_option("each algorithm's fit, held-out errors and predictions")
def comm_fit(files: tuple[Path, ...], model: str | None, classes: int | None, nbytes: int | None,
             json_path: Path | None, **values: Any) -> None:
    """Fit each allreduce algorithm's cost model to bench-allreduce results and predict Delta(P).

    FILES are `bench-allreduce --json` results taken at different rank
    counts (e.g. P = 2, 3, 4, 5), possibly several at each (repeats). Per
    algorithm, a latency-bandwidth-reduction model of what dimd's
    implementation sends (a per message, b per byte moved, c per byte added;
    s per message waiting for a time slice, in runs with more ranks than
    cores) is fitted by non-negative least squares on relative errors; the
    fit is checked on the rank counts held out of it, then refitted on all
    and used to predict one allreduce of the gradients for P up to
    --max-ranks, assuming a core per rank.

    \b
    Example:
      dimd plan-batch comm ar-P2.json ar-P3.json ar-P4.json ar-P5.json --model resnet20 --json comm.json
    """
    from dimd.errors import DimdError
    from dimd.report import result_document, write_json
    from dimd.train.plan.commfit import fit_algorithms, read_bench_results
    from dimd.train.plan.measure import gradient_size

    if model is not None and nbytes is not None:
        raise click.UsageError("give --model or --bytes, not both")
    if classes is not None and model is None:
        raise click.UsageError("--classes goes with --model")
    if nbytes is not None and nbytes < 1:
        raise click.BadParameter(f"must be positive (got {nbytes})", param_hint="'--bytes'")
    try:
        gradient_bytes, source = gradient_size(model, classes, nbytes)
    except DimdError as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None
    config = build_config(CommFitConfig, files=tuple(str(f) for f in files), gradient_bytes=gradient_bytes,
                          **values)
    figures = fit_algorithms(read_bench_results(config.files), config)
    figures["gradient_source"] = source
    _print_comm(figures)
    if json_path is not None:
        write_json(json_path, result_document("plan-batch comm", config, figures))


def _print_comm(figures: dict[str, Any]) -> None:
    from dimd.units import format_bytes

    fits = figures["algorithms"]
    held = ",".join(map(str, figures["holdout_ranks"]))
    rows = []
    for name, fit in fits.items():
        p = fit["parameters"]
        check = fit["holdout"]
        per = {r["ranks"]: r for r in check["per_ranks"]} if check else {}
        rows.append([name, seconds(p["a"]), f"{1 / p['b'] / 1e9:.2f}" if p["b"] > 0 else "-",
                     f"{1 / p['c'] / 1e9:.2f}" if p["c"] > 0 else "-", seconds(p["s"]),
                     f"{100 * fit['fit_rms_relative_error']:.0f}%",
                     ",".join(map(str, check["fit_ranks"])) if check else "-",
                     *[f"{100 * per[q]['median_abs_error']:.0f}% ({100 * per[q]['max_abs_error']:.0f}%)"
                       if q in per else "-" for q in figures["holdout_ranks"]]])
    print_table(f"cost models: T = a L + b X + c R [+ s W with shared cores] (measured at P = "
                f"{', '.join(map(str, figures['ranks_measured']))}; held out: {held})",
                ["algorithm", "a (per msg)", "1/b (GB/s)", "1/c (GB/s)", "s (shared)", "fit rms", "fit on P",
                 *[f"P={q} median (max) err" for q in figures["holdout_ranks"]]], rows, left=1)
    names = list(fits)
    table = []
    for i, best in enumerate(figures["fastest"]):
        table.append([str(best["ranks"]), *[seconds(fits[n]["predictions"][i]["seconds"]) for n in names],
                      best["algorithm"] or "-"])
    print_table(f"Delta(P): one allreduce of {format_bytes(figures['gradient_bytes'])} "
                f"({figures['gradient_source']}), a core per rank", ["P", *names, "fastest"], table)
    if figures["skipped"]:
        click.echo("not fitted: " + "; ".join(f"{k} ({v})" for k, v in figures["skipped"].items()))


# ---------------------------------------------------------------------------- convergence
@plan_batch.command("convergence")
@click.argument("train_set", metavar="TRAIN")
@click.option("--val", "val_set", metavar="VAL", required=True, help="Packed validation set (`dimd pack`).")
@shared_option(ConvergenceConfig, "model", required=True)
@config_option(ConvergenceConfig, "target_top1", "--target-top1", required=True,
               help="The validation top-1 each run trains to, in (0, 1] (e.g. 0.95).")
@config_option(ConvergenceConfig, "batch_sizes", "--batch-sizes", type=INT_LIST, required=True,
               help="Global batch sizes M to train at (at least 2), e.g. 8,16,32,64,128,256,512.")
@config_option(ConvergenceConfig, "seeds", "--seeds", help="Runs per batch size (seeds --first-seed, +1, ...).")
@config_option(ConvergenceConfig, "first_seed", "--first-seed")
@config_option(ConvergenceConfig, "lr", "--lr",
               help="Base learning rate for 256 images, scaled linearly to each M [default: dimd train's].")
@config_option(ConvergenceConfig, "warmup_epochs", "--warmup-epochs",
               help="Linear warm-up, as dimd train [default: 5 epochs when M exceeds 256, else 0].")
@config_option(ConvergenceConfig, "max_epochs", "--max-epochs",
               help="Each run's budget: a run that has not reached the target by then is reported as not "
                    "reached.")
@config_option(ConvergenceConfig, "eval_every_images", "--eval-every-images",
               help="Evaluate every N training images (and at every epoch end) [default: a tenth of TRAIN].")
@config_option(ConvergenceConfig, "ranks_per_run", "--ranks-per-run",
               help="Ranks that train one run together (M/G images each); the job's ranks split into "
                    "groups of this many, each training its share of the runs at the same time.")
@config_option(ConvergenceConfig, "image_size", "--image-size",
               help="Square input size in pixels [default: the size the model is designed for].")
@shared_option(ConvergenceConfig, "crop_scale", default_from=TrainConfig)
@config_option(ConvergenceConfig, "optimizer", "--optimizer", type=click.Choice(OPTIMIZERS),
               help="The runs' optimizer, as dimd train's --optimizer: N_update(M) is fitted per optimizer, and "
                    "solve names the one it assumes [default: sgd].")
@config_option(ConvergenceConfig, "lars_trust", "--lars-trust", help="With --optimizer lars [default: dimd train's].")
@config_option(ConvergenceConfig, "momentum", "--momentum", help="[default: dimd train's]")
@config_option(ConvergenceConfig, "weight_decay", "--weight-decay", help="[default: dimd train's]")
@config_option(ConvergenceConfig, "allreduce", "--allreduce", type=ALLREDUCE_ALGORITHM,
               help="With --ranks-per-run 2 or more [default: the fastest measured at each run's start].")
@shared_option(ConvergenceConfig, "device", type=click.Choice(DEVICES), default_from=TrainConfig)
@shared_option(ConvergenceConfig, "threads")
@shared_option(ConvergenceConfig, "decode_workers", default_from=TrainConfig)
@config_option(ConvergenceConfig, "eval_batch_size", "--eval-batch-size",
               help="Validation batch per rank [default: the training batch per rank, at least 128].")
@json_option("N_inf, alpha, R², every batch's runs (reached or not) and each run's evaluations")
@quiet_option()
@mpi_command("serialized")   # each run's stall watchdog (dimd train's) may end the job from its thread
def convergence(train_set: str, val_set: str, json_path: Path | None, quiet: bool, comm, mpi_setup,
                **values: Any) -> None:
    """Train at each global batch M until validation top-1 first reaches the target; fit N_update = N_inf + alpha/M.

    Every (M, seed) is one short run of dimd train's engine (S-SGD, the rate
    --lr x M / 256 after a warm-up as dimd train's, then constant), evaluated
    every --eval-every-images training images; its updates to the target are
    the steps taken at the first evaluation that reached it. A run that has
    not reached it after --max-epochs (or that diverged) is reported as not
    reached, and counts as "more than its budget" in its batch's median. The
    fit is least squares of the per-batch medians on 1/M. Run it under
    mpirun: the ranks split into groups of --ranks-per-run (default 1), which
    train the runs at the same time (each group asks rank 0 for its next run
    as it finishes one, largest M first), so P ranks go through the sweep
    about P times faster; it also runs on one rank. The JSON is what `plan-batch solve --convergence`
    reads.

    \b
    Example:
      mpirun -n 2 dimd plan-batch convergence mnist/train --val mnist/val --model lenet \\
          --image-size 28 --target-top1 0.95 --batch-sizes 8,16,32,64,128,256,512 --seeds 3 \\
          --lr 0.4 --max-epochs 30 --json conv.json
    """
    from dimd.mpi import agree_or_raise
    from dimd.report import result_document, write_json
    from dimd.train.plan.convergence import COMMAND
    from dimd.train.plan.runs import run_convergence

    config = build_config(ConvergenceConfig, train=train_set, val=val_set, **values)
    root = comm.Get_rank() == 0
    if root and not quiet:
        count = len(set(config.batch_sizes)) * config.seeds
        groups = max(1, comm.Get_size() // config.ranks_per_run)
        click.echo(f"# {config.model}: {count} runs to validation top-1 {config.target_top1:g}, "
                   f"{groups} at a time ({config.ranks_per_run} rank(s) each); rank 0's runs as they finish, "
                   f"everyone's at the end")

    def on_run(record: Any, number: int, runs: int) -> None:
        if root and not quiet:
            click.echo(_run_line(record) + f"  [run {number} of {runs}]")

    swept = run_convergence(config, comm, on_run=on_run)
    problem = None
    if root:
        figures, problem = swept.figures(config.target_top1)
        _print_convergence(figures, swept.records, config)
        if json_path is not None:
            write_json(json_path, result_document(COMMAND, config, figures, mpi=mpi_setup.as_dict()))
            if problem is not None:
                problem += f" (every run is in {json_path})"
    agree_or_raise(comm, problem)


def _run_line(record: Any) -> str:
    where = f"M={record.batch} seed {record.seed}"
    if record.reached:
        return (f"{where}: reached after {record.updates:,} updates ({record.images_to_target:,} images, "
                f"{record.train_seconds_to_target:.1f} s of training, {record.seconds:.1f} s in all)")
    best = f"; its last top-1 {100 * record.final_top1:.1f}%" if record.final_top1 is not None else ""
    return f"{where}: NOT reached ({record.reason}; budget {record.budget:,} updates){best}"


def _print_convergence(figures: dict[str, Any], records: Sequence[Any], config: ConvergenceConfig) -> None:
    rows = []
    for row in figures["batches"]:
        spread_ = row["updates"]
        median = row["median_updates"]
        rows.append([str(row["batch"]), f"{row['lr']:.4g}" if row["lr"] is not None else "-",
                     f"{row['reached']}/{row['runs']}",
                     f"{median:,.0f}" if median is not None else "not reached",
                     f"{spread_['min']:,.0f}-{spread_['max']:,.0f}" if spread_["runs"] else "-",
                     f"{row['fitted_updates']:,.0f}" if "fitted_updates" in row else "-",
                     "yes" if row["in_fit"] else "no", seconds(row["train_seconds_median"])])
    click.echo(f"# updates to validation top-1 {config.target_top1:g} per global batch M, evaluated every "
               f"{figures['eval_every_images']:,} training images; a missed run counts as beyond its budget")
    print_table("convergence", ["M", "lr", "reached", "median updates", "range", "fit", "in fit",
                                "training s (median)"], rows)
    for r in records:
        if not r.reached:
            click.echo("not reached: " + _run_line(r))
    if figures["n_inf"] is not None:
        b_crit = figures["b_crit"]
        click.echo(f"N_update(M) = N_inf + alpha/M for {figures['optimizer']}: N_inf = {figures['n_inf']:,.4g}, "
                   f"alpha = {figures['alpha']:,.4g}, "
                   f"R² = {figures['r2']:.3f}" + (f"; alpha/N_inf (the critical batch) = {b_crit:,.0f}"
                                                  if b_crit is not None else "; N_inf <= 0: no critical batch"))


# ---------------------------------------------------------------------------- solve
@plan_batch.command("solve")
@click.option("--step", "step_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The `plan-batch step-time` result.")
@click.option("--comm", "comm_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The `plan-batch comm` result.")
@click.option("--convergence", "conv_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The `plan-batch convergence` result.")
@config_option(SolveConfig, "ranks", "--ranks", type=INT_LIST,
               default=",".join(map(str, POWERS_OF_TWO_TO_1024)),
               show_default=True, help="Rank counts P to plan for.")
@config_option(SolveConfig, "strong_batch", "--strong-batch",
               help="Strong scaling's fixed global batch [default: the optimal batch at the largest P].")
@config_option(SolveConfig, "weak_per_rank", "--weak-per-rank",
               help="Weak scaling's images per rank [default: the optimal per-rank batch at the smallest P].")
@config_option(SolveConfig, "max_batch", "--max-batch",
               help="Largest global batch to consider (e.g. the training set's size) [default: none].")
@config_option(SolveConfig, "allowed_per_rank", "--allowed-per-rank", type=INT_LIST,
               help="Per-rank batches to choose from, e.g. 1,2,4,...,256 [default: any whole number].")
@config_option(SolveConfig, "algorithms", "--algorithms", "-a", type=MODELLED_ALGORITHMS,
               help="Comma list of allreduce algorithms to choose from, or 'all' [default: every one comm fitted "
                    "that passed --max-holdout-error].")
@config_option(SolveConfig, "max_holdout_error", "--max-holdout-error",
               help="Without --algorithms: leave out the algorithms whose cost model missed the rank counts "
                    "held out of its fit by more than this (median relative error).")
@click.option("--plot", "plot_path", type=OUTPUT_FILE, default=None,
              help="Also draw T_C against P, N_update against M, Delta(P) and Gamma(m) to this PNG "
                   "(needs matplotlib).")
@json_option("the plan: one row per P")
def solve(step_path: Path, comm_path: Path, conv_path: Path, plot_path: Path | None, json_path: Path | None,
          **values: Any) -> None:
    """For each P: the batch M that minimises the time to target, and T_C under optimal, strong and weak scaling.

    T_C(M, P) = (N_inf + alpha/M) * (c + gamma max(M/P, M_T) + Delta(P)), with
    Delta(P) from the allreduce algorithm predicted fastest at P. The best M
    has a closed form, max(sqrt(alpha (c + Delta) P / (gamma N_inf)), M_T P), taken
    to whole images per rank; strong scaling keeps M fixed, weak scaling
    keeps M/P fixed. A value marked * extrapolates beyond what was measured.

    \b
    Example:
      dimd plan-batch solve --step step.json --comm comm.json --convergence conv.json \\
          --ranks 1,2,4,8,16,32,64,128,256,512,1024 --json plan.json --plot plan.png
    """
    from dimd.report import result_document, write_json
    from dimd.train.plan.results import (COMM_COMMAND, CONVERGENCE_COMMAND, STEP_TIME_COMMAND, read,
                                         solve_documents)

    config = build_config(SolveConfig, **values)
    if plot_path is not None:
        from dimd.train.plan.plot import require_matplotlib

        require_matplotlib()
    documents = (read(step_path, STEP_TIME_COMMAND), read(comm_path, COMM_COMMAND),
                 read(conv_path, CONVERGENCE_COMMAND))
    figures = solve_documents(config, *documents, sources=(str(step_path), str(comm_path), str(conv_path)))
    _print_plan(figures)
    if json_path is not None:
        parameters = {"step": str(step_path), "comm": str(comm_path), "convergence": str(conv_path),
                      **config.__dict__}
        write_json(json_path, result_document("plan-batch solve", parameters, figures))
    if plot_path is not None:
        from dimd.train.plan.plot import plot_plan

        plot_plan(figures, *documents, plot_path)
        click.echo(f"plot: {plot_path}")


def _regime_cells(regime: dict[str, Any], updates: bool = False) -> list[str]:
    """[batch, (updates,) T_C]; a star marks a value that extrapolates beyond the measurements."""
    if regime["time_s"] is None:
        return [str(regime["batch"]), *(["-"] if updates else []), "n/a (M < P)" if regime.get("note") else "-"]
    star = "*" if regime.get("extrapolated") else ""
    cells = [f"{regime['batch']} ({regime['per_rank']}/rank){star}", seconds(regime["time_s"])]
    return cells[:1] + [f"{regime['updates']:,.0f}"] + cells[1:] if updates else cells


def _print_plan(figures: dict[str, Any]) -> None:
    model = figures["model"]
    b_crit = figures["critical_batch"]
    click.echo(f"# c {seconds(model['overhead'])}/step, gamma {seconds(model['gamma'])}/image, "
               f"M_T {model['m_t']:.3g}/rank; "
               f"N_update = {model['n_inf']:.4g} + {model['alpha']:.4g}/M with {figures['optimizer']}"
               + (f" (alpha/N_inf = {b_crit:,.0f})" if b_crit else "")
               + f"; strong M = {figures['strong_batch']}, weak m = {figures['weak_per_rank']}/rank")
    rows = []
    for row in figures["plan"]:
        rows.append([str(row["ranks"]), row["algorithm"] or "-", seconds(row["delta_s"]),
                     *_regime_cells(row["optimal"], updates=True), *_regime_cells(row["strong"]),
                     *_regime_cells(row["weak"])])
    if figures.get("algorithms_left_out"):
        click.echo("# allreduce models left out: " + "; ".join(
            f"{name} ({why})" for name, why in figures["algorithms_left_out"].items()))
    print_table("time to target T_C per rank count P (* extrapolated beyond the measurements)",
                ["P", "allreduce", "Delta(P)", "optimal M", "updates", "T_C", "strong M", "T_C",
                 "weak M", "T_C"], rows)
    beyond = critical_batch_line(figures)
    if beyond:
        click.echo(beyond)


def critical_batch_line(figures: dict[str, Any]) -> str | None:
    """One line naming the batches, asked about or chosen, beyond the fit's critical batch; None if none is."""
    where = {regime: ranks for regime, ranks in figures["beyond_critical_batch"].items() if ranks}
    if not where:
        return None

    def at(ranks: list[int]) -> str:
        return f"P = {ranks[0]}" if len(ranks) == 1 else f"P = {ranks[0]}-{ranks[-1]}"

    parts = [f"the strong M {figures['strong_batch']} ({at(where['strong'])})" if regime == "strong"
             else f"the {regime} M at {at(ranks)}" for regime, ranks in where.items()]
    other = ", or plan with a LARS sweep's fit" if figures["optimizer"] == "sgd" else ""
    return (f"# beyond the {figures['optimizer']} fit's critical batch alpha/N_inf = "
            f"{figures['critical_batch']:,.0f}: {', '.join(parts)}; N_update there extrapolates the fit: "
            f"sweep such batches{other}")
