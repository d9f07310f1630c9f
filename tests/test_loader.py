"""The batch loader on one rank: shapes, labels, determinism, exact resume, evaluation coverage,
and its decoding worker processes: failures end with one line and leave nothing behind."""

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_python
from mpi_case import case, case_command, say, world

from dimd.errors import DimdError
from dimd.format import PackedDataset
from dimd.shuffle import BatchLoader, DistributedStore, decode_eval


def collect(loader, epoch):
    return [(images.clone(), labels.clone()) for images, labels in loader.epoch(epoch)]


def test_training_batches_are_uint8_nchw_with_int64_labels(store):
    with BatchLoader(store, batch_size=5, image_size=32, decode_workers=2, seed=1) as loader:
        assert loader.steps_per_epoch == 48 // 5 == len(loader)
        batches = collect(loader, 0)
    assert len(batches) == 9
    for images, labels in batches:
        assert images.shape == (5, 3, 32, 32) and images.dtype == torch.uint8
        assert labels.shape == (5,) and labels.dtype == torch.int64


def test_an_epoch_draws_without_replacement_and_labels_follow_the_records(store, packed_sample):
    loader = BatchLoader(store, batch_size=5, image_size=32, seed=1)
    indices = loader.epoch_indices(0)
    drawn = np.concatenate(indices)
    assert len(drawn) == 45 and len(set(drawn.tolist())) == 45
    assert not np.array_equal(drawn, np.sort(drawn))
    assert not np.array_equal(drawn, np.concatenate(loader.epoch_indices(1)))
    names = PackedDataset(packed_sample).names
    for (_, labels), batch in zip(collect(loader, 0), indices):
        assert labels.tolist() == store.labels[batch].tolist()
        for label, i in zip(labels.tolist(), batch):  # the class folder of the source file
            assert names[store.global_index[i]].split("/")[0] == store.classes[label]
    loader.close()


def test_batches_do_not_depend_on_the_number_of_workers_or_their_timing(store):
    one = collect(BatchLoader(store, batch_size=8, image_size=24, decode_workers=1, seed=4), 2)
    two = collect(BatchLoader(store, batch_size=8, image_size=24, decode_workers=2, seed=4, prefetch=3), 2)
    three = collect(BatchLoader(store, batch_size=8, image_size=24, decode_workers=3, seed=4, prefetch=1), 2)
    other_seed = collect(BatchLoader(store, batch_size=8, image_size=24, decode_workers=2, seed=5), 2)
    for other in (two, three):
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, other))
    assert not torch.equal(one[0][0], other_seed[0][0])


def test_every_batch_after_a_shuffle_within_the_epoch_is_the_shuffled_stores_and_resumes_exactly(packed_sample,
                                                                                                world):
    """Batches in flight when the store shuffles are read again from it: every batch after the shuffle, and
    a loader resumed from a ``state_dict()`` taken right then, give what a loader started on it gives."""
    def load(shuffled: bool) -> DistributedStore:
        store = DistributedStore.load(packed_sample, world)
        if shuffled:
            store.shuffle(9, 1)
        return store

    with BatchLoader(load(False), batch_size=4, image_size=24, decode_workers=2, seed=3) as loader:
        unshuffled = collect(loader, 0)
    with BatchLoader(load(True), batch_size=4, image_size=24, decode_workers=2, seed=3) as loader:
        loader.seek(0, 3)
        shuffled = collect(loader, 0)
    store = load(False)
    seen = []
    with BatchLoader(store, batch_size=4, image_size=24, decode_workers=2, seed=3, prefetch=2) as loader:
        for step, (images, labels) in enumerate(loader.epoch(0)):
            seen.append((images.clone(), labels.clone()))
            if step == 2:
                store.shuffle(9, 1)   # batches 3 and 4 are in flight
                state = loader.state_dict()
    with BatchLoader(load(True), batch_size=4, image_size=24, decode_workers=2, seed=3) as resumed:
        resumed.load_state_dict(state)
        after_resume = collect(resumed, 0)
    expected = unshuffled[:3] + shuffled
    assert len(seen) == len(expected) == loader.steps_per_epoch
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(seen, expected))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(after_resume, shuffled))


