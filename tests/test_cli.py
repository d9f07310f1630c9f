"""The command line as a user meets it: help, version, errors without tracebacks.

Most run in this process through click's CliRunner; what only a real process
shows (the entry point, no traceback, no heavy imports) runs in one.
"""

import os

import pytest
from conftest import invoke_dimd, run_dimd

from dimd import __version__
from dimd.cli import COMMANDS


def test_help_lists_every_command_with_a_summary():
    proc = invoke_dimd("--help", check=True)
    for name in COMMANDS:
        assert name in proc.stdout


def test_version():
    assert __version__ in invoke_dimd("--version", check=True).stdout


def test_every_command_has_help():
    for name in COMMANDS:
        proc = invoke_dimd(name, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "Usage:" in proc.stdout


def test_user_error_is_one_line_without_traceback(tmp_path):
    proc = run_dimd("inspect", tmp_path / "nothing")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"dimd: error: {tmp_path / 'nothing'}.idx.h5: index file not found "
                                   "(is this a `dimd pack` output?)")


def test_a_value_the_config_refuses_is_a_usage_error_naming_the_flag(tmp_path):
    proc = run_dimd("sample-data", tmp_path / "x", "--classes", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "Error: Invalid value for '--classes': must be in [1, 80] (got 0)"
    assert not (tmp_path / "x").exists()


def test_usage_error_exit_code_is_2():
    assert invoke_dimd("no-such-command").returncode == 2


def test_under_a_launcher_the_first_task_reports_a_usage_error_and_the_others_leave_it_to_it():
    """Every task parsed the same line; a second one failing first could get the job ended unsaid."""
    bad = ("bench-allreduce", "--algorithms", "mpi,nope")
    first = run_dimd(*bad, env={**os.environ, "PMI_SIZE": "2", "PMI_RANK": "0"})
    assert first.returncode == 2 and "algorithm 'nope' is not one of" in first.stderr
    second = run_dimd(*bad, env={**os.environ, "PMI_SIZE": "2", "PMI_RANK": "1"})
    assert (second.returncode, second.stdout, second.stderr) == (0, "", "")


def test_dimd_help_does_not_import_heavy_modules():
    import subprocess
    import sys

    code = ("import sys; from dimd.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'mpi4py.MPI', 'PIL.Image', 'h5py') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "HEAVY []" in out


def test_quiet_drops_the_progress_lines_and_keeps_the_results(packed_sample, tmp_path):
    loud = run_dimd("verify", packed_sample, check=True)
    quiet = run_dimd("verify", packed_sample, "-q", check=True)
    assert "verify: " in loud.stderr and quiet.stderr == ""
    assert quiet.stdout.startswith("ok: 48 records")
    made = run_dimd("sample-data", tmp_path / "sample", "--classes", "2", "--per-class", "2", "--quiet", check=True)
    assert made.stderr == "" and made.stdout.startswith("wrote 4 images")


def test_an_exception_inside_a_message_is_one_line_without_the_path_named_already():
    from dimd.errors import describe

    assert describe(FileNotFoundError(2, "No such file or directory", "/data/x.jpg")) == "No such file or directory"
    assert describe(ValueError("bad header\nat byte 512\n")) == "bad header"
    assert describe(EOFError()) == "EOFError"



def test_a_late_progress_bar_counts_from_its_start_and_an_error_ends_it_without_its_last_line(capsys):
    from dimd.console import LateProgress

    with LateProgress() as bar:
        bar.advance(5)                      # before the total is known: not counted
        bar.start(3, "pack", unit="img", status=lambda: "1 archives")
        bar.advance(3)
    assert capsys.readouterr().err.startswith("pack: 3/3 img (100%), 1 archives, ")
    with pytest.raises(KeyboardInterrupt), LateProgress() as bar:
        bar.start(3, "pack", unit="img")
        bar.advance(1)
        raise KeyboardInterrupt
    assert capsys.readouterr().err == ""
