"""``python -m adaserve`` is the ``adaserve`` command."""

import sys

from adaserve.cli import main

sys.exit(main())
