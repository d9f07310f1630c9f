"""The in-memory store on one rank: the load, zero-copy records, errors, the one-rank shuffle."""

import shutil

import numpy as np
import pytest

from dimd.errors import DimdError
from dimd.format import PackedDataset, crc32
from dimd.shuffle import DistributedStore


def test_load_holds_every_record_with_its_index_row(packed_sample, world):
    store = DistributedStore.load(packed_sample, world)
    packed = PackedDataset(packed_sample)
    assert len(store) == store.total == len(packed) == 48
    assert store.classes == packed.classes
    assert np.array_equal(store.global_index, np.arange(48))
    assert np.array_equal(store.labels, packed.labels) and store.labels.dtype == np.int32
    for i in (0, 17, 47):
        assert bytes(store.record(i)) == bytes(packed.record(i))
    assert list(store.actual_crc32()) == list(packed.records["crc32"])
    assert store.load_stats.reads == 1 and store.load_stats.bytes == packed.data_bytes


def test_records_are_views_into_one_buffer(packed_sample, world):
    store = DistributedStore.load(packed_sample, world)
    view = store.record(3)
    assert isinstance(view, memoryview) and view.readonly
    assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(store.record(3), np.uint8))
    assert crc32(view) == int(store.crc32[3])


def test_a_group_of_one_rank_shuffles_by_reordering_only(packed_sample, world):
    store = DistributedStore.load(packed_sample, world, groups=1)
    stats = store.shuffle(seed=3, round=0)
    assert stats.bytes_sent == stats.bytes_received == 0 and stats.records_held == 48
    assert not np.array_equal(store.global_index, np.arange(48))
    assert sorted(store.global_index) == list(range(48))
    assert list(store.actual_crc32()) == list(store.crc32)
    first = store.global_index.copy()
    store.shuffle(seed=3, round=1)
    assert not np.array_equal(store.global_index, first)
    store.shuffle(seed=3, round=0)  # the placement depends only on (seed, round)
    assert np.array_equal(store.global_index, first)


def test_memory_limit_error_suggests_more_ranks_when_the_share_is_the_most(packed_sample, world):
    with pytest.raises(DimdError, match=r"needs .* `memory_limit` is 1.0 KiB; spread the set over more ranks$"):
        DistributedStore.load(packed_sample, world, memory_limit=1024)


def test_memory_error_advice_is_about_the_largest_part_that_can_shrink():
    from dimd.shuffle.partition import MemoryNeed, memory_problem

    def advice(need: MemoryNeed, workers: int = 1, groups: int = 1) -> str | None:
        text = memory_problem(need, budget=100, memory_limit=None, rank=0, records=9, group_size=2,
                              groups=groups, path="x.dimd", decode_workers=workers)
        return text and text.split("; ")[-1]

    assert advice(MemoryNeed(share_bytes=90)) is None
    assert memory_problem(MemoryNeed(share_bytes=200), budget=100, memory_limit=None, rank=0, records=9, group_size=2,
                          groups=1, path="x.dimd") == ("x.dimd: rank 0's share (9 records) needs 200 B but the "
                                                       "available memory per rank on this node is 100 B; spread "
                                                       "the set over more ranks")
    assert advice(MemoryNeed(share_bytes=200), groups=2) == (
        "spread the set over more ranks (fewer `groups`: a group now has 2 ranks, or more ranks)")
    assert advice(MemoryNeed(share_bytes=10, worker_bytes=300), workers=6) == "use fewer decoding workers"
    assert advice(MemoryNeed(share_bytes=10, worker_bytes=300), workers=1) == "spread the set over more ranks"
    assert advice(MemoryNeed(share_bytes=10, worker_bytes=50, batch_bytes=900)) == "use a smaller batch or image size"


def test_an_image_size_whose_batches_cannot_fit_is_refused_before_the_load(packed_sample, world):
    from dimd.shuffle.memory import batch_memory

    with pytest.raises(DimdError, match=r"its 2 decoding workers and its batches need .* TiB but the available "
                                        r"memory per rank on this node is .*; use a smaller batch or image size"):
        DistributedStore.load(packed_sample, world, decode_workers=2,
                              batch_bytes=batch_memory(16, 100_000, slots=3, decode_workers=2))


