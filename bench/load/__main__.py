"""`python -m bench.load`: see bench/load/cli.py."""

import sys

from bench.load.cli import main

sys.exit(main())
