"""dimd: feed and synchronise data-parallel training on HPC clusters.

The package is one namespace over the project's top-level folders:
``dimd`` (this folder, ``dimdtool/``), ``dimd.pack``, ``dimd.shuffle``,
``dimd.allreduce`` and ``dimd.train``. Importing it is cheap: heavy
dependencies (torch, mpi4py, PIL, h5py) load inside the code that needs them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dimd")  # declared once, in pyproject.toml
except PackageNotFoundError:  # pragma: no cover - running from a tree that was never installed
    __version__ = "0+unknown"
