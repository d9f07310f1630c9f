"""After training: `dimd eval` scores a checkpoint as the run did, `dimd export` writes it for torchvision and
TorchScript, `dimd predict` classifies image files with the export, and `--tensorboard` recorded the run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from conftest import invoke_dimd, pack_tree_as_is, run_mpi_dimd

EPOCHS = 3
#: Every test reads the module's training run, which starts MPI ranks.
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def trained(colour_set, tmp_path_factory) -> Path:
    """resnet18 (torchvision's layout) trained for three epochs on 2 ranks, at 16 px: its last checkpoint,
    its metrics and its TensorBoard files, in one folder."""
    out = tmp_path_factory.mktemp("trained")
    run_mpi_dimd(2, "train", colour_set, "--val", colour_set, "--model", "resnet18", "--image-size", "16",
                 "--epochs", str(EPOCHS), "--batch-size", "8", "--lr", "0.05", "--no-lr-scaling",
                 "--schedule", "constant", "--decode-workers", "1", "--threads", "1", "--allreduce", "ring",
                 "--checkpoint-dir", out / "checkpoints", "--keep-checkpoints", "1", "--metrics",
                 out / "metrics.jsonl", "--tensorboard", out / "tensorboard", "--tensorboard-every", "2", "-q",
                 timeout=180, check=True)
    return out


def last_checkpoint(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("checkpoint-*.pt"))[-1]


def logged_epoch(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


def test_eval_on_the_runs_ranks_gives_the_logged_figures_to_the_image(trained, colour_set, tmp_path):
    run_mpi_dimd(2, "eval", last_checkpoint(trained), colour_set, "--threads", "1", "--decode-workers", "1",
                 "--json", tmp_path / "eval.json", timeout=120, check=True)
    result = json.loads((tmp_path / "eval.json").read_text())["result"]
    logged = logged_epoch(trained)
    assert result["epoch"] == logged["epoch"] == EPOCHS and result["samples"] == 48
    assert round(result["top1"] * 48) == round(logged["val_top1"] * 48)
    assert round(result["top5"] * 48) == round(logged["val_top5"] * 48)
    assert result["loss"] == pytest.approx(logged["val_loss"], rel=1e-6)
    assert result["logged"]["val_top1"] == logged["val_top1"]


def test_eval_on_one_rank_scores_rank_0s_model_with_each_class_apart(trained, colour_set, tmp_path):
    proc = invoke_dimd("eval", last_checkpoint(trained), colour_set, "--threads", "1", "--decode-workers", "1",
                       "--per-class", "--json", tmp_path / "eval.json", check=True)
    result = json.loads((tmp_path / "eval.json").read_text())["result"]
    rows = result["per_class"]
    assert [row["class"] for row in rows] == ["red", "green", "blue", "grey"]
    assert [row["samples"] for row in rows] == [12] * 4
    assert sum(row["top1"] * row["samples"] for row in rows) == pytest.approx(result["top1"] * 48)
    assert result["world_size"] == 1 and "the run logged for epoch 3" in proc.stdout


def test_eval_with_flip_averages_each_image_with_its_mirror(trained, colour_set, tmp_path):
    invoke_dimd("eval", last_checkpoint(trained), colour_set, "--tta", "flip", "--threads", "1",
                "--decode-workers", "1", "--json", tmp_path / "flip.json", check=True)
    invoke_dimd("eval", last_checkpoint(trained), colour_set, "--threads", "1",
                "--decode-workers", "1", "--json", tmp_path / "plain.json", check=True)
    flip, plain = (json.loads((tmp_path / f"{name}.json").read_text())["result"] for name in ("flip", "plain"))
    assert flip["tta"] == "flip" and flip["samples"] == plain["samples"] == 48
    assert flip["loss"] != plain["loss"]   # the mirror images' logits count too


def test_eval_and_export_refuse_a_file_that_is_no_dimd_checkpoint_in_one_line(trained, colour_set, tmp_path):
    for proc in (invoke_dimd("eval", trained / "metrics.jsonl", colour_set),
                 invoke_dimd("export", trained / "metrics.jsonl", "-o", tmp_path / "model")):
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [f"dimd: error: {trained / 'metrics.jsonl'}: not a readable dimd "
                                                    "checkpoint (not the zip archive torch.save writes: truncated, "
                                                    "overwritten or another kind of file)"]
    assert not (tmp_path / "model").exists()


def test_eval_refuses_a_validation_set_of_other_classes_before_loading_it(trained, sample_tree, tmp_path):
    other = pack_tree_as_is(sample_tree, tmp_path / "shapes")
    proc = invoke_dimd("eval", last_checkpoint(trained), other)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "4 of its 4 classes are not classes of" in proc.stderr and str(other) in proc.stderr


# -- dimd export -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "model"
    invoke_dimd("export", last_checkpoint(trained), "-o", out, "--torchvision", "--onnx", check=True)
    return out


def test_torchvision_loads_the_exported_resnet18_strictly_and_gives_dimds_logits(trained, exported):
    import torch

    from dimd.train.checkpoint_eval import read_trained_model
    from torchvision_reference import pil_is_pillow_simd, torchvision_resnet

    reference = torchvision_resnet("resnet18")(num_classes=4).eval()
    state = torch.load(exported / "model.pt", weights_only=True)
    reference.load_state_dict(state, strict=True)
    ours = read_trained_model(last_checkpoint(trained)).build()
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(reference(images), ours(images), atol=1e-5)
        with warnings.catch_warnings():   # torch deprecates TorchScript
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.load(str(exported / "model.ts"))
        assert torch.allclose(scripted(images), ours(images), atol=1e-5)
    assert pil_is_pillow_simd()


def test_the_export_says_how_to_feed_the_model_and_what_it_scored(trained, exported):
    import onnx

    meta = json.loads((exported / "meta.json").read_text())
    logged = logged_epoch(trained)
    assert meta["classes"] == ["red", "green", "blue", "grey"] and meta["torchvision"] == "resnet18"
    assert (meta["input_size"], meta["resize_shorter_side"], meta["centre_crop"]) == (16, 18, 16)
    assert meta["normalize"]["mean"] == pytest.approx([0.485, 0.456, 0.406])
    assert meta["epoch"] == EPOCHS and meta["val_top1"] == logged["val_top1"] and meta["dimd_version"]
    assert sorted(p.name for p in exported.parent.iterdir()) == ["model"]   # no temporary left beside it
    onnx.checker.check_model(onnx.load(str(exported / "model.onnx")))


def rewritten(trained: Path, path: Path, change) -> Path:
    """The run's last checkpoint with ``change`` applied to its document, saved at ``path``."""
    import torch

    torch.save(change(torch.load(last_checkpoint(trained), weights_only=True)), path)
    return path


def old_name(key):
    if isinstance(key, str) and key.startswith(("conv1.", "bn1.")):
        return ("stem.0." if key.startswith("conv1.") else "stem.1.") + key.split(".", 1)[1]
    return key


def old_names(value):
    """Checkpoint version 5's names of the ImageNet ResNets' stem, in any state dict of ``value``."""
    if isinstance(value, dict):
        return {old_name(k): old_names(v) for k, v in value.items()}
    return [old_names(v) for v in value] if isinstance(value, list) else value


def version_5(document):
    """A checkpoint as version 5 wrote it: the ResNet stem's old names, S-SGD's settings not yet a section."""
    old = {**old_names(document), "version": 5}
    config = dict(old["config"])
    old["config"] = {**{k: v for k, v in config.items() if k != "ssgd"}, **config["ssgd"]}
    return old


def test_a_checkpoint_of_the_old_resnet_names_is_read_through_the_renaming(trained, colour_set, tmp_path):
    """Version 5 named the ResNet stem ``stem.0``/``stem.1`` and kept S-SGD's settings at the config's top
    level: such a checkpoint evaluates and exports as before."""
    import torch

    from dimd.train.checkpoint import load_checkpoint

    old = rewritten(trained, tmp_path / "old.pt", version_5)
    stored = torch.load(old, weights_only=True)
    assert "stem.0.weight" in stored["model"] and "nesterov" in stored["config"]
    assert load_checkpoint(old)["config"]["ssgd"]["nesterov"] is False   # moved into its section on reading
    for name, path in (("old", old), ("new", last_checkpoint(trained))):
        invoke_dimd("eval", path, colour_set, "--threads", "1", "--decode-workers", "1",
                    "--json", tmp_path / f"{name}.json", check=True)
    new, renamed = (json.loads((tmp_path / f"{name}.json").read_text())["result"] for name in ("new", "old"))
    assert (renamed["top1"], renamed["loss"]) == (new["top1"], new["loss"])
    invoke_dimd("export", old, "-o", tmp_path / "model", "--torchvision", check=True)
    assert "conv1.weight" in torch.load(tmp_path / "model" / "model.pt", weights_only=True)


def test_export_refuses_a_folder_that_exists_without_force_and_replaces_it_with(trained, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = invoke_dimd("export", last_checkpoint(trained), "-o", out)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"dimd: error: {out}: exists (set --force to replace it)"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    invoke_dimd("export", last_checkpoint(trained), "-o", out, "--force", check=True)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "model.pt", "model.ts"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_refuses_torchvision_names_for_a_model_torchvision_has_not(trained, tmp_path):
    from dimd.train.models import build_model

    resnet20 = rewritten(trained, tmp_path / "resnet20.pt", lambda document: {
        **document, "model_name": "resnet20", "model": build_model("resnet20", 4).state_dict()})
    proc = invoke_dimd("export", resnet20, "-o", tmp_path / "model", "--torchvision")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"dimd: error: {resnet20}: model 'resnet20' has no torchvision counterpart whose names its state dict "
        "could take; --torchvision names are for resnet18, resnet50"]
    invoke_dimd("export", resnet20, "-o", tmp_path / "model", check=True)   # with dimd's own names
    assert not (tmp_path / "model" / "meta.json").read_text().count('"torchvision": "')


def test_a_checkpoint_whose_weights_are_not_its_models_is_refused_by_eval_and_export(trained, colour_set, tmp_path):
    three = rewritten(trained, tmp_path / "three.pt",
                      lambda document: {**document, "classes": ["red", "green", "blue"]})
    for proc in (invoke_dimd("eval", three, colour_set), invoke_dimd("export", three, "-o", tmp_path / "model")):
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        assert f"{three}: does not fit model 'resnet18' with 3 classes (" in proc.stderr
    assert not (tmp_path / "model").exists()


def test_export_without_the_onnx_package_refuses_onnx_in_one_line(trained, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else find_spec(name, *a))
    proc = invoke_dimd("export", last_checkpoint(trained), "-o", tmp_path / "model", "--onnx")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "dimd: error: --onnx needs the onnx package: pip install 'dimd[onnx]'"]
    assert not (tmp_path / "model").exists()


