"""Hostile and careless input on the dynamics and command side (issue 10).

Every case reproduces a defect first. CLI cases run ``powerlens.cli.main`` and assert the
exit code, the one-line message naming the culprit, and that nothing was written (the
``--out`` folder does not exist afterwards). The memory cases that would exhaust the
machine if the refusal regressed run in a subprocess under an address-space limit.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from powerlens.cli import main
from powerlens._src.dynamics.params import LayerConfig, make_layers
from powerlens._src.dynamics.schedule import Schedule
from powerlens._src.dynamics.synthetic import synthetic_system
from powerlens._src.models.npz import save_weights_npz


def cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def error_line(err: str, command: str) -> str:
    """The one error line of a refused command (no traceback, nothing else said)."""
    assert "Traceback" not in err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"powerlens {command}: error: "), lines[0]
    return lines[0]


def refused(argv, capsys, out, *needles) -> str:
    """Run ``argv --out out``: exit 2, one line naming every needle, nothing written."""
    code, _, err = cli(list(argv) + ["--out", str(out)], capsys)
    assert code == 2, err
    line = error_line(err, argv[0])
    for needle in needles:
        assert needle in line, (needle, line)
    assert not os.path.exists(out)
    return line


# ------------------------------------------------------------------ 1. compact schedules

def test_shared_schedule_of_a_billion_steps_costs_nothing():
    layers = synthetic_system([2.0, 0.5], d=4)
    t0 = time.perf_counter()
    shared = layers.shared(0, 10**9)
    hash(shared.config)
    assert shared.config == layers.shared(0, 10**9).config
    synthetic_system([2.0, 0.5], d=4, steps=10**9)
    assert time.perf_counter() - t0 < 1.0
    assert len(pickle.dumps(shared.config)) < 2000
    s = shared.schedule
    assert len(s) == 10**9 and s[0] == 0 and s[-1] == 0 and s[10**9 - 1] == 0
    with pytest.raises(IndexError):
        s[10**9]
    assert s[5:8] == (0, 0, 0) and len(s[:-1]) == 10**9 - 1 and len(s[10:]) == 10**9 - 10
    assert np.asarray(s[100:104]).tolist() == [0, 0, 0, 0]
    assert s.array(10, 14).dtype == np.int32 and s.array(10, 14).tolist() == [0] * 4


def test_schedule_semantics_are_those_of_a_tuple():
    assert Schedule.of((0, 0, 0)) == Schedule.repeat(0, 3) == (0, 0, 0)
    assert hash(Schedule.of((0, 0, 0))) == hash(Schedule.repeat(0, 3))
    assert Schedule.range(4) == (0, 1, 2, 3) == Schedule.of([0, 1, 2, 3]) and Schedule.range(4)[1:3] == (1, 2)
    albert = Schedule.of((0, 1, 0, 1, 2, 3))
    assert albert == (0, 1, 0, 1, 2, 3) and list(albert) == [0, 1, 0, 1, 2, 3] and albert[-2:] == (2, 3)
    assert albert != (0, 1) and albert != Schedule.range(6)
    assert albert.steps_of(1) == (1, 3) and tuple(Schedule.repeat(0, 5).steps_of(0)) == tuple(range(5))
    assert not Schedule.of(()) and len(Schedule.repeat(0, 5)[5:]) == 0
    assert jnp.asarray(Schedule.range(3)).tolist() == [0, 1, 2]


def test_compact_schedules_are_validated_without_expanding_them():
    from powerlens._src.steering.alpha import steered_steps
    from powerlens._src.steering.effects import last_step
    layers = synthetic_system([2.0, 0.5], d=4)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"schedule refers to layer\(s\) \[3\] but only 1 exist"):
        layers.with_schedule(Schedule.repeat(3, 10**9))
    with pytest.raises(ValueError, match=r"at least one step"):
        layers.with_schedule(Schedule.repeat(0, 0))
    shared = layers.shared(0, 10**9)
    assert len(steered_steps(shared, 0)) == 10**9 and last_step(shared, 0) == 10**9 - 1
    assert time.perf_counter() - t0 < 1.0


def test_run_over_a_compact_schedule_equals_the_explicit_one():
    from powerlens._src import dynamics as pl
    layers = synthetic_system([2.0, 0.5, 0.1 + 0.4j], d=6, heads=2, kind="normal", seed=1)
    x0 = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    obs = lambda: {"final": pl.final(), "consensus": pl.consensus()}
    compact = pl.run(layers.shared(0, 9), x0, None, rule="paper", attention="softmax", observers=obs())
    explicit = pl.run(layers, x0, None, rule="paper", attention="softmax", observers=obs(),
                      schedule=np.zeros(9, np.int32))
    np.testing.assert_array_equal(np.asarray(compact["final"]), np.asarray(explicit["final"]))
    np.testing.assert_array_equal(np.asarray(compact["consensus"].consensus),
                                  np.asarray(explicit["consensus"].consensus))
    # a layer-varying stack: its default schedule 0..U-1 is arithmetic, no index array needed
    two = make_layers(np.concatenate([layers.W_v, 0.5 * layers.W_v]), np.concatenate([layers.W_o, layers.W_o]),
                      W_q=np.concatenate([layers.W_q] * 2), W_k=np.concatenate([layers.W_k] * 2))
    a = pl.run(two, x0, None, rule="paper", attention="softmax", observers={"final": pl.final()})["final"]
    b = pl.run(two, x0, None, rule="paper", attention="softmax", observers={"final": pl.final()},
               schedule=np.arange(2))["final"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ 2. memory and time

def test_memory_estimate_names_its_parts(monkeypatch):
    from powerlens._src.commands import budget
    est = budget.run_estimate(steps=10**9, batch=1, tokens=16, d=4, heads=1, d_head=4, itemsize=4,
                              save_states=True)
    assert est.total > 10**12 and est.parts["states"] >= (10**9 + 1) * 16 * 4 * 4
    assert 0 < budget.available_bytes() < float("inf")
    monkeypatch.setattr(budget, "available_bytes", lambda: 22.9 * 2**30)
    with pytest.raises(ValueError, match=r"needs about [\d.]+ [PT]iB \(.*states [\d.]+ [GTP]iB.*\), more than the "
                                         r"22\.9 GiB available"):
        budget.check(est)
    assert budget.format_bytes(1.2 * 2**40) == "1.2 TiB" and budget.format_bytes(512) == "512 B"


def test_simulate_refuses_a_billion_saved_states(tmp_path, capsys):
    t0 = time.perf_counter()
    refused(["simulate", "--spectrum", "3,1", "--steps", "1000000000", "--save-states", "--quiet"], capsys,
            tmp_path / "out", "needs about", "states", "available")
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("argv,needle", [
    (["--steps", "1000000000"], "per-step measures"),
    (["--tokens", "200000", "--steps", "3"], "attention"),
    (["--batch", "100000000", "--steps", "3"], "initial tokens"),
])
def test_simulate_refuses_what_does_not_fit(argv, needle, tmp_path, capsys):
    t0 = time.perf_counter()
    refused(["simulate", "--spectrum", "3,1", "--quiet"] + argv, capsys, tmp_path / "out", "needs about", needle,
            "available")
    assert time.perf_counter() - t0 < 10


def test_simulate_refuses_when_memory_is_short(tmp_path, capsys, monkeypatch):
    from powerlens._src.commands import budget
    monkeypatch.setattr(budget, "available_bytes", lambda: 1000.0)
    refused(["simulate", "--spectrum", "3,1", "--steps", "5", "--quiet"], capsys, tmp_path / "out",
            "more than the 1000 B available")


def test_align_refuses_a_billion_shared_steps(tmp_path, capsys):
    refused(["align", "minilm", "--text", "The cat sat on the mat.", "--shared-layer", "0", "--steps", "1000000000",
             "--quiet"], capsys, tmp_path / "out", "needs about", "available")


def test_steer_and_spectrum_check_memory(tmp_path, capsys, monkeypatch):
    from powerlens._src.commands import budget
    monkeypatch.setattr(budget, "available_bytes", lambda: 1000.0)
    refused(["spectrum", "--spectrum", "3,1", "--dim", "8"], capsys, tmp_path / "s", "available")
    layers = synthetic_system([2.0, 0.5], d=4)
    save_weights_npz(str(tmp_path / "w.npz"), layers)
    np.save(tmp_path / "x0.npy", np.eye(4)[:3])
    refused(["steer", "--weights", str(tmp_path / "w.npz"), "--init", str(tmp_path / "x0.npy"), "--direction",
             "random"], capsys, tmp_path / "t", "available")


_UNDER_LIMIT = """
import resource, sys
lim = 4 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
from powerlens.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("extra", [[], ["--save-states"]])
def test_billion_steps_fail_fast_under_a_memory_limit(tmp_path, extra):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _UNDER_LIMIT, "simulate", "--spectrum", "3,1", "--steps",
                           "1000000000", "--quiet", "--out", str(out)] + extra,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs about" in error_line(proc.stderr, "simulate")
    assert time.perf_counter() - t0 < 60 and not out.exists()


