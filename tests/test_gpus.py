"""Each rank takes a GPU of its own, however the cluster hands them out; GPUs are told apart by their UUID."""

from __future__ import annotations

from dimd.gpus import assign_gpus, shared_gpu, too_few_gpus_problem


def test_with_every_gpu_visible_each_rank_takes_the_one_at_its_node_local_rank():
    assert assign_gpus([("GPU-a", "GPU-b", "GPU-c", "GPU-d")] * 4) == [0, 1, 2, 3]


def test_with_one_gpu_bound_to_each_rank_each_takes_its_cuda_0():
    """srun --gpus-per-task=1: every rank sees one device, as cuda:0, a different GPU each."""
    visible = [("GPU-a",), ("GPU-b",), ("GPU-c",)]
    picks = assign_gpus(visible)
    assert picks == [0, 0, 0]
    assert too_few_gpus_problem([0, 1, 2], visible, picks, "node7") is None


def test_more_ranks_than_gpus_they_see_is_one_line_naming_the_ranks_left_out():
    visible = [("GPU-a", "GPU-b")] * 3
    picks = assign_gpus(visible)
    assert picks == [0, 1, None]
    assert too_few_gpus_problem([4, 5, 6], visible, picks, "node7") == (
        "3 ranks on node7 and 2 GPU(s) they can see: rank(s) 6 would share a GPU; start at most one rank per GPU "
        "(SLURM: --gpus-per-task=1), or use `device` cpu")


def test_two_ranks_bound_to_the_same_gpu_are_not_doubled_up():
    visible = [("GPU-a",), ("GPU-a",)]
    picks = assign_gpus(visible)
    assert picks == [0, None]
    assert "rank(s) 1 would share a GPU" in too_few_gpus_problem([0, 1], visible, picks, "node7")


def test_ranks_at_the_same_index_on_different_gpus_share_nothing():
    assert shared_gpu([0, 1, 2], ["GPU-a", "GPU-b", None]) is None
    assert shared_gpu([0, 1, 2, 3], ["GPU-a", "GPU-b", "GPU-a", "GPU-a"]) == ("GPU-a", [0, 2, 3])
