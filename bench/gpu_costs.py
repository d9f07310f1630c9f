"""What each job of ``make gpu-check`` costs on one H100 or H200: its plan, and its parts' time limits, come from here.

A GPU machine is lent for minutes, and a check that overruns loses its last parts. So every job the check
launches (a process, a ``dimd train`` run, a step grid, a set-up) is priced before it starts, by the few rules
below, and the parts' limits are those prices. The figures with a source were measured on the H100 machine of
docs/measurements.md (16 cores); an H200 is the same GH100 chip with faster memory, so they hold there at
least. Where no figure exists the number is a guess on the slow side, and says so: a part priced too low is
cut, one priced too high only passes its unused seconds to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Images/s of a step alone, on fixed batches already on one H100, one process, SGD with momentum:
#: (model, image size, batch per learner, learners, graphed, precision). docs/measurements.md: "CUDA graphs,
#: before dimd had them" (a hand-written loop, 2026-11-27) and `make gpu-feed`'s ceilings (2026-11-25);
#: resnet50 in bf16-mixed from docs/gpu.md's step on 8 GPUs.
STEP_RATES: dict[tuple[str, int, int, int, bool, str], float] = {
    ("resnet20", 32, 16, 1, False, "32-true"): 1_822,
    ("resnet20", 32, 16, 1, True, "32-true"): 12_153,
    ("resnet20", 32, 16, 4, True, "32-true"): 27_822,
    ("resnet20", 32, 256, 1, False, "32-true"): 25_707,
    ("resnet18", 224, 16, 1, False, "32-true"): 1_896,
    ("resnet18", 224, 16, 1, True, "32-true"): 3_446,
    ("resnet18", 224, 16, 4, True, "32-true"): 4_639,
    ("resnet18", 224, 128, 1, False, "32-true"): 4_666,
    ("resnet18", 224, 128, 1, False, "bf16-mixed"): 9_539,
    ("resnet50", 224, 128, 1, False, "32-true"): 2_444,
    ("resnet50", 224, 128, 1, False, "bf16-mixed"): 3_707,
}
#: Images/s a loader hands to the GPU, alone, by image size: dimd's with 14 decoding workers and a DataLoader
#: script's with 14 workers at 224 px (measured, docs/measurements.md, 2026-11-25). At 32 px there is no
#: figure: a 36-px JPEG decodes far faster than a 256-px one, but a batch of 16 carries more overhead per
#: image; taken as 3,000, half the 224-px figure.
DIMD_LOADER_RATES = {32: 3_000.0, 224: 5_918.0}
DATALOADER_RATE = 3_374.0


def step_rate(model: str, size: int, batch: int, learners: int = 1, graphed: bool = False,
              precision: str = "32-true") -> float:
    """The step's images/s from :data:`STEP_RATES`. Without a figure of its own, a graphed step is priced as
    the eager one (a graph only removes launches), and K eager learners as K eager steps one after the other
    (the measured loop found extra eager learners added nothing)."""
    for key in ((model, size, batch, learners, graphed, precision), (model, size, batch, learners, False, precision),
                (model, size, batch, 1, False, precision)):
        if key in STEP_RATES:
            return STEP_RATES[key]
    raise KeyError(f"no step rate for {model} at {size} px, batch {batch} x {learners}, {precision}")


@dataclass(frozen=True)
class Job:
    """One thing a part launches, and the seconds it is expected to take."""

    what: str
    seconds: float


@dataclass(frozen=True)
class Costs:
    """The seconds of what every job is made of (each field says where its number comes from)."""

    #: A cold process: Python, torch and dimd imported, a CUDA context made. No figure on the H100 machine
    #: (torch's import alone takes about 2 s on the 2-core development VM): taken as 6 s.
    process_s: float = 6.0
    #: ``mpiexec`` and MPI's start-up, and on several ranks the allreduce timed at start-up. No figure: 2 s.
    mpi_s: float = 2.0
    #: ``dimd train`` past its imports: the set into memory, the decoding workers up, the model on the device,
    #: the first steps' cuDNN choices, a checkpoint at the end. No figure: 5 s.
    train_start_s: float = 5.0
    #: A step grid's set-up: its model and strategy built, its first steps. No figure: 1 s.
    setup_s: float = 1.0
    #: One CUDA graph: the 3 warm-up steps before it and the capture. None has been captured on a GPU: 1 s.
    capture_s: float = 1.0
    #: A DataLoader script's 14 worker processes started (torchvision imported). No figure: 2 s.
    dataloader_start_s: float = 2.0
    #: One row of ``dimd bench-allreduce --device cuda`` (about 128 MiB moved, through the host and back for
    #: the host rows), its warm-up and check. No figure: 0.25 s.
    allreduce_row_s: float = 0.25
    #: One CUDA test of ``pytest -m cuda`` on average: 14 of today's 20 start a ``dimd train`` or
    #: ``bench-allreduce`` process each (a fork of the tests' warm interpreter, a CUDA context, a capture or
    #: two, an epoch of 48 images), the rest step resnet20 in the test's process. No figure: 6.5 s.
    cuda_test_s: float = 6.5
    #: ``dimd train``'s images/s against its step alone: 0.88 for resnet50 at 224 px, batch 128 (measured,
    #: docs/measurements.md); at small batches the host's share per image grows: taken as 0.5.
    dimd_share: float = 0.5
    #: A dimd command that leaves the GPU alone (sample-data, pack): about 1 s on the development VM; 2 s.
    cli_s: float = 2.0
    #: CPU-seconds per image to generate (``dimd sample-data``; the share of large images at its default, or
    #: none) and to pack it (at a short side of 256 px; 0.0012 at 36): the development VM, 1,000 images,
    #: ``time dimd sample-data DIR --classes 10 --per-class 100 [--large-share 0]`` and ``time dimd pack``
    #: (user + sys, under other sessions' load; the processes' start included).
    generate_cpu_s: float = 0.022
    generate_small_cpu_s: float = 0.0076
    pack_cpu_s: float = 0.0022
    #: The GPU machine's 16 cores, counted as 8 (their speed against the VM's is not known).
    cores: float = 8.0

    # ------------------------------------------------------------------ the jobs, priced
    def train(self, *, images: int, epochs: int, step: float, loader: float, graphs: int = 0,
              ranks: int = 1) -> float:
        """A ``dimd train`` run: ``images`` per epoch (validation included) at the lesser of its step's rate
        (times :attr:`dimd_share`) and its loader's; on several ranks under ``mpiexec``."""
        rate = min(self.dimd_share * step, loader)
        launch = self.mpi_s if ranks > 1 else 0.0
        return self.process_s + launch + self.train_start_s + graphs * self.capture_s + epochs * images / rate

    def grid(self, timings: list[float], graphs: int, runs: int) -> float:
        """A step grid in one process: each set-up built (and its graphs captured), then ``runs`` rounds of
        its ``timings`` (seconds each set-up is timed per round)."""
        return self.process_s + len(timings) * self.setup_s + graphs * self.capture_s + runs * sum(timings)

    def ceiling(self, *, steps: int, batch: int, step: float) -> float:
        """The model on one fixed batch on the GPU for ``steps`` steps."""
        return self.process_s + self.setup_s + steps * batch / step

    def dataloader(self, *, images: int, epochs: int, step: float) -> float:
        """The DataLoader script: its workers, then ``epochs`` of ``images``."""
        rate = min(self.dimd_share * step, DATALOADER_RATE)
        return self.process_s + self.dataloader_start_s + epochs * images / rate

    def allreduce_table(self, rows: int) -> float:
        """``dimd bench-allreduce --device cuda`` on one rank, ``rows`` rows (sizes x algorithms)."""
        return self.process_s + self.mpi_s + rows * self.allreduce_row_s

    def cuda_tests(self, tests: int) -> float:
        """``pytest -m cuda`` over ``tests`` tests."""
        return self.process_s + tests * self.cuda_test_s

    def sample_sets(self, sets: list[tuple[int, bool]], commands: int = 4) -> float:
        """Sample sets built side by side, each ``dimd sample-data`` and ``dimd pack`` of a training and a
        validation set: (images in all, with sample-data's large images or not) each. Their commands start one
        after the other within a set; the images share the cores."""
        cpu = sum(images * ((self.generate_cpu_s if large else self.generate_small_cpu_s) + self.pack_cpu_s)
                  for images, large in sets)
        return commands * self.cli_s + cpu / self.cores

