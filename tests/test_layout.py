"""The wheel must hold what the editable install does: every package is declared."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = config["package-dir"]
    declared = set(config["packages"])

    def folder_of(package: str) -> Path:
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):
            prefix = ".".join(parts[:cut])
            if prefix in mapping:
                return ROOT / mapping[prefix] / Path(*parts[cut:])
        raise AssertionError(f"{package} has no package-dir mapping")

    found = set()
    for top in mapping:
        base = ROOT / mapping[top]
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            found.add(".".join([top, *relative.parts]))
    assert found == declared
    for package in declared:
        assert (folder_of(package) / "__init__.py").exists(), package


def test_no_stray_top_level_packages():
    """Stage folders install only under `dimd`, never as top-level `train`, `pack`..."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "dimd" or p.startswith("dimd.") for p in config["packages"])
