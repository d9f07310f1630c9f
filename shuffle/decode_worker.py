"""The entry point of a decoding worker process: ``python -m dimd.shuffle.decode_worker FD``.

A module of its own so that the process's ``__main__`` is not
:mod:`dimd.shuffle.workers` itself (which the rank's side imports too).
"""

import sys

from dimd.shuffle.workers import worker_main

if __name__ == "__main__":
    worker_main(sys.argv[1:])
