#!/usr/bin/env python3
"""Reproduce the papers' figures at small scale: bench/results/NAME.json + NAME.png, and bench/README.md.

    .venv/bin/python bench/reproduce.py                  # every default reproduction (make reproduce)
    .venv/bin/python bench/reproduce.py NAME [NAME...]   # some of them
    .venv/bin/python bench/reproduce.py --quick          # small sizes: proves each works end to end
    .venv/bin/python bench/reproduce.py --plot-only      # redraw PNGs and README from the JSONs
    .venv/bin/python bench/reproduce.py --list

To add a reproduction: write bench/NAME.py defining ``REPRODUCTION =
Reproduction(...)`` (see bench/_common.py and any module below), and add
its module name to MODULES. That is all: the runner measures it, writes its
JSON and PNG, and gives it a section in bench/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

from _common import BENCH, RESULTS, Context, JobError, Reproduction, read_result, write_result

#: The gallery, in README order: one module of bench/ per reproduction.
MODULES = (
    "allreduce_bandwidth",   # DIMD fig. 5
    "epoch_by_allreduce",    # DIMD fig. 6
    "shuffle_scaling",       # DIMD figs. 7-9
    "memory_vs_files",       # DIMD figs. 10-11
    "comm_vs_ranks",         # FireCaffe fig. 4, eqs. 3-4
    "train_vs_ddp",          # dimd train against PyTorch DDP
    "sma_tta",               # Crossbow: time to accuracy, S-SGD against SMA
    "sma_tta_resnet",        # opt-in: the same on resnet20 and the demo set (batch norm)
    "plan_batch_plan",       # Perrone et al.: T_C against P (three regimes), the inverse law
    "plan_batch_check",      # Perrone et al.: the plan against real runs to the target; B_simple vs alpha/N_inf
    "large_batch",           # You et al.: SGD against LARS at 1-8x M_opt, the planner's law per optimizer
    "recipe",                # FFCV, torchvision: label smoothing, progressive resizing, EMA; time to 90%
    "allreduce_vs_mpich",    # opt-in: dimd's algorithms against MPICH's, forced
    "peer_loaders",          # opt-in (make bench-peers): dimd against FFCV, litdata, webdataset, ImageFolder
    "gpu_feed",              # opt-in, CUDA only (make gpu-feed): one GPU's ceiling, dimd, a DataLoader script
    "cuda_graphs",           # opt-in, CUDA only: the step and SMA's learners as CUDA graphs, eager against graphed
    "sma_tta_gpu",           # opt-in, CUDA only: Crossbow's time to accuracy on one GPU, graphed learners
    "gpu_allreduce",         # opt-in, CUDA only: the host path's copies per size, nccl on one GPU
)

README = BENCH / "README.md"


def registry() -> dict[str, Reproduction]:
    found = {}
    for module in MODULES:
        reproduction = importlib.import_module(module).REPRODUCTION
        if reproduction.name in found:
            raise SystemExit(f"two reproductions are named {reproduction.name}")
        found[reproduction.name] = reproduction
    return found


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure_one(reproduction: Reproduction, quick: bool, results: Path) -> Path:
    ctx = Context(reproduction.name, quick)
    started, cpu = time.perf_counter(), children_cpu_seconds()
    parameters, figures = reproduction.measure(ctx)
    figures["wall_seconds"] = round(time.perf_counter() - started, 1)
    # CPU time of every job it ran: on C free cores a run takes at least this / C, however busy the machine
    figures["jobs_cpu_seconds"] = round(children_cpu_seconds() - cpu, 1)
    path, _ = write_result(reproduction.name, parameters, figures, results)
    ctx.log(f"{reproduction.name}: {path} written after {figures['wall_seconds'] / 60:.1f} min")
    return path


def measure_on_gpu(reproduction: Reproduction, quick: bool, problem: str | None, results: Path = RESULTS) -> int:
    """A CUDA-only reproduction's own command: ``problem`` (no CUDA here) in one line and exit status 2; else
    measure, draw the figure and rewrite bench/README.md (the figure where the plotting extras are installed)."""
    if problem:
        print(problem, file=sys.stderr)
        return 2
    measure_one(reproduction, quick, results)
    try:
        png = draw_one(reproduction, results)
        write_readme(registry(), results)
        print(f"{png} and bench/README.md written", file=sys.stderr)
    except (ImportError, SystemExit) as exc:   # no matplotlib / pillow-simd on this machine
        print(f"{results / (reproduction.name + '.json')} written; the figure needs the plotting extras ({exc}): run "
              f"`.venv/bin/python bench/reproduce.py --plot-only {reproduction.name}` where `make plots-setup` ran",
              file=sys.stderr)
    return 0


def draw_one(reproduction: Reproduction, results: Path) -> Path | None:
    from dimd import plotting

    path = results / f"{reproduction.name}.json"
    if not path.exists():
        return None
    envelope = read_result(path, f"bench/reproduce.py {reproduction.name}")
    fig = reproduction.plot(envelope)
    return plotting.save(fig, results / f"{reproduction.name}.png", envelope, title=reproduction.title)


def write_readme(reproductions: dict[str, Reproduction], results: Path, readme: Path = README) -> None:
    """bench/README.md: one section per reproduction, from the JSONs in ``results``."""
    rel = results.relative_to(readme.parent) if results.is_relative_to(readme.parent) else results
    total = sum(r.minutes for r in reproductions.values() if r.default)
    out = ["# The papers' figures, reproduced at small scale", "",
           "Generated by `bench/reproduce.py` from `bench/results/*.json`: do not edit by hand; run",
           "`.venv/bin/python bench/reproduce.py --plot-only` to regenerate it from the JSONs.", "",
           f"`make reproduce` (after `make setup`) measures every figure below, about {total:.0f} minutes on a",
           "quiet 2-core machine; `.venv/bin/python bench/reproduce.py NAME` measures one,",
           "`--quick` at a size that only proves the pipeline works. Every figure is the median of at least",
           "3 runs, shown with its min-max spread (shaded bands, error bars); each JSON is the standard",
           "dimd result envelope (parameters, versions, git commit, date, host; figures under `result`),",
           "and every run's own `--json` is kept under `bench/work/runs/NAME/`. The papers:",
           "DIMD (*Efficient Training of Convolutional Neural Nets on Large Distributed Systems*,",
           "arXiv:1711.00705), FireCaffe (*FireCaffe: near-linear acceleration of deep neural network",
           "training on compute clusters*, arXiv:1511.00175).", "",
           "The one-off measurements behind design choices, which no figure here runs, are in",
           "[probes/](probes/README.md); what was measured on the way, dated, in",
           "[docs/measurements.md](../docs/measurements.md).", "",
           "| figure | paper | measured here |", "|---|---|---|"]
    sections = []
    for number, (name, reproduction) in enumerate(reproductions.items(), 1):
        path = results / f"{name}.json"
        envelope = read_result(path, f"bench/reproduce.py {name}") if path.exists() else None
        state = _state(envelope)
        out.append(f"| [{number}. {reproduction.title.split(':')[0]}](#{_anchor(number, reproduction)}) "
                   f"| {reproduction.title.split(': ', 1)[-1]} | {state} |")
        command = f".venv/bin/python bench/reproduce.py {name}"
        section = [f"## {number}. {reproduction.title}", "",
                   f"**The paper.** {reproduction.claim}", "",
                   f"**Reproduce:** `{command}` (about {reproduction.minutes:.0f} min"
                   + ("" if reproduction.default else "; opt-in, not part of `make reproduce`") + ").", ""]
        if envelope is None:
            section += ["*Not measured yet.*", ""]
        else:
            try:
                here = reproduction.findings(envelope)
            except Exception as exc:   # one figure's bad JSON must not lose the whole README
                print(f"{name}: findings failed: {exc!r}", file=sys.stderr)
                here = f"*(the findings could not be read from results/{name}.json: {exc!r})*"
            section += [f"![{reproduction.title}]({rel}/{name}.png)", "",
                        f"**Here.** {here}", "",
                        f"*{_provenance(envelope)}*", ""]
        sections.append("\n".join(section))
    readme.write_text("\n".join(out) + "\n\n" + "\n".join(sections) + "\n" + ADDING)


ADDING = """## Adding a reproduction

