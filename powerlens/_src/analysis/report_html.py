"""The one HTML renderer of powerlens' reports (``sweep``'s and ``reproduce``'s report.html).

A report is one self-contained page: one stylesheet, figures embedded as base64 PNG data
URIs, tables of numbers, and a JSON block of settings. The commands compose the pieces::

    page(title, parts)            -> the whole document (<!DOCTYPE html> ... </html>)
    figures(folder, paths)        -> <div class='figures'> with one <figure> per PNG
    table(columns, rows, caption) -> a scrolling <table> (numbers through ``number``)
    json_block(obj)               -> <pre> with ``obj`` as indented JSON
    number(v)                     -> "–" for None or NaN, 4 significant digits for a float

Every text goes through ``html.escape``; a figure whose file is missing is named in a
visible note instead of an image, so a report never shows an empty frame silently.
"""
from __future__ import annotations

import base64
import html
import json
import os
from typing import Any, Iterable, Optional, Sequence

STYLE = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#1f2328;line-height:1.5}
h1{border-bottom:2px solid #d0d7de;padding-bottom:.3em}
h2{margin-top:2.2em;border-bottom:1px solid #d0d7de;padding-bottom:.2em}
.badge{display:inline-block;color:#fff;border-radius:1em;padding:.1em .8em;font-size:.85em;font-weight:600;
vertical-align:middle;margin-left:.6em}
nav ol{columns:2;list-style:none;padding-left:0}
nav li{margin:.25em 0;break-inside:avoid}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
caption{text-align:left;font-weight:600;padding:.2em 0}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:right}
td{white-space:nowrap}
.table-wrap{overflow-x:auto;max-width:100%}
th{background:#f6f8fa}
td:first-child,th:first-child{text-align:left}
figure{display:inline-block;vertical-align:top;margin:.5em;max-width:48%}
figure.wide{display:block;max-width:100%}
figure img{max-width:100%;height:auto;border:1px solid #d0d7de}
.missing{display:inline-block;color:#cf222e;border:1px dashed #cf222e;padding:.5em 1em;margin:.5em}
figcaption{font-size:.8em;color:#57606a;text-align:center}
.claim{background:#f6f8fa;border-left:4px solid #0969da;padding:.5em 1em}
.checks li.ok::marker{content:"✔ ";color:#1a7f37}
.checks li.no::marker{content:"✘ ";color:#cf222e}
pre{background:#f6f8fa;padding:1em;overflow:auto;font-size:.8em}
pre.error{white-space:pre-wrap;overflow-wrap:anywhere;border-left:4px solid #cf222e}
"""

WIDE_PX = 700
"""A figure wider than this (in pixels) and at least 1.2 times as wide as tall gets a full row."""


def number(v: Any) -> str:
    """A table cell's text: "–" for None or NaN, ``.4g`` for a float, ``str`` otherwise (unescaped)."""
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def png_size(raw: bytes):
    """(width, height) in pixels from a PNG's IHDR chunk, or None if ``raw`` is not a PNG."""
    if len(raw) >= 24 and raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR":
        return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    return None


def figure(folder: str, rel: str) -> str:
    """A <figure> with the PNG ``folder/rel`` embedded as a data URI, captioned with its file
    name; a landscape figure (see :data:`WIDE_PX`) gets class ``wide``, so its text is not
    shrunk to half width. A missing file gives a visible ``missing figure REL`` note."""
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        return f'<p class="missing">missing figure {html.escape(rel)}</p>'
    with open(path, "rb") as fh:
        raw = fh.read()
    data = base64.b64encode(raw).decode()
    size = png_size(raw)
    wide = size is not None and size[0] > WIDE_PX and size[0] >= 1.2 * size[1]
    name = html.escape(os.path.basename(rel))
    cls = ' class="wide"' if wide else ""
    return (f'<figure{cls}><img alt="{name}" src="data:image/png;base64,{data}">'
            f'<figcaption>{name}</figcaption></figure>')


def figures(folder: str, paths: Iterable[str]) -> str:
    """Every figure of ``paths`` (relative to ``folder``) in one ``<div class='figures'>``."""
    return "<div class='figures'>" + "".join(figure(folder, p) for p in paths) + "</div>"


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]], caption: Optional[str] = None) -> str:
    """A horizontally scrolling table: a header of ``columns``, one row per entry of ``rows``
    (each cell through :func:`number`), and an optional caption."""
    e = html.escape
    head = (f"<caption>{e(caption)}</caption>" if caption else "") + \
        "<tr>" + "".join(f"<th>{e(str(c))}</th>" for c in columns) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{e(number(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<div class='table-wrap'><table>{head}{body}</table></div>"


def json_block(obj: Any) -> str:
    """``obj`` as indented JSON in a <pre> (anything JSON cannot hold is written with ``str``)."""
    return f"<pre>{html.escape(json.dumps(obj, indent=2, default=str))}</pre>"


def page(title: str, parts: Iterable[str]) -> str:
    """The document: ``title`` (escaped) in <title> and as the <h1>, then ``parts`` (HTML)."""
    t = html.escape(title)
    return "".join(["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
                    "<meta name='viewport' content='width=device-width, initial-scale=1'>",
                    f"<title>{t}</title><style>{STYLE}</style></head><body>", f"<h1>{t}</h1>",
                    *parts, "</body></html>"])
