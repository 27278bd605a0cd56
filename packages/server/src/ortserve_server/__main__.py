"""``python -m ortserve_server`` is the ``ortserve`` command."""

import sys

from ._cli import main

sys.exit(main())