def test_a_second_iteration_of_one_loader_takes_over_and_the_first_says_so(store):
    with BatchLoader(store, batch_size=4, image_size=24, decode_workers=2, seed=3) as loader:
        reference = collect(loader, 1)
        first = loader.epoch(0)
        next(first)                      # two more of its batches are in flight in the ring
        second = collect(loader, 1)
        with pytest.raises(DimdError, match=r"epoch\(\) was called again while this iteration was still open"):
            next(first)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(second, reference))


def test_an_iteration_continued_after_close_says_the_loader_was_closed(store):
    loader = BatchLoader(store, batch_size=4, image_size=24, decode_workers=2, seed=3)
    batches = loader.epoch(0)
    next(batches)
    loader.close()
    with pytest.raises(DimdError, match="the loader was closed while this iteration was still open"):
        next(batches)
    assert loader.position == (0, 1) and len(collect(loader, 0)) == loader.steps_per_epoch - 1
    loader.close()


def test_a_ranks_memory_adds_its_workers_proportional_share_not_their_whole_resident_set(store):
    from dimd.shuffle.memory import process_memory, rank_memory

    with BatchLoader(store, batch_size=8, image_size=24, decode_workers=2, seed=4) as loader:
        collect(loader, 0)   # the workers have read the whole store
        memory = rank_memory(loader.worker_pids)
        worker_rss = sum(process_memory(pid).rss for pid in loader.worker_pids)
    assert memory.workers == 2 and memory.total == memory.rank_pss + memory.workers_pss
    assert 0 < memory.workers_private < memory.workers_pss < worker_rss   # the store and libraries are shared
    assert memory.rank_pss <= memory.rank_rss


def test_raising_prefetch_after_the_first_epoch_keeps_every_batch_intact(store):
    """SMA's engine asks for 2K batches ahead once it knows K: the ring of batch slots must follow,
    or a batch is overwritten by one drawn later before it is read."""
    reference = collect(BatchLoader(store, batch_size=4, image_size=24, decode_workers=2, seed=3, prefetch=4), 1)
    with BatchLoader(store, batch_size=4, image_size=24, decode_workers=2, seed=3) as loader:
        collect(loader, 0)
        loader.prefetch = 4
        batches = loader.epoch(1)
        held = [next(batches) for _ in range(4)]            # four batches held at once, as 2 x 2 learners
        rest = [(images.clone(), labels.clone()) for images, labels in batches]
    for (images, labels), (expected, expected_labels) in zip(held + rest, reference):
        assert torch.equal(images, expected) and torch.equal(labels, expected_labels)


def test_state_dict_resumes_exactly_mid_epoch(store):
    reference = BatchLoader(store, batch_size=4, image_size=24, seed=9)
    expected = collect(reference, 1)

    first = BatchLoader(store, batch_size=4, image_size=24, seed=9)
    for step, _ in enumerate(first.epoch(1)):
        if step == 4:
            state = first.state_dict()  # taken after consuming batches 0..4
            break
    first.close()
    assert state["epoch"] == 1 and state["step"] == 5

    resumed = BatchLoader(store, batch_size=4, image_size=24, seed=9)
    resumed.load_state_dict(state)
    rest = collect(resumed, 1)
    assert len(rest) == len(expected) - 5
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, expected[5:]))
    assert resumed.state_dict()["epoch"] == 2 and resumed.state_dict()["step"] == 0
    assert len(collect(resumed, 2)) == resumed.steps_per_epoch  # later epochs start at 0


