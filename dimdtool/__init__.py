"""dimd: feed and synchronise data-parallel training on HPC clusters.

The package is one namespace over the project's top-level folders:
``dimd`` (this folder, ``dimdtool/``), ``dimd.pack``, ``dimd.shuffle``,
``dimd.allreduce`` and ``dimd.train``. Importing it is cheap: heavy
dependencies (torch, mpi4py, PIL, h5py) load inside the code that needs them.

The library for a user's own training script (docs/library.md) is here too,
loaded on first use::

    import dimd
    comm, device = dimd.init()
    loader = dimd.open_loader(TRAIN, comm, batch_size=64, image_size=32)
    grads = dimd.DistributedGradients(model, optimizer=optimizer)   # optimizer: torch's, or dimd.LARS
"""

#: The installed version (a str), looked up on first use: see _version.
__version__: str

#: The public library, by name -> the module that defines it (imported on first use, PEP 562).
_LIBRARY = {
    "init": "dimd.train.launch",
    "Job": "dimd.train.launch",
    "open_loader": "dimd.shuffle.loader",
    "Normalize": "dimd.shuffle.normalize",
    "DistributedGradients": "dimd.train.distributed",
    "LARS": "dimd.train.lars",
}

__all__ = ["__version__", *_LIBRARY]


def _version() -> str:
    """The installed version, declared once in pyproject.toml. Looked up on first use: importing
    importlib.metadata costs ~60 ms, paid by every dimd process and decoding worker otherwise."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dimd")
    except PackageNotFoundError:  # pragma: no cover - running from a tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> object:
    if name == "__version__":
        globals()["__version__"] = found = _version()
        return found
    if name in _LIBRARY:
        import importlib

        return getattr(importlib.import_module(_LIBRARY[name]), name)
    raise AttributeError(f"module 'dimd' has no attribute {name!r}")
