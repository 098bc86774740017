"""One rank of a several-hosts bench run (``elche.bench.on_host``)."""

from __future__ import annotations

import contextvars
from types import SimpleNamespace

import pytest

import elche.api
from elche.bench import on_host
from elche.runtime import lifetimes


def test_a_cells_rank_stopped_says_where_it_is_saved_not_how_to_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The bench resumes no cell: a stopped cell's ranks printed the library's
    # "resume with: resume_from=…" hint in their hosts' logs.
    hints: list[object] = []

    def train(*args: object, **kwargs: object) -> SimpleNamespace:
        hints.append(lifetimes.RESUME_HINT.get())
        return SimpleNamespace(summary={"outcome": "saved_and_shutdown"})

    monkeypatch.setattr(elche.api, "train", train)
    monkeypatch.setenv("RANK", "0")
    run = on_host.HostRun("cadence", "digits-mlp", 1, 32, 0, (1.0, 1.0), 0.0, "/nonexistent")
    monkeypatch.setattr(on_host.HostRun, "split", lambda self: (None, None))
    summary = contextvars.copy_context().run(on_host._elche, run)
    assert summary == {"outcome": "saved_and_shutdown"}
    assert hints == [None]
