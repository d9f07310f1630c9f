"""Copies of an image set in the archive forms people download: ImageNet's tars, WebDataset shards, Parquet.

Written with Python's tarfile (and pyarrow for Parquet) from a class tree or a
flat folder that ``dimd sample-data`` made, so ``dimd pack`` can be checked
against packing the files themselves: ``bench/probes/pack_archives.py`` times them,
``tests/test_pack_archives.py`` checks the records they give.

* :func:`write_nested_tar`: a tar of per-class tars, as ``ILSVRC2012_img_train.tar``;
* :func:`write_flat_tar`: one tar of images, as ``ILSVRC2012_img_val.tar``;
* :func:`write_webdataset`: shards of ``class/name.jpg`` + ``.cls`` (or ``.json``) samples;
* :func:`write_parquet`: files of ``image`` (the Hub's struct) and ``label`` rows, with or
  without the Hub's ``ClassLabel`` metadata.

Each keeps the tree's order (classes sorted, files sorted) unless asked to
shuffle, so its records match the tree's.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path
from typing import Iterator

#: tarfile's write modes for the compressions the tests use.
COMPRESSION_MODES = {"": "w", "gz": "w:gz", "bz2": "w:bz2", "xz": "w:xz"}


def tree_files(tree: Path) -> list[tuple[str, list[Path]]]:
    """(class, its image files) of a flat class tree, both sorted as the folder source sorts them."""
    return [(folder.name, sorted(p for p in folder.iterdir() if p.is_file()))
            for folder in sorted(p for p in tree.iterdir() if p.is_dir() and not p.name.startswith("."))]


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def _shuffled(items: list, seed: int | None) -> list:
    if seed is None:
        return items
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def write_nested_tar(tree: Path, out: Path, *, shuffle_seed: int | None = None, compression: str = "") -> Path:
    """A tar of ``CLASS.tar`` members, each a tar of that class's images (archive order shuffled on request)."""
    with tarfile.open(out, COMPRESSION_MODES[compression]) as outer:
        for name, files in _shuffled(tree_files(tree), shuffle_seed):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as tar:
                for path in _shuffled(files, shuffle_seed):
                    _add_bytes(tar, path.name, path.read_bytes())
            _add_bytes(outer, f"{name}.tar", inner.getvalue())
    return out


def write_flat_tar(folder: Path, names: list[str], out: Path, *, shuffle_seed: int | None = None,
                   compression: str = "") -> Path:
    """A tar of the files ``names`` (paths relative to ``folder``)."""
    with tarfile.open(out, COMPRESSION_MODES[compression]) as tar:
        for name in _shuffled(names, shuffle_seed):
            _add_bytes(tar, name, (folder / name).read_bytes())
    return out


def samples(tree: Path) -> Iterator[tuple[str, str, int, bytes]]:
    """(key, image extension, label, bytes) of every image, in the tree's order."""
    for label, (name, files) in enumerate(tree_files(tree)):
        for path in files:
            yield f"{name}/{path.stem}", path.suffix.lower().lstrip("."), label, path.read_bytes()


def write_webdataset(tree: Path, folder: Path, *, per_shard: int, label: str = "cls") -> list[Path]:
    """Shards ``train-000000.tar`` ... of ``per_shard`` samples: ``KEY.jpg`` and ``KEY.cls`` (or ``KEY.json``)."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[Path] = []
    tar = None
    for i, (key, extension, number, data) in enumerate(samples(tree)):
        if i % per_shard == 0:
            if tar is not None:
                tar.close()
            shards.append(folder / f"train-{len(shards):06d}.tar")
            tar = tarfile.open(shards[-1], "w")
        assert tar is not None
        extension = "jpg" if extension in ("jpeg", "jpg") else extension
        if label == "cls":
            _add_bytes(tar, f"{key}.cls", str(number).encode())
        else:
            _add_bytes(tar, f"{key}.json", json.dumps({"label": number, "source": "sample"}).encode())
        _add_bytes(tar, f"{key}.{extension}", data)
    if tar is not None:
        tar.close()
    return shards


def write_parquet(tree: Path, folder: Path, *, files: int, class_label: bool = True,
                  row_group_rows: int = 16) -> list[Path]:
    """``files`` Parquet files of ``image`` ({bytes, path}) and ``label`` (int64) rows, in the tree's order;
    ``class_label``: the Hub's ClassLabel metadata names the classes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = list(samples(tree))
    classes = [name for name, _ in tree_files(tree)]
    features = {"image": {"_type": "Image"},
                "label": {"names": classes, "_type": "ClassLabel"} if class_label else {"dtype": "int64",
                                                                                       "_type": "Value"}}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image_type), ("label", pa.int64())], metadata=metadata)
    per_file = -(-len(rows) // files)
    paths = []
    for n in range(files):
        part = rows[n * per_file:(n + 1) * per_file]
        table = pa.table({"image": pa.array([{"bytes": data, "path": f"{key}.{ext}"} for key, ext, _, data in part],
                                            image_type),
                          "label": pa.array([label for _, _, label, _ in part], pa.int64())}, schema=schema)
        paths.append(folder / f"train-{n:05d}-of-{files:05d}.parquet")
        pq.write_table(table, paths[-1], row_group_size=row_group_rows)
    return paths