def test_the_memory_limit_counts_the_store_once_and_each_decoding_workers_own_memory(packed_sample, world):
    from dimd.shuffle.memory import WORKER_PRIVATE_BYTES

    packed = PackedDataset(packed_sample)
    need = packed.data_path.stat().st_size + len(packed) * 24 * 4   # one rank: no shuffle buffer
    limit = need + WORKER_PRIVATE_BYTES                              # room for one worker, not two
    DistributedStore.load(packed_sample, world, memory_limit=limit, decode_workers=1)
    with pytest.raises(DimdError, match=r"share \(48 records\), its 2 decoding workers need"):
        DistributedStore.load(packed_sample, world, memory_limit=limit, decode_workers=2)


def test_groups_must_divide_the_ranks(packed_sample, world):
    with pytest.raises(DimdError, match="`groups` 2 does not divide the 1 ranks"):
        DistributedStore.load(packed_sample, world, groups=2)


def test_data_file_that_is_not_the_index_pair_is_refused(packed_sample, world, tmp_path):
    stem = tmp_path / "mismatch"
    shutil.copy(packed_sample.with_suffix(".idx.h5"), stem.with_suffix(".idx.h5"))
    data = bytearray(packed_sample.with_suffix(".dimd").read_bytes())
    data[10:20] = bytes(10)  # same size, other bytes in the first record
    stem.with_suffix(".dimd").write_bytes(bytes(data))
    with pytest.raises(DimdError, match="do not match the crc32"):
        DistributedStore.load(stem, world)
    stem.with_suffix(".dimd").write_bytes(bytes(data[:-100]))
    with pytest.raises(DimdError, match="truncated"):
        DistributedStore.load(stem, world)


def test_missing_dataset_is_a_clear_error(tmp_path, world):
    with pytest.raises(DimdError, match="index file not found"):
        DistributedStore.load(tmp_path / "nothing", world)


def test_shares_are_balanced_and_contiguous():
    from dimd.shares import balanced_bounds as share_bounds

    assert share_bounds(10, 4).tolist() == [0, 3, 6, 8, 10]
    assert share_bounds(2, 4).tolist() == [0, 1, 2, 2, 2]  # empty partitions are fine
    assert share_bounds(0, 3).tolist() == [0, 0, 0, 0]


def test_gather_bytes_copies_ranges_back_to_back():
    from dimd.shuffle.exchange import block_sums, displacements, gather_bytes

    data = np.arange(20, dtype=np.uint8)
    starts, lengths = np.array([10, 0, 2, 4, 15]), np.array([3, 2, 2, 1, 5])
    out = gather_bytes(data, starts, lengths)  # records 1..3 are adjacent: copied as one run
    assert out.tolist() == [10, 11, 12, 0, 1, 2, 3, 4, 15, 16, 17, 18, 19]
    assert gather_bytes(data, np.zeros(0, np.int64), np.zeros(0, np.int64)).size == 0
    assert block_sums(lengths, np.array([2, 0, 3])).tolist() == [5, 0, 8]
    assert displacements(np.array([5, 0, 8])).tolist() == [0, 5, 5]


def test_gather_bytes_fills_the_front_of_a_given_buffer_and_refuses_a_short_one():
    from dimd.shuffle.exchange import gather_bytes

    data = np.arange(20, dtype=np.uint8)
    buffer = np.zeros(8, np.uint8)
    out = gather_bytes(data, np.array([10, 0]), np.array([3, 2]), out=buffer)
    assert out.tolist() == [10, 11, 12, 0, 1] and np.shares_memory(out, buffer)   # no new array
    assert buffer[5:].tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        gather_bytes(data, np.array([0]), np.array([9]), out=buffer)