# -- dimd predict -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image_files(colour_set, tmp_path_factory) -> tuple[list[Path], list[str]]:
    """The colour set's 48 records as the JPEG files they were packed from, and each one's class."""
    from dimd.format import PackedDataset

    folder = tmp_path_factory.mktemp("images")
    packed = PackedDataset(colour_set)
    paths, labels = [], []
    for i in range(len(packed)):
        path = folder / packed.name(i).replace("/", "-")
        path.write_bytes(bytes(packed.record(i)))
        paths.append(path)
        labels.append(packed.classes[packed.label(i)])
    return paths, labels


def test_predict_gives_each_image_the_probabilities_of_evals_batches(trained, exported, colour_set, image_files,
                                                                     world, tmp_path):
    """The files hold the packed records' bytes: predict's probabilities are those of the model on the batches
    evaluation's loader makes of the records (the same crop, resize and normalisation), image for image."""
    import torch

    from dimd.shuffle import Normalize, open_loader
    from dimd.train.checkpoint_eval import read_trained_model

    paths, labels = image_files
    invoke_dimd("predict", exported, *paths, "--json", tmp_path / "predict.json", check=True)
    predictions = json.loads((tmp_path / "predict.json").read_text())["predictions"]
    assert [p["image"] for p in predictions] == list(map(str, paths))
    predicted = torch.tensor([[{row["class"]: row["probability"] for row in p["top"]}[name]
                               for name in ("red", "green", "blue", "grey")] for p in predictions])
    loader = open_loader(str(colour_set), world, 16, image_size=16, train=False, decode_workers=1)
    model, normalize = read_trained_model(last_checkpoint(trained)).build(), Normalize(torch.device("cpu"))
    try:
        with torch.no_grad():
            evaluated = torch.cat([torch.softmax(model(normalize(images)), dim=1) for images, _ in loader.epoch(0)])
    finally:
        loader.close()
    assert torch.allclose(predicted, evaluated, atol=1e-6)
    assert [p["top"][0]["class"] for p in predictions] == [["red", "green", "blue", "grey"][i]
                                                           for i in evaluated.argmax(dim=1).tolist()]


