"""A class tree on a file system whose listing gives every file one inode number (sshfs, FUSE without
``use_ino``): each file is still packed, once; only files ``stat`` calls the same are packed once."""

from __future__ import annotations

import os

from hostile import small_tree

from dimd.pack.sources import open_source


class ListedWithoutInode:
    """A directory entry as sshfs lists it: the entry's inode number is the same for every file."""

    def __init__(self, entry: os.DirEntry) -> None:
        self._entry = entry

    def __getattr__(self, name: str):
        return getattr(self._entry, name)

    def inode(self) -> int:
        return 0xFFFFFFFF


def test_files_that_share_a_listed_inode_number_are_told_apart_by_stat(tmp_path, monkeypatch):
    root = small_tree(tmp_path / "tree", {"a": 3, "b": 2})
    os.link(root / "a" / "0.jpg", root / "b" / "also-a0.jpg")
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: [ListedWithoutInode(e) for e in scandir(path)])
    source = open_source(root)
    assert [name for name, _ in source.files] == ["a/0.jpg", "a/1.jpg", "a/2.jpg", "b/0.jpg", "b/1.jpg"]
    assert source.rejected == [("b/also-a0.jpg", "the same file as a/0.jpg (a symlink or hard link); packed once, "
                                                 "as a/0.jpg")]
