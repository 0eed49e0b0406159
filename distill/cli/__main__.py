"""``python -m distill.cli``: the ``cascade`` command, for where the console script is not on PATH."""

import sys

from distill.cli import main

sys.exit(main())
