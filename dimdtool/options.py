"""Shared click options: each option, choice and default declared once.

The library's frozen config dataclasses hold the only defaults and validate
themselves (``__post_init__`` raises :class:`~dimd.errors.ConfigError`
naming the field). This module builds click options from those fields
(:func:`config_option`), so ``--help`` shows the dataclass's default, and
:func:`build_config` turns a field's error back into a usage error naming the
flag. Options every measuring command shares (``--json``) and the value
types the commands parse (sizes, number lists) live here too, as in
sqlite-utils' shared options.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

import click

from dimd.errors import ConfigError, DimdError
from dimd.wording import name_settings

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")

#: Registry attribute on a command callback: field name -> the flag that sets it.
_FLAGS_ATTR = "__dimd_option_flags__"


# ---------------------------------------------------------------------------- value types
class SizeType(click.ParamType):
    """A byte count such as ``8``, ``64K``, ``1.5M`` or ``2GiB`` (binary units)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from dimd.units import parse_size

        try:
            return parse_size(value)
        except DimdError as exc:
            self.fail(str(exc), param, ctx)


class NumberListType(click.ParamType):
    """Comma-separated numbers (``1,2,4,8``) as a tuple of ``kind``."""

    def __init__(self, kind: type = int) -> None:
        self.kind = kind
        self.name = f"{kind.__name__}[,{kind.__name__}...]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple:
        if isinstance(value, tuple):
            return value
        try:
            numbers = tuple(self.kind(v) for v in str(value).split(",") if v.strip())
        except ValueError:
            self.fail(f"expected comma-separated {self.kind.__name__} values like 1,2,4, got {value!r}",
                      param, ctx)
        if not numbers:
            self.fail("expected at least one value", param, ctx)
        if self.kind is float and not all(math.isfinite(v) for v in numbers):
            self.fail(f"values must be finite, got {value!r}", param, ctx)
        return numbers


