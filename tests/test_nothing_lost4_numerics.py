"""Silent numbers from float32 overflow, tokenizer files that name no file, ``top_tokens`` on
text, and ``haar`` on a (d, k) input with k < d.

Each test fails on the code before the fix: the nonnormal builder's principal basis overflowed
past s ~ 1.8e19 (every row: final_gamma 0, direction_rate 1, ``finite`` True); a bad
``tokenizer.json`` raised json/tokenizers errors naming no file; ``top_tokens(model, ["text"])``
raised JAX's TypeError; ``haar`` of a jnp (d, k) array failed for 1 < k < d and returned a
d x d matrix for k = 1.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerlens._src.dynamics import synthetic as syn
from powerlens._src.dynamics.linalg import gram_schmidt, haar, haar_q, pow2_scale, scaled_norm
from powerlens._src.sweeps.spec import load_spec

TINY = {"system": {"d": 4, "tokens": 4, "kind": "nonnormal", "spectrum": "2,0.5,-0.3"},
        "run": {"steps": 40, "attention": "uniform"}}


def _spec(grid, x64=False, **system):
    return {"grid": grid, "system": {**TINY["system"], **system}, "run": {**TINY["run"], "x64": x64}}


# ------------------------------------------------------------------ item 2: nonnormality and float32

def test_normal_max_is_the_samplers_extreme_draw():
    for dt in (np.float32, np.float64):
        lo = np.nextafter(np.array(-1.0, dt), np.array(0.0, dt), dtype=dt)     # jax.random.normal's lowest u
        with jax.enable_x64(dt == np.float64):
            z = float(np.sqrt(2.0) * jax.scipy.special.erfinv(jnp.asarray(lo, dt)))
            draws = jax.random.normal(jax.random.key(0), (1 << 20,), dt)
            assert float(jnp.max(jnp.abs(draws))) <= syn.NORMAL_MAX[np.dtype(dt)]
        assert abs(z) <= syn.NORMAL_MAX[np.dtype(dt)] <= abs(z) * (1 + 1e-6)


def test_spec_refuses_a_nonnormality_whose_S_overflows_the_dtype():
    # S = I + s G / sqrt(d), |G| <= 5.42 in float32: with eigenvalues up to 2 (|Re| + |Im|),
    # S D stays finite for s <= (fmax / 2 - 1) * 2 / 5.4199834 = 6.278e37 at d = 4
    limit = (float(np.finfo(np.float32).max) / 2.0 - 1.0) * 2.0 / 5.4199834
    assert syn.nonnormality_limit(4, 2.0, np.float32) == pytest.approx(limit, rel=1e-12)
    load_spec(_spec({"nonnormality": [1e3, 1e20, 1e30, 0.99 * limit]}))                # accepted
    with pytest.raises(ValueError) as e:
        load_spec(_spec({"nonnormality": [1e3, 1.01 * limit]}))
    line = str(e.value)
    assert "\n" not in line and "[grid] nonnormality" in line and "overflows float32" in line \
        and "x64 = true" in line, line
    load_spec(_spec({"nonnormality": [1.01 * limit, 1e300]}, x64=True))               # fits float64
    with pytest.raises(ValueError, match="overflows float64"):
        load_spec(_spec({"nonnormality": [1e308]}, x64=True))
    load_spec(_spec({"nonnormality": [1e38]}, kind="normal"))                           # not used: not checked
    with pytest.raises(ValueError, match="nonnormality 1e\\+38 overflows float32"):
        syn.synthetic_system([2.0, 0.5], kind="nonnormal", d=4, nonnormality=1e38)


def test_spec_refuses_a_bipartite_noise_whose_squares_overflow():
    # +-v1 + noise G is normalised: its squared norm <= d (1 + noise 5.42)^2 must fit float32
    limit = (np.sqrt(float(np.finfo(np.float32).max) / 4) - 1) / 5.4199834
    assert syn.noise_limit(4, np.float32) == pytest.approx(limit, rel=1e-12)
    bip = dict(kind="symmetric", init="bipartite", spectrum="random")
    load_spec(_spec({"noise": [0.1, 0.99 * limit]}, **bip))
    with pytest.raises(ValueError, match="\\[grid\\] noise: .* overflows float32.*x64 = true"):
        load_spec(_spec({"noise": [0.1, 1.01 * limit]}, **bip))
    load_spec(_spec({"noise": [1e30]}, x64=True, **bip))


@pytest.mark.parametrize("dtype,s", [(np.float32, 1e20), (np.float32, 1e30), (np.float64, 1e30),
                                     (np.float64, 1e200)])
def test_a_huge_nonnormality_gives_a_true_eigenbasis(dtype, s):
    # past s ~ 1e8 (float32) the identity of S = I + s G / sqrt(d) is below rounding: F = S D S^-1
    # is G D G^-1, a valid system with the same spectrum, whose principal eigenvector is the
    # first column of G, normalised; the basis must be that eigenvector (it was 0 past 1.8e19)
    _, f = syn.synthetic_system([2.0, 0.5, -0.3], kind="nonnormal", d=4, seed=1, dtype=dtype, nonnormality=s,
                                facts=True)
    F, p = f["F"].astype(np.float64), f["principal"][:, 0].astype(np.float64)
    eps = float(np.finfo(dtype).eps)
    assert f["principal_dim"] == 1 and np.linalg.norm(p) == pytest.approx(1.0, abs=10 * eps)
    assert np.linalg.norm(F @ p - 2.0 * p) <= 100 * eps * np.linalg.norm(F)          # F p = lambda_1 p
    w, V = np.linalg.eig(F)                                                             # independent: LAPACK
    v = np.real(V[:, np.argmax(np.abs(1 + w))])
    assert abs(v @ p) / np.linalg.norm(v) == pytest.approx(1.0, abs=100 * eps)


def test_the_issue_sweep_reports_the_right_numbers():
    # float32 rows at s = 1e20 and 1e30 (before: final_gamma 0, direction_rate 1, finite True):
    # the tokens align with v1 (the gap |1 + 2| vs |1 + 0.5|), and the measured direction rate is
    # the predicted |1 + lambda_2| / |1 + lambda_1| = 1.5 / 3, as closely as in the in-range row
    # s = 1e3 (0.478: the per-token normalisation and the nonnormal transient bend the fit by a few %)
    from powerlens._src.sweeps.api import sweep
    df = sweep(_spec({"nonnormality": [1e3, 1e20, 1e30]}), progress=False)
    assert df["finite"].all()
    np.testing.assert_allclose(df["direction_rate_pred"], 0.5, rtol=1e-5)
    np.testing.assert_allclose(df["direction_rate"], 0.5, rtol=0.06)
    assert (df["final_gamma"] > 1 - 1e-5).all()


def test_a_degenerate_basis_makes_the_run_non_finite(monkeypatch):
    # a basis with a zero kept column measures nothing: the system's W_o is NaN, so a sweep row
    # reads finite False and its measures are null (before: gamma 0, direction rate 1, finite True)
    fresh = lambda: jax.jit(lambda seed, values, cfg: syn.synthetic(seed, values, cfg), static_argnames="cfg")
    seed, values, cfg = syn.synthetic_inputs([2.0, 0.5], kind="nonnormal", d=4, nonnormality=3.0)
    good, _ = fresh()(seed, values, cfg)
    assert np.isfinite(good.W_o).all()
    monkeypatch.setattr(syn, "gram_schmidt", lambda A, keep: jnp.zeros_like(A))
    build = fresh()                                  # a new program (build's cached one has the real basis)
    bad, facts = build(seed, values, cfg)
    assert np.isnan(bad.W_o).all() and np.isfinite(facts["F"]).all()
    monkeypatch.setattr(syn, "build", build)
    with pytest.raises(ValueError, match="degenerate eigenbasis"):
        syn.synthetic_system([2.0, 0.5], kind="nonnormal", d=4, nonnormality=3.0)


def test_scaled_norm_is_the_plain_norm_in_range_and_right_outside():
    g = jax.random.normal(jax.random.key(3), (50, 7))
    plain = jax.jit(jax.vmap(jnp.linalg.norm))(g)
    assert np.array_equal(jax.jit(jax.vmap(scaled_norm))(g), plain)                  # bit for bit
    assert np.array_equal(scaled_norm(np.asarray(g)), np.linalg.norm(np.asarray(g), axis=-1))
    for scale in (1e20, 1e36, 1e-25, 1e-40):                                          # squares over/underflow
        v = jnp.asarray([3.0, -4.0, 0.0], jnp.float32) * jnp.float32(scale)
        assert float(scaled_norm(v)) == pytest.approx(5.0 * float(jnp.float32(scale)), rel=1e-6)
    assert float(scaled_norm(jnp.asarray([3e20, 4e20]), small=False)) == pytest.approx(5e20, rel=1e-6)
    assert not np.isfinite(scaled_norm(jnp.asarray([jnp.inf, 1.0]))) and np.isnan(scaled_norm(jnp.asarray([jnp.nan])))
    assert float(pow2_scale(jnp.float32(3.0))) == 4.0 and pow2_scale(np.float64(0.0)) == 1.0


def test_gram_schmidt_of_huge_or_tiny_columns_is_orthonormal():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((5, 2))
    want = np.asarray(gram_schmidt(jnp.asarray(A, jnp.float32), jnp.array([True, True])))
    for scale in (1e20, 1e-25):                                     # squares overflow / flush to 0 in float32
        got = np.asarray(gram_schmidt(jnp.asarray(A * scale, jnp.float32), jnp.array([True, True])))
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_mean_tangent_and_complex_planes_of_huge_states_and_weights():
    from powerlens._src.dynamics.observers import _mean_tangent, complex_pair_planes
    from powerlens._src.dynamics.subspaces import Subspaces
    # tan(mean, span) is scale-free: tokens x 1e20 (squares overflow float32) give the same tangent
    rng = np.random.default_rng(1)
    X = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    B = jnp.asarray(np.linalg.qr(rng.standard_normal((5, 2)))[0], jnp.float32)
    valid = jnp.ones(4, bool)
    tan = _mean_tangent(B)
    assert float(tan(X * 1e20, valid)) == pytest.approx(float(tan(X, valid)), rel=1e-5)
    # a complex pair's plane is one at any weight scale: B^T F B x 1e20 squares past float32 in the
    # discriminant (both of its terms: inf - inf was NaN, "not a plane")
    layers, f = syn.synthetic_system([0.5 + 1.2j, 0.1], kind="nonnormal", d=3, seed=2, nonnormality=2.0,
                                     facts=True)
    sub = Subspaces(basis=jnp.asarray(f["direction"], jnp.float32)[None, None], dim=jnp.array([[2]]),
                    names=("principal",))
    assert bool(complex_pair_planes(sub, layers, 0)[0])
    assert bool(complex_pair_planes(sub, layers.replace(W_o=layers.W_o * 1e20), 0)[0])


# ------------------------------------------------------------------ also: haar on (d, k)

@pytest.mark.parametrize("d,k", [(6, 1), (6, 3), (6, 6), (1, 1)])
def test_haar_gives_k_orthonormal_columns_and_both_branches_agree(d, k):
    G = np.random.default_rng(d * 10 + k).standard_normal((d, k))
    Qn = haar(G)
    Qj = np.asarray(haar(jnp.asarray(G, jnp.float32)))
    assert Qn.shape == Qj.shape == (d, k)
    np.testing.assert_allclose(Qn.T @ Qn, np.eye(k), atol=1e-12)
    np.testing.assert_allclose(Qj, Qn, atol=1e-5)                   # the thin QR with diag R > 0 is unique
    R = Qn.T @ G                                                    # G = Q R, R upper triangular, diag > 0
    np.testing.assert_allclose(np.tril(R, -1), 0, atol=1e-12)
    assert (np.diag(R) > 0).all()


def test_haar_square_output_is_unchanged():
    # k = d is the builder's Q of every symmetric and normal system: it must stay bit for bit (a
    # copy of the loop before the (d, k) change, which ran d reflections on a d x d identity)
    G = jax.random.normal(jax.random.key(7), (5, 5))

    def before(G):
        d = G.shape[0]
        rows = jnp.arange(d)

        def step(j, carry):
            R, Q = carry
            x = jnp.where(rows >= j, R[:, j], 0.0)
            alpha = -jnp.where(x[j] >= 0, 1.0, -1.0) * jnp.linalg.norm(x)
            v = x - alpha * (rows == j)
            nv = jnp.linalg.norm(v)
            v = jnp.where(nv > 0, v / jnp.where(nv > 0, nv, 1.0), 0.0)
            return R - 2.0 * jnp.outer(v, v @ R), Q - 2.0 * jnp.outer(Q @ v, v)

        R, Q = jax.lax.fori_loop(0, d, step, (G, jnp.eye(d, dtype=G.dtype) + jnp.zeros_like(G)))
        return Q * jnp.where(jnp.diag(R) < 0, -1.0, 1.0)

    assert np.array_equal(jax.jit(haar_q)(G), jax.jit(before)(G))


@pytest.mark.parametrize("k", [1, 3])
def test_haar_columns_are_uniform_on_the_sphere(k):
    # a column of a Haar matrix is uniform on S^(d-1): q_1^2 ~ Beta(1/2, (d-1)/2), mean 1/d,
    # variance 2 (d - 1) / (d^2 (d + 2)); q_1 itself has mean 0, variance 1/d (a sign convention
    # that did not fix diag R > 0 would bias it). 6-sigma bounds over N draws.
    d, N = 5, 4000
    G = jax.random.normal(jax.random.key(11), (N, d, k))
    Q = np.asarray(jax.jit(jax.vmap(haar))(G), np.float64)
    var_sq = 2 * (d - 1) / (d ** 2 * (d + 2))
    for j in range(k):
        q = Q[:, 0, j]
        assert abs(np.mean(q ** 2) - 1 / d) <= 6 * np.sqrt(var_sq / N)
        assert abs(np.mean(q)) <= 6 * np.sqrt(1 / d / N)
    np.testing.assert_allclose(np.einsum("nij,nik->njk", Q, Q), np.broadcast_to(np.eye(k), (N, k, k)), atol=1e-5)


def test_haar_refuses_more_columns_than_rows():
    with pytest.raises(ValueError, match="1 <= k <= d"):
        haar(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="1 <= k <= d"):
        haar(jnp.zeros((3, 4)))


# ------------------------------------------------------------------ item 10: tokenizer.json

def _tokenizer_folder(tmp_path, name, data: bytes):
    from powerlens._src.models.load import resolve
    folder = tmp_path / name
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(data)
    for extra in ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(os.path.join(resolve("minilm"), extra), folder / extra)
    return str(folder)


def _minilm_tokenizer_json() -> dict:
    from powerlens._src.models.load import resolve
    with open(os.path.join(resolve("minilm"), "tokenizer.json"), encoding="utf-8") as fh:
        return json.load(fh)


@pytest.mark.parametrize("case,needle", [
    ("empty", "is empty"), ("non_utf8", "not UTF-8"), ("deep", "nested too deeply"),
    ("negative_vocab_id", "negative id -5"), ("negative_added_id", "negative id -1"), ("bad_json", "not valid JSON"),
    ("a_list", "JSON list, not an object")])
def test_a_bad_tokenizer_json_is_one_error_naming_the_file(tmp_path, case, needle):
    from powerlens._src.models.embed import _tokenizer_for
    from powerlens._src.models.reader import CheckpointError
    doc = _minilm_tokenizer_json()
    if case == "negative_vocab_id":
        doc["model"]["vocab"]["hello"] = -5
    if case == "negative_added_id":
        doc["added_tokens"][0]["id"] = -1
    raw = {"empty": b"", "non_utf8": b'{"model": "\xff\xfe"}', "deep": b"[" * 100_000 + b"]" * 100_000,
           "bad_json": b'{"model": }', "a_list": b"[1, 2]"}
    data = raw[case] if case in raw else json.dumps(doc).encode()
    folder = _tokenizer_folder(tmp_path, case, data)
    with pytest.raises(CheckpointError) as e:
        _tokenizer_for(folder)
    line = str(e.value)
    assert "\n" not in line and line.startswith(os.path.join(folder, "tokenizer.json") + ": ") and needle in line, line


def test_a_good_tokenizer_json_still_loads(tmp_path):
    from powerlens._src.models.embed import _tokenizer_for
    folder = _tokenizer_folder(tmp_path, "good", json.dumps(_minilm_tokenizer_json()).encode())
    assert _tokenizer_for(folder).encode("hello world") == [101, 7592, 2088, 102]


# ------------------------------------------------------------------ item 16: top_tokens and its siblings

@pytest.fixture(scope="module")
def minilm():
    import powerlens as pl
    return pl.load("minilm")


@pytest.mark.parametrize("logits", [["text"], "text", None, {"a": 1}, [[1.0, 2.0], [3.0]]])
def test_top_tokens_of_non_numbers_names_the_argument(minilm, logits):
    import powerlens as pl
    with pytest.raises(ValueError) as e:
        pl.top_tokens(minilm, logits)
    assert "\n" not in str(e.value) and str(e.value).startswith("top_tokens: logits must be"), str(e.value)


def test_top_tokens_refuses_complex_and_boolean_logits(minilm):
    import powerlens as pl
    V = minilm.embeddings["word"].shape[0]
    for z in (np.ones(V, complex), np.ones(V, bool)):
        with pytest.raises(ValueError, match="logits must be real numbers"):
            pl.top_tokens(minilm, z)
    top = pl.top_tokens(minilm, np.where(np.arange(V) == 7592, 10, 0), k=1)          # integer logits are numbers
    assert top[0].id == 7592 and top[0].text == "hello"


def test_the_token_functions_name_a_bad_model_or_mask(minilm):
    import powerlens as pl
    from powerlens._src.models.tokens import token_texts, vocabulary_size
    for fn, args in ((pl.top_tokens, (np.zeros(3),)), (pl.decode, ([1],)), (token_texts, ([1],)),
                     (vocabulary_size, ())):
        with pytest.raises(ValueError, match="model must be a powerlens Model"):
            fn("minilm", *args)
    for valid in ("x", [None, None]):
        with pytest.raises(ValueError, match="decode: valid must be a mask of booleans"):
            pl.decode(minilm, [101, 102], valid=valid)
    assert pl.decode(minilm, [101, 7592, 102], valid=[1, 1, 0]) == pl.decode(minilm, [101, 7592])
