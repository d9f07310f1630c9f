"""The index is a contract, checked by every reader: missing or absurd values are one clear line.

Mechanism: :func:`dimd.format.read_index` checks attributes, datasets (present,
one-dimensional, declared dtype, ``count`` rows: before anything is
allocated), then the records over whole arrays (inside ``data_bytes``, in
order, not overlapping, labels inside ``classes``) and unique class names.
:class:`~dimd.format.PackedDataset` - and so inspect, verify, shuffle and
train - goes through it.
"""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from conftest import run_dimd, run_mpi_dimd
from hostile import jpeg, one_error_line

from dimd.errors import DimdError
from dimd.format import MAX_RECORDS, PackedDataset, PackedRecord, PackWriter, check_records


@pytest.fixture(scope="module")
def good_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "set"
    blobs = [jpeg((40, 30), (10 * i, 0, 0)) for i in range(3)]
    with PackWriter(out) as writer:
        for i, blob in enumerate(blobs):
            writer.add(PackedRecord(blob, i % 2, f"c{i % 2}/{i}.jpg", 30, 40))
        writer.commit(["c0", "c1"], short_side=30, quality=90, source="test")
    return out, [len(b) for b in blobs]


def damaged(good_set, tmp_path, change) -> tuple:
    """A copy of the good set with ``change(h5py_file, lengths)`` applied to its index."""
    out, lengths = good_set
    tmp_path.mkdir(parents=True, exist_ok=True)
    copy = tmp_path / "set"
    shutil.copy(f"{out}.dimd", f"{copy}.dimd")
    shutil.copy(f"{out}.idx.h5", f"{copy}.idx.h5")
    with h5py.File(f"{copy}.idx.h5", "r+") as f:
        change(f, lengths)
    return copy, f"{copy}.idx.h5"


def set_column(name, values, dtype=None):
    def change(f, lengths):
        data = np.array(values, dtype=dtype or f[name].dtype)
        del f[name]
        f.create_dataset(name, data=data)
    return change


def set_attr(name, value):
    def change(f, lengths):
        if value is None:
            del f.attrs[name]
        else:
            f.attrs[name] = value
    return change


def drop(name):
    def change(f, lengths):
        del f[name]
    return change


def past_the_end(f, lengths):
    offsets = f["offset"][...]
    offsets[2] += 5
    f["offset"][...] = offsets


def overlapping(f, lengths):
    f["offset"][1] = 3


TOTAL = "{total}"
CASES = {
    "label above classes": (set_column("label", [0, 99, 1]),
                            "record 1 has label 99, outside the 2 classes (0..1)"),
    "negative labels": (set_column("label", [-1, 0, -1]),
                        "record 0 has label -1, outside the 2 classes (0..1) (and 1 more record)"),
    "no name dataset": (drop("name"), "index lacks the 'name' dataset"),
    "no classes dataset": (drop("classes"), "index lacks the 'classes' dataset"),
    "short name dataset": (set_column("name", [b"a", b"b"], h5py.string_dtype()),
                           "dataset 'name' has 2 rows, the count attribute says 3"),
    "numbers for names": (set_column("name", [1, 2, 3], np.int64),
                          "dataset 'name' holds int64, not strings"),
    "count 10^12": (set_attr("count", 10**12), "dataset 'offset' has 3 rows, the count attribute says "
                                                "1000000000000"),
    "count 2^50": (set_attr("count", 2**50), f"attribute count is {2**50}, outside 0..{MAX_RECORDS}"),
    "count -1": (set_attr("count", -1), f"attribute count is -1, outside 0..{MAX_RECORDS}"),
    "count missing": (set_attr("count", None), "index lacks the attribute count"),
    "count a string": (set_attr("count", "three"), "attribute count is 'three', not an integer"),
    "data_bytes missing": (set_attr("data_bytes", None), "index lacks the attribute data_bytes"),
    "offsets as int32": (set_column("offset", [0, 1, 2], np.int32),
                         "dataset 'offset' holds int32, the format declares uint64"),
    "a 2-D column": (set_column("crc32", [[1], [2], [3]], np.uint32), "'crc32' is not a one-dimensional dataset"),
    "offset past the end": (past_the_end, "record 2 (bytes {start}..{end}) ends past the data_bytes "
                                          "{total} the index declares"),
    "overlapping records": (overlapping, "record 1 starts at byte 3, before record 0 ends (byte {first}): "
                                         "records overlap or are out of data-file order"),
    "duplicate class names": (set_column("classes", [b"c0", b"c0"], h5py.string_dtype()),
                              "class name 'c0' is used for labels 0 and 1"),
    "not a dimd index": (set_attr("format", "other"), "not a dimd index (format attribute is 'other')"),
}


