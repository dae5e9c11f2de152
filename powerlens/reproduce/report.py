"""report.md and a self-contained report.html (figures embedded as base64 PNG)."""
from __future__ import annotations

import base64
import html
import json
import os
from typing import List

from .section import SectionResult

BADGE = {"supported": "#1a7f37", "partly supported": "#b08800", "not supported": "#cf222e",
         "failed": "#6e7781", "skipped": "#8c959f"}


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if v != v:
            return "–"
        return f"{v:.4g}"
    return str(v)


def _anchor(s: SectionResult) -> str:
    return "sec-" + s.id


def render_markdown(sections: List[SectionResult], settings: dict) -> str:
    lines = ["# powerlens reproduce", "",
             "Reproduction of *Analogies between Transformer Layers and Power Method* (Li & Altafini, 2026), "
             "with the corrections of powerlens' design notes. Every verdict below is computed from the numbers.", "",
             "## Contents", ""]
    for s in sections:
        lines.append(f"- [{s.title}](#{_anchor(s)}) — **{s.verdict}**")
    for s in sections:
        lines += ["", f'<a id="{_anchor(s)}"></a>', f"## {s.title}", "", f"**Claim.** {s.claim}", "",
                  f"**Verdict: {s.verdict}.** {s.summary}", ""]
        if s.error:
            lines += ["```", s.error, "```", ""]
        checks = s.numbers.get("checks") if isinstance(s.numbers, dict) else None
        if checks:
            lines += [f"- {'✔' if ok else '✘'} {name}" for name, ok in checks.items()] + [""]
        for t in s.tables:
            lines += [f"*{t.title}*", "", "| " + " | ".join(t.columns) + " |",
                      "|" + "---|" * len(t.columns)]
            lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in t.rows]
            lines.append("")
        for f in s.figures:
            lines.append(f"![{os.path.basename(f)}]({f})")
        lines.append("")
    lines += ["## Settings and versions", "", "```json", json.dumps(settings, indent=2, default=str), "```", ""]
    return "\n".join(lines)


CSS = """
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


def _png_size(raw: bytes):
    """(width, height) in pixels from a PNG's IHDR chunk, or None if ``raw`` is not a PNG."""
    if len(raw) >= 24 and raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR":
        return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    return None


def _img(out_dir: str, rel: str) -> str:
    """A <figure> with the PNG embedded as a data URI; landscape figures (w/h >= 1.2, wider than
    700 px) get class ``wide`` and a full row, so their text is not shrunk to half width."""
    path = os.path.join(out_dir, rel)
    if not os.path.isfile(path):
        return f'<p class="missing">missing figure {html.escape(rel)}</p>'
    with open(path, "rb") as fh:
        raw = fh.read()
    data = base64.b64encode(raw).decode()
    size = _png_size(raw)
    wide = size is not None and size[0] > 700 and size[0] >= 1.2 * size[1]
    name = html.escape(os.path.basename(rel))
    cls = ' class="wide"' if wide else ""
    return (f'<figure{cls}><img alt="{name}" src="data:image/png;base64,{data}">'
            f'<figcaption>{name}</figcaption></figure>')


def render_html(sections: List[SectionResult], settings: dict, out_dir: str) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             "<title>powerlens reproduce</title><style>", CSS, "</style></head><body>",
             "<h1>powerlens reproduce</h1>",
             "<p>Reproduction of <em>Analogies between Transformer Layers and Power Method</em> (Li &amp; Altafini, "
             "2026), with the corrections of powerlens' design notes. Every verdict is computed from the numbers.</p>",
             "<nav><h2>Contents</h2><ol>"]
    for s in sections:
        parts.append(f"<li><a href='#{_anchor(s)}'>{e(s.title)}</a> <span class='badge' "
                     f"style='background:{BADGE.get(s.verdict, '#57606a')}'>{e(s.verdict)}</span></li>")
    parts.append("<li><a href='#settings'>Settings and versions</a></li></ol></nav>")
    for s in sections:
        parts.append(f"<section id='{_anchor(s)}'><h2>{e(s.title)}<span class='badge' "
                     f"style='background:{BADGE.get(s.verdict, '#57606a')}'>{e(s.verdict)}</span></h2>")
        if s.claim:
            parts.append(f"<p class='claim'><b>Claim.</b> {e(s.claim)}</p>")
        parts.append(f"<p>{e(s.summary)}</p>")
        if s.error:
            parts.append(f"<pre class='error'>{e(s.error)}</pre>")
        checks = s.numbers.get("checks") if isinstance(s.numbers, dict) else None
        if checks:
            parts.append("<ul class='checks'>" + "".join(
                f"<li class='{'ok' if ok else 'no'}'>{e(name)}</li>" for name, ok in checks.items()) + "</ul>")
        for t in s.tables:
            parts.append(f"<div class='table-wrap'><table><caption>{e(t.title)}</caption><tr>" +
                         "".join(f"<th>{e(c)}</th>" for c in t.columns) + "</tr>")
            for row in t.rows:
                parts.append("<tr>" + "".join(f"<td>{e(_fmt(v))}</td>" for v in row) + "</tr>")
            parts.append("</table></div>")
        parts.append("<div class='figures'>" + "".join(_img(out_dir, f) for f in s.figures) + "</div></section>")
    parts.append(f"<section id='settings'><h2>Settings and versions</h2><pre>"
                 f"{e(json.dumps(settings, indent=2, default=str))}</pre></section></body></html>")
    return "".join(parts)
