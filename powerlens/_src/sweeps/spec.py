"""The sweep spec: one TOML file, read, validated and filled with defaults.

    name = "consensus-vs-heads"          # top level: name, seed
    seed = 0
    [grid]     any [system] or [run] key as a list: every combination is one point
    [system]   the synthetic system of every point (d, tokens, heads, beta, kind, spectrum,
               top, rest, imag, pair, nonnormality, init, cone, noise, replicates, builder,
               builder_path)
    [run]      the dynamics (steps, attention, rule, order, keep_bias, x64) and how it runs:
               chunk_size (0: from a memory estimate), micro_batch ("auto", "all" or a count)
    [measure]  how the measured columns are taken (fit windows, rotation_steps, thresholds,
               series)
    [model]    instead of a synthetic system: name, layers ("all" or a list), prompts

Every error is a one-line ``ValueError`` naming the file, the table and the key:
malformed TOML, a file that is not UTF-8 or is nested too deeply, an unknown table or key,
a list where a scalar is needed, a negative count, more than :data:`MAX_SYSTEM_STEPS` steps, a
seed outside 0 .. 2^64-1, heads that do not divide d, an empty grid, a grid larger than
:data:`MAX_POINTS` points or :data:`MAX_GROUPS` static combinations, more than
:data:`MAX_SYSTEMS` systems (points x replicates, or x prompts), a value that is not
finite in the precision it will be used in (float32 unless x64; a nonnormality whose S = I + s G / sqrt(d)
or a bipartite noise whose start's squared norm can overflow it, for any normal draw G), ``rule = "full"`` on a
synthetic system (it has no FFN), an unknown model.

A custom builder (``builder = "module:function"``) is user code: powerlens imports and
runs it as it is, with the rights of the user. Its module is imported only if it is
installed (found on ``sys.path`` without the current directory: a file that happens to lie
where the command runs is never imported), or from the file that ``builder_path`` names
(relative to the spec's folder). It is imported only once the rest of the spec is valid.

The kinds of key (counts, ranges, choices, ...) and the one-line refusals are
:mod:`powerlens._src.sweeps.schema`'s; this module holds the sweep's own tables and the checks
across keys (heads dividing d, an explicit spectrum fitting d, the values' precision, the model).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Dict, Mapping, Optional

import numpy as np

from ..analysis.spectra import ORDERS
from ..dynamics.attention import ATTENTION_MODES
from ..dynamics.layer import RULES
from ..dynamics.synthetic import INITS, KINDS, NORMAL_MAX, noise_limit, nonnormality_limit, parse_spectrum
from ..io import read_toml  # noqa: F401  (a spec's TOML, read before any numerical library is imported)
from ..models.load import resolve
from .schema import (Key, batch, boolean, choice, count, fail, interval, layer_list, names, real, scalar, show, text,
                     window)
from .sources import builder_file, host_builder, model_layers

MAX_POINTS = 10_000_000
"""Grid points a spec may have."""
MAX_SYSTEMS = 10_000_000
"""Systems (rows) a sweep may have: points x replicates (x prompts in a model sweep)."""
MAX_GROUPS = 10_000
"""Static combinations (one compilation each) a grid may have."""
MAX_SYSTEM_STEPS = 2 ** 31 - 1
"""Steps of one system of a sweep at most (the schedule's index is an int32)."""
MAX_SEED = 2 ** 64 - 1
SERIES = ("consensus", "gamma", "rotation", "direction_tan", "top2_tan", "plane_angle")
STATIC = ("d", "tokens", "heads", "kind", "spectrum", "init", "steps", "attention", "rule", "order",
          "keep_bias", "x64")
"""The static keys: each combination of their values is a group of the grid (see
:mod:`~powerlens._src.sweeps.grid`), compiled once unless only its explicit spectrum differs."""
DYNAMIC = ("beta", "top", "rest", "imag", "pair", "nonnormality", "cone", "noise")
"""The dynamic keys, the numbers a synthetic system is built from: arrays with one entry
per system, arguments of the compiled program."""


def spectrum() -> Key:
    def check(v, where):
        text(None).check(v, where)
        if v != "random":
            try:
                parse_spectrum(v)
            except ValueError as exc:
                fail(where, str(exc))
        return v
    return Key("random", check)


SCHEMA: Dict[str, Dict[str, Key]] = {
    "": {"name": text("sweep", griddable=False), "seed": count(0, 0, griddable=False, maximum=MAX_SEED)},
    "system": {
        "d": count(1, 16), "tokens": count(1, 16), "heads": count(1, 1), "beta": real(1.0),
        "kind": choice(KINDS, "symmetric"), "spectrum": spectrum(),
        "top": interval([1.0, 3.0]), "rest": interval([-0.8, 0.8]), "imag": interval([0.3, 1.5]),
        "pair": real(0.0, 0.0, 1.0), "nonnormality": real(1.0, 0.0),
        "init": choice(INITS, "sphere"), "cone": real(0.5, 0.0, math.pi), "noise": real(0.02, 0.0),
        "replicates": count(1, 1, griddable=False), "builder": text("synthetic", griddable=False),
        "builder_path": text("", griddable=False, empty=True),
    },
    "run": {
        "steps": count(1, 100, maximum=MAX_SYSTEM_STEPS), "attention": choice(ATTENTION_MODES, "softmax"),
        "rule": choice(RULES, "paper"),
        "order": choice(ORDERS, "shifted"), "keep_bias": boolean(False), "x64": boolean(False),
        "chunk_size": count(0, 0, griddable=False), "micro_batch": batch(),
    },
    "measure": {
        "consensus_window": window(), "direction_window": window(), "top2_window": window(),
        "rotation_steps": count(0, 0, griddable=False),
        "converged_consensus": dataclasses.replace(real(1e-3, 0.0), griddable=False),
        "converged_gamma": dataclasses.replace(real(0.99, 0.0, 1.0), griddable=False),
        "bipartite_cos": dataclasses.replace(real(0.95, 0.0, 1.0), griddable=False),
        "series": names(SERIES),
    },
    "model": {"name": text(None, griddable=False), "layers": layer_list(),
              "prompts": names(nonempty=True)},
}
TABLES = ("grid", "system", "run", "measure", "model")


@dataclasses.dataclass(frozen=True)
class Spec:
    """A validated sweep spec with every default filled in.

    Attributes:
      name, seed: the top-level keys.
      grid: ``{key: [values]}`` in the file's order (the last key varies fastest).
      system, run, measure: ``{key: value}`` of the fixed keys (grid keys removed).
      model: the ``[model]`` table (a model sweep) or None (a synthetic sweep).
      source: the file the spec came from (for messages), or ``"<dict>"``.
    """

    name: str
    seed: int
    grid: Dict[str, list]
    system: Dict[str, Any]
    run: Dict[str, Any]
    measure: Dict[str, Any]
    model: Optional[Dict[str, Any]] = None
    source: str = "<dict>"

    def value(self, key: str):
        """The fixed value of a [system] or [run] key (KeyError for a grid key)."""
        for table in (self.system, self.run):
            if key in table:
                return table[key]
        raise KeyError(key)

    @property
    def replicates(self) -> int:
        return len(self.model["prompts"]) if self.model else int(self.system["replicates"])

    @property
    def n_points(self) -> int:
        return math.prod(len(v) for v in self.grid.values()) * (len(self.model["layers"]) if self.model else 1)

    @property
    def n_systems(self) -> int:
        return self.n_points * self.replicates

    def to_dict(self) -> dict:
        """The normalised spec (what the output folder's marker and sweep.json record)."""
        out = {"name": self.name, "seed": self.seed, "grid": dict(self.grid), "system": dict(self.system),
               "run": dict(self.run), "measure": dict(self.measure)}
        if self.model is not None:
            out["model"] = dict(self.model)
        return out


def load_spec(source, overrides: Optional[Mapping] = None) -> Spec:
    """A :class:`Spec` from a TOML path, a raw dict or a Spec; ``overrides`` are merged into
    the raw tables first (``{"system": {"replicates": 4}}``)."""
    if isinstance(source, Spec):
        raw, where = source.to_dict(), source.source
    elif isinstance(source, Mapping):
        where = "<dict>"
        try:
            raw = json.loads(json.dumps(source))
        except RecursionError:
            raise ValueError(f"{where}: nested too deeply to be a sweep spec") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a spec of tables, lists, strings, numbers and booleans ({exc})") from None
    else:
        where = os.fspath(source)
        raw = read_toml(where)
    for table, values in (overrides or {}).items():
        if isinstance(values, Mapping):
            raw.setdefault(table, {}).update(values)
        else:
            raw[table] = values
    return parse(raw, where)


def parse(raw: Mapping, source: str = "<dict>") -> Spec:
    """Validate a raw spec table (see the module docstring for the rules)."""
    try:
        return _parse(raw, source)
    except RecursionError:
        raise ValueError(f"{source}: nested too deeply to be a sweep spec") from None


def _parse(raw: Mapping, source: str) -> Spec:
    where = lambda table, key=None: f"{source}: [{table}]" + ("" if key is None else f" {key}") if table else \
        f"{source}: {key}"
    top = {}
    for key, value in raw.items():
        if key in TABLES:
            if not isinstance(value, Mapping):
                fail(f"{source}: [{key}]", "must be a table")
            continue
        if isinstance(value, Mapping):
            fail(f"{source}: [{key}]", f"unknown table; expected some of {', '.join('[' + t + ']' for t in TABLES)}")
        if key not in SCHEMA[""]:
            fail(f"{source}: {key}", f"unknown key; expected name, seed or the tables {', '.join(TABLES)}")
        top[key] = SCHEMA[""][key].check(value, where("", key))
    model = raw.get("model")
    system = raw.get("system", {})
    builder = {k: SCHEMA["system"][k].check(system[k], where("system", k))
               for k in ("builder", "builder_path") if k in system and model is None}
    name = builder.get("builder", "synthetic")
    if name != "synthetic" and ":" not in name:
        fail(where("system", "builder"), f"must be \"synthetic\" or \"module:function\", got {name!r}")
    if builder.get("builder_path") and name == "synthetic":
        fail(where("system", "builder_path"), "names the file of a custom builder; give builder = \"module:function\"")
    schema = SCHEMA
    if name != "synthetic":       # the rest first (the builder's own keys aside): user code runs only on a valid spec
        _tables(raw, where, schema, defer=True)
        extra = builder_keys(name, builder_file(builder.get("builder_path", ""), source), where)
        schema = {**SCHEMA, "system": {**SCHEMA["system"], **extra}}
    tables, grid = _tables(raw, where, schema)
    system = tables.get("system", {}) if model is None else {}
    spec = Spec(name=top.get("name", "sweep"), seed=top.get("seed", 0), grid=grid, system=system,
                run=tables["run"], measure=tables["measure"], model=tables.get("model"), source=source)
    _check_points(spec, where)
    return spec


def _tables(raw: Mapping, where, schema, defer: bool = False):
    """(tables, grid): every table's keys checked and defaulted, the grid keys moved out.
    ``defer``: keys that [system] or [grid] do not know are skipped (a custom builder's own
    keys, checked once it is imported)."""
    model = raw.get("model")
    tables = {}
    for table in ("system", "run", "measure", "model"):
        given = dict(raw.get(table, {}))
        if table == "model" and model is None:
            continue
        if table == "system" and model is not None and given:
            fail(where("system", next(iter(given))), "does not apply to a model sweep (the model fixes the system)")
        out = {}
        for key, value in given.items():
            if key not in schema[table]:
                if defer and table == "system":
                    continue
                fail(where(table, key), f"unknown key; expected one of {', '.join(schema[table])}")
            out[key] = schema[table][key].check(value, where(table, key))
        for key, k in schema[table].items():
            if key not in out:
                if k.default is None:
                    fail(where(table, key), "is required")
                out[key] = k.default
        tables[table] = out
    grid = _grid(raw.get("grid", {}), tables, model is not None, where, schema, defer)
    return tables, grid


def builder_keys(name: str, path: str, where) -> Dict[str, Key]:
    """The extra [system]/[grid] keys the custom builder ``name`` reads (imported as
    :func:`~powerlens._src.sweeps.sources.host_builder` does): its ``keys`` attribute
    ``{name: default}`` (scalars of the default's type)."""
    try:
        fn = host_builder(name, path)
    except ValueError as exc:
        fail(where("system", "builder_path" if path else "builder"), str(exc).split(": ", 1)[-1])
    declared = getattr(fn, "keys", {})
    if not isinstance(declared, Mapping):
        fail(where("system", "builder"),
              f"{name}.keys must be a dict {{name: default}}, got {type(declared).__name__}")
    out = {}
    for key, default in declared.items():
        if not isinstance(key, str) or any(key in t for t in SCHEMA.values()):
            fail(where("system", "builder"), f"{name} declares the key {key!r}, which the spec already has")
        if isinstance(default, (list, dict)) or default is None:
            fail(where("system", "builder"), f"{name} declares the key {key!r} with the default {show(default)}; "
                                              f"a builder key is a number, a string or a boolean")
        kind = float if isinstance(default, float) else type(default)

        def check(v, w, kind=kind):
            scalar(v, w)
            if isinstance(v, bool) != (kind is bool) or not isinstance(v, (int, float) if kind is float else kind):
                fail(w, f"must be of type {kind.__name__}, got {show(v)}")
            return kind(v)
        out[key] = Key(default, check)
    return out


def _grid(raw_grid: Mapping, tables: dict, is_model: bool, where, schema=SCHEMA, defer: bool = False
          ) -> Dict[str, list]:
    """Move every grid key out of its table; each grid value is checked like a fixed one."""
    owner = {key: table for table in ("system", "run") for key in schema[table]}
    grid = {}
    for key, values in raw_grid.items():
        if key not in owner or (is_model and owner[key] == "system"):
            if defer and key not in owner:
                continue
            allowed = [k for k, t in owner.items() if schema[t][k].griddable and not (is_model and t == "system")]
            fail(where("grid", key), f"unknown grid key; expected some of {', '.join(allowed)}")
        table = owner[key]
        k = schema[table][key]
        if not k.griddable:
            fail(where("grid", key), f"cannot be a grid key; give it once in [{table}]")
        if not isinstance(values, list):
            fail(where("grid", key), f"must be a list of values, got {show(values)}")
        if not values:
            fail(where("grid", key), "has no values: an empty grid")
        if len(values) > MAX_POINTS:
            fail(where("grid", key), f"has {len(values):,} values; a grid has at most {MAX_POINTS:,} points")
        if isinstance(k.default, list) and not all(isinstance(v, list) for v in values):
            fail(where("grid", key), f"each value must be a range [lo, hi], got {show(values)}")
        grid[key] = [k.check(v, where("grid", key)) for v in values]
        if len({tuple(v) if isinstance(v, list) else (type(v), v) for v in grid[key]}) != len(grid[key]):
            fail(where("grid", key), f"repeats a value: {show(values)}")
        tables[table].pop(key, None)
    if not grid and not defer:
        fail(where("grid"), "is empty or missing: an empty grid (give at least one key with a list of values)")
    return grid


def _check_points(spec: Spec, where) -> None:
    """Sizes, heads dividing d, explicit spectra fitting d, the values' precision, the model:
    before any point is expanded."""
    if spec.model is not None:
        _check_model(spec, where)
    n = spec.n_points
    if n > MAX_POINTS:
        sizes = " x ".join(f"{len(v)} {k}" for k, v in spec.grid.items())
        fail(where("grid"), f"has {n:,} points ({sizes}); at most {MAX_POINTS:,} are allowed")
    groups = math.prod(len(v) for k, v in spec.grid.items() if k in STATIC)
    if groups > MAX_GROUPS:
        sizes = " x ".join(f"{len(v)} {k}" for k, v in spec.grid.items() if k in STATIC)
        fail(where("grid"), f"has {groups:,} combinations of the keys that change shapes or code ({sizes}), one "
                             f"compilation each; at most {MAX_GROUPS:,} are allowed")
    if spec.n_systems > MAX_SYSTEMS:
        if spec.model is not None:
            key, what = where("model", "prompts"), f"{len(spec.model['prompts']):,} prompts"
        else:
            key, what = where("system", "replicates"), f"{spec.replicates:,} replicates"
        fail(key, f"{n:,} point{'s' * (n != 1)} x {what} = {spec.n_systems:,} systems; a sweep has at most "
                   f"{MAX_SYSTEMS:,} (one row each)")
    values = lambda key: spec.grid.get(key, [spec.value(key)] if key in spec.system or key in spec.run else [])
    at = lambda key: where("grid" if key in spec.grid else ("run" if key in spec.run else "system"), key)
    if spec.model is not None:
        return
    if "full" in values("rule") and spec.system["builder"] == "synthetic":
        fail(at("rule"), "\"full\" runs the model's own block, FFN included, and a synthetic system has none; "
                          "use paper, post_ln or pre_ln (or a [model] sweep)")
    for d in values("d"):
        for h in values("heads"):
            if d % h:
                fail(where("grid" if "heads" in spec.grid or "d" in spec.grid else "system", "heads"),
                      f"heads={h} does not divide d={d}")
        for s in values("spectrum"):
            if s != "random":
                need = sum(2 if z.imag else 1 for z in parse_spectrum(s))
                if need > d:
                    fail(at("spectrum"), f"{s!r} needs d >= {need} (a complex entry counts twice), got d={d}")
    if "bipartite" in values("init") and min(values("tokens")) < 2:
        fail(at("tokens"), "a bipartite start needs at least 2 tokens")
    if "symmetric" in values("kind"):
        for s in values("spectrum"):
            if s != "random" and any(z.imag for z in parse_spectrum(s)):
                fail(at("spectrum"), f"{s!r} has a complex pair, but kind = \"symmetric\" "
                                      f"needs a real spectrum (use normal or nonnormal)")
    if spec.system["builder"] == "synthetic":        # a custom builder makes its own arrays
        _check_precision(spec, values, at)


def _check_precision(spec: Spec, values, at) -> None:
    """Every number a synthetic system is built from is finite in the dtype it is used in
    (float32 unless every point has x64 = true), and so are a range's width hi - lo and
    |1 + lambda| of an explicit spectrum's eigenvalues (the key they are ordered by)."""
    x64 = all(values("x64"))
    dt, name = (np.float64, "float64") if x64 else (np.float32, "float32")
    where = f"{name}, the precision of {'every point' if x64 else 'the points with x64 = false'}"
    advice = "use a smaller value" + ("" if x64 else " or x64 = true")

    def fits(*xs) -> bool:
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(np.asarray(xs, np.float64).astype(dt)).all())

    for key in DYNAMIC:                   # every value of a key at once (a grid axis may be long)
        vals = values(key)
        with np.errstate(over="ignore", invalid="ignore"):
            cast = np.asarray(vals, np.float64).astype(dt).reshape(len(vals), -1)
            width = cast[:, 1] - cast[:, 0] if cast.shape[1] == 2 else np.zeros(len(vals), dt)
        bad = ~np.isfinite(cast).all(axis=1)
        if bad.any():
            fail(at(key), f"{show(vals[int(np.argmax(bad))])} overflows {where}; {advice}")
        if not np.isfinite(width).all():
            v = vals[int(np.argmax(~np.isfinite(width)))]
            fail(at(key), f"the width hi - lo of {show(v)} overflows {where}; {advice}")
    for s in values("spectrum"):
        if s == "random":
            continue
        for z in parse_spectrum(s):
            with np.errstate(over="ignore", invalid="ignore"):
                ok = fits(z.real, z.imag) and np.isfinite(np.hypot(dt(1.0) + dt(z.real), dt(z.imag)))
            if not ok:
                fail(at("spectrum"), f"the eigenvalue {z:g} of {show(s)} (or |1 + lambda|) overflows {where}; "
                                      f"{advice}")
    if "nonnormal" in values("kind"):
        _check_nonnormality(values, at, dt, where, advice)
    if "bipartite" in values("init"):
        d, noise = max(values("d")), max(values("noise"))
        if noise > noise_limit(d, dt):
            fail(at("noise"), f"{noise:g} overflows {where}: a bipartite start +-v1 + noise G (G a normal draw, "
                               f"|G| <= {NORMAL_MAX[np.dtype(dt)]:.4g}) is normalised by its norm, whose square "
                               f"stays finite for noise <= {noise_limit(d, dt):.4g} at d = {d}; {advice}")


