"""Sweeps: explicit spectra in [grid] are dynamic values. The groups of every explicit
spectrum share one compiled program (their slots are an argument), and each row is
byte-identical to the row computed with its spectrum compiled in (the grouping before:
one program per spectrum)."""
from __future__ import annotations

import contextlib
import io

import pytest

from jax import monitoring

import powerlens as pl
from powerlens._src.sweeps import engine, grid
from powerlens._src.sweeps.spec import load_spec

SPECTRA = ["1.5,0.4,-0.2", "0.9+0.6j,0.3"]
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"     # one per program (or cache read)


def _spec(spectra=SPECTRA, **system):
    return {"seed": 3, "grid": {"spectrum": list(spectra), "heads": [1, 2]},
            "system": {"d": 4, "tokens": 4, "kind": "normal", "replicates": 3, **system},
            "run": {"steps": 12}}


@contextlib.contextmanager
def compiles():
    """The XLA programs made inside the block: jax's backend-compile events, one per program
    compiled or read back from a persistent compilation cache."""
    seen = []
    listener = lambda event, secs, **kw: seen.append(event) if event == BACKEND_COMPILE_EVENT else None
    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


def _table_bytes(df) -> bytes:
    buf = io.BytesIO()
    df.to_parquet(buf, index=False, engine="pyarrow")
    return buf.getvalue()


def test_explicit_spectra_compile_once_and_give_the_rows_of_one_program_per_spectrum(monkeypatch):
    spec = _spec()
    with compiles() as before_n:
        with monkeypatch.context() as m:       # the grouping before: each spectrum compiled in as a constant
            m.setattr(engine, "program_key", lambda key, value: value)
            old = engine.Engine(load_spec(spec), progress=False)
            assert old.programs == 4
            expected = pl.sweep(spec, progress=False)
    with compiles() as after_n:
        new = engine.Engine(load_spec(spec), progress=False)
        assert len(new.groups) == 4 and new.programs == 2          # one program per heads value
        assert new.describe().endswith("; 2 compilations (by heads; explicit spectra are dynamic values)")
        got = pl.sweep(spec, progress=False)
    assert len(got) == 12 and set(got["spectrum"]) == set(SPECTRA)
    assert _table_bytes(got) == _table_bytes(expected)            # rows do not depend on the grouping
    # XLA compilations of the sweep's programs (helpers compiled by the first run are cached)
    assert len(before_n) >= 4 and len(after_n) == 2, (len(before_n), len(after_n))


def test_a_spectrum_alone_in_system_is_the_rows_of_that_spectrum_in_the_grid():
    """A spectrum given in [system] and the same spectrum as the only value of a [grid] axis:
    the same seeds, the same bytes (where a spectrum is given does not change its rows)."""
    alone = {"seed": 3, "grid": {"beta": [0.5, 2.0]},
             "system": {"d": 4, "tokens": 4, "kind": "nonnormal", "init": "cone", "replicates": 2,
                        "spectrum": SPECTRA[1]}, "run": {"steps": 10}}
    in_grid = {**alone, "grid": {"spectrum": [SPECTRA[1]], "beta": [0.5, 2.0]},
               "system": {k: v for k, v in alone["system"].items() if k != "spectrum"}}
    a, b = pl.sweep(alone, progress=False), pl.sweep(in_grid, progress=False)
    assert list(a["seed"]) == list(b["seed"])
    cols = [c for c in a.columns if c != "spectrum"]
    assert _table_bytes(a[cols]) == _table_bytes(b[cols])


def test_the_keys_that_split_compilations():
    axes = {"spectrum": ["random", "2,0.5", "1+0.5j"], "heads": [1, 2], "beta": [1.0, 2.0], "kind": ["normal"]}
    assert grid.compiled_keys(axes) == ["spectrum", "heads"]      # spectrum: random apart from explicit only
    assert grid.compiled_keys({"spectrum": ["2,0.5", "1+0.5j", "3"], "heads": [1]}) == []
    eng = engine.Engine(load_spec(_spec(["random", *SPECTRA])), progress=False)
    assert len(eng.groups) == 6 and eng.programs == 4            # (random, explicit) x 2 heads
    assert "4 compilations (by spectrum x heads; explicit spectra are dynamic values)" in eng.describe()
    # the systems of an explicit spectrum's group, rebuilt: lambda_1 = 1.5, lambda_2 = 0.4 (shifted order)
    group = next(g for g in eng.groups if g.static["spectrum"] == SPECTRA[0])
    sy = eng.systems_of(group.systems(0, 3))
    assert sy.lam[:, 0].tolist() == [[1.5, 0.0]] * 3 and sy.lam[:, 1, 0].tolist() == pytest.approx([0.4] * 3)
    one = engine.Engine(load_spec({"grid": {"beta": [1.0, 2.0]}, "system": {"d": 4, "tokens": 4}}), progress=False)
    assert one.describe().endswith("; 1 compilation")


def test_explicit_slots_are_the_spectrum_padded_to_d():
    slots = grid.explicit_slots("2,0.5+1j", 5)
    assert slots.tolist() == [[2, 0], [0.5, 1], [0.5, -1], [0, 0], [0, 0]]
    with pytest.raises(ValueError):
        grid.explicit_slots("2,x", 4)
