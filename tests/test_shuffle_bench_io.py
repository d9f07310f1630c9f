"""dimd bench-io: the three measurements run on the same images and land in the JSON (no timings asserted)."""

import json

from conftest import run_dimd


def test_bench_io_measures_the_three_methods(packed_sample, sample_tree, tmp_path):
    report = tmp_path / "bench-io.json"
    proc = run_dimd("bench-io", packed_sample, "--tree", sample_tree, "--workers", 1, "--batch-size", 4,
                    "--images", 8, "--image-size", 32, "--repeats", 1, "--json", report, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "dimd / torch DataLoader" in proc.stdout
    doc = json.loads(report.read_text())
    figures = doc["result"]
    assert set(figures["methods"]) == {"dimd", "torch", "limit"}
    assert all(m["images"] == 8 and m["images_per_s"]["median"] > 0 and len(m["images_per_s"]["runs"]) == 1
               for m in figures["methods"].values())
    assert figures["ratios"]["dimd_over_torch"] > 0 and doc["parameters"]["workers"] == 1


def test_bench_io_needs_the_source_tree(packed_sample, tmp_path):
    proc = run_dimd("bench-io", packed_sample, "--tree", tmp_path, timeout=60)
    assert proc.returncode != 0 and "--tree must be the folder" in proc.stderr


def _baseline(sample_tree, seed):
    import numpy as np

    from dimd.shuffle.bench_io import FileDataset

    paths = sorted(p for p in sample_tree.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg"))[:4]
    return FileDataset(paths, np.zeros(len(paths), np.int64), image_size=16, seed=seed)


def test_the_file_baselines_augmentation_is_seeded_and_fresh_each_epoch(sample_tree):
    import torch
    from torch.utils.data import DataLoader

    def epochs(seed, workers):
        loader = DataLoader(_baseline(sample_tree, seed), batch_size=2, num_workers=workers,
                            persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))
        return [torch.cat([images for images, _ in loader]) for _ in range(2)]

    for workers in (0, 1):
        first, second = epochs(0, workers), epochs(0, workers)
        assert all(torch.equal(a, b) for a, b in zip(first, second))   # the same seed, the same crops
        assert not torch.equal(first[0], first[1])                      # a new epoch, new crops
        assert not torch.equal(first[0], epochs(1, workers)[0])          # another seed, other crops