Write `bench/NAME.py` defining `REPRODUCTION = Reproduction(...)` (bench/_common.py) and add `NAME`
to `MODULES` in bench/reproduce.py; the runner then measures it, writes `results/NAME.json` and
`NAME.png`, and gives it a section here. Its parts:

- `measure(ctx)` runs real commands (`_common.dimd_job` for `[mpiexec -n P] dimd ... --json`, which
  reads the envelope back with `dimd.report.read_result`; `mpi_python` and `python_job` for scripts
  in bench/), repeats each measurement `runs` (at least 3) times, interleaved, and returns
  `(parameters, figures)` with every repeated figure summarised by `dimd.report.spread`;
  `ctx.size(FULL, QUICK)` picks the parameters for full or `--quick` size;
- `plot(envelope)` returns a matplotlib figure drawn with dimdtool/plotting.py (units on every axis,
  `plotting.baseline` / `baseline_level` for the baseline, `bytes_axis` for sizes); the runner adds
  the title and the footnote (machine, commit, date, load, size) and writes the PNG through pillow-simd;
- `findings(envelope)` returns the Markdown paragraph "Here." from the figures, not from prose
  written in advance;
- `minutes`: the full size's time on a quiet 2-core machine; `default=False` keeps a long or
  install-heavy reproduction (the peer loaders) out of `make reproduce`.

