"""``python -m switchyard``: the same as the ``switchyard`` command."""

import sys

from switchyard.cli import main

sys.exit(main())
