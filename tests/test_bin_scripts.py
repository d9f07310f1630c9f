"""The shell scripts in bin/ parse, and every dimd option they use exists."""

from __future__ import annotations

import re
import sys
import subprocess
from pathlib import Path

import click
import pytest

from dimd.cli import COMMANDS, main

BIN = Path(__file__).resolve().parents[1] / "bin"
SCRIPTS = sorted(p for p in BIN.rglob("*") if p.is_file())


def dimd_invocations(script: Path) -> list[tuple[str, list[str]]]:
    """(command, [--options]) for every `dimd CMD ...` line, continuations joined."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    calls = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in re.finditer(r"(?:\$DIMD|\bdimd) ([a-z][a-z-]*)([^;&|]*)", line):
            calls.append((match.group(1), re.findall(r"(?<!\S)(--[a-z][a-z-]*)", match.group(2))))
    return calls


def test_bin_has_the_pipeline_and_both_schedulers():
    names = {p.relative_to(BIN).as_posix() for p in SCRIPTS}
    assert {"pipeline.sh", "slurm/pack.sbatch", "slurm/train.sbatch",
            "lsf/pack.lsf", "lsf/train.lsf"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(BIN).as_posix())
def test_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(BIN).as_posix())
def test_script_uses_only_real_commands_and_options(script):
    calls = dimd_invocations(script)
    assert calls, f"{script} runs no dimd command"
    ctx = click.Context(main)
    for name, options in calls:
        assert name in COMMANDS, f"{script}: no command `dimd {name}`"
        command = main.get_command(ctx, name)
        known = {opt for param in command.params for opt in getattr(param, "opts", [])}
        known |= {opt for param in command.params for opt in getattr(param, "secondary_opts", [])}
        unknown = sorted(set(options) - known - {"--help"})
        assert not unknown, f"{script}: `dimd {name}` has no option {unknown}"


def test_pipeline_without_arguments_prints_its_usage():
    proc = subprocess.run(["bash", str(BIN / "pipeline.sh")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "usage: bin/pipeline.sh TRAIN_SRC VAL_SRC WORKDIR" in proc.stderr


def test_pipeline_checks_every_step_name_before_running_any(tmp_path):
    """A typo in STEPS is reported before the pack runs, not after it."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "STEPS": "pack trian"}
    proc = subprocess.run(["bash", str(BIN / "pipeline.sh"), str(tmp_path / "missing"), str(tmp_path / "missing"),
                           str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown step 'trian'" in proc.stderr
    assert "== pack" not in proc.stdout and not (tmp_path / "work" / "train.dimd").exists()


def test_train_job_run_outside_slurm_says_to_submit_it_with_sbatch(tmp_path):
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", str(BIN / "slurm" / "train.sbatch"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "submit it with sbatch" in proc.stderr and "unbound variable" not in proc.stderr
