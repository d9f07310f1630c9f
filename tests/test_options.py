"""Options come from the config dataclasses: one default, one check, errors that name the flag."""

from __future__ import annotations

import dataclasses
import threading

import click
import pytest
from click.testing import CliRunner

from dimd.errors import ConfigError, DimdError
from dimd.options import (FINITE_FLOAT, FLOAT_LIST, INT_LIST, SIZE, SectionedCommand, build_config,
                          cli_message, config_option, field_default, option_group)
from dimd.pack.config import PackConfig
from dimd.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Example:
    name: str
    rate: float = 0.5
    count: int = 3
    limit: int | None = None
    fast: bool = False

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError("count", f"must be at least 1 (got {self.count})")


@click.command()
@config_option(Example, "rate")
@config_option(Example, "count", "--count", "-c")
@config_option(Example, "limit", help="A limit [default: none].")
@config_option(Example, "fast")
def example(**values):
    config = build_config(Example, name="x", **values)
    click.echo(f"{config.rate} {config.count} {config.limit} {config.fast}")


def test_defaults_come_from_the_dataclass():
    result = CliRunner().invoke(example, [])
    assert result.exit_code == 0 and result.output.strip() == "0.5 3 None False"
    help_text = CliRunner().invoke(example, ["--help"]).output
    assert "[default: 0.5]" in help_text and "[default: 3]" in help_text


def test_a_field_error_is_a_usage_error_naming_the_flag():
    result = CliRunner().invoke(example, ["-c", "0"])
    assert result.exit_code == 2
    assert "Invalid value for '--count': must be at least 1 (got 0)" in result.output


@dataclasses.dataclass(frozen=True)
class Inner:
    count: int = 3
    fast: bool = False

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError("count", f"must be at least 1 (got {self.count})")


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner = Inner()
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.verbose and self.inner.fast:
            raise ConfigError("fast", "cannot go with `verbose`")


@click.command(cls=SectionedCommand)
@config_option(Outer, "verbose")
@option_group("Inner (a config of its own)", config_option(Inner, "count", "--count", "-c"),
              config_option(Inner, "fast"))
@config_option(Outer, "name")
def grouped(**values):
    config = build_config(Outer, **values)
    click.echo(f"{config.name} {config.inner.count} {config.inner.fast} {config.verbose}")


def test_an_option_group_is_a_section_of_the_help_and_builds_the_nested_config():
    help_text = CliRunner().invoke(grouped, ["--help"]).output
    options, group = help_text.split("Inner (a config of its own):")
    assert all(flag in options for flag in ("--verbose", "--name", "--help")) and "--fast" not in options
    assert group.index("--count") < group.index("--fast") and "[default: 3]" in group, group
    result = CliRunner().invoke(grouped, ["--name", "a", "-c", "5"])
    assert result.exit_code == 0 and result.output.strip() == "a 5 False False"
    for args, flag in ((["-c", "0"], "--count"), (["--fast", "--verbose"], "--fast")):   # its checks, the outer's
        result = CliRunner().invoke(grouped, ["--name", "a", *args])
        assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.output, result.output


def test_non_finite_floats_are_refused_at_parse_time():
    for text in ("inf", "nan", "-inf"):
        result = CliRunner().invoke(example, ["--rate", text])
        assert result.exit_code == 2 and "is not a finite number" in result.output


def test_value_types():
    assert SIZE.convert("64K", None, None) == 65536
    assert INT_LIST.convert("1,2,4", None, None) == (1, 2, 4)
    assert FLOAT_LIST.convert("30,60.5", None, None) == (30.0, 60.5)
    assert FINITE_FLOAT.convert("1e-3", None, None) == 0.001
    for bad_type, text in ((SIZE, "1Q"), (INT_LIST, "1,x"), (FLOAT_LIST, "1,inf")):
        with pytest.raises(click.BadParameter):
            bad_type.convert(text, None, None)


def test_library_messages_name_fields_and_the_cli_names_flags():
    @config_option(PackConfig, "force")
    @config_option(PackConfig, "list_file", "--list")
    def pack_like(**values):
        pass

    text = "out.dimd: output exists (set `force` to overwrite it); see `list_file` and `other`"
    assert cli_message(text, pack_like) == (
        "out.dimd: output exists (set --force to overwrite it); see --list and `other`")


def test_a_line_the_library_prints_itself_names_the_running_commands_flags():
    """dimd.stall's line from the watchdog's thread, where no click context is: the flags the command passed in."""
    from dimd.stall import STALL_HINT
    from dimd.wording import flags_named, name_settings

    assert name_settings(STALL_HINT).startswith("`stall_timeout` sets how long")   # a library caller's field
    with flags_named({"stall_timeout": "--stall-timeout"}):
        seen = []
        thread = threading.Thread(target=lambda: seen.append(name_settings(STALL_HINT)))
        thread.start()
        thread.join()
    assert seen == ["--stall-timeout sets how long a rank waits for the others; 0 waits forever"]
    assert name_settings(STALL_HINT) == STALL_HINT   # the command ended


def test_configs_refuse_nonsense_from_python_too():
    with pytest.raises(ConfigError, match="lr must be positive"):
        TrainConfig(train="t", val="v", lr=-1.0)
    with pytest.raises(ConfigError, match="threads must be at least 1"):
        TrainConfig(train="t", val="v", threads=-1)
    with pytest.raises(ConfigError, match="warmup_epochs must be a finite number"):
        TrainConfig(train="t", val="v", warmup_epochs=float("inf"))
    with pytest.raises(ConfigError, match="files_root is where `read_from` files or files-cold finds"):
        TrainConfig(train="t", val="v", files_root="images")   # read from memory: the folder would go unread
    with pytest.raises(ConfigError, match="quality must be in"):
        PackConfig(src="a", out="b", quality=0)
    assert isinstance(ConfigError("x", "y"), DimdError)
    assert field_default(TrainConfig, "batch_size") == 64


def test_train_refuses_non_finite_and_nonsense_options_before_any_work(packed_sample):
    from conftest import run_dimd

    for option, value, flag in (("--lr", "inf", "--lr"), ("--threads", "-1", "--threads"),
                                ("--momentum", "nan", "--momentum"), ("--warmup-epochs", "inf", "--warmup-epochs")):
        proc = run_dimd("train", packed_sample, "--val", packed_sample, option, value, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert f"Invalid value for '{flag}'" in proc.stderr and "Traceback" not in proc.stderr