def test_predict_takes_a_png_of_any_size_and_goes_on_past_an_image_it_cannot_decode(exported, image_files, tmp_path):
    from PIL import Image

    paths, labels = image_files
    with Image.open(paths[0]) as image:
        image.convert("RGBA").resize((40, 24)).save(tmp_path / "wide.png")
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not a JPEG")
    proc = invoke_dimd("predict", exported, tmp_path / "wide.png", tmp_path / "broken.jpg", paths[1], "--top", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"dimd: error: {tmp_path / 'broken.jpg'}: not a decodable image "
                                                "(no image format recognised)"]
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [str(tmp_path / "wide.png"), str(paths[1])]
    assert all(line.count("%") == 2 for line in lines)


def test_predict_refuses_a_folder_that_is_no_export_in_one_line(tmp_path, image_files):
    proc = invoke_dimd("predict", tmp_path, image_files[0][0])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"dimd: error: {tmp_path / 'meta.json'}: not found (is {tmp_path} a `dimd export` folder?)"]


# -- dimd train --tensorboard ------------------------------------------------------------------------


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of ``folder``, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_the_steps_figures_and_each_epochs_validation(trained):
    found = scalars(trained / "tensorboard")
    epochs = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [step for step, _ in found["val/top1"]] == [3, 6, 9]   # 3 steps per epoch
    assert [value for _, value in found["val/top1"]] == pytest.approx([e["val_top1"] for e in epochs])
    assert [value for _, value in found["val/loss"]] == pytest.approx([e["val_loss"] for e in epochs], rel=1e-6)
    assert [step for step, _ in found["train/loss"]] == [2, 4, 6, 8]   # --tensorboard-every 2
    assert all(0 <= value <= 1 for _, value in found["train/top1"])
    assert [value for _, value in found["train/lr"]] == pytest.approx([0.05] * 4)
    assert {"step_time/data", "step_time/compute", "step_time/allreduce", "step_time/optimizer"} <= set(found)
    assert "step_time/sync" not in found and not any(tag.startswith("sma/") for tag in found)   # S-SGD
    assert all(value > 0 for _, value in found["train/images_per_s"])


def test_tensorboard_has_smas_learners_and_synchronisations(tmp_path):
    from dimd.train.results import EpochMetrics
    from dimd.train.board import TrainingBoard

    board = TrainingBoard(tmp_path, every=1)
    board.epoch(EpochMetrics(epoch=1, step=12, lr=0.1, train_loss=1.0, train_top1=0.5, val_loss=0.9, val_top1=0.6,
                             val_top5=1.0, images=96, images_per_s=50.0, seconds=2.0, train_seconds=1.9,
                             eval_seconds=0.1, shuffle_seconds=0.0, time_split={}, sync="sma", learners_per_rank=3,
                             alpha=1 / 6, synchronisations=12))
    board.close()
    found = scalars(tmp_path)
    assert found["sma/learners_per_rank"] == [(12, 3.0)] and found["sma/synchronisations"] == [(12, 12.0)]
    assert found["sma/alpha"][0][1] == pytest.approx(1 / 6)
