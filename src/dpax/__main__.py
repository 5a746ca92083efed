"""The `dpax` command and `python -m dpax`."""

import sys

from dpax.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
