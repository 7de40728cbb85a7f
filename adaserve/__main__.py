"""``python -m adaserve`` is the ``adaserve`` command."""

import sys

from adaserve.cli.main import main

sys.exit(main())
