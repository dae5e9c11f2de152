"""A section of the report: one claim, its numbers, figures and a computed verdict."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

@dataclasses.dataclass
class Table:
    title: str
    columns: List[str]
    rows: List[List[Any]]

    def to_json(self):
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


@dataclasses.dataclass
class SectionResult:
    id: str
    title: str
    claim: str
    verdict: str
    summary: str
    numbers: Dict[str, Any] = dataclasses.field(default_factory=dict)
    figures: List[str] = dataclasses.field(default_factory=list)      # paths relative to the output folder
    tables: List[Table] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    seconds: float = 0.0

    def to_json(self):
        return {"id": self.id, "title": self.title, "claim": self.claim, "verdict": self.verdict,
                "summary": self.summary, "numbers": self.numbers, "figures": self.figures,
                "tables": [t.to_json() for t in self.tables], "error": self.error}


def verdict_from(checks: Dict[str, bool]) -> str:
    """All checks pass: supported; some: partly supported; none: not supported."""
    vals = list(checks.values())
    if vals and all(vals):
        return "supported"
    if any(vals):
        return "partly supported"
    return "not supported"