def _check_nonnormality(values, at, dt, where: str, advice: str) -> None:
    """The largest nonnormality s against :func:`~powerlens._src.dynamics.synthetic.nonnormality_limit`
    (S = I + s G / sqrt(d) and S D finite for every normal draw), at the smallest d and the
    largest |Re lambda| + |Im lambda| any point can have (an explicit spectrum's, or the ranges'
    top + imag and rest): one bound for the whole grid, however long."""
    scale = 0.0
    for s in values("spectrum"):
        if s == "random":
            big = lambda key: max(max(abs(lo), abs(hi)) for lo, hi in values(key))
            pair = big("imag") if max(values("pair")) > 0 else 0.0
            scale = max(scale, big("top") + pair, big("rest"))
        else:
            scale = max([scale] + [abs(z.real) + abs(z.imag) for z in parse_spectrum(s)])
    d = min(values("d"))
    limit = nonnormality_limit(d, scale, dt)
    s = max(values("nonnormality"))
    if s > limit:
        eigs = f" and eigenvalues up to |Re| + |Im| = {scale:g}" if scale > 1 else ""
        fail(at("nonnormality"), f"{s:g} overflows {where}: the nonnormal S = I + s G / sqrt(d) (G a normal draw, "
                                  f"|G| <= {NORMAL_MAX[np.dtype(dt)]:.4g}) and S D stay finite for s <= {limit:.4g} "
                                  f"at d = {d}{eigs}; {advice}")


def _check_model(spec: Spec, where) -> None:
    """The model exists; ``layers`` becomes the 0-based numbers of the layers it names (which
    loads the model): every unique layer for ``"all"``, a list checked against the model, a
    negative index counted from the last layer (see :func:`~.sources.model_layers`)."""
    try:
        resolve(spec.model["name"])
    except ValueError as exc:
        fail(where("model", "name"), f"unknown model {spec.model['name']!r} ({' '.join(str(exc).split())})")
    spec.model["layers"] = model_layers(spec)