def expected(message: str, lengths: list[int]) -> str:
    total = sum(lengths)
    return message.format(total=total, first=lengths[0], start=lengths[0] + lengths[1] + 5,
                          end=total + 5)


@pytest.mark.parametrize("case", list(CASES))
def test_every_reader_refuses_a_broken_index_in_one_line(good_set, tmp_path, case):
    change, message = CASES[case]
    copy, index = damaged(good_set, tmp_path, change)
    want = f"{index}: {expected(message, good_set[1])}"
    with pytest.raises(DimdError) as caught:
        PackedDataset(copy)
    assert str(caught.value) == want
    with pytest.raises(DimdError):
        PackedDataset(copy, check_size=False)  # verify's way of opening: the index is still checked


@pytest.mark.parametrize("case", ["label above classes", "negative labels", "no name dataset",
                                  "count 10^12", "offset past the end"])
def test_inspect_and_verify_name_the_problem(good_set, tmp_path, case):
    change, message = CASES[case]
    copy, index = damaged(good_set, tmp_path, change)
    want = f"{index}: {expected(message, good_set[1])}"
    assert one_error_line(run_dimd("inspect", copy)) == want
    assert one_error_line(run_dimd("verify", copy, "--workers", "2")) == want


@pytest.mark.mpi
def test_shuffle_verify_and_train_refuse_it_too(good_set, tmp_path):
    copy, index = damaged(good_set, tmp_path, drop("name"))
    proc = run_mpi_dimd(2, "shuffle", copy, "--verify", timeout=120)
    assert f"{index}: index lacks the 'name' dataset" in proc.stderr and "KeyError" not in proc.stderr
    assert proc.returncode != 0
    copy, index = damaged(good_set, tmp_path / "labels", set_column("label", [0, 99, 1]))
    proc = run_dimd("train", copy, "--val", copy, "--model", "lenet", "--image-size", "32", "--epochs", "1",
                    "--batch-size", "1", "--decode-workers", "1", "--threads", "1", timeout=180)
    assert one_error_line(proc) == f"{index}: record 1 has label 99, outside the 2 classes (0..1)"


def test_a_truncated_data_file_says_so_without_contradiction(good_set, tmp_path):
    copy, index = damaged(good_set, tmp_path, lambda f, lengths: None)
    total = sum(good_set[1])
    with open(f"{copy}.dimd", "r+b") as f:
        f.truncate(total - 7)
    assert one_error_line(run_dimd("inspect", copy)) == (
        f"{copy}.dimd: data file is {total - 7} bytes, the index expects {total} (truncated, or not the "
        f"pair of set.idx.h5)")
    proc = run_dimd("verify", copy)  # verify names the records the cut lost
    assert proc.returncode == 1 and "dimd: bad record 2 (c0/2.jpg): extends past the end" in proc.stderr


def test_the_record_checks_are_whole_array_operations():
    """A million records check in numpy: no Python loop over them (no timing asserted)."""
    n = 1_000_000
    rows = np.zeros(n, [("offset", "<u8"), ("length", "<u4"), ("label", "<i4")])
    rows["length"] = 10
    rows["offset"] = np.arange(n, dtype=np.uint64) * 10
    rows["label"] = np.arange(n) % 1000
    check_records(rows, 1000, 10 * n, "big")
    rows["label"][[17, 500_000]] = 1000
    with pytest.raises(DimdError, match=r"^big: record 17 has label 1000, outside the 1000 classes "
                                        r"\(0\.\.999\) \(and 1 more record\)$"):
        check_records(rows, 1000, 10 * n, "big")
