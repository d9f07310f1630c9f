"""dimd bench-io: the three measurements run on the same images and land in the JSON (no timings asserted)."""

import json

from conftest import invoke_dimd, run_dimd


def test_bench_io_measures_the_three_methods(packed_sample, sample_tree, tmp_path):
    report = tmp_path / "bench-io.json"
    proc = run_dimd("bench-io", packed_sample, "--tree", sample_tree, "--workers", 1, "--batch-size", 4,
                    "--images", 8, "--image-size", 32, "--repeats", 1, "--json", report, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "dimd / torch DataLoader" in proc.stdout
    doc = json.loads(report.read_text())
    figures = doc["result"]
    assert set(figures["methods"]) == {"dimd", "torch", "limit"}
    assert all(m["images"] == 8 and m["images_per_s_median"] > 0 for m in figures["methods"].values())
    assert figures["ratios"]["dimd_over_torch"] > 0 and doc["parameters"]["workers"] == 1


def test_bench_io_needs_the_source_tree(packed_sample, tmp_path):
    proc = invoke_dimd("bench-io", packed_sample, "--tree", tmp_path)
    assert proc.returncode != 0 and "--tree must be the folder" in proc.stderr