`memory_vs_files` needs root, sshd and sshfs (`make netfs-setup`); without them it measures the
local set-ups only and says so.
"""


def _anchor(number: int, reproduction: Reproduction) -> str:
    import re

    heading = f"{number}. {reproduction.title}".lower()
    return re.sub(r"[^a-z0-9 _-]", "", heading).replace(" ", "-")


def _state(envelope: dict | None) -> str:
    if envelope is None:
        return "not yet"
    size = "quick size" if envelope["parameters"].get("quick") else "full size"
    return f"{envelope['date'][:10]}, {size}"


def _provenance(envelope: dict) -> str:
    m = envelope["result"].get("machine", {})
    size = ("--quick size: a smoke test of the pipeline, not a result" if envelope["parameters"].get("quick")
            else "full size")
    load = m.get("load_average", ["?"])
    result = envelope["result"]
    cpu = f" ({result['jobs_cpu_seconds'] / 60:.1f} CPU-min)" if "jobs_cpu_seconds" in result else ""
    return (f"Measured {envelope['date'][:16].replace('T', ' ')} at commit {envelope.get('commit') or '?'} on "
            f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB), load average "
            f"{load[0]} at the end, in {result.get('wall_seconds', 0) / 60:.1f} min{cpu}; {size}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("names", nargs="*", help="reproductions to run [default: every default one]")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test, not a result)")
    parser.add_argument("--plot-only", action="store_true", help="redraw PNGs and README from the JSONs")
    parser.add_argument("--list", action="store_true", help="list the reproductions and exit")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where NAME.json and NAME.png go")
    args = parser.parse_args(argv)

    reproductions = registry()
    if args.list:
        for name, r in reproductions.items():
            print(f"{name:<22} {r.minutes:>4.0f} min{'' if r.default else ' (opt-in)'}  {r.title}")
        return 0
    unknown = [n for n in args.names if n not in reproductions]
    if unknown:
        parser.error(f"unknown reproduction(s) {', '.join(unknown)}; choose from {', '.join(reproductions)}")
    chosen = args.names or [n for n, r in reproductions.items() if r.default]

    from dimd import plotting

    plotting.pyplot()   # matplotlib and pillow-simd present before any measuring starts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # SystemExit: children get SIGTERM, clean up
    failed = []
    for name in chosen:
        if not args.plot_only:
            print(f"== {name}{' (quick)' if args.quick else ''}", file=sys.stderr, flush=True)
            try:
                measure_one(reproductions[name], args.quick, args.results)
            except JobError as exc:
                print(f"{name}: failed: {exc}", file=sys.stderr)
                failed.append(name)
                continue
            except Exception:
                traceback.print_exc()
                failed.append(name)
                continue
        png = draw_one(reproductions[name], args.results)
        if png:
            print(f"{name}: {png}", file=sys.stderr)
    readme = README if args.results.resolve() == RESULTS.resolve() else args.results / "README.md"
    write_readme(reproductions, args.results, readme)
    print(f"{readme} regenerated", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
