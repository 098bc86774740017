"""Headless Chromium for tests, through selenium and Debian's chromium-driver.

``open_browser`` returns a driver, or the reason there is none (the test
skips with it). ``page_view`` reads what the dashboard page shows: its rank
table's cells, its charts' data (uPlot's columns) and its alerts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

# The page's own globals: `charts` (id -> {plot}), the table and the alert list.
PAGE_VIEW_JS = """
const rows = [...document.querySelectorAll('#ranks tbody tr')].map(tr => ({
  rank: Number(tr.dataset.rank), cls: tr.className,
  cells: [...tr.cells].map(td => td.textContent)}));
const data = {};
for (const [id, entry] of Object.entries(charts)) data[id] = entry.plot.data;
return {rows, charts: data, canvases: document.querySelectorAll('canvas').length,
  alerts: [...document.querySelectorAll('#alerts li')].map(li => li.textContent),
  header: document.getElementById('run').textContent,
  records: document.body.dataset.records || null,
  resources: performance.getEntriesByType('resource').map(e => e.name)};
"""
# The rank table's columns (dashboard.html).
COLUMNS = ["rank", "host", "device", "state", "samples/s", "share", "samples", "idle %",
           "ms/batch", "loss", "roles"]  # fmt: skip


def open_browser() -> tuple[Any, str | None]:
    """A headless Chromium driver, or (None, why not)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        return None, "chromium and chromium-driver are not installed (.ci/run installs them)"
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None, "selenium is not installed (it is in the test extra)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,2000"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_path), options=options), None


def page_view(driver: Any) -> dict[str, Any]:
    """What the page shows now (see ``PAGE_VIEW_JS``)."""
    view: dict[str, Any] = driver.execute_script(PAGE_VIEW_JS)
    return view


def screenshot(driver: Any, out: Path, name: str) -> Path:
    """Save what the browser shows as ``out/name.png``; returns the path."""
    path = out / f"{name}.png"
    driver.save_screenshot(str(path))
    return path
