#!/usr/bin/env python3
"""Render a powerlens ``report.html`` in headless Chromium and check that every figure loaded.

Usage::

    python tools/render_report.py OUT/report.html [--screenshot shot.png] [--window-size 1280,2400]
                                                 [--full-page] [--json]

How the check works (no Python packages beyond the standard library):

1. The report is copied to a temporary folder and a small ``<script>`` is appended.  On the
   window ``load`` event (which waits for every ``<img>``, data URIs included) it records, for
   each ``<img>``: its ``alt``, ``complete`` and ``naturalWidth``/``naturalHeight``; the number of
   ``.missing`` placeholders (figures whose PNG file did not exist when the report was written);
   the page title, the number of ``<h2>`` headings and of ``.badge`` elements; and the page's
   scroll height.  It then replaces the document with a single ``<pre id="imgcheck">`` holding
   that JSON, so the dumped DOM is small even when the report embeds megabytes of base64 PNG.
2. ``chromium --headless --dump-dom`` loads the copy and prints the DOM; the JSON is parsed out.
3. Optionally a second Chromium run takes a screenshot of the unmodified report.

An image counts as *loaded* when ``complete`` is true and ``naturalWidth > 0``: a data URI
holding bytes that are not a decodable PNG ends with ``complete`` true but ``naturalWidth == 0``.

Exit status of the command line: 0 if at least one figure is present and every figure loaded
(and none is missing), 1 otherwise, 2 if Chromium is not installed or failed.
"""
from __future__ import annotations

import argparse
import html as _html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Flags that keep headless Chromium quiet, offline and deterministic on a CI machine.
BASE_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-quic", "--no-first-run", "--no-default-browser-check",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-extensions", "--hide-scrollbars", "--mute-audio",
              "--run-all-compositor-stages-before-draw")

CHECK_ID = "imgcheck"

CHECK_SCRIPT = """
<script>
(function () {
  function report() {
    var imgs = Array.prototype.slice.call(document.images);
    var info = imgs.map(function (im) {
      return {alt: im.getAttribute('alt') || '', complete: im.complete,
              width: im.naturalWidth, height: im.naturalHeight};
    });
    var res = {
      title: document.title,
      images: imgs.length,
      loaded: info.filter(function (i) { return i.complete && i.width > 0; }).length,
      details: info,
      missing: document.querySelectorAll('.missing').length,
      missing_text: Array.prototype.map.call(document.querySelectorAll('.missing'),
                                             function (e) { return e.textContent; }),
      headings: document.querySelectorAll('h2').length,
      badges: document.querySelectorAll('.badge').length,
      scroll_height: Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)
    };
    var pre = document.createElement('pre');
    pre.id = '%s';
    pre.textContent = JSON.stringify(res);
    document.body.innerHTML = '';
    document.body.appendChild(pre);
  }
  if (document.readyState === 'complete') { report(); }
  else { window.addEventListener('load', report); }
})();
</script>
""" % CHECK_ID


class RenderError(RuntimeError):
    """Chromium is missing, failed, or the injected check did not run."""


