"""The suite's one process-wide setting: Python's bytecode caches are written.

With ``PYTHONDONTWRITEBYTECODE`` set (as some CI images set it), every
pytest worker would rewrite and compile all ~100 test modules anew at
collection (about 7 s of CPU each), and every rank process a test starts
would compile elche's modules anew. Caches are written here, for pytest's
workers and the processes the tests start, as they are by default.
"""

from __future__ import annotations

import os
import sys

sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
