"""``python -m fullband`` (and ``torchrun -m fullband train ...``)."""

import sys

from fullband.cli import main

sys.exit(main())
