"""Steering's Adam loop runs from the host in chunks of compiled steps (no host callbacks).

- ``solve_in_chunks`` gives bitwise the same result whatever the chunk size: chunks of 3 (the
  last one masking 2 of its steps) against one scan of all the steps, for the alignment and
  token objectives.
- Every call of the loop has one length, so it is one compiled program: 7 steps in chunks of at
  most 3 are three calls of 3 steps; 30 steps in chunks of at most 25 are two calls of 15.
- A run with progress equals a quiet one bitwise, and the progress sink hears the step count
  at every chunk boundary (20, 40, 60 for 60 steps).
- The compiled programs go to JAX's persistent compilation cache: a second process with the
  same cache folder compiles nothing new (a program with a host callback is never written there,
  so every non-quiet run used to recompile).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_steer_token import D, tiny_decoder  # noqa: E402

import powerlens as pl  # noqa: E402
import powerlens._src.steering.optimize as O  # noqa: E402
from powerlens._src.steering.progress import SteerProgress  # noqa: E402

X0 = np.random.default_rng(0).normal(size=(2, 3, D)).astype(np.float32)
TOKEN = dict(objective="token", target_prob=[0.3, 0.9], max_kl=5.0, controls=[[1, 2], [3]])
FIELDS = ("factor_P", "factor_Q", "norm", "multiplier", "feasible")


def _same(a, b, fields):
    for f in fields:
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f


def _with_chunk(monkeypatch, chunk):
    monkeypatch.setattr(O, "solve_in_chunks", functools.partial(_REAL, chunk=chunk))


_REAL = O.solve_in_chunks


@pytest.mark.parametrize("param", ["lowrank", "activation"])
def test_token_chunks_equal_one_scan(monkeypatch, param):
    import powerlens._src.steering.token as T
    model = tiny_decoder(1, vocab=5)
    runs = []
    for chunk in (3, 1000):
        monkeypatch.setattr(T, "solve_in_chunks", functools.partial(_REAL, chunk=chunk))
        runs.append(pl.optimize_steering(model, X0, [0, 0], param=param, steps=7, **TOKEN))
    _same(*runs, FIELDS + ("target_prob", "control_kl", "shrink", "history_min_target_prob", "history_norm"))
    assert runs[0].history_norm.shape == (2, 7)


@pytest.mark.parametrize("param", ["lowrank", "w_alpha"])
def test_alignment_chunks_equal_one_scan(monkeypatch, param):
    model = tiny_decoder(1, vocab=5)
    u = np.random.default_rng(1).normal(size=(2, D))
    runs = []
    for chunk in (3, 1000):
        _with_chunk(monkeypatch, chunk)
        runs.append(pl.optimize_steering(model.layers, X0, u, target=0.9, steps=7, param=param))
    _same(*runs, FIELDS + ("alignment", "history_alignment", "history_norm"))
    assert runs[0].history_alignment.shape == (2, 7)


def test_every_call_of_the_loop_has_one_length(monkeypatch):
    import powerlens._src.steering.lagrangian as G
    from powerlens._src.steering.lagrangian import chunk_length
    assert [chunk_length(s, 25) for s in (1, 25, 26, 30, 51, 100)] == [1, 25, 13, 15, 17, 25]
    assert [chunk_length(7, 3), chunk_length(6, 3), chunk_length(8, 3)] == [3, 3, 3]
    lengths, real = [], G.map_targets

    def recording(fn, split, shared, mapped, static, mesh=None):
        if "n" in static:
            lengths.append(static["n"])
        return real(fn, split, shared, mapped, static, mesh)
    monkeypatch.setattr(G, "map_targets", recording)
    model = tiny_decoder(1, vocab=5)
    _with_chunk(monkeypatch, 3)
    res = pl.optimize_steering(model.layers, X0, np.ones(D), target=0.9, steps=7)
    assert lengths == [3, 3, 3] and res.history_alignment.shape == (1, 7)
    lengths.clear()
    _with_chunk(monkeypatch, 25)
    pl.optimize_steering(model.layers, X0, np.ones(D), target=0.9, steps=30)
    assert lengths == [15, 15]


class _Recorder(SteerProgress):
    def __init__(self):
        super().__init__(True, stream=open(os.devnull, "w"), interval=100.0)
        self.seen = []

    def step(self, i, p_min, kl, level):
        self.seen.append((i, level, np.isfinite(kl)))
        super().step(i, p_min, kl, level)


def test_progress_between_chunks_and_quiet_equal():
    model = tiny_decoder(1, vocab=5)
    quiet = pl.optimize_steering(model, X0, [0, 0], param="lowrank", steps=60, **TOKEN)
    with _Recorder() as rec:
        rec.stage("t", total=60, levels=[0.3, 0.9])
        loud = pl.optimize_steering(model, X0, [0, 0], param="lowrank", steps=60, progress=True, **TOKEN)
    _same(quiet, loud, FIELDS + ("target_prob", "control_kl", "history_norm", "history_min_target_prob"))
    assert sorted({i for i, _, _ in rec.seen}) == [19, 39, 59]          # 0-based last step of each chunk
    assert sorted({round(lv, 6) for _, lv, _ in rec.seen}) == [0.3, 0.9] and all(k for _, _, k in rec.seen)
    u = np.random.default_rng(1).normal(size=D)
    quiet = pl.optimize_steering(model.layers, X0, u, target=0.9, steps=30)
    with _Recorder() as rec:
        rec.stage("a", total=30, levels=[0.9])
        loud = pl.optimize_steering(model.layers, X0, u, target=0.9, steps=30, progress=True)
    _same(quiet, loud, FIELDS + ("alignment", "history_alignment"))
    assert [i for i, _, _ in rec.seen] == [14, 29] and not any(k for _, _, k in rec.seen)   # no KL: NaN


_CHILD = """
import sys, numpy as np, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
sys.path.insert(0, sys.argv[2])
from jax._src import compiler
compiles = []
real = compiler.backend_compile_and_load
def counted(*a, **k):
    compiles.append(1)
    return real(*a, **k)
compiler.backend_compile_and_load = counted           # every compilation that does not come from the cache
from test_steer_token import D, tiny_decoder
import powerlens as pl
from powerlens._src.steering.progress import SteerProgress
import io
model = tiny_decoder(1, vocab=5)
x0 = np.random.default_rng(0).normal(size=(2, 3, D)).astype(np.float32)
with SteerProgress(True, stream=io.StringIO()) as progress:
    progress.stage("t", total=30)
    pl.optimize_steering(model, x0, [0, 0], objective="token", target_prob=[0.3, 0.9], max_kl=5.0,
                         controls=[[1, 2], [3]], steps=30, progress=True)
print("compiled", len(compiles))
"""


def test_non_quiet_programs_reach_the_persistent_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda: subprocess.run([sys.executable, "-c", _CHILD, str(cache), os.path.dirname(__file__)], env=env,
                                 capture_output=True, text=True, timeout=600)
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(os.listdir(cache)) >= 4 and "compiled 0" not in first.stdout      # start, chunks of 25 and 5, finish
    second = run()
    assert second.returncode == 0, second.stderr[-2000:]
    assert "compiled 0" in second.stdout, second.stdout     # every program came from the cache
