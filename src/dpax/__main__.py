import sys

from dpax.cli import main

sys.exit(main())
