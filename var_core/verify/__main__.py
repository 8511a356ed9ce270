"""``python -m var_core.verify FIXTURE_DIR`` (see :mod:`var_core.verify.cli`)."""

import sys

from .cli import main

sys.exit(main())