def test_resume_refuses_a_store_that_holds_other_records(packed_sample, world):
    store = DistributedStore.load(packed_sample, world)
    state = BatchLoader(store, batch_size=4, seed=0).state_dict()
    store.shuffle(seed=0, round=0)
    with pytest.raises(DimdError, match="replay its last shuffle"):
        BatchLoader(store, batch_size=4, seed=0).load_state_dict(state)
    with pytest.raises(DimdError, match="batch_size=4"):
        BatchLoader(store, batch_size=3, seed=0).load_state_dict(state)


def test_evaluation_visits_every_record_once_in_order(store):
    loader = BatchLoader(store, batch_size=10, image_size=32, train=False, decode_workers=2)
    batches = collect(loader, 0)
    assert loader.steps_per_epoch == len(batches) == 5
    assert [len(labels) for _, labels in batches] == [10, 10, 10, 10, 8]
    labels = torch.cat([labels for _, labels in batches])
    assert labels.tolist() == store.labels.tolist()
    images = torch.cat([images for images, _ in batches])
    for i in (0, 23, 47):
        assert np.array_equal(images[i].numpy(), decode_eval(store.record(i), 32))


def test_each_epoch_is_decoded_at_its_scheduled_size_with_the_same_crops(store):
    """Progressive resizing: epoch e's batches are the fixed-size loader's of that size (the same records and
    draws), whichever size the slots were made for; a resume mid-epoch continues at the epoch's size."""
    from dimd.train.image_sizes import parse_size_schedule

    schedule = parse_size_schedule("16:32", model="resnet20", epochs=3)   # 16, 24, 32 px
    with BatchLoader(store, batch_size=6, image_size=schedule.largest, seed=2, sizes=schedule) as loader:
        assert [loader.image_size_at(epoch) for epoch in range(3)] == [16, 24, 32]
        growing = [collect(loader, epoch) for epoch in range(3)]
        for epoch in range(3):
            assert {tuple(images.shape) for images, _ in growing[epoch]} == {(6, 3, schedule(epoch), schedule(epoch))}
        loader.seek(1, 3)
        state = loader.state_dict()
    with BatchLoader(store, batch_size=6, image_size=24, seed=2) as fixed:
        at_24 = collect(fixed, 1)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(growing[1], at_24))
    with BatchLoader(store, batch_size=6, image_size=schedule.largest, seed=2, sizes=schedule) as resumed:
        resumed.load_state_dict(state)
        rest = collect(resumed, 1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rest, at_24[3:])) and len(rest) == len(at_24) - 3


def test_a_scheduled_size_above_the_loaders_image_size_is_refused(store):
    loader = BatchLoader(store, batch_size=6, image_size=24, sizes=lambda epoch: 32)
    with pytest.raises(DimdError, match=r"^epoch 0's image size 32 px is outside 8\.\.24 px"):
        next(loader.epoch(0))
    loader.close()


def test_evaluation_resizes_the_shorter_side_to_the_size_over_the_crop_ratio(store):
    """torchvision's --val-resize-size over --val-crop-size: 1.0 keeps the whole shorter side, 224/256 the default."""
    loader = BatchLoader(store, batch_size=10, image_size=32, train=False, crop_ratio=1.0)
    images, _ = next(loader.epoch(0))
    loader.close()
    assert np.array_equal(images[3].numpy(), decode_eval(store.record(3), 32, crop_ratio=1.0))
    assert not np.array_equal(images[3].numpy(), decode_eval(store.record(3), 32))
    with pytest.raises(DimdError, match=r"crop ratio must be in \(0, 1\]"):
        BatchLoader(store, batch_size=10, train=False, crop_ratio=1.2)


def test_a_batch_larger_than_the_share_is_refused(store):
    with pytest.raises(DimdError, match="fewer than one batch per rank"):
        BatchLoader(store, batch_size=49)


@pytest.mark.parametrize("crop_scale", [0.0, 1.5])
def test_a_crop_scale_outside_zero_to_one_is_refused(store, crop_scale):
    with pytest.raises(DimdError, match="crop scale must be in"):
        BatchLoader(store, batch_size=8, crop_scale=crop_scale)


