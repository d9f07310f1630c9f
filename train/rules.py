"""The rules between a run's settings, each written once: whether what it governs can be on, why, the refusal.

Each rule is a function returning a :class:`~dimd.checks.Rule`. The config
(:mod:`dimd.train.config`) refuses what it was explicitly asked for and a
rule forbids (:meth:`~dimd.checks.Rule.check`); the run plan
(:mod:`dimd.train.run_plan`) applies the rules to the defaults once the
device is known, and refuses in the same words what only it can tell (a
``--cuda-graphs`` run whose ``device`` auto found no GPU). "nccl needs a GPU"
is :func:`dimd.allreduce.group.nccl_needs_a_gpu`, where a library user's
:class:`dimd.DistributedGradients` meets it too.

:func:`graphs_rule` is the default of ``cuda_graphs`` built from them: on
CUDA when a learner's batch is small (:data:`GRAPHS_UP_TO_PIXELS`), where the
launches dominate; docs/gpu.md has the measurements.
"""

from __future__ import annotations

from dimd.checks import Rule

#: Graphs are on by default up to this many pixels per learner step (batch x image_size^2): a batch
#: of 32 at 224 px, or 1,568 at 32 px. Below it a step is launch-bound (measured on an H100: graphed
#: 6.7x eager for resnet20 at batch 16 and 32 px, 1.8-1.9x for resnet18 and resnet50 at batch 16 and
#: 224 px); well above it the GPU is the limit and eager steps run at the same speed.
GRAPHS_UP_TO_PIXELS = 32 * 224 * 224


def graphs_need_a_gpu(device: str) -> Rule:
    """CUDA graphs replay CUDA work. ``device``: the config's ("auto": not known yet) or the run's device type."""
    on = device != "cpu"
    return Rule(on, "the device is a GPU" if device == "cuda" else "auto may find a GPU" if on
                else "the device is not a GPU", "cuda_graphs",
                "replays the step's CUDA work, so it needs a GPU, and this run's device is the CPU; leave it out")


def threads_cannot_be_captured(learner_compute: str) -> Rule:
    """Whether graphs can go with SMA's ``learner_compute``: a capture records one thread's CUDA work only."""
    on = learner_compute != "threads"
    return Rule(on, f"--learner-compute {learner_compute} runs " + ("no learner in a thread of its own" if on else
                "learners in Python threads, which a graph cannot capture"), "cuda_graphs",
                "cannot go with `learner_compute` threads: a graph cannot capture learners in Python threads; "
                "leave one out")


def overlap_cannot_be_captured(overlap: bool | None) -> Rule:
    """Whether graphs can go with S-SGD's ``overlap``: its communication thread starts collectives from autograd's
    hooks while backward runs, which a capture of backward cannot hold. Seen from the other side it is why
    overlap is off by default under graphs (:func:`dimd.train.run_plan.overlap_choice`)."""
    on = not overlap
    return Rule(on, "no gradient bucket is reduced while backward runs" if on else
                "--overlap reduces gradient buckets on a thread while backward runs, which a graph cannot capture",
                "cuda_graphs", "cannot go with `overlap`: a graph cannot capture the thread that reduces gradient "
                "buckets while backward runs; leave one out")


def compile_is_not_captured(compiled: bool) -> Rule:
    """Whether graphs can go with S-SGD's ``compile``: torch.compile's code makes CUDA graphs of its own
    ("reduce-overhead"), and dimd's capture of a step that runs compiled code has not been shown to hold."""
    return Rule(not compiled, "the forward runs eagerly" if not compiled else
                "--compile runs the forward as torch.compile's code, which dimd does not capture",
                "cuda_graphs", "cannot go with `compile`: torch.compile's code is not captured by dimd's graphs "
                "(its own mode reduce-overhead makes graphs); leave one out")


def branches_need_graphs(learner_compute: str, graphs: tuple[bool, str]) -> Rule:
    """Whether SMA's ``learner_compute`` can run with ``graphs`` (on, and the line saying why): branches is one
    CUDA graph with a branch per learner, so it needs graphs on (and so a GPU)."""
    on = learner_compute != "branches" or graphs[0]
    return Rule(on, f"graphs are {graphs[1]}", "learner_compute",
                f"branches is one CUDA graph with a branch per learner, and graphs are {graphs[1]}: it needs a GPU "
                f"and CUDA graphs")


def graphs_asked(choice: bool | None, device: str) -> tuple[bool, str] | None:
    """What the settings alone say of graphs (on, and why), or None where the default decides.

    ``choice``: ``--cuda-graphs`` (True), ``--no-cuda-graphs`` (False) or the default (None).
    """
    gpu = graphs_need_a_gpu(device)
    if not gpu.on:
        return False, f"off: {gpu.why}"
    if choice is None:
        return None
    return choice, "on: --cuda-graphs" if choice else "off: --no-cuda-graphs"


def graphs_rule(choice: bool | None, device: str, batch_size: int, image_size: int, *,
                learner_compute: str, overlap: bool | None = None, compiled: bool = False) -> tuple[bool, str]:
    """Whether a run's steps replay as CUDA graphs, and why, in one line (it goes into the JSON).

    ``device``: the run's device type. The conflicts of an explicit ``--cuda-graphs`` are refused by the
    config; here they turn the default off.
    """
    asked = graphs_asked(choice, device)
    if asked is not None:
        return asked
    for rule in (overlap_cannot_be_captured(overlap), threads_cannot_be_captured(learner_compute),
                 compile_is_not_captured(compiled)):
        if not rule.on:
            return False, f"off: {rule.why}"
    pixels = batch_size * image_size * image_size
    if pixels <= GRAPHS_UP_TO_PIXELS:
        return True, (f"on: {batch_size} images of {image_size} px per learner step ({pixels:,} pixels, at most "
                      f"{GRAPHS_UP_TO_PIXELS:,}): a step this small is bound by its kernel launches, which a graph "
                      f"replays in one")
    return False, (f"off: {batch_size} images of {image_size} px per learner step ({pixels:,} pixels, above "
                   f"{GRAPHS_UP_TO_PIXELS:,}): the GPU, not the launches, sets the pace")
