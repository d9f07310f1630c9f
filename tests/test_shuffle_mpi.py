"""The group shuffle on real MPI ranks: conservation, balance, fresh orders, labels, errors that end the job.

(One rank failing before the shuffle's Alltoallv: ``test_mpi_setup.py``.)
"""

import json
import zlib
from typing import Any

import numpy as np
import pytest

from conftest import mpi_run, run_mpi_dimd
from mpi_case import case, say, world
from dimd.format import PackedDataset, PackedRecord, PackWriter

pytestmark = pytest.mark.mpi


def saved_orders(folder, rounds, ranks):
    return [[np.load(folder / f"round{r}_rank{k}.npy") for k in range(ranks)] for r in range(rounds)]


# One group of 2 and of 3; one rank per group (nothing moves); two groups of 2.
@pytest.mark.parametrize("ranks,groups", [(2, 1), (3, 1), (3, 3), (4, 2)])
def test_shuffle_conserves_balances_and_reorders(packed_sample, tmp_path, ranks, groups):
    orders, report = tmp_path / "orders", tmp_path / "shuffle.json"
    proc = run_mpi_dimd(ranks, "shuffle", packed_sample, "--groups", groups, "--rounds", 3, "--seed", 11,
                        "--verify", "--save-order", orders, "--json", report, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "every round verified" in proc.stdout
    held = saved_orders(orders, 3, ranks)
    per_group = ranks // groups
    share = 48 // per_group
    for r, ranks_held in enumerate(held):
        for g in range(groups):
            members = ranks_held[g * per_group:(g + 1) * per_group]
            assert sorted(np.concatenate(members).tolist()) == list(range(48))  # each record once
            assert all(abs(len(m) - share) <= 1 for m in members)               # balanced
        if r:
            assert any(not np.array_equal(a, b) for a, b in zip(held[r - 1], ranks_held))
    if groups > 1:  # groups place the records independently
        assert not np.array_equal(held[0][0], held[0][per_group])
    doc = json.loads(report.read_text())
    figures = doc["result"]
    assert doc["command"] == "shuffle" and figures["world_size"] == ranks and figures["groups"] == groups
    assert len(figures["rounds"]) == 3 and figures["load"]["verified"]
    assert doc["parameters"]["seed"] == 11 and "thread_level_provided" in doc["mpi"]
    moved = [r["bytes_moved"] for r in figures["rounds"]]
    assert all(m == 0 for m in moved) if per_group == 1 else all(m > 0 for m in moved)


@case
def send_buffer_across_shuffles(dataset: str, rounds: str) -> None:
    """Shuffle DATASET ROUNDS times; each round says whether it gathered into the last round's send buffer.

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py send_buffer_across_shuffles packed/sample 4
        -> {"rank": 0, "rounds": [[bytes sent, capacity before, same buffer], ...]}   (one line per rank)

    A new buffer is allowed only where the bytes leaving outgrew the one held.
    """
    from dimd.shuffle import DistributedStore

    store = DistributedStore.load(dataset, world())
    rounds_seen = []
    for r in range(int(rounds)):
        before = store._send
        stats = store.shuffle(seed=2, round=r)
        rounds_seen.append([stats.bytes_sent, len(before), store._send is before])
        assert len(store._send) >= stats.bytes_sent
    say(json.dumps({"rank": store.group_comm.Get_rank(), "rounds": rounds_seen}))


def test_a_shuffle_gathers_into_the_last_shuffles_send_buffer_unless_it_outgrew_it(packed_sample):
    """The leaving records are packed into the buffer the previous shuffle faulted in (docs/shuffle.md)."""
    proc = mpi_run(send_buffer_across_shuffles, 2, packed_sample, "4", timeout=120)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.strip().splitlines():
        rounds = json.loads(line)["rounds"]
        assert rounds[0][1] == 0 and not rounds[0][2]            # the first shuffle makes it
        for sent, capacity, same in rounds[1:]:
            assert same == (sent <= capacity)
        assert any(same for _, _, same in rounds[1:])


def pack_subset(packed_sample, out, count):
    packed = PackedDataset(packed_sample)
    with PackWriter(out) as writer:
        for i in range(count):
            row = packed.records[i]
            writer.add(PackedRecord(bytes(packed.record(i)), int(row["label"]), packed.names[i],
                                    int(row["height"]), int(row["width"])))
        writer.commit(packed.classes, short_side=0, quality=0, source="subset")
    return out


def test_odd_counts_spread_over_the_ranks(packed_sample, tmp_path):
    subset = pack_subset(packed_sample, tmp_path / "subset", 7)
    orders = tmp_path / "orders"
    proc = run_mpi_dimd(4, "shuffle", subset, "--rounds", 4, "--verify", "--save-order", orders,
                        timeout=120)
    assert proc.returncode == 0, proc.stderr
    for ranks_held in saved_orders(orders, 4, 4):
        assert sorted(np.concatenate(ranks_held).tolist()) == list(range(7))
        assert sorted(len(m) for m in ranks_held) == [1, 2, 2, 2]


@case
def shuffled_orders(dataset: str, rounds: str) -> None:
    """Load DATASET over the job (one group), shuffle it ROUNDS times, checking each; each rank prints the
    records it held after each round::

        mpiexec -n 4 python -m mpi4py tests/mpi_case.py shuffled_orders subset 4
        -> {"rank": 0, "orders": [[1], [0], [], []]}   (one line per rank)
    """
    from dimd.shuffle import DistributedStore
    from dimd.shuffle.verify import check_group

    comm = world()
    store = DistributedStore.load(dataset, comm)
    orders = []
    for r in range(int(rounds)):
        store.shuffle(seed=0, round=r)
        check_group(store, f"round {r}")
        orders.append(store.global_index.tolist())
    say(json.dumps({"rank": comm.Get_rank(), "orders": orders}))


def test_a_store_with_fewer_records_than_ranks_shuffles_them_all(packed_sample, tmp_path):
    """The library keeps ranks with no record (a small validation set on many ranks); only the
    ``dimd shuffle`` command refuses them."""
    subset = pack_subset(packed_sample, tmp_path / "subset", 2)
    proc = mpi_run(shuffled_orders, 4, subset, 4, timeout=120, check=True)
    lines = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda line: line["rank"])
    for r in range(4):
        held = [line["orders"][r] for line in lines]
        assert sorted(sum(held, [])) == [0, 1] and sorted(map(len, held)) == [0, 0, 1, 1]


