"""Every Markdown file, ``#section`` and repository file the tree refers to exists, inside the repository.

Code comments, docstrings, help texts and the docs themselves point readers at
``docs/NAME.md#a-section`` or ``bench/NAME.py``; a renamed heading or file
would leave them pointing nowhere, as sqlite-utils' docs tests guard against.
Anchors are GitHub's: the heading in lower case, punctuation dropped, spaces
as hyphens. Paths with a placeholder (``NAME``) and what runs write under
``bench/work/`` are not files of the tree.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".sbatch", ".lsf", ".cfg", ".txt", ".yml", ".yaml"}
SKIPPED_FOLDERS = {".git", ".venv", "build", "demo", "node_modules", "__pycache__"}

#: ``[text](target)`` and ``![alt](target)`` in Markdown.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
#: A Markdown file named anywhere (a comment, a docstring, prose), with an optional section.
MARKDOWN_MENTION = re.compile(r"(?<![\w/.-])((?:\.\.?/)*[\w.-]+(?:/[\w.-]+)*\.md)(#[\w-]+)?(?![\w])")
#: A file of the tree named by its path from the root (``bench/netfs.sh``, ``tests/mpi_case.py``).
TREE_PATH = re.compile(r"(?<![\w/.-])((?:bench|bin|docs|examples|tests|dimdtool|pack|shuffle|allreduce|train)"
                       r"/[\w./-]*\.(?:py|sh|json|png|sbatch|lsf|toml|txt))(?![\w])")


def tree_files() -> list[Path]:
    """The repository's text files: git's list when this is a checkout, else a walk."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
        paths = [ROOT / name for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in ROOT.rglob("*") if not SKIPPED_FOLDERS & set(p.relative_to(ROOT).parts)]
    return sorted(p for p in paths if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in {"Makefile", "run"}))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown file's headings (fenced code skipped; repeats get -1, -2, ...)."""
    found: list[str] = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(match.group(1))
            repeats = sum(1 for a in found if a == base or re.fullmatch(re.escape(base) + r"-\d+", a))
            found.append(base if repeats == 0 else f"{base}-{repeats}")
    return frozenset(found)


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def problem(source: Path, target: str, anchor: str, candidates: list[Path]) -> str | None:
    """Why ``target#anchor``, named in ``source``, leads nowhere; None when it resolves."""
    where = source.relative_to(ROOT)
    if not target:
        found = source
    else:
        found = next((c for c in candidates if inside(c) and c.is_file()), None)
        if found is None:
            outside = [c for c in candidates if not inside(c)]
            return (f"{where}: {target} lies outside the repository" if outside and len(outside) == len(candidates)
                    else f"{where}: {target} does not exist")
    if anchor and found.suffix == ".md" and anchor not in anchors(found):
        return f"{where}: {target}#{anchor}: no such section in {found.relative_to(ROOT)}"
    return None


def references(source: Path):
    """(target, anchor, candidate paths) for each reference in ``source``."""
    text = source.read_text(encoding="utf-8", errors="replace")
    if source.suffix == ".md":
        for match in MARKDOWN_LINK.finditer(text):
            link = match.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", link):        # http:, mailto: ...
                continue
            target, _, anchor = link.partition("#")
            yield target, anchor, [source.parent / target]
    for match in MARKDOWN_MENTION.finditer(text):
        target, anchor = match.group(1), (match.group(2) or "#")[1:]
        yield target, anchor, [source.parent / target, ROOT / target]
    for match in TREE_PATH.finditer(text):
        target = match.group(1)
        if "NAME" not in target and not target.startswith("bench/work/"):
            yield target, "", [ROOT / target]


def test_every_markdown_file_and_section_referred_to_exists():
    this = Path(__file__).resolve()   # its examples of broken references are on purpose
    problems = [found for source in tree_files() if source != this
                for target, anchor, candidates in references(source)
                if (found := problem(source, target, anchor, candidates))]
    assert problems == [], "\n".join(problems)


def test_the_check_catches_a_missing_file_a_missing_section_and_a_file_outside(tmp_path):
    readme = ROOT / "README.md"
    assert problem(readme, "docs/mpi.md", "mpi-on-one-machine", [ROOT / "docs/mpi.md"]) is None
    assert problem(readme, "NOTES.md", "", [ROOT / "NOTES.md"]) == "README.md: NOTES.md does not exist"
    assert problem(readme, "docs/mpi.md", "no-such", [ROOT / "docs/mpi.md"]) == (
        "README.md: docs/mpi.md#no-such: no such section in docs/mpi.md")
    assert problem(readme, "../elsewhere/NOTES.md", "", [ROOT / "../elsewhere/NOTES.md"]) == (
        "README.md: ../elsewhere/NOTES.md lies outside the repository")


@pytest.mark.parametrize("heading, anchor", [
    ("MPI under SLURM: one job, not N singletons", "mpi-under-slurm-one-job-not-n-singletons"),
    ("`dimd pack SRC -o OUT`", "dimd-pack-src--o-out"),
    ("Step 4: the gradient noise scale, `dimd train --noise-scale`",
     "step-4-the-gradient-noise-scale-dimd-train---noise-scale"),
    ("1. DIMD figure 5: allreduce throughput", "1-dimd-figure-5-allreduce-throughput"),
])
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor
