"""``python -m benchmarks.gpu_check``: see :mod:`benchmarks.gpu_check`."""

import sys

from benchmarks.gpu_check.cli import main

sys.exit(main())
