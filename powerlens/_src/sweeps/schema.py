"""The schema machinery of a sweep spec: the kinds of key, their bounds, and the messages.

    Key(default, check, griddable)      one key: ``check(value, where) -> value`` (a ValueError
                                        ``"WHERE: why"`` when refused)
    count, real, choice, boolean, text, interval, window, batch, names, layer_list
                                        the kinds of key (bounds as arguments)
    fail(where, msg), scalar(v, where), show(v)
                                        the one-line refusal, the scalar check, a value for a message
    flatten(doc), differing_keys(a, b)  dotted keys of nested tables, and those two specs differ in

Plain Python: no numerical library and no other part of powerlens. The sweep's own schema
(its tables, keys and defaults) and the checks across keys are :mod:`powerlens._src.sweeps.spec`'s.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Dict, List, Mapping, Optional

SHOW = 80
"""Characters of a bad value shown in a message."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of the schema: ``check(value, where) -> value`` validates one (scalar) value."""

    default: Any
    check: Callable[[Any, str], Any]
    griddable: bool = True


def fail(where: str, msg: str):
    """Refuse: a ValueError ``"WHERE: MSG"`` (one line, naming the file, the table and the key)."""
    raise ValueError(f"{where}: {msg}")


def show(v) -> str:
    """A value for a message: its JSON (repr if it has none), cut to :data:`SHOW` characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        text = repr(v)
    return text if len(text) <= SHOW else text[:SHOW - 4] + " ..."


def scalar(v, where):
    """``v`` itself, refused when it is a list or a table (a scalar key given as a list)."""
    if isinstance(v, (list, dict)):
        fail(where, f"{show(v)} is a list where a scalar is needed (a list of values belongs in [grid])")
    return v


def count(minimum: int = 1, default: int = 1, griddable: bool = True, maximum: Optional[int] = None) -> Key:
    """An integer in [minimum, maximum]."""
    def check(v, where):
        scalar(v, where)
        if isinstance(v, bool) or not isinstance(v, int):
            fail(where, f"must be an integer, got {show(v)}")
        if v < minimum:
            word = "negative" if v < 0 else "too small"
            fail(where, f"{word} count {v}: must be an integer >= {minimum}")
        if maximum is not None and v > maximum:
            fail(where, f"{v} is too large: must be an integer <= {maximum:,}")
        return int(v)
    return Key(default, check, griddable)


def real(default: float, lo: float = -math.inf, hi: float = math.inf) -> Key:
    """A finite number in [lo, hi]."""
    def check(v, where):
        scalar(v, where)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            fail(where, f"must be a finite number, got {show(v)}")
        if not lo <= v <= hi:
            fail(where, f"must lie in [{lo}, {hi}], got {v!r}")
        return float(v)
    return Key(default, check)


def choice(options, default) -> Key:
    """One of ``options``."""
    def check(v, where):
        scalar(v, where)
        if v not in options:
            fail(where, f"unknown value {show(v)}; expected one of {', '.join(map(str, options))}")
        return v
    return Key(default, check)


def boolean(default: bool) -> Key:
    def check(v, where):
        scalar(v, where)
        if not isinstance(v, bool):
            fail(where, f"must be true or false, got {show(v)}")
        return v
    return Key(default, check)


def interval(default) -> Key:
    """A range [lo, hi] of two numbers (one value, not a grid axis)."""
    def check(v, where):
        if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                             and math.isfinite(x) for x in v)) or v[0] > v[1]:
            fail(where, f"must be a range [lo, hi] of two finite numbers with lo <= hi, got {show(v)}")
        return [float(v[0]), float(v[1])]
    return Key(default, check)


def window(default="auto") -> Key:
    """``"auto"`` or a range (lo, hi) with 0 < lo < hi: the values a rate is fitted over."""
    rng = interval(None).check

    def check(v, where):
        if v == "auto":
            return v
        lo, hi = rng(v, where)
        if not 0 < lo < hi:
            fail(where, f"must be \"auto\" or [lo, hi] with 0 < lo < hi, got {show(v)}")
        return [lo, hi]
    return Key(default, check, griddable=False)


def batch(default="auto") -> Key:
    """Systems per vmap step on a device: ``"auto"`` (8 on a CPU, all on an accelerator),
    ``"all"`` or a positive integer. It is part of the spec because XLA's rounding can depend
    on the vector width: with a fixed width the numbers do not depend on the chunking."""
    def check(v, where):
        if v in ("auto", "all"):
            return v
        return count(1, 1).check(v, where)
    return Key(default, check, griddable=False)


def text(default, griddable=True, empty: bool = False) -> Key:
    """A string (non-empty unless ``empty``)."""
    def check(v, where):
        scalar(v, where)
        if not isinstance(v, str) or not (v.strip() or empty):
            fail(where, f"must be a {'' if empty else 'non-empty '}string, got {show(v)}")
        return v
    return Key(default, check, griddable)


def names(options=None, default=(), nonempty=False) -> Key:
    """A list of non-empty strings (some of ``options`` when given)."""
    def check(v, where):
        if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
            fail(where, f"must be a list of non-empty strings, got {show(v)}")
        if nonempty and not v:
            fail(where, "must not be empty")
        bad = [x for x in v if options is not None and x not in options]
        if bad:
            fail(where, f"unknown name(s) {bad}; expected some of {', '.join(options)}")
        return list(v)
    return Key(list(default), check, griddable=False)


def layer_list() -> Key:
    """``"all"`` or a non-empty list of layer indices."""
    def check(v, where):
        if v == "all":
            return v
        if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            fail(where, f"must be \"all\" or a non-empty list of layer indices, got {show(v)}")
        return list(v)
    return Key("all", check, griddable=False)


def flatten(doc: Mapping, prefix: str = "") -> Dict[str, Any]:
    """``{"system": {"d": 8}}`` -> ``{"system.d": 8}``."""
    out = {}
    for k, v in doc.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differing_keys(a: Mapping, b: Mapping) -> List[str]:
    """The dotted keys whose values differ between two normalised specs (``Spec.to_dict``)."""
    fa, fb = flatten(a), flatten(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, None) != fb.get(k, None))