def test_a_corrupt_record_names_itself(tmp_path, packed_sample, world):
    from dimd.format import PackedRecord, PackWriter

    packed = PackedDataset(packed_sample)
    with PackWriter(tmp_path / "bad") as writer:
        writer.add(PackedRecord(bytes(packed.record(0)), 0, "good.jpg", 1, 1))
        writer.add(PackedRecord(b"\xff\xd8not a jpeg at all", 1, "bad.jpg", 1, 1))
        writer.commit(["a", "b"], short_side=0, quality=0, source="test")
    bad = DistributedStore.load(tmp_path / "bad", world)
    with pytest.raises(DimdError, match=r"bad.dimd: record 1: not a decodable image"):
        collect(BatchLoader(bad, batch_size=2, train=False), 0)


def test_asking_again_for_the_current_epoch_continues_it(store):
    loader = BatchLoader(store, batch_size=6, image_size=16, seed=2)
    expected = [labels.tolist() for _, labels in BatchLoader(store, batch_size=6, image_size=16,
                                                             seed=2).epoch(0)]
    got = []
    for _, labels in loader.epoch(0):
        got.append(labels.tolist())
        if len(got) == 3:
            break  # e.g. to shuffle the store mid-epoch
    got += [labels.tolist() for _, labels in loader.epoch(0)]
    assert got == expected
    assert loader.state_dict()["epoch"] == 1
    assert len(list(loader.epoch(0))) == loader.steps_per_epoch  # another epoch starts afresh
    loader.close()


def test_a_killed_worker_ends_the_epoch_with_one_line_naming_it(store):
    from dimd.shuffle.workers import WorkerDied

    loader = BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, seed=0)
    batches = loader.epoch(0)
    next(batches)
    victim = loader.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=rf"decoding worker 1 \(pid {victim}\) was killed by SIGKILL"):
        for _ in batches:
            pass
    loader.close()
    with BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, seed=0) as fresh:  # a new pool starts
        assert len(collect(fresh, 0)) == fresh.steps_per_epoch


def test_a_worker_killed_while_the_rank_sends_it_tasks_ends_with_the_same_line():
    """The rank blocked in a send (the worker stopped reading, its socket full) when the worker dies: the
    send's error (a reset connection, a broken pipe) is WorkerDied's line, never an OSError of its own."""
    import threading

    from dimd.shuffle.workers import DecodeWorkers, WorkerDied

    pool = DecodeWorkers(2)
    victim = pool.pids[1]
    os.kill(victim, signal.SIGSTOP)
    threading.Timer(1.0, os.kill, args=(victim, signal.SIGKILL)).start()
    with pytest.raises(WorkerDied, match=rf"decoding worker 1 \(pid {victim}\) was killed by SIGKILL"):
        for _ in range(1_000_000):
            pool.detach(12345)   # a message to each worker: the stopped one's socket fills, and the send waits
    assert pool.closed


def test_a_loader_sharing_the_workers_of_a_killed_one_gets_the_same_line(store):
    from dimd.shuffle.workers import WorkerDied

    train = BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, seed=0)
    evaluation = BatchLoader(store, batch_size=4, image_size=16, decode_workers=2, train=False)
    batches, scores = train.epoch(0), evaluation.epoch(0)   # e.g. a feeding thread trains, the rank evaluates
    next(batches)
    next(scores)
    victim = train.worker_pids[0]
    os.kill(victim, signal.SIGKILL)
    line = rf"decoding worker 0 \(pid {victim}\) was killed by SIGKILL"
    with pytest.raises(WorkerDied, match=line):
        for _ in batches:
            pass
    with pytest.raises(WorkerDied, match=line):
        for _ in scores:
            pass
    train.close()
    evaluation.close()