class FiniteFloat(click.ParamType):
    """A float that is not ``inf`` or ``nan`` (click's FLOAT accepts both)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class OutputPath(click.ParamType):
    """A location a command will write: checked before the command's work starts.

    ``kind`` "file": the folder must exist and be writable, the path must not
    be a folder (``--json nodir/x.json`` fails at once, in one line).
    ``kind`` "folder": created with its parents if missing (``mkdir -p``);
    the nearest existing ancestor must be a writable folder.

    The check (:func:`output_problems`) runs as the value is parsed, except
    in commands run under MPI (:func:`dimd.commands.mpi_job.mpi_command`),
    where rank 0 checks every such option once MPI is up and all ranks agree,
    so a job fails with one line, not one per rank.
    """

    def __init__(self, kind: str = "file") -> None:
        self.kind = kind
        self.name = "path" if kind == "file" else "folder"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        path = value if isinstance(value, Path) else Path(value)
        if ctx is not None and not defers_output_checks(ctx) and not ctx.resilient_parsing:
            problem = output_problem_for(path, self, param)
            if problem:
                raise DimdError(problem)
        return path


def output_problem_for(path: Path, kind: "OutputPath", param: click.Parameter | None) -> str | None:
    from dimd.fsutil import output_problem

    flag = _flag_of(param)
    return output_problem(path, kind="folder" if kind.kind == "folder" else "file",
                          create=kind.kind == "folder", what=flag)


def _flag_of(param: click.Parameter | None) -> str:
    if param is None:
        return ""
    if isinstance(param, click.Argument):
        return (param.human_readable_name or "").upper()
    longs = [o for o in param.opts if o.startswith("--")]
    return (longs or list(param.opts) or [param.name or ""])[0]


#: Attribute an MPI command's callback carries: its output options are checked on rank 0, collectively.
DEFERS_OUTPUT_CHECKS = "__dimd_defers_output_checks__"


def defer_output_checks(callback: F) -> F:
    """Mark a command whose callback starts MPI itself: its output options are checked there, on rank 0.

    :func:`dimd.commands.mpi_job.mpi_command` marks the commands it wraps; a
    command that calls ``mpi_command`` inside (``train``) says so with this.
    """
    setattr(callback, DEFERS_OUTPUT_CHECKS, True)
    return callback


def defers_output_checks(ctx: click.Context) -> bool:
    callback = ctx.command.callback if ctx.command is not None else None
    return bool(getattr(callback, DEFERS_OUTPUT_CHECKS, False))


def output_problems(ctx: click.Context | None = None) -> str | None:
    """The first problem with the output locations the running command was given, or None.

    Every parameter whose type is an :class:`OutputPath` and that has a value
    is checked, whatever the command: wiring an option with ``OUTPUT_FILE``
    or ``OUTPUT_DIR`` is all a command does.
    """
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None or ctx.command is None:
        return None
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if isinstance(param.type, OutputPath) and value is not None:
            problem = output_problem_for(Path(value), param.type, param)
            if problem:
                return problem
    return None


class RegistryChoice(click.Choice):
    """A choice among a library registry's names, loaded on first use.

    ``registry`` names it as ``"module:NAME"`` (``"dimd.train.models:MODELS"``);
    it is imported when a value is converted, so ``dimd --help`` never imports
    torch for the model zoo, nor a command's ``--help`` the allreduce package.
    The metavar stays short; the help says where the list is.
    """

    def __init__(self, registry: str, metavar: str = "NAME") -> None:
        self._registry = registry
        self._names: tuple[str, ...] | None = None
        self._metavar = metavar
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]  # click.Choice's is a plain attribute
        if self._names is None:
            import importlib

            module, name = self._registry.split(":")
            self._names = tuple(getattr(importlib.import_module(module), name))
        return self._names

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self._metavar


class NameListType(click.ParamType):
    """Comma-separated names; ``all`` expands to every name of the registry ``load`` returns.

    A name outside it is a usage error while the command line is parsed, so
    under mpirun it is refused before MPI starts, once; the message lists the
    names there are.
    """

    name = "names"

    def __init__(self, load: Callable[[], Any], what: str = "name") -> None:
        self._load = load
        self._what = what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple:
        if isinstance(value, tuple):
            return value
        known = tuple(self._load())
        if str(value).strip() == "all":
            return known
        names = tuple(v.strip() for v in str(value).split(",") if v.strip())
        unknown = [n for n in names if n not in known]
        if unknown:
            self.fail(f"{self._what} {unknown[0]!r} is not one of {', '.join(known)}, or all", param, ctx)
        return names


SIZE = SizeType()
INT_LIST = NumberListType(int)
FLOAT_LIST = NumberListType(float)
FINITE_FLOAT = FiniteFloat()
#: An output file (``--json``, ``--skipped``, ``--metrics``): its folder must exist and be writable.
OUTPUT_FILE = OutputPath("file")
#: An output folder (``--save-order``, ``--checkpoint-dir``): created if missing, must be writable.
OUTPUT_DIR = OutputPath("folder")
#: ``--allreduce`` of the commands that train: a name of dimd.allreduce's registry, imported on first use.
ALLREDUCE_ALGORITHM = RegistryChoice("dimd.allreduce:ALGORITHMS", "ALGORITHM")


# ---------------------------------------------------------------------------- options from config fields
def config_field(config_cls: type, name: str) -> dataclasses.Field:
    for f in dataclasses.fields(config_cls):
        if f.name == name:
            return f
    raise TypeError(f"{config_cls.__name__} has no field {name!r}")  # a programming error


def field_default(config_cls: type, name: str) -> Any:
    f = config_field(config_cls, name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _click_type(config_cls: type, name: str) -> Any:
    """The click type for a field's annotation (``X | None`` counts as ``X``): int, finite float, str, bool."""
    hint = typing.get_type_hints(config_cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = members[0] if len(members) == 1 else str
    return {bool: bool, int: int, float: FINITE_FLOAT}.get(hint, str)


def config_option(config_cls: type, name: str, *param_decls: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option for field ``name`` of ``config_cls``, its default taken from the dataclass.

    ``param_decls`` defaults to ``--field-name``. A boolean field becomes a
    flag (``--x/--no-x`` can be given explicitly). A field whose default is
    None ("automatic") shows no default: its help says what happens.
    """
    flag = next((d for d in param_decls if d.startswith("--")), "--" + name.replace("_", "-"))
    decls = param_decls or (flag,)
    default = field_default(config_cls, name)
    kwargs.setdefault("type", _click_type(config_cls, name))
    if kwargs["type"] is bool and not any("/" in d for d in decls):
        kwargs.pop("type")
        kwargs.setdefault("is_flag", True)
    kwargs.setdefault("default", default)
    kwargs.setdefault("show_default", default is not None and default is not False)
    option = click.option(*decls, name, **kwargs)

    def decorate(callback: F) -> F:
        flags = getattr(callback, _FLAGS_ATTR, None)
        if flags is None:
            flags = {}
            setattr(callback, _FLAGS_ATTR, flags)
        flags[name] = flag
        return option(callback)

    return decorate


def build_config(config_cls: type[C], callback: Callable[..., Any] | None = None, **values: Any) -> C:
    """``config_cls(**values)``; a :class:`ConfigError` becomes a usage error naming the flag.

    A field whose type is itself a config dataclass (``TrainConfig.sma``) and
    that ``values`` leaves out is built from the values named after its fields,
    so a command passes every option alike, whichever config declares it.
    ``callback`` is the command function whose :func:`config_option` flags
    name the fields (default: the running click command's).
    """
    try:
        return config_cls(**nest_values(config_cls, values))
    except ConfigError as exc:
        flag = _flags(callback).get(exc.field)
        raise click.BadParameter(cli_message(exc.problem, callback),
                                 param_hint=f"'{flag}'" if flag else exc.field) from None


def nest_values(config_cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the fields of each config nested in ``config_cls`` built into that config."""
    values = dict(values)
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        inner = hints[f.name]
        if f.name not in values and isinstance(inner, type) and dataclasses.is_dataclass(inner):
            names = {g.name for g in dataclasses.fields(inner)}
            clash = names & {g.name for g in dataclasses.fields(config_cls)}
            if clash:   # a programming error: a value could not tell which config it is for
                raise TypeError(f"{config_cls.__name__}.{f.name} repeats the field(s) {sorted(clash)}")
            values[f.name] = inner(**nest_values(inner, {k: values.pop(k) for k in list(values) if k in names}))
    return values


def _flags(callback: Callable[..., Any] | None) -> dict[str, str]:
    if callback is None:
        ctx = click.get_current_context(silent=True)
        callback = ctx.command.callback if ctx is not None and ctx.command is not None else None
    while callback is not None:
        flags = getattr(callback, _FLAGS_ATTR, None)
        if flags is not None:
            return flags
        callback = getattr(callback, "__wrapped__", None)
    return {}


# ---------------------------------------------------------------------------- option groups in --help
#: Attribute of a click parameter: the title of the ``--help`` section it is listed in.
_SECTION_ATTR = "dimd_help_section"


def option_group(title: str, *options: Callable[[F], F]) -> Callable[[F], F]:
    """Apply ``options`` (listed in the order given) and list them in ``--help`` under ``title``.

    click has no option groups: a command made with ``cls=SectionedCommand``
    shows each group as a section of its own after the other options, as a
    config dataclass nested in another (``TrainConfig.sma``) is a group of
    its own.
    """
    def decorate(callback: F) -> F:
        before = len(getattr(callback, "__click_params__", ()))
        for option in reversed(options):   # decorators apply bottom-up
            callback = option(callback)
        for param in callback.__click_params__[before:]:  # type: ignore[attr-defined]  # click's registry
            setattr(param, _SECTION_ATTR, title)
        return callback

    return decorate


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists each :func:`option_group` in a section titled by it."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, _SECTION_ATTR, "Options"), []).append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


# ---------------------------------------------------------------------------- options several commands share
#: The help of the options that ``dimd train``, ``plan-batch step-time`` and ``plan-batch convergence``
#: share, written once, as each default is (in the commands' config dataclasses).
SHARED_HELP = {
    "model": "Model name (`dimd train --list-models`).",
    "device": "auto: one GPU per rank when every rank has CUDA, else CPU.",
    "threads": "Torch compute threads per rank [default: cores / ranks on the node].",
    "decode_workers": "Decoding worker processes of each rank's loader [default: the rank's cores but one].",
    "crop_scale": ("Smallest share of the image area a random-resized training crop keeps (0.08 as for "
                   "ImageNet; 0.35 or more suits small images)."),
}


def shared_option(config_cls: type, name: str, *param_decls: str, when: str | None = None,
                  default_from: type | None = None, **kwargs: Any) -> Callable[[F], F]:
    """:func:`config_option` with the help :data:`SHARED_HELP` declares for ``name``.

    ``when``: the condition the option applies under (``"With --data"``), put
    first. ``default_from``: the config (``dimd train``'s) whose default a
    None here stands for; the help shows it.
    """
    text = SHARED_HELP[name]
    if when:
        text = f"{when}: {text[0].lower()}{text[1:]}"
    inherited = field_default(default_from, name) if default_from is not None else None
    if inherited is not None and field_default(config_cls, name) is None:
        text += f" [default: dimd train's, {inherited}]"
    return config_option(config_cls, name, *param_decls, help=text, **kwargs)


# ---------------------------------------------------------------------------- shared options
def json_option(what: str = "the figures") -> Callable[[F], F]:
    """``--json PATH``: every measuring command writes one result envelope (``dimd.report``)."""
    return click.option("--json", "json_path", type=OUTPUT_FILE, metavar="PATH", default=None,
                        help=f"Write {what} to PATH as one JSON result (command, parameters, versions, "
                             "MPI set-up, git commit, date; the figures under 'result').")


def stall_timeout_option(config_cls: type, waits: str) -> Callable[[F], F]:
    """``--stall-timeout SECONDS`` of every MPI command; ``waits`` names the command's waits for the others."""
    return config_option(config_cls, "stall_timeout", metavar="SECONDS",
                         help=f"A rank that waits this long for the others in {waits} ends the job with a line "
                              "naming it (a peer's host may be gone; docs/mpi.md); 0: wait forever.")


def quiet_option() -> Callable[[F], F]:
    return click.option("-q", "--quiet", is_flag=True, help="No progress output; only results and errors.")


def processes_option(help_text: str = "Worker processes") -> Callable[[F], F]:
    """``--workers N`` means processes wherever it appears (pack, verify, sample-data)."""
    return click.option("--workers", type=click.IntRange(min=1), default=None,
                        help=f"{help_text} [default: the cores available]. The output is the same "
                             "for any number.")


# ---------------------------------------------------------------------------- library messages on the CLI
def cli_message(message: str, callback: Callable[..., Any] | None = None) -> str:
    """A library message for the command line: each `field` it mentions becomes its flag.

    The library names settings by their config field in backquotes ("output
    exists (set `force` to overwrite)"), since a library caller has no flags;
    the running command knows which flag sets each field ("--force").
    """
    return name_settings(message, _flags(callback))


def command_flags() -> dict[str, str]:
    """The running click command's flag for each config field it sets (for :func:`dimd.wording.flags_named`)."""
    return dict(_flags(None))
