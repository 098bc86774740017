"""The report to keep: ``RUN_DIR/report.html``, the dashboard's page with the data inlined.

At the end of a run the launching process folds the whole timeline into
the run's state (``elche.monitor.state``, as the dashboard does) and writes
one HTML file: the dashboard's own page (``static/dashboard.html``) with
its styles, the chart library, the page's script and the state inlined, so
the same code draws it and the file opens offline, from anywhere, with no
server. The page sees ``window.ELCHE_STATE`` and draws it instead of
connecting to ``/events``.

Nothing in the file names an ``http(s)://`` resource: the chart library's
banner comment, the one URL in it, is written without its scheme (its
licence follows it, as an HTML comment).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from elche._files import write_text_atomic
from elche.monitor.state import RunView
from elche.monitor.timeline import read_timeline

__all__ = ["REPORT_FILE", "render_report", "write_report"]

REPORT_FILE = "report.html"
_STYLE = re.compile(r'<link rel="stylesheet" href="/static/([\w.-]+)">')
_SCRIPT = re.compile(r'<script src="/static/([\w.-]+)"></script>')
_LINKS = re.compile(r'<span class="links">.*?</span>', re.S)
_SCHEME = re.compile(r"https?://")


def _static(name: str) -> str:
    return (resources.files("elche.monitor") / "static" / name).read_text(encoding="utf-8")


def _inline_json(state: dict[str, Any]) -> str:
    """``state`` as a JavaScript literal that cannot close its ``<script>``."""
    text = json.dumps(state, allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_report(state: dict[str, Any]) -> str:
    """The dashboard page for ``state``, one self-contained HTML document."""
    page = _static("dashboard.html")
    page = _STYLE.sub(lambda m: f"<style>\n{_static(m.group(1))}\n</style>", page)

    def script(match: re.Match[str]) -> str:
        name = match.group(1)
        body = _SCHEME.sub("", _static(name)).replace("</script", "<\\/script")
        prefix = ""
        if name == "dashboard.js":
            prefix = f"<script>window.ELCHE_STATE = {_inline_json(state)};</script>\n"
        else:
            licence = _SCHEME.sub("", _static("LICENSE-uPlot.txt")).replace("--", "- -")
            prefix = f"<!-- {name}: the uPlot chart library, MIT licence:\n{licence}-->\n"
        return f"{prefix}<script>\n{body}\n</script>"

    page = _SCRIPT.sub(script, page)
    run_dir = str(state.get("run", {}).get("run_dir", ""))
    links = f'<span class="links">report of {_escape(run_dir)}</span>'
    return _LINKS.sub(lambda _: links, page)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_report(run_dir: Path, world_size: int, *, devices: list[str] | None = None) -> Path:
    """Fold ``run_dir``'s timeline and write ``run_dir/report.html``; returns its path.

    Raises:
        OSError: the timeline cannot be read or the report cannot be written.
    """
    view = RunView(world_size, devices=devices, run_dir=str(run_dir))
    for event in read_timeline(run_dir):
        view.observe(event)
    path = run_dir / REPORT_FILE
    write_text_atomic(path, render_report(view.state()))
    return path
