"""Each rule between a run's settings, written once: whether it lets a thing be on, why, and its one refusal;
and the run plan that applies them, with every choice it makes and its reason."""

from __future__ import annotations

import pytest
import torch

from dimd.allreduce.group import nccl_needs_a_gpu
from dimd.errors import ConfigError
from dimd.train.config import SMAConfig, SSGDConfig, TrainConfig
from dimd.train.rules import (GRAPHS_UP_TO_PIXELS, branches_need_graphs, graphs_need_a_gpu, graphs_rule,
                              overlap_cannot_be_captured, threads_cannot_be_captured)


def test_graphs_need_a_gpu():
    assert graphs_need_a_gpu("cuda").on and graphs_need_a_gpu("auto").on   # auto: the plan asks again
    rule = graphs_need_a_gpu("cpu")
    assert not rule.on and rule.why == "the device is not a GPU"
    assert rule.refusal == ("`cuda_graphs` replays the step's CUDA work, so it needs a GPU, and this run's device "
                            "is the CPU; leave it out")
    with pytest.raises(ConfigError, match="^cuda_graphs replays the step's CUDA work, so it needs a GPU"):
        TrainConfig(train="t", val="v", device="cpu", cuda_graphs=True)


def test_threads_cannot_be_captured():
    assert threads_cannot_be_captured("loop").on and threads_cannot_be_captured("branches").on
    rule = threads_cannot_be_captured("threads")
    assert not rule.on and "Python threads, which a graph cannot capture" in rule.why
    assert rule.refusal.startswith("`cuda_graphs` cannot go with `learner_compute` threads")
    with pytest.raises(ConfigError, match="^cuda_graphs cannot go with `learner_compute` threads"):
        TrainConfig(train="t", val="v", sync="sma", sma=SMAConfig(learner_compute="threads"), cuda_graphs=True)


def test_overlap_cannot_be_captured():
    assert overlap_cannot_be_captured(None).on and overlap_cannot_be_captured(False).on
    rule = overlap_cannot_be_captured(True)
    assert not rule.on and rule.why.startswith("--overlap reduces gradient buckets on a thread")
    assert rule.refusal.startswith("`cuda_graphs` cannot go with `overlap`: a graph cannot capture the thread")
    with pytest.raises(ConfigError, match="^cuda_graphs cannot go with `overlap`"):
        TrainConfig(train="t", val="v", ssgd=SSGDConfig(overlap=True), cuda_graphs=True)


def test_branches_need_graphs():
    assert branches_need_graphs("loop", (False, "off: --no-cuda-graphs")).on
    assert branches_need_graphs("branches", (True, "on: --cuda-graphs")).on
    rule = branches_need_graphs("branches", (False, "off: the device is not a GPU"))
    assert not rule.on and rule.why == "graphs are off: the device is not a GPU"
    assert rule.refusal == ("`learner_compute` branches is one CUDA graph with a branch per learner, and graphs are "
                            "off: the device is not a GPU: it needs a GPU and CUDA graphs")
    branches = SMAConfig(learner_compute="branches")
    for asked, why in (({"cuda_graphs": False}, "off: --no-cuda-graphs"),
                       ({"device": "cpu"}, "off: the device is not a GPU")):
        with pytest.raises(ConfigError, match=f"^learner_compute branches .* graphs are {why}"):
            TrainConfig(train="t", val="v", sync="sma", sma=branches, **asked)
    TrainConfig(train="t", val="v", sync="sma", sma=branches)   # the plan decides once the device is known


def test_nccl_needs_a_gpu():
    assert nccl_needs_a_gpu("cuda").on and nccl_needs_a_gpu("auto").on
    rule = nccl_needs_a_gpu("cpu")
    assert not rule.on and rule.why == "this rank computes on the CPU"
    assert rule.refusal == ("`allreduce` nccl reduces tensors on GPUs and this rank computes on the CPU: name gloo "
                            "(the same path on the CPU) or a host algorithm")
    with pytest.raises(ConfigError, match="^allreduce nccl reduces tensors on GPUs"):
        TrainConfig(train="t", val="v", allreduce="nccl", device="cpu")


