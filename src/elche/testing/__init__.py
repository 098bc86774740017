"""Public fakes for testing code that talks to elche.

- ``FakeRank`` (``fake_rank``): a torch-free rank that speaks the real
  control-plane protocol through a real ``RankEndpoint``, for driving a
  ``Host`` (``elche.runtime.host``) from threads of one test process.
- ``Rig`` (``hosts``): several hosts on one Linux machine, as network
  namespaces on a bridge, each with its own address and its own ``/tmp``,
  optionally on bandwidth-limited links (needs root, ``ip``, ``unshare``).
"""

from __future__ import annotations

from elche.testing.fake_rank import FakeRank
from elche.testing.hosts import Rig

__all__ = ["FakeRank", "Rig"]