def test_memory_limit_ends_the_job_with_advice(packed_sample):
    proc = run_mpi_dimd(2, "shuffle", packed_sample, "--memory-limit", "64K", timeout=60)
    assert proc.returncode != 0
    assert "--memory-limit is 64.0 KiB; spread the set over more ranks" in proc.stderr


def test_index_and_data_mismatch_ends_the_job(packed_sample, tmp_path):
    other = pack_subset(packed_sample, tmp_path / "other", 5)
    other.with_suffix(".dimd").write_bytes(packed_sample.with_suffix(".dimd").read_bytes())
    proc = run_mpi_dimd(3, "shuffle", other, timeout=60)
    assert proc.returncode != 0 and "the index expects" in proc.stderr


@case
def each_rank_loads_its_own_copy(*datasets: str) -> None:
    """Rank r loads DATASETS[r], as a job reads a copy of the set on each node's own disk.

        mpiexec -n 2 python -m mpi4py tests/mpi_case.py each_rank_loads_its_own_copy a/train b/train
        -> rank 0: loaded 40 records     (one line per rank; copies that differ: rank 0: refused: <why>)
    """
    from dimd.mpi import AgreedError
    from dimd.shuffle import DistributedStore

    comm = world()
    try:
        store = DistributedStore.load(datasets[comm.rank], comm)
    except AgreedError as exc:   # every rank refuses alike, so the job can end in order
        say(f"rank {comm.rank}: refused: {exc}")
        return
    say(f"rank {comm.rank}: loaded {store.total} records")


