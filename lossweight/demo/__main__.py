"""``python -m lossweight.demo``: the command line of :mod:`lossweight.demo.cli`."""

from .cli import main

# Only when run: importing this module, as documentation tools do, trains nothing.
if __name__ == "__main__":
    main()