def test_graphs_are_on_by_default_only_on_a_gpu_for_small_batches():
    def rule(choice, device, batch, size, learner_compute="loop", **options):
        return graphs_rule(choice, device, batch, size, learner_compute=learner_compute, **options)

    assert rule(None, "cpu", 16, 32) == (False, "off: the device is not a GPU")
    assert rule(True, "cuda", 256, 224) == (True, "on: --cuda-graphs")
    assert rule(False, "cuda", 16, 32) == (False, "off: --no-cuda-graphs")
    on, why = rule(None, "cuda", 16, 224)
    assert on and why.startswith("on: 16 images of 224 px") and "launches" in why
    assert rule(None, "cuda", 16, 224, "branches")[0]
    on, why = rule(None, "cuda", 128, 224)
    assert not on and "the GPU, not the launches" in why and 128 * 224 ** 2 > GRAPHS_UP_TO_PIXELS
    assert rule(None, "cuda", 16, 32, overlap=True) == (False, f"off: {overlap_cannot_be_captured(True).why}")
    assert rule(None, "cuda", 16, 32, "threads") == (False, f"off: {threads_cannot_be_captured('threads').why}")


def test_each_sync_refuses_the_other_ones_settings_naming_the_field():
    with pytest.raises(ConfigError, match="^noise_scale is a setting of S-SGD: it compares each rank's gradient"):
        TrainConfig(train="t", val="v", sync="sma", ssgd=SSGDConfig(noise_scale=True))
    with pytest.raises(ConfigError, match="^learners is a setting of model averaging"):
        TrainConfig(train="t", val="v", sma=SMAConfig(learners=2))
    with pytest.raises(ConfigError, match="^overlap cannot go with `noise_scale`"):
        SSGDConfig(overlap=True, noise_scale=True)


def test_the_help_lists_each_syncs_own_options_in_a_section_of_its_own():
    from conftest import invoke_dimd

    help_text = invoke_dimd("train", "--help", check=True).stdout
    ssgd = help_text[help_text.index("S-SGD (--sync ssgd, the default):"):help_text.index("Model averaging")]
    assert all(flag in ssgd for flag in ("--overlap / --no-overlap", "--noise-scale", "--nesterov"))
    assert "--learners" not in ssgd and help_text.count("--nesterov") == 1
    proc = invoke_dimd("train", "t", "--val", "v", "--sync", "sma", "--nesterov")
    assert proc.returncode == 2 and "Invalid value for '--nesterov': is a setting of S-SGD: SMA's learners use " \
        "Polyak momentum, as Crossbow's do; leave it out with --sync sma" in proc.stderr


# -- the run plan ---------------------------------------------------------------------------------


def plan_of(data, world, **settings):
    from dimd.train.run_plan import plan_run

    config = TrainConfig(**{"train": str(data), "val": str(data), "model": "lenet", "image_size": 16,
                            "epochs": 1, "batch_size": 8, "decode_workers": 1, "threads": 1, **settings})
    events: list[str] = []
    return plan_run(config, world, on_event=events.append, device=torch.device("cpu")), events


def test_a_plan_on_one_cpu_rank_makes_each_choice_with_its_reason(packed_sample, world):
    from dimd.train.sgd import SSGD

    plan, events = plan_of(packed_sample, world)
    try:
        assert plan.device == torch.device("cpu") and plan.threads == 1 and plan.decode_workers == 1
        assert plan.algorithm == "mpi"
        assert plan.algorithm_choice == {"how": "single rank", "overlap": False,
                                         "overlap_why": "off: a single rank reduces nothing"}
        assert (plan.graphs.on, plan.graphs.rule, plan.graphs.explicit) == (False, "off: the device is not a GPU",
                                                                            False)
        assert plan.group is None and plan.calibration is None and isinstance(plan.strategy, SSGD)
        assert plan.batches_per_epoch == 48 // 8 and plan.lr_batch == 8 and plan.resume_path is None
        assert plan.model_info["classes"] == 4 and plan.model_info["name"] == "lenet"
        assert any(event.startswith("loaded 48 training and 48 validation records") for event in events)
    finally:
        plan.close()


def test_a_plan_for_sma_with_graphs_asked_for_says_so(packed_sample, world):
    from dimd.train.graphs import StandIn
    from dimd.train.run_plan import plan_run

    config = TrainConfig(train=str(packed_sample), val=str(packed_sample), model="lenet", image_size=16, epochs=1,
                         batch_size=8, decode_workers=1, threads=1, sync="sma", sma=SMAConfig(learners=2),
                         cuda_graphs=True)
    plan = plan_run(config, world, device=torch.device("cpu"), graph_backend=StandIn())
    try:
        graphs = plan.graphs
        assert graphs.on and graphs.explicit and graphs.rule == "on: stand-in backend given to the trainer"
        assert plan.algorithm_choice["overlap_why"] == "off: SMA averages models, not gradients"
        assert plan.calibration is not None and plan.strategy.learners == 2 and plan.lr_batch == 8
    finally:
        plan.close()