def test_long_runs_are_chunked_with_progress(capsys):
    from powerlens._src.analysis.experiment import chunk_steps, run_system
    assert chunk_steps(50) == 50 and chunk_steps(10**4) == 100 and chunk_steps(10**6) == 10**4
    assert -(-10**9 // chunk_steps(10**9)) <= 10**5
    layers = synthetic_system([2.0, 0.5], d=8).shared(0, 20000)
    x0 = np.random.default_rng(0).standard_normal((16, 8))
    t0 = time.perf_counter()
    res = run_system(layers, x0, progress=True)
    assert time.perf_counter() - t0 < 60
    assert res.measures.consensus.shape == (20001,)
    err = capsys.readouterr().err
    assert "simulate:" in err and "/20000" in err


def test_interrupt_between_chunks_exits_130_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from powerlens._src.analysis import experiment
    calls = []
    real = experiment.simulate_batch

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(experiment, "simulate_batch", interrupted)
    out = tmp_path / "out"
    code, _, err = cli(["simulate", "--spectrum", "3,1", "--steps", "250", "--quiet", "--out", str(out)], capsys)
    assert code == 130 and len(calls) == 2 and "interrupted" in err
    assert not out.exists()


# ------------------------------------------------------------------ 3. non-finite states

def _scaled_weights(path, factor, *, dtype=np.float32):
    """A small softmax system with W_q, W_k, W_v, W_o scaled by ``factor``. Seed 2: every
    product W_o[i,k] V[k,j] is below 0.9, so the scaled F = W_o V stays finite up to a factor
    of 1e154 in float64 (1e19 in float32), and only the states overflow."""
    layers = synthetic_system([1.5, 0.5], kind="normal", d=6, heads=2, seed=2, dtype=np.float64)
    arrays = {k: np.asarray(getattr(layers, k), np.float64) * factor for k in ("W_q", "W_k", "W_v", "W_o")}
    np.savez(path, **{k: a[0] for k, a in arrays.items()})
    return str(path)


def test_scaled_weights_pre_ln_reports_true_numbers(tmp_path, capsys):
    """Weights x 1e18, rule pre_ln, --x64: states are finite (~1e36); every measure is
    computed scale-free, so gamma and consensus are numbers and the pairwise cosine is that
    of the saved states (it was -1/(n-1) from an overflow). In float32 the LayerNorm of such
    states overflows, and the run is refused (tests/test_hostile_inputs2.py)."""
    path = _scaled_weights(tmp_path / "big.npz", 1e18)
    out = tmp_path / "out"
    code, _, err = cli(["simulate", "--weights", path, "--rule", "pre_ln", "--steps", "6", "--tokens", "8",
                        "--save-states", "--quiet", "--x64", "--out", str(out)], capsys)
    assert code == 0, err
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    S = np.load(out / "states.npy").astype(np.float64)
    assert np.all(np.isfinite(S)) and np.abs(S).max() > 1e35
    for t, row in enumerate(steps):
        X = S[t] / np.linalg.norm(S[t], axis=1, keepdims=True)
        n = len(X)
        cos = (np.sum(X.sum(0) ** 2) - n) / (n * (n - 1))
        R = S[t] - S[t].mean(0)
        assert row["pairwise_cos"] == pytest.approx(cos, abs=1e-4)
        assert row["consensus"] == pytest.approx(np.linalg.norm(R) / np.linalg.norm(S[t]), rel=1e-4)
        assert row["gamma"] is not None and 0 <= row["gamma"] <= 1 + 1e-6
        if t:
            assert row["rho"] is not None


def test_overflowing_state_fails_naming_the_step(tmp_path, capsys):
    path = _scaled_weights(tmp_path / "huge.npz", 1e19)     # F ~ 1e38 is finite, F LN(x) is not
    line = refused(["simulate", "--weights", path, "--rule", "pre_ln", "--steps", "6", "--tokens", "8", "--quiet"],
                   capsys, tmp_path / "out", "non-finite at step 1", "rule pre_ln", "--x64")
    assert "smaller weights" in line


def test_overflowing_layer_matrix_names_the_layer(tmp_path, capsys):
    path = _scaled_weights(tmp_path / "huge.npz", 1e20)     # F = O V ~ 1e40 overflows float32 itself
    refused(["simulate", "--weights", path, "--rule", "pre_ln", "--steps", "6", "--tokens", "8", "--quiet"],
            capsys, tmp_path / "out", "F contains non-finite values at layer(s) [0]", "float32")


def test_overflow_in_float64_does_not_suggest_x64(tmp_path, capsys):
    path = _scaled_weights(tmp_path / "vast.npz", 1e154)
    line = refused(["simulate", "--weights", path, "--rule", "pre_ln", "--steps", "4", "--tokens", "8", "--x64",
                    "--quiet"], capsys, tmp_path / "out", "non-finite at step 1")
    assert "--x64" not in line


def test_paper_rule_overflow_names_the_step(tmp_path, capsys):
    path = _scaled_weights(tmp_path / "big.npz", 1e18)
    refused(["simulate", "--weights", path, "--steps", "6", "--tokens", "8", "--quiet"], capsys, tmp_path / "out",
            "non-finite at step 1", "rule paper")


def test_finite_observer_flags_inf_nan_and_zero_tokens_but_not_padding():
    from powerlens._src.dynamics.observers import Step, finite
    valid = jnp.asarray([True, True, False])
    ob = finite()
    X = jnp.ones((3, 2))
    flag = lambda Y: bool(ob.update(ob.init(X, valid, None), X, jnp.asarray(Y), Step(0, 0, valid))[1])
    assert bool(ob.init(X, valid, None)) and flag([[1.0, 2.0], [3.0, 4.0], [np.nan, 0.0]])
    assert not flag([[1.0, np.inf], [3.0, 4.0], [1.0, 1.0]])
    assert not flag([[1.0, np.nan], [3.0, 4.0], [1.0, 1.0]])
    assert not flag([[1.0, 2.0], [np.nan, 4.0], [1.0, 1.0]]) and not flag([[1.0, 2.0], [3.0, -np.inf], [1.0, 1.0]])
    assert not flag([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])


def test_measures_of_huge_finite_states_are_scale_free():
    from powerlens._src.dynamics import measures as DM
    from powerlens._src.dynamics.observers import Step, alignment
    from powerlens._src.dynamics.subspaces import Subspaces
    rng = np.random.default_rng(3)
    X = rng.standard_normal((7, 5)).astype(np.float32)
    valid = jnp.asarray([True] * 6 + [False])
    big = jnp.asarray(X * np.float32(1e36))
    assert np.all(np.isfinite(np.asarray(big)))
    B = jnp.asarray(np.linalg.qr(rng.standard_normal((5, 2)))[0], jnp.float32)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
    close(DM.token_alignment(big, B), DM.token_alignment(jnp.asarray(X), B))
    for f in (DM.consensus_distance, DM.rank_collapse_residual, DM.mean_pairwise_cosine):
        close(f(big, valid), f(jnp.asarray(X), valid))
    c_big, c = DM.consensus_measures(big, valid), DM.consensus_measures(jnp.asarray(X), valid)
    # tiny: squares of 1e-30 underflow in float32; a padding row of ones and one of inf change nothing
    tiny = jnp.asarray(X * np.float32(1e-30)).at[6].set(1.0)
    c_tiny = DM.consensus_measures(tiny, valid)
    c_inf = DM.consensus_measures(jnp.asarray(X).at[6].set(np.inf), valid)
    for name in ("consensus", "rank_collapse", "pairwise_cos"):
        assert np.isfinite(float(getattr(c_big, name)))
        close(getattr(c_big, name), getattr(c, name))
        close(getattr(c_tiny, name), getattr(c, name))
        close(getattr(c_inf, name), getattr(c, name))
    # a non-finite valid token makes every consensus measure NaN, never a number
    for bad in (np.inf, -np.inf, np.nan):
        c_bad = DM.consensus_measures(jnp.asarray(X).at[2, 1].set(bad), valid)
        assert all(np.isnan(float(getattr(c_bad, k))) for k in ("consensus", "rank_collapse", "pairwise_cos"))
    basis = jnp.zeros((1, 3, 5, 2), jnp.float32).at[:, :, :, :].set(B)
    subs = Subspaces(basis=basis, dim=jnp.full((1, 3), 2, jnp.int32), names=("principal", "random", "other_layer"))
    layers = synthetic_system([1.0 + 0.5j, 0.2], kind="normal", d=5, seed=0)
    ob = alignment(subs)
    X2 = X + 0.7 * rng.standard_normal(X.shape).astype(np.float32)            # the state after the step
    step = lambda a, b: ob.update(ob.init(a, valid, layers), a, b, Step(t=0, layer=0, valid=valid))
    _, out_big = step(big, jnp.asarray(X2 * np.float32(1e36)))
    _, out = step(jnp.asarray(X), jnp.asarray(X2))
    assert np.all(np.isfinite(np.asarray(out_big.gamma)))
    close(out_big.gamma, out.gamma)
    close(out_big.rho, out.rho)


# ------------------------------------------------------------------ 4. symmetric spectra

def test_symmetric_system_has_no_complex_eigenvalues(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = cli(["simulate", "--spectrum", "3,1", "--dim", "16", "--kind", "symmetric", "--steps", "3",
                        "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    layer = json.loads((out / "metrics.json").read_text())["layers"][0]
    for key in ("eigenvalues_shifted", "eigenvalues_plain"):
        assert all(im == 0.0 for _, im in layer[key]), layer[key]
    assert layer["complex"] is False and layer["complex_plain"] is False
    assert layer["eigenvalues_shifted"][0][0] == pytest.approx(3.0, rel=1e-6)


def test_numerically_symmetric_F_is_real_but_a_rotation_is_not():
    from powerlens._src.analysis.spectra import layer_spectra
    from powerlens._src.dynamics.synthetic import spectrum_matrix
    F = spectrum_matrix([3.0, 1.0], kind="symmetric", d=16, seed=0)
    F32 = F.astype(np.float32).astype(np.float64) + 1e-9 * np.random.default_rng(1).standard_normal(F.shape)
    s = layer_spectra(F32)[0]
    for o in (s.shifted, s.plain):
        assert np.all(o.eigenvalues.imag == 0) and not o.is_complex
    np.testing.assert_allclose(np.sort(s.shifted.eigenvalues.real)[-2:], [1.0, 3.0], atol=1e-6)
    rot = spectrum_matrix([0.5 + 1e-3j, 0.1], kind="normal", d=6, seed=0)
    assert layer_spectra(rot)[0].shifted.is_complex


# ------------------------------------------------------------------ 5. messages

def test_non_utf8_prompts_name_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"a fine prompt\n\xff\xfe not utf-8\n")
    refused(["align", "minilm", "--prompts", str(bad), "--quiet"], capsys, tmp_path / "out", str(bad), "line 2",
            "UTF-8")


@pytest.mark.parametrize("content", [b"", b"\n  \n\t\n"])
def test_empty_prompts_file_says_it_is_empty(content, tmp_path, capsys):
    empty = tmp_path / "prompts.txt"
    empty.write_bytes(content)
    refused(["align", "minilm", "--prompts", str(empty), "--quiet"], capsys, tmp_path / "out", str(empty), "empty")


def test_spectrum_errors_name_the_flag(tmp_path, capsys):
    refused(["simulate", "--spectrum", "3,abc", "--quiet"], capsys, tmp_path / "a", "--spectrum", "'abc'")
    refused(["simulate", "--spectrum", "3,,1", "--quiet"], capsys, tmp_path / "b", "--spectrum")
    refused(["simulate", "--spectrum", "3,inf", "--quiet"], capsys, tmp_path / "c", "--spectrum")
    code, _, err = cli(["simulate", "--spectrum=-0.5,1", "--steps", "2", "--quiet", "--out", str(tmp_path / "d")],
                       capsys)
    assert code == 0, err


# ------------------------------------------------------------------ 6. types, not casts

def _arrays(**over):
    rng = np.random.default_rng(0)
    a = dict(W_v=rng.standard_normal((1, 2, 3, 6)), W_o=rng.standard_normal((1, 6, 6)),
             W_q=rng.standard_normal((1, 2, 3, 6)), W_k=rng.standard_normal((1, 2, 3, 6)))
    a.update(over)
    return a


@pytest.mark.parametrize("name", ["W_v", "W_o", "W_q", "b_o", "norm_scale"])
@pytest.mark.parametrize("kind", ["complex", "bool", "str", "object"])
def test_make_layers_rejects_wrong_dtypes(name, kind):
    shape = {"b_o": (1, 6), "norm_scale": (1, 6)}.get(name) or _arrays()[name].shape
    a = np.ones(shape)
    bad = {"complex": a * (1 + 1j), "bool": a > 0, "str": np.full(shape, "x"), "object": a.astype(object)}[kind]
    with pytest.raises(ValueError, match=rf"{name}.*(complex|bool|str|object|<U|numeric|real)"):
        make_layers(**_arrays(**{name: bad}))


@pytest.mark.parametrize("window,needle", [(-3, "window"), (np.array([-1]), "window"), (1.5, "window"),
                                           ("2", "window"), (True, "window"),
                                           (np.array([2.0]), "window")])
def test_make_layers_rejects_bad_windows(window, needle):
    with pytest.raises(ValueError, match=needle):
        make_layers(**_arrays(), window=window)


def test_make_layers_accepts_integer_windows():
    assert np.asarray(make_layers(**_arrays(), window=np.int64(3)).window).tolist() == [3]
    assert np.asarray(make_layers(**_arrays(), window=[2]).window).tolist() == [2]


@pytest.mark.parametrize("causal", ["no", "False", 1, 0.0, None, np.array([True, False])])
def test_layer_config_causal_must_be_a_bool(causal):
    with pytest.raises(ValueError, match="causal"):
        LayerConfig(d_model=6, n_heads=2, d_head=3, causal=causal)


def test_layer_config_accepts_numpy_bools():
    assert LayerConfig(d_model=6, n_heads=2, d_head=3, causal=np.bool_(True)).causal is True
    assert LayerConfig(d_model=6, n_heads=2, d_head=3, causal=np.array(False)).causal is False
