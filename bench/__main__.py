"""`python -m bench`: run every benchmark and write the table and the chart."""

import sys

from bench.cli import main

sys.exit(main())