def find_chromium(explicit: Optional[str] = None) -> Optional[str]:
    """Path of a Chromium/Chrome executable: ``explicit``, ``$CHROMIUM``, or the first on PATH."""
    for name in ((explicit,) if explicit else ()) + ((os.environ.get("CHROMIUM"),) if os.environ.get("CHROMIUM")
                                                      else ()) + CHROMIUM_NAMES:
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def _run_chromium(chromium: str, args: Sequence[str], profile: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [chromium, *BASE_FLAGS, f"--user-data-dir={profile}", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RenderError(f"chromium timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc


def _inject(src_html: str) -> str:
    """The report with the check script placed just before ``</body>`` (appended if absent)."""
    i = src_html.lower().rfind("</body>")
    return src_html + CHECK_SCRIPT if i < 0 else src_html[:i] + CHECK_SCRIPT + src_html[i:]


def check_images(report: str, chromium: Optional[str] = None, timeout: float = 60.0,
                 window_size: str = "1280,2400", budget_ms: int = 5000) -> dict:
    """Load ``report`` in headless Chromium and return what the injected check saw.

    Returns a dict with ``title``, ``images`` (number of ``<img>``), ``loaded`` (how many have
    ``complete`` and ``naturalWidth > 0``), ``details`` (per image: alt, complete, width,
    height), ``missing`` (number of ``.missing`` placeholders), ``headings``, ``badges``,
    ``scroll_height`` (CSS px at ``window_size``'s width) and ``ok`` (images > 0, loaded ==
    images and missing == 0).  Raises ``RenderError`` if Chromium is missing or the check
    did not run, and ``FileNotFoundError`` if ``report`` does not exist.
    """
    if not os.path.isfile(report):
        raise FileNotFoundError(f"report not found: {report}")
    exe = find_chromium(chromium)
    if exe is None:
        raise RenderError(f"no Chromium found (looked for {', '.join(CHROMIUM_NAMES)} on PATH and $CHROMIUM); "
                          "install it with `apt-get install -y chromium`")
    with open(report, encoding="utf-8") as fh:
        src = fh.read()
    with tempfile.TemporaryDirectory(prefix="render_report_") as tmp:
        page = os.path.join(tmp, "report_check.html")
        with open(page, "w", encoding="utf-8") as fh:
            fh.write(_inject(src))
        proc = _run_chromium(exe, [f"--window-size={window_size}", f"--virtual-time-budget={budget_ms}",
                                   "--dump-dom", "file://" + page], os.path.join(tmp, "profile"), timeout)
    m = re.search(r'<pre id="%s">(.*?)</pre>' % CHECK_ID, proc.stdout, re.S)
    if m is None:
        raise RenderError(f"the image check did not run in chromium on {report} (exit {proc.returncode}); "
                          f"stderr tail:\n{proc.stderr[-2000:]}\nstdout head:\n{proc.stdout[:500]}")
    res = json.loads(_html.unescape(m.group(1)))
    res["ok"] = bool(res["images"] > 0 and res["loaded"] == res["images"] and res["missing"] == 0)
    res["chromium"] = exe
    return res


def screenshot(report: str, png: str, chromium: Optional[str] = None, window_size: str = "1280,2400",
               timeout: float = 60.0, budget_ms: int = 5000) -> str:
    """Save a PNG screenshot of the unmodified ``report`` at ``window_size`` (``W,H`` CSS px)."""
    if not os.path.isfile(report):
        raise FileNotFoundError(f"report not found: {report}")
    exe = find_chromium(chromium)
    if exe is None:
        raise RenderError("no Chromium found; install it with `apt-get install -y chromium`")
    png = os.path.abspath(png)
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    if os.path.exists(png):
        os.remove(png)
    with tempfile.TemporaryDirectory(prefix="render_report_") as tmp:
        proc = _run_chromium(exe, [f"--window-size={window_size}", f"--virtual-time-budget={budget_ms}",
                                   f"--screenshot={png}", "file://" + os.path.abspath(report)],
                             os.path.join(tmp, "profile"), timeout)
    if not os.path.isfile(png):
        raise RenderError(f"chromium wrote no screenshot {png} (exit {proc.returncode}); "
                          f"stderr tail:\n{proc.stderr[-2000:]}")
    return png


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="path to report.html")
    ap.add_argument("--screenshot", metavar="PNG", help="also save a screenshot of the report")
    ap.add_argument("--window-size", default="1280,2400", help="W,H in CSS pixels (default 1280,2400)")
    ap.add_argument("--full-page", action="store_true", help="screenshot height = the page's full height")
    ap.add_argument("--chromium", help="Chromium executable (default: $CHROMIUM or chromium on PATH)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per Chromium run")
    ap.add_argument("--json", action="store_true", help="print the full check result as JSON")
    a = ap.parse_args(argv)
    if not re.fullmatch(r"\d+,\d+", a.window_size):
        ap.error(f"--window-size must be W,H in pixels, got {a.window_size!r}")
    try:
        res = check_images(a.report, chromium=a.chromium, timeout=a.timeout, window_size=a.window_size)
        if a.screenshot:
            size = a.window_size
            if a.full_page:
                size = f"{a.window_size.split(',')[0]},{int(res['scroll_height'])}"
            screenshot(a.report, a.screenshot, chromium=a.chromium, window_size=size, timeout=a.timeout)
    except (RenderError, FileNotFoundError) as exc:
        print(f"render_report: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{a.report}: title {res['title']!r}; {res['loaded']}/{res['images']} figures loaded, "
              f"{res['missing']} missing; {res['headings']} sections, {res['badges']} badges; "
              f"page height {res['scroll_height']} px")
        for d in res["details"]:
            if not (d["complete"] and d["width"] > 0):
                print(f"  NOT LOADED: {d['alt']}")
        for t in res["missing_text"]:
            print(f"  MISSING: {t}")
        if a.screenshot:
            print(f"screenshot: {a.screenshot}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
