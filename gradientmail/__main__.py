"""``python -m gradientmail``: the same command line as the ``gradientmail`` script."""

import sys

from gradientmail.cli import main

if __name__ == "__main__":
    sys.exit(main())
