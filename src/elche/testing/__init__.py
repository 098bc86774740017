"""Public fakes for testing code that talks to elche.

- ``FakeRank`` (``fake_rank``): a torch-free rank that speaks the real
  control-plane protocol through a real ``RankEndpoint``, for driving a
  ``Host`` (``elche.runtime.host``) from threads of one test process.
"""

from __future__ import annotations

from elche.testing.fake_rank import FakeRank

__all__ = ["FakeRank"]