def test_workers_are_new_interpreters_without_mpi_that_ignore_stop_signals(store):
    with BatchLoader(store, batch_size=4, image_size=16, decode_workers=1, seed=0) as loader:
        collect(loader, 0)
        (pid,) = loader.worker_pids
        environment = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert not [v for v in environment if v.startswith((b"PMI_", b"HYDRA_", b"OMPI_"))]
        assert b"libmpi" not in open(f"/proc/{pid}/maps", "rb").read()
        os.kill(pid, signal.SIGINT)   # Ctrl-C reaches the whole process group: the rank decides
        assert len(collect(loader, 1)) == loader.steps_per_epoch


def test_closing_ends_the_workers_even_if_a_process_forked_from_the_rank_holds_their_sockets():
    """A torch DataLoader worker forked from the rank holds copies of the workers' sockets: closing
    them is not enough, so the workers are told to end, and do at once rather than being killed later."""
    from dimd.shuffle.workers import DecodeWorkers

    workers = DecodeWorkers(2)
    forked = os.fork()
    if forked == 0:
        time.sleep(60)
        os._exit(0)
    try:
        assert workers.close() == [0, 0]
    finally:
        os.kill(forked, signal.SIGKILL)
        os.waitpid(forked, 0)


def test_a_stop_signal_sent_while_a_worker_starts_is_held_until_it_ignores_it():
    """A plain scancel (or bkill) signals every process of the job, workers still starting included:
    the worker is started with the stop signals blocked, so it cannot die of one before its SIG_IGN."""
    from dimd.shuffle.workers import STOP_SIGNALS, _spawn_shielded

    starting = ("import os, signal\n"
                "os.kill(os.getpid(), signal.SIGTERM)   # arrives before the worker has set SIG_IGN\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
                "print('alive')\n")
    process = _spawn_shielded([sys.executable, "-c", starting], stdout=subprocess.PIPE, text=True)
    assert process.communicate(timeout=60)[0] == "alive\n" and process.returncode == 0
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())   # the rank's mask is back
    assert {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT} == STOP_SIGNALS


def test_a_record_whose_bytes_changed_since_the_pack_is_named_even_if_it_decodes(tmp_path, packed_sample, world):
    import shutil

    stem = tmp_path / "flipped"
    for suffix in (".dimd", ".idx.h5"):
        shutil.copy(packed_sample.with_suffix(suffix), stem.with_suffix(suffix))
    packed = PackedDataset(stem)
    offset = int(packed.records["offset"][7]) + int(packed.records["length"][7]) // 2   # entropy-coded data
    data = bytearray(stem.with_suffix(".dimd").read_bytes())
    data[offset] ^= 0x01
    stem.with_suffix(".dimd").write_bytes(bytes(data))
    store = DistributedStore.load(stem, world)   # the load's spot check reads the first and last record only
    with BatchLoader(store, batch_size=4, image_size=24, train=False) as loader, pytest.raises(
            DimdError, match=r"flipped.dimd: record 7: crc32 [0-9a-f]{8}, the index says [0-9a-f]{8} \(the bytes "
                             r"changed since the pack"):
        collect(loader, 0)


def test_a_loader_dropped_while_a_pool_starts_is_closed_without_a_deadlock(packed_sample, tmp_path):
    """The garbage collector may close a dropped loader in the thread that holds the pools' lock to start a
    pool (Popen allocates); in a process of its own, as a deadlock would hang it."""
    script = tmp_path / "drop.py"
    script.write_text(f"""
import gc
from dimd.mpi import init_mpi
init_mpi("funneled")
from mpi4py import MPI
from dimd.shuffle import BatchLoader, DistributedStore
from dimd.shuffle.workers import DecodeWorkers
store = DistributedStore.load({str(packed_sample)!r}, MPI.COMM_WORLD)
loader = BatchLoader(store, batch_size=4, image_size=24, decode_workers=1)
next(loader.epoch(0))
with DecodeWorkers._pools_lock:   # what DecodeWorkers.shared() holds while it starts a pool
    del loader, store             # the two hold each other (the store's on_change hook): a cycle, so
    gc.collect()                  # the collector runs the loader's __del__, which releases the pool
print("closed")
""")
    proc = run_python(script, timeout=60)
    assert proc.stdout == "closed\n", proc.stderr