def test_ranks_that_read_different_packs_under_one_name_are_refused_on_every_rank(packed_sample, tmp_path):
    """A stale copy on one node's disk: every rank refuses before reading a share, naming who reads what."""
    copy = tmp_path / "copy" / "sample"
    copy.parent.mkdir()
    for suffix in (".dimd", ".idx.h5"):
        copy.with_suffix(suffix).write_bytes(packed_sample.with_suffix(suffix).read_bytes())
    proc = mpi_run(each_rank_loads_its_own_copy, 2, packed_sample, copy, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"rank {r}: loaded {len(PackedDataset(packed_sample))} records"
                                                for r in (0, 1)]
    stale = pack_subset(packed_sample, tmp_path / "stale", 5)
    proc = mpi_run(each_rank_loads_its_own_copy, 2, packed_sample, stale, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert len(lines) == 2 and all(line.startswith(f"rank {r}: refused: ") for r, line in enumerate(lines))
    assert "rank 1 on " in lines[0] and "reads a different pack (5 records" in lines[0], lines
    assert "every rank must read the same pack" in lines[0] and lines[0][9:] == lines[1][9:]


def test_more_ranks_than_records_is_refused_before_the_load(packed_sample, tmp_path):
    """As ``dimd train`` refuses a set too small for one batch per rank: no rank may be left empty."""
    one = pack_subset(packed_sample, tmp_path / "one", 1)
    proc = run_mpi_dimd(2, "shuffle", one, timeout=60)
    assert proc.returncode == 1
    assert [line for line in proc.stderr.splitlines() if "dimd:" in line] == [
        f"dimd: error: {one}.dimd: 1 record is fewer than the 2 ranks that share a copy (each rank needs one); "
        "run fewer ranks or more --groups"]
    assert run_mpi_dimd(2, "shuffle", one, "--groups", 2, "--rounds", 1, timeout=60).returncode == 0


def test_groups_must_divide_the_job(packed_sample):
    proc = run_mpi_dimd(3, "shuffle", packed_sample, "--groups", 2, timeout=60)
    assert proc.returncode != 0 and "--groups 2 does not divide the 3 ranks" in proc.stderr


@case
def loader_batches(dataset: str, groups: str) -> None:
    """Load DATASET in GROUPS groups, train an epoch, shuffle, train one more and evaluate one.

    The decoding workers read the load-order share in epoch 0 and the shuffled
    one after it, without restarting; the shuffle comes while epoch 1 is being
    read, and that iteration goes on. Rank 0 prints one JSON line: every rank's
    steps per epoch, how many training images rank 0 saw after the shuffle,
    whether any rank's workers restarted, whether every rank's iteration gave
    after the shuffle (its batches in flight then included) what a loader
    started on the shuffled store gives, and each rank's evaluation (global index, label, crc32 of the
    decoded image), for the test to check against the packed set::

        mpiexec -n 3 python -m mpi4py tests/mpi_case.py loader_batches packed/sample 1
        -> {"steps": [4, 4, 4], "seen": 16, "restarted": false, "continued": true, "pairs": [[[0, 2, 123], ...]]}
    """
    from dimd.shuffle import BatchLoader, DistributedStore

    comm = world("funneled")
    from mpi4py import MPI

    store = DistributedStore.load(dataset, comm, groups=int(groups))
    train = BatchLoader(store, batch_size=4, image_size=32, decode_workers=2, seed=1)
    steps = comm.allgather(train.steps_per_epoch)
    for _ in train.epoch(0):
        pass
    workers = train.worker_pids
    def fingerprints(batches: Any) -> list[tuple[int, list[int]]]:
        return [(zlib.crc32(images.numpy().tobytes()), labels.tolist()) for images, labels in batches]

    in_flight = train.epoch(1)
    next(in_flight)                  # batches 1 and 2 of epoch 1 still decoding while the bytes move
    store.shuffle(seed=4, round=0)   # the workers move to the received share at this round boundary
    continued = fingerprints(in_flight)   # batches 1 on: the shuffled store's
    train.seek(1, 1)
    continued_as_started = comm.allreduce(int(continued == fingerprints(train.epoch(1))), op=MPI.MIN)
    train.seek(1)
    seen = sum(len(labels) for _, labels in train.epoch(1))
    restarted = bool(comm.allreduce(int(train.worker_pids != workers)))
    evaluation = BatchLoader(store, batch_size=5, image_size=32, train=False, decode_workers=2)
    pairs: list[tuple[int, int, int]] = []
    for images, labels in evaluation.epoch(0):
        pairs += [(int(store.global_index[len(pairs) + j]), int(labels[j]),
                   zlib.crc32(images[j].numpy().tobytes())) for j in range(len(labels))]
    everything = comm.gather(pairs)
    if comm.rank == 0:
        say(json.dumps({"steps": steps, "seen": seen, "restarted": restarted,
                        "continued": bool(continued_as_started), "pairs": everything}))


@pytest.mark.parametrize("ranks,groups", [(3, 1)])
def test_batches_decode_to_the_right_labels_on_every_rank(packed_sample, ranks, groups):
    """After a shuffle, every rank's batches carry its own records' labels and decode as packed,
    through the same decoding workers as before it (they follow the store to its new share)."""
    import zlib

    from dimd.shuffle import decode_eval

    proc = mpi_run(loader_batches, ranks, packed_sample, groups, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == [48 // (ranks * 4)] * ranks  # the same on every rank
    assert result["seen"] == 48 // (ranks * 4) * 4
    assert result["restarted"] is False and result["continued"] is True
    packed = PackedDataset(packed_sample)
    per_group = ranks // groups
    for g in range(groups):
        pairs = [p for rank_pairs in result["pairs"][g * per_group:(g + 1) * per_group] for p in rank_pairs]
        assert sorted(i for i, _, _ in pairs) == list(range(48))  # evaluation sees each record once
        for index, label, image_crc in pairs:
            assert label == packed.labels[index]
            assert image_crc == zlib.crc32(decode_eval(packed.record(index), 32).tobytes())
