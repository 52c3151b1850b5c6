"""``python -m hyper_parallel.train``: the same as the ``hp-train`` command."""

import sys

from hyper_parallel.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