def test_a_worker_whose_rank_ended_while_it_started_leaves_quietly():
    """The rank's end of the socket is closed before the worker says it is ready (its rank was killed)."""
    import socket

    ours, theirs = socket.socketpair()
    ours.close()
    worker = subprocess.run([sys.executable, "-m", "dimd.shuffle.decode_worker", str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=60)
    theirs.close()
    assert (worker.returncode, worker.stderr) == (0, "")


@case
def loader_as_a_library(dataset: str, hold: str = "") -> None:
    """What a user's own script does, with no launcher: load DATASET, read one training epoch.

    Prints one JSON line: the crc32 of each batch's images and labels and the
    decoding workers' and its own process ids. With HOLD, then waits (for a test to kill it)::

        python tests/mpi_case.py loader_as_a_library packed/sample
        -> {"batches": [[123, 456], ...], "workers": [4242, 4243], "pid": 4240}
    """
    import time

    from dimd.shuffle import BatchLoader, DistributedStore

    store = DistributedStore.load(dataset, world("funneled"))
    with BatchLoader(store, batch_size=8, image_size=24, decode_workers=2, seed=3) as loader:
        batches = [(zlib.crc32(images.numpy().tobytes()), zlib.crc32(labels.numpy().tobytes()))
                   for images, labels in loader.epoch(0)]
        say(json.dumps({"batches": batches, "workers": loader.worker_pids, "pid": os.getpid()}))
        while hold:
            time.sleep(1)


@pytest.fixture(scope="module")
def library_user(packed_sample):
    """:func:`loader_as_a_library` on DATASET with ``hold``, started as a user's own script (no launcher,
    no ``-m mpi4py``), after its first epoch: (the process, its JSON line)."""
    process = subprocess.Popen([*case_command(loader_as_a_library, mpi4py=False), str(packed_sample), "hold"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line:
        process.kill()
        pytest.fail(process.communicate()[1])
    yield process, json.loads(line)
    process.kill()
    process.communicate()


def test_a_library_user_without_a_launcher_gets_the_same_batches(store, library_user):
    import zlib

    _, result = library_user
    with BatchLoader(store, batch_size=8, image_size=24, decode_workers=3, seed=3) as loader:
        ours = [[zlib.crc32(images.numpy().tobytes()), zlib.crc32(labels.numpy().tobytes())]
                for images, labels in loader.epoch(0)]
    assert result["batches"] == ours


def ours_in_dev_shm():
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(("dimd-store", "dimd-ring")))


def test_a_sigkilled_rank_leaves_no_shared_memory_and_no_workers_behind(library_user):
    process, result = library_user
    maps = open(f"/proc/{process.pid}/maps").read()
    assert "memfd:dimd-store" in maps and "memfd:dimd-ring" in maps   # nameless: nothing to clean up
    before = ours_in_dev_shm()
    process.kill()
    process.communicate()
    for pid in result["workers"]:   # each worker ends when the rank's end of its socket closes
        wait_until_gone(pid, "the killed rank's decoding worker")
    assert ours_in_dev_shm() == before


def wait_until_gone(pid: int, what: str) -> None:
    for _ in range(600):
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} {pid} is still running")


@pytest.mark.mpi
def test_a_sigkilled_rank_of_a_job_leaves_nothing_in_dev_shm(packed_sample, mpi_leaves_no_files):
    """MPICH's per-node file included: dimd unlinks it as soon as every rank of the node has it mapped."""
    from conftest import launcher

    job = subprocess.Popen([*launcher(2), *case_command(loader_as_a_library), str(packed_sample), "hold"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = [json.loads(job.stdout.readline()) for _ in range(2)]
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode != 0
    for rank in ranks:
        for pid in (rank["pid"], *rank["workers"]):
            wait_until_gone(pid, "a process of the killed job")


def test_a_borrowed_batch_is_the_slot_a_copied_batch_was_copied_from(store):
    with BatchLoader(store, batch_size=5, image_size=20, seed=4) as loader:
        copied = [images.clone() for images, _ in loader.epoch(0)]
        loader.seek(0)
        borrowed = [images.clone() for images, _ in loader.epoch(0, borrow=True)]
    assert all(torch.equal(a, b) for a, b in zip(copied, borrowed)) and len(copied) == len(borrowed)


def test_a_training_and_an_evaluation_loader_share_their_workers_from_two_threads(store):
    """A GPU's feeding thread runs the training loader while the rank evaluates with the same workers."""
    import threading

    with BatchLoader(store, batch_size=4, image_size=24, decode_workers=2, seed=3) as train, \
            BatchLoader(store, batch_size=6, image_size=24, decode_workers=2, train=False) as evaluation:
        alone = collect(train, 0), collect(evaluation, 0)
        train.seek(0)
        side: list = []
        thread = threading.Thread(target=lambda: side.extend(collect(train, 0)))
        thread.start()
        beside = collect(evaluation, 0)
        thread.join()
    for one, other in ((alone[0], side), (alone[1], beside)):
        assert len(one) == len(other)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, other))


def test_one_rank_takes_the_first_epoch_in_random_order_after_the_first_shuffle(packed_sample):
    """The placement of round 0 and the sampler of epoch 0 are different random streams: on one rank the
    sampler once undid the shuffle, and the first epoch's batches came in the pack's class order."""
    from mpi4py import MPI

    from dimd.shuffle.streams import CROPS, PLACEMENT, SAMPLER, stream

    store = DistributedStore.load(packed_sample, MPI.COMM_SELF)
    store.shuffle(seed=5, round=0)
    taken = store.global_index[np.concatenate(BatchLoader(store, batch_size=4, image_size=16, seed=5).epoch_indices(0))]
    assert not np.all(np.diff(taken) > 0)
    draws = [stream(purpose, 5, 0, 0).permutation(48) for purpose in (PLACEMENT, SAMPLER, CROPS)]
    assert not np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[1], draws[2])


def minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


#: What a crop does to the allocator: two ~400 KB arrays (a resize's intermediate and its output), freed.
CROP_ALLOCATIONS = """
import numpy as np, resource
def crop():
    a = np.ones(400_000, np.uint8); b = np.ones(400_000, np.uint8)
for _ in range(3):
    crop()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    crop()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_the_workers_allocator_keeps_a_crops_memory_instead_of_faulting_it_in_again():
    """glibc by default gives such arrays back to the kernel (a trimmed heap, or a mapping of their own)
    and faults them in page by page for the next crop: ~160 faults per crop. In a worker's environment
    they stay in its heap."""
    from dimd.shuffle.workers import WORKER_MALLOC

    def faults(env):
        run = subprocess.run([sys.executable, "-c", CROP_ALLOCATIONS], env=env, capture_output=True, text=True,
                             check=True)
        return int(run.stdout)

    plain = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    assert faults(plain) > 50 * 100
    assert faults({**plain, **WORKER_MALLOC}) < 50


def test_warm_workers_decode_without_page_faults(store):
    """Crops at 224 px: each image's arrays come from the worker's heap, not from fresh pages."""
    with BatchLoader(store, batch_size=8, image_size=224, decode_workers=2, seed=1) as loader:
        for epoch in range(2):   # warm: the heap has grown to what a batch needs
            for _ in loader.epoch(epoch):
                pass
        before = {pid: minor_faults(pid) for pid in loader.worker_pids}
        images = sum(len(labels) for _, labels in loader.epoch(2))
        faults = {pid: minor_faults(pid) - count for pid, count in before.items()}
    assert images >= 40
    assert all(count < images for count in faults.values()), faults
