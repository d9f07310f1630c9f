"""dimd: feed and synchronise data-parallel training on HPC clusters.

The package is one namespace over the project's top-level folders:
``dimd`` (this folder, ``dimdtool/``), ``dimd.pack``, ``dimd.shuffle``,
``dimd.allreduce`` and ``dimd.train``. Importing it is cheap: heavy
dependencies (torch, mpi4py, PIL, h5py) load inside the code that needs them.
"""

__version__ = "0.1.0"
