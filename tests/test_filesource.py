"""--read-from files: the same records, read from the original image files on each access."""

from pathlib import Path

import numpy as np
import pytest

from dimd.errors import DimdError
from dimd.format import PackedDataset
from dimd.shuffle.filesource import OriginalFiles


class LocalShare:
    """What OriginalFiles needs of a DistributedStore: the path and the local records' global index."""

    def __init__(self, path, global_index):
        self.path, self.global_index = path, np.asarray(global_index, np.int64)
        self.labels = PackedDataset(path).labels[self.global_index]

    def __len__(self):
        return len(self.global_index)


def test_records_come_from_the_original_files(packed_sample):
    packed = PackedDataset(packed_sample)
    share = LocalShare(packed.data_path, [40, 3, 17])
    files = OriginalFiles(share)
    assert len(files) == 3 and list(files.labels) == list(share.labels)   # the rest is the store's
    for i, g in enumerate(share.global_index):
        assert files.record(i) == bytes(packed.record(int(g)))   # packed as-is: the files' own bytes


def test_a_wrong_root_is_a_clear_error(packed_sample, tmp_path):
    share = LocalShare(PackedDataset(packed_sample).data_path, [0])
    with pytest.raises(DimdError, match="original file not found.*`files_root`"):
        OriginalFiles(share, tmp_path)


def test_files_cold_drops_each_files_cached_pages_before_reading_it(packed_sample, monkeypatch):
    import os

    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: dropped.append(advice),
                        raising=False)
    packed = PackedDataset(packed_sample)
    files = OriginalFiles(LocalShare(packed.data_path, [5, 9]), cold=True)
    assert files.record(0) == bytes(packed.record(5)) and files.record(1) == bytes(packed.record(9))
    assert dropped == [os.POSIX_FADV_DONTNEED] * 2   # one eviction per read, the same bytes


def test_a_file_gone_mid_run_is_named_once_with_the_reason(packed_sample, sample_tree, world, tmp_path):
    import shutil

    from dimd.shuffle import BatchLoader, DistributedStore

    root = tmp_path / "train"
    shutil.copytree(sample_tree, root)
    store = DistributedStore.load(packed_sample, world)
    files = OriginalFiles(store, root)
    gone = files.record_paths([5])[0]
    Path(gone).unlink()
    with BatchLoader(files, batch_size=8, image_size=24, train=False, decode_workers=1) as loader:
        with pytest.raises(DimdError) as error:
            list(loader.epoch(0))
    assert str(error.value) == f"{gone}: No such file or directory"