def test_pack_down_moves_kept_records_to_the_front_in_place():
    from dimd.shuffle.exchange import pack_down

    data = np.arange(20, dtype=np.uint8)
    # records at 0 (in place already), 3, 6 (moving onto part of itself) and 16
    starts, end = pack_down(data, np.array([0, 3, 6, 16]), np.array([2, 2, 4, 4]))
    assert starts.tolist() == [0, 2, 4, 8] and end == 12
    assert data[:12].tolist() == [0, 1, 3, 4, 6, 7, 8, 9, 16, 17, 18, 19]
    with pytest.raises(ValueError):
        pack_down(data, np.array([6, 0]), np.array([2, 2]))   # not in byte order


def test_the_compiled_range_mover_is_built_in_this_install():
    from dimd.shuffle import exchange

    assert exchange._ranges is not None, "pip did not build dimd.shuffle._ranges (no C compiler?)"


@pytest.mark.parametrize("in_place", [False, True], ids=["gather", "pack-down"])
def test_the_compiled_mover_moves_what_one_python_call_per_range_moves(in_place):
    from dimd.shuffle.exchange import _move, _move_in_python, displacements

    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 300, 2000)
    starts = displacements(lengths)
    kept = np.sort(rng.choice(len(lengths), 1500, replace=False)) if in_place else rng.permutation(len(lengths))
    source = rng.integers(0, 256, int(lengths.sum()), dtype=np.uint8)
    at = displacements(lengths[kept])
    moved = []
    for move in (_move, _move_in_python):
        data = source.copy()
        target = data if in_place else np.zeros(int(lengths[kept].sum()), np.uint8)
        move(target, at, data, starts[kept], lengths[kept])   # in place: ranges land on their own old bytes
        moved.append(target[: int(lengths[kept].sum())])
    expected = np.concatenate([source[s:s + n] for s, n in zip(starts[kept], lengths[kept])])
    assert np.array_equal(moved[0], expected) and np.array_equal(moved[1], expected)


def test_the_compiled_mover_refuses_a_range_outside_its_buffer_before_moving_a_byte():
    from dimd.shuffle import exchange

    source, target = np.arange(16, dtype=np.uint8), np.zeros(8, np.uint8)
    for at, start, length in ((0, 10, 8), (4, 0, 5), (-1, 0, 1)):
        with pytest.raises(ValueError, match="outside its buffer"):
            exchange._ranges.move(target, np.array([0, at]), source, np.array([0, start]), np.array([2, length]))
        assert not target.any()
    with pytest.raises(TypeError, match="int64"):
        exchange._ranges.move(target, np.array([0], np.int32), source, np.array([0]), np.array([1]))


def test_a_grown_segment_keeps_its_bytes_and_gets_a_new_key():
    from dimd.shuffle.shm import Segment

    segment = Segment(3, "dimd-test")
    segment.array[:] = [1, 2, 3]
    key = segment.key
    segment.grow(5000)
    assert segment.size == 5000 and segment.key != key and segment.array[:3].tolist() == [1, 2, 3]
    held = segment.array[:3]          # a live view: the next growth maps the file a second time
    segment.grow(9000)
    assert segment.array[:3].tolist() == [1, 2, 3] and held.tolist() == [1, 2, 3]
    segment.close()


def test_verification_names_missing_doubled_and_changed_records(packed_sample):
    from types import SimpleNamespace

    from dimd.shuffle.verify import _compare

    packed = PackedDataset(packed_sample)
    store = SimpleNamespace(path=packed.data_path, group=1)
    indices = np.arange(48)
    crc = packed.records["crc32"].copy()
    assert _compare(store, indices, crc, "round 0") is None
    indices[5], crc[5] = 6, crc[6]   # record 5 lost, record 6 held twice
    crc[10] ^= 1            # record 10's bytes changed
    message = _compare(store, indices, crc, "round 2")
    assert message.startswith("verify after round 2: group 1: ")
    assert f"1 records missing: 5 ({packed.names[5]})" in message
    assert "1 records held more than once: 6" in message
    assert f"1 records with changed bytes (crc32): 10 ({packed.names[10]})" in message
