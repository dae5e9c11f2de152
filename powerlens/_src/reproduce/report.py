"""report.md and a self-contained report.html (figures embedded as base64 PNG, by the one
renderer :mod:`powerlens._src.analysis.report_html`)."""
from __future__ import annotations

import html
import json
import os
from typing import List

from ..analysis import report_html as page
from .section import SectionResult

BADGE = {"supported": "#1a7f37", "partly supported": "#b08800", "not supported": "#cf222e",
         "failed": "#6e7781", "skipped": "#8c959f"}


def _anchor(s: SectionResult) -> str:
    return "sec-" + s.id


def _claim_verdicts(s: SectionResult) -> dict:
    """A section with several claims (``numbers["verdicts"]``, e.g. section 7's paper claim and
    output claim): {"paper claim": verdict, ...}; {} for the others."""
    verdicts = s.numbers.get("verdicts") if isinstance(s.numbers, dict) else None
    return {k.replace("_", " "): v for k, v in verdicts.items()} if isinstance(verdicts, dict) else {}


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
        if _claim_verdicts(s):
            lines += ["; ".join(f"**{claim}: {v}**" for claim, v in _claim_verdicts(s).items()), ""]
        if s.error:
            lines += ["```", s.error, "```", ""]
        checks = s.numbers.get("checks") if isinstance(s.numbers, dict) else None
        if checks:
            lines += [f"- {'✔' if ok else '✘'} {name}" for name, ok in checks.items()] + [""]
        for t in s.tables:
            lines += [f"*{t.title}*", "", "| " + " | ".join(t.columns) + " |",
                      "|" + "---|" * len(t.columns)]
            lines += ["| " + " | ".join(page.number(v) for v in row) + " |" for row in t.rows]
            lines.append("")
        for f in s.figures:
            lines.append(f"![{os.path.basename(f)}]({f})")
        lines.append("")
    lines += ["## Settings and versions", "", "```json", json.dumps(settings, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def _badge(verdict: str) -> str:
    return (f"<span class='badge' style='background:{BADGE.get(verdict, '#57606a')}'>"
            f"{html.escape(verdict)}</span>")


def _section(s: SectionResult, out_dir: str) -> str:
    e = html.escape
    parts = [f"<section id='{_anchor(s)}'><h2>{e(s.title)}{_badge(s.verdict)}</h2>"]
    if s.claim:
        parts.append(f"<p class='claim'><b>Claim.</b> {e(s.claim)}</p>")
    if _claim_verdicts(s):
        parts.append("<p class='verdicts'>" + " ".join(f"{e(claim)}: {_badge(v)}"
                                                      for claim, v in _claim_verdicts(s).items()) + "</p>")
    parts.append(f"<p>{e(s.summary)}</p>")
    if s.error:
        parts.append(f"<pre class='error'>{e(s.error)}</pre>")
    checks = s.numbers.get("checks") if isinstance(s.numbers, dict) else None
    if checks:
        parts.append("<ul class='checks'>" + "".join(
            f"<li class='{'ok' if ok else 'no'}'>{e(name)}</li>" for name, ok in checks.items()) + "</ul>")
    parts += [page.table(t.columns, t.rows, caption=t.title) for t in s.tables]
    parts.append(page.figures(out_dir, s.figures) + "</section>")
    return "".join(parts)


def render_html(sections: List[SectionResult], settings: dict, out_dir: str) -> str:
    """The report (:mod:`powerlens._src.analysis.report_html`): contents with each section's verdict,
    then each section (claim, summary, checks, tables, figures embedded), then the settings."""
    e = html.escape
    contents = "".join(f"<li><a href='#{_anchor(s)}'>{e(s.title)}</a> {_badge(s.verdict)}</li>" for s in sections)
    return page.page("powerlens reproduce", [
        "<p>Reproduction of <em>Analogies between Transformer Layers and Power Method</em> (Li &amp; Altafini, "
        "2026), with the corrections of powerlens' design notes. Every verdict is computed from the numbers.</p>",
        f"<nav><h2>Contents</h2><ol>{contents}<li><a href='#settings'>Settings and versions</a></li></ol></nav>",
        *(_section(s, out_dir) for s in sections),
        f"<section id='settings'><h2>Settings and versions</h2>{page.json_block(settings)}</section>"])
