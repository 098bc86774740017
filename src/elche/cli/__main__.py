"""``python -m elche.cli``: the ``elche`` command."""

import sys

from elche.cli import main

sys.exit(main())
