"""``dimd pack``, ``dimd inspect``, ``dimd verify``: thin click wrappers over :mod:`dimd.pack`."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from dimd.console import LateProgress, progress
from dimd.errors import DimdError
from dimd.options import (OUTPUT_FILE, build_config, cli_message, config_option, json_option,
                          processes_option, quiet_option)
from dimd.pack.config import PackConfig
from dimd.units import format_bytes

if TYPE_CHECKING:
    from dimd.pack.packer import AnySource, PackResult

#: An input file (--list, --classes-file); outputs are OUTPUT_FILE, checked before the work.
_FILE = click.Path(dir_okay=False, path_type=Path)
#: A scan of SRC that takes longer than this gets a line saying what is happening.
SCAN_NOTICE_S = 2.0
#: Skipped images named on stderr; past this (an LMDB of something other than Caffe's Datum skips every
#: record) one line says more follow, and the end's count and ``--skipped`` say how many and which.
SKIP_LINES = 20


@click.command("pack")
@click.argument("src", nargs=-1, required=True, type=click.Path(path_type=Path))
@config_option(PackConfig, "out", "-o", "--output", required=True, type=click.Path(),  # str: out/ keeps its /
               help="Output stem: writes OUT.dimd (the JPEGs) and OUT.idx.h5 (the index); "
                    "missing folders are created.")
@config_option(PackConfig, "list_file", "--list", "--labels", type=_FILE,
               help="Pack the images named in FILE, one 'relative/path label' line each "
                    "(Caffe's convert_imageset format), e.g. ImageNet's flat val folder or val tar.")
@config_option(PackConfig, "classes_file", type=_FILE,
               help="Class names, one per line, line i naming label i (for --list, LMDB, WebDataset and "
                    "Parquet sources; default: a Parquet file's ClassLabel names, else the label numbers).")
@config_option(PackConfig, "label_field", metavar="NAME",
               help="WebDataset: the field of KEY.json that holds the label (when there is no KEY.cls).")
@config_option(PackConfig, "image_column", metavar="NAME",
               help="Parquet: the image column, a struct with 'bytes' (the Hub's Image) or binary.")
@config_option(PackConfig, "label_column", metavar="NAME", help="Parquet: the integer label column.")
@config_option(PackConfig, "short_side", help="Resize so the shorter side is this many pixels (aspect ratio kept).")
@config_option(PackConfig, "quality", help="JPEG quality of the stored images.")
@config_option(PackConfig, "workers", help="Worker processes [default: the cores available; at most 4 per "
                                           "core]. The output is the same for any number.")
@config_option(PackConfig, "strict", help="Stop at the first image that cannot be packed.")
@click.option("--skipped", "skipped_file", type=OUTPUT_FILE,
              help="Write the names of skipped images, with the reason, to FILE.")
@config_option(PackConfig, "force", help="Overwrite an existing OUT.")
@json_option("the summary")
@quiet_option()
def pack_command(src: tuple[Path, ...], skipped_file: Path | None, json_path: Path | None, quiet: bool,
                 **fields: Any) -> None:
    """Resize and pack the images of SRC into one data file plus an HDF5 index.

    \b
    SRC is one of:
      a folder of class sub-folders   labels are the sorted sub-folder names (like ImageFolder)
      a folder plus --list FILE       'relative/path label' lines; label names from --classes-file
      a Caffe LMDB folder (data.mdb)  caffe.Datum values, encoded or raw CHW BGR; name = key
      a tar of per-class tars         ImageNet's train tar: the same records as its extracted tree
      a tar plus --list FILE          ImageNet's val tar: the same records as the folder and list
      WebDataset shards               'train-{000000..000146}.tar', several paths or a file listing
                                      them; KEY.jpg/.jpeg/.png/.webp with KEY.cls or KEY.json
      Parquet files                   'data/train-*.parquet' (pip install 'dimd[parquet]'): an image
                                      struct or binary column and an integer label column

    Archives are read once, front to back, never extracted (gzip, bzip2 and xz
    tars too); their records come out in the extracted tree's (or the list's)
    order, WebDataset samples and Parquet rows in the order they are read.

    Every image becomes RGB (grey, CMYK, palette and alpha handled, EXIF
    orientation applied), its shorter side is resized to --short-side
    (antialiased; large JPEGs are decoded at reduced scale first) and stored as
    a JPEG of --quality. Files without an image extension and hidden files are
    ignored; anything that is not a regular file, and empty, truncated or
    undecodable images are skipped and named. Symlinks are followed, but each
    folder is walked and each file packed once. Outputs appear only when the
    pack completes; an interrupted pack (Ctrl-C, SIGTERM, a full disk) leaves
    nothing, and the next pack to the same OUT removes what a killed one left
    (docs/policies.md).

    \b
    Examples:
      dimd pack imagenet/train -o /scratch/in1k/train
      dimd pack imagenet/val --list val.txt --classes-file synsets.txt -o /scratch/in1k/val
      dimd pack caffe/ilsvrc12_train_lmdb -o /scratch/in1k/train --workers 16
      dimd pack ILSVRC2012_img_train.tar -o /scratch/in1k/train
      dimd pack ILSVRC2012_img_val.tar --list val.txt --classes-file synsets.txt -o /scratch/in1k/val
      dimd pack 'shards/train-{000000..000146}.tar' --classes-file classes.txt -o /scratch/in1k/train
      dimd pack 'imagenet-1k/data/train-*.parquet' -o /scratch/in1k/train
    """
    from dimd.pack.packer import pack
    from dimd.report import result_document, write_json

    config = build_config(PackConfig, src=src[0] if len(src) == 1 else src, **fields)
    with PackProgress(config, quiet=quiet) as shown:
        result = pack(config, advance=shown.advance, on_skip=shown.on_skip, on_start=shown.on_start,
                      on_archive=shown.on_archive)
    if skipped_file is not None:
        from dimd.fsutil import atomic_write_text

        atomic_write_text(skipped_file, "".join(f"{n}\t{cli_message(r)}\n" for n, r in result.skipped))
    _say_how_it_went(config, result)
    if json_path is not None:
        write_json(json_path, result_document("pack", config, result.summary()))


class PackProgress(LateProgress):
    """What ``dimd pack`` shows while it works: a line if listing SRC takes a while, a progress bar once the
    source is known (with the archives read, for a source read front to back), the first skips. A context:
    the bar ends with it."""

    def __init__(self, config: PackConfig, *, quiet: bool) -> None:
        super().__init__(enabled=not quiet)
        self.strict = config.strict
        self.archives_read = 0
        self.archives: int | None = 0    # the source's: 0 for none, None when known only once read
        self.skips = 0
        # Listing a million-file tree on a parallel file system takes a while: say so, but only then.
        self._scanning = threading.Timer(SCAN_NOTICE_S, lambda: click.echo(
            f"scanning {config.shown_src} (listing every image before packing) ...", err=True))
        self._scanning.daemon = True
        if not quiet:
            self._scanning.start()

    def __exit__(self, *exc: Any) -> None:
        self._scanning.cancel()
        super().__exit__(*exc)

    def on_start(self, source: AnySource) -> None:
        self._scanning.cancel()
        self.archives = source.archives
        self.start(source.count, f"pack ({source.kind})", unit="img",
                   status=self.status if source.archives != 0 else None)

    def status(self) -> str:
        return f"{self.archives_read}/{self.archives} archives" if self.archives else f"{self.archives_read} archives"

    def on_archive(self, name: str) -> None:
        self.archives_read += 1

    def on_skip(self, name: str, reason: str) -> None:
        if self.strict:
            return  # the pack stops with one line saying the same
        self.skips += 1
        if self.skips <= SKIP_LINES:
            click.echo(f"dimd: skipped {name}: {cli_message(reason)}", err=True)
        elif self.skips == SKIP_LINES + 1:
            click.echo("dimd: skipping more; the rest are not named here (`--skipped FILE` names every "
                       "one), only counted at the end", err=True)


def _say_how_it_went(config: PackConfig, result: PackResult) -> None:
    """The notes (temporaries removed or left, records put in order) and the summary line."""
    for path in result.stale_removed:
        click.echo(f"dimd: removed {path}, left by a pack that no longer runs", err=True)
    for path in result.stale_foreign:
        click.echo(f"dimd: note: {path} was left by a pack on another host; remove it if that "
                   "pack no longer runs", err=True)
    if result.source_info.get("reordered"):
        order = {"tree": "the extracted tree's", "list": "the list's"}[result.source_info["record_order"]]
        click.echo(f"dimd: note: {config.shown_src} is not in {order} order; its records were put in that "
                   "order once it was read (one more pass over the output)", err=True)
    click.echo(f"packed {result.images} images in {len(result.classes)} classes "
               f"({len(result.skipped)} skipped) to {result.data_path} + {result.index_path.name}: "
               f"{format_bytes(result.bytes_in)} in, {format_bytes(result.bytes_out)} out, "
               f"{result.seconds:.1f} s, {result.images_per_s:,.1f} images/s, "
               f"{result.workers} worker{'s' if result.workers != 1 else ''}"
               + (f", {result.archives} archive{'s' if result.archives != 1 else ''} read"
                  if result.source_info else ""))


@click.command("inspect")
@click.argument("dataset", type=click.Path(path_type=Path))
@json_option("the description")
@click.option("--all-classes", is_flag=True, help="List every class (default: at most 20).")
def inspect_command(dataset: Path, json_path: Path | None, all_classes: bool) -> None:
    """Describe a packed data set: count, classes, bytes, image sizes, how it was packed.

    DATASET is the stem given to `dimd pack -o` (or either of its two files).
    Fails if the data file's size does not match its index (truncated or
    mismatched pair).

    \b
    Example:
      dimd inspect /scratch/in1k/train --json train-info.json
    """
    from dimd.pack.inspection import describe
    from dimd.report import result_document, write_json

    info = describe(dataset)
    attrs = info["attributes"]
    lines = [
        f"dataset     {info['dataset']}",
        f"records     {info['count']}",
        f"classes     {info['classes']}",
        f"data        {format_bytes(info['data_bytes'])} ({info['data_bytes']} bytes), "
        f"index {format_bytes(info['index_bytes'])}",
        _stats_line("record", info["record_bytes"], " B"),
        _stats_line("height", info["height"], " px"),
        _stats_line("width", info["width"], " px"),
        f"packed      short side {attrs.get('short_side')}, quality {attrs.get('quality')}, "
        f"from {attrs.get('source')} ({attrs.get('source_kind', '?')}), "
        f"format v{attrs.get('version')}, dimd {attrs.get('dimd_version')}",
    ]
    counts = list(info["class_counts"].items())
    shown = counts if all_classes or len(counts) <= 20 else counts[:20]
    lines.append("per class   " + ", ".join(f"{name}: {n}" for name, n in shown)
                 + (f", ... ({len(counts) - len(shown)} more; --all-classes)" if len(shown) < len(counts) else ""))
    click.echo("\n".join(lines))
    if json_path is not None:
        write_json(json_path, result_document("inspect", {"dataset": str(dataset)}, info))


def _stats_line(label: str, stats: dict, unit: str) -> str:
    return (f"{label:<11} min {stats['min']}{unit}, median {stats['median']:g}{unit}, "
            f"mean {stats['mean']:g}{unit}, max {stats['max']}{unit}")


@click.command("verify")
@click.argument("dataset", type=click.Path(path_type=Path))
@processes_option()
@click.option("--crc-only", is_flag=True, help="Check the crc32s only, do not decode the images.")
@json_option("the findings")
@quiet_option()
def verify_command(dataset: Path, workers: int | None, crc_only: bool, json_path: Path | None, quiet: bool) -> None:
    """Check that every record of a packed data set is intact: crc32 and a full decode.

    Exits with status 1 and names every bad record (index, name, problem).

    \b
    Example:
      dimd verify /scratch/in1k/train
    """
    from dimd.format import PackedDataset
    from dimd.pack.inspection import verify
    from dimd.host import available_cores
    from dimd.report import result_document, write_json

    total = len(PackedDataset(dataset, check_size=False))
    with progress(total, "verify", unit="rec", enabled=not quiet) as advance:
        result = verify(dataset, workers=workers or available_cores(), decode=not crc_only,
                        advance=advance)
    if json_path is not None:
        write_json(json_path, result_document("verify", {"dataset": str(dataset), "crc_only": crc_only},
                                              result.figures()))
    for i, name, problem in result.bad:
        click.echo(f"dimd: bad record {i} ({name}): {problem}", err=True)
    if result.file_problem:
        click.echo(f"dimd: {result.file_problem}", err=True)
    checked = "crc32" if crc_only else "crc32 and decode"
    if not result.ok:
        raise DimdError(f"{dataset}: {len(result.bad)} of {result.count} records are bad"
                        + (" and the data file size is wrong" if result.file_problem else ""))
    click.echo(f"ok: {result.count} records, {checked} checked in {result.seconds:.1f} s")
