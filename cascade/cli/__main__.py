"""``python -m cascade.cli``: the ``cascade`` command, for where the console script is not on PATH."""

import sys

from cascade.cli import main

sys.exit(main())
