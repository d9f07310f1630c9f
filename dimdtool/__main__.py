"""``python -m dimd`` behaves exactly like the ``dimd`` command."""

from dimd.cli import main

if __name__ == "__main__":
    main(prog_name="dimd")
