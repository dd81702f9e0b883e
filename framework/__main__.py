"""``python -m framework``: the ``framework`` command."""

import sys

from framework.cli import main

if __name__ == "__main__":
    sys.exit(main())
