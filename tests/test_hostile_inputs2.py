"""Hostile input, second round: padded batches with a zero pad row, silent casts of
checkpoint values, the Python API's checks, and overflow outside sweeps.

Each case reproduces a defect first: it failed before the fix (a zero-norm error at a padded
position or a NaN leaking through the mask; a window of 2**32 + 3 read as 3; a rope_theta of
true, inf or 0 accepted or misreported; a mask with no valid token, complex tokens or a
schedule past the layers accepted by ``pl.run``; an all-NaN Trajectory from ``simulate_batch``;
a pre-LN float32 run whose LayerNorm overflowed reported with exit 0). The padding checks
against transformers, family by family, are in the families' test files
(``test_a_zero_pad_row_is_validated_out_and_inert``, helpers in tests/zero_pad.py).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl
from powerlens.cli import main
from powerlens._src.dynamics.inputs import check_batch
from powerlens._src.dynamics.norms import l2_normalize, layer_norm, rms_norm
from powerlens._src.dynamics.params import LayerConfig, make_layers
from powerlens._src.models import CheckpointError, load
from powerlens._src.models.npz import load_weights_npz

# ----------------------------------------------------------------------------- helpers


def _causal_system(seed: int = 0, U: int = 2, d: int = 8):
    """U random causal softmax layers (2 heads of 4, no RoPE, so a prompt's states do not
    depend on where its padding sits), l2 norms for pre_ln/post_ln."""
    rng = np.random.default_rng(seed)
    cfg = LayerConfig(d_model=d, n_heads=2, d_head=4, causal=True, norm="l2")
    return make_layers(rng.standard_normal((U, 2, 4, d)) / 2, rng.standard_normal((U, d, 8)) / 2,
                       W_q=rng.standard_normal((U, 2, 4, d)), W_k=rng.standard_normal((U, 2, 4, d)), config=cfg)


def _padded(x, pads: int, *, left: bool, fill=0.0):
    """The prompt x "float[n d]" with ``pads`` padding rows of ``fill`` before (``left``) or
    after it, and its mask."""
    pad = np.full((pads, x.shape[1]), fill, x.dtype)
    X = np.concatenate([pad, x] if left else [x, pad])
    valid = np.arange(len(X)) >= pads if left else np.arange(len(X)) < len(x)
    return X, valid


def _cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line(err: str, command: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, lines
    assert lines[0].startswith(f"powerlens {command}: error: "), lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- 1. padding

def test_only_valid_tokens_are_validated():
    """A zero (or NaN) padding row is accepted; a zero or NaN valid token is still an error
    naming its index."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((2, 5, 8)).astype(np.float32)
    valid = np.ones((2, 5), bool)
    valid[1, 3:] = False
    X[1, 3] = 0.0
    X[1, 4] = np.nan
    out, v = check_batch(X, valid, 8)
    assert out.shape == (2, 5, 8) and v[1].sum() == 3
    X[0, 2] = 0.0
    with pytest.raises(ValueError, match=r"x0 has a zero-norm token at index \[0, 2\]"):
        check_batch(X, valid, 8)
    X[0, 2] = np.inf
    with pytest.raises(ValueError, match=r"x0 contains non-finite values .* index \[0, 2\]"):
        check_batch(X, valid, 8)


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
@pytest.mark.parametrize("rule,attention", [("paper", "uniform"), ("paper", "softmax"), ("pre_ln", "softmax"),
                                            ("post_ln", "identity")])
def test_padding_rows_are_inert_in_the_scan(rule, attention, left):
    """Padding rows of zeros (and of NaN) change nothing at the valid tokens: their states are
    those of the prompt without padding, and finite. Before, a zero padding row was refused
    by run_batch, and through ``pl.run`` it became N2(0) = NaN (a left-padded causal query has
    no key: uniform attention gives it 0), which the next step's A @ V spread to every token."""
    layers = _causal_system()
    x = pl.sphere_tokens(np.random.default_rng(2), 5, 8).astype(np.float32)
    alone = np.asarray(pl.run_batch(layers, x, rule=rule, attention=attention, observe=("states",))["states"])[0]
    for fill in (0.0, np.nan):
        X, valid = _padded(x, 3, left=left, fill=fill)
        states = np.asarray(pl.run_batch(layers, X, valid, rule=rule, attention=attention,
                                         observe=("states",))["states"])[0]
        np.testing.assert_allclose(states[:, valid], alone, rtol=1e-5, atol=1e-6)
        one = pl.run(layers, X, valid, rule=rule, attention=attention, observers={"final": pl.final()})["final"]
        np.testing.assert_allclose(np.asarray(one)[valid], alone[-1], rtol=1e-5, atol=1e-6)
        # the padding rows hold the fixed unit vector e_1 in every state
        np.testing.assert_array_equal(states[:, ~valid], np.broadcast_to(np.eye(8)[0], states[:, ~valid].shape))


def test_padding_is_inert_in_every_measure():
    """simulate_batch over a zero-padded prompt measures what the prompt alone measures."""
    layers = _causal_system(seed=3, U=1).shared(0, 4)
    subs = pl.reference_subspaces(pl.spectra_of(layers))
    x = pl.sphere_tokens(np.random.default_rng(4), 6, 8).astype(np.float32)
    X, valid = _padded(x, 2, left=True)
    a = pl.simulate_batch(layers, x[None], subs, attention="uniform")
    b = pl.simulate_batch(layers, X[None], subs, valid=valid[None], attention="uniform")
    for name in ("gamma", "rho", "consensus", "pairwise_cos"):
        np.testing.assert_allclose(np.asarray(getattr(b, name)), np.asarray(getattr(a, name)), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert np.asarray(b.finite).all()


# ----------------------------------------------------------------------------- 2. silent casts

@pytest.mark.parametrize("window", [2 ** 32 + 3, 2 ** 40, 2 ** 31])
def test_an_npz_window_past_int32_is_refused_not_wrapped(tmp_path, window):
    """2**32 + 3 was read as 3 and 2**40 as 0 (global attention)."""
    rng = np.random.default_rng(0)
    path = str(tmp_path / "w.npz")
    np.savez(path, W_v=rng.standard_normal((2, 2, 4)), W_o=rng.standard_normal((4, 4)),
             W_q=rng.standard_normal((2, 2, 4)), W_k=rng.standard_normal((2, 2, 4)), window=np.int64(window))
    with pytest.raises(CheckpointError) as err:
        load_weights_npz(path)
    msg = str(err.value)
    assert "\n" not in msg and path in msg and "'window'" in msg and str(window) in msg
    np.savez(path, W_v=rng.standard_normal((2, 2, 4)), W_o=rng.standard_normal((4, 4)),
             W_q=rng.standard_normal((2, 2, 4)), W_k=rng.standard_normal((2, 2, 4)), window=np.int64(2 ** 31 - 1))
    assert int(np.asarray(load_weights_npz(path).window)[0]) == 2 ** 31 - 1


D, H, G, E, F, V = 8, 2, 1, 4, 12, 11


def _llama_folder(folder, model_type: str = "llama", **over) -> str:
    """A one-layer Llama-style safetensors folder (model_type llama, mistral or qwen2) with
    config attributes ``over``."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    w = lambda *s: (0.5 * rng.standard_normal(s)).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": np.ones(D, np.float32)}
    p = "model.layers.0."
    t.update({p + "self_attn.q_proj.weight": w(H * E, D), p + "self_attn.k_proj.weight": w(G * E, D),
              p + "self_attn.v_proj.weight": w(G * E, D), p + "self_attn.o_proj.weight": w(D, H * E),
              p + "input_layernorm.weight": np.ones(D, np.float32),
              p + "post_attention_layernorm.weight": np.ones(D, np.float32),
              p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
              p + "mlp.down_proj.weight": w(D, F)})
    if model_type == "qwen2":
        t.update({p + "self_attn.q_proj.bias": w(H * E), p + "self_attn.k_proj.bias": w(G * E),
                  p + "self_attn.v_proj.bias": w(G * E)})
    cfg = dict(model_type=model_type, hidden_size=D, num_attention_heads=H, num_key_value_heads=G, head_dim=E,
               num_hidden_layers=1, intermediate_size=F, vocab_size=V, rms_norm_eps=1e-6, max_position_embeddings=16,
               tie_word_embeddings=True)
    cfg.update(over)
    os.makedirs(folder, exist_ok=True)
    save_file(t, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as fh:
        fh.write(json.dumps(cfg))            # inf and NaN as JSON's Infinity and NaN, as Python writes them
    return str(folder)


def _refused(folder, *needles) -> str:
    with pytest.raises(CheckpointError) as err:
        load(folder)
    msg = str(err.value)
    assert "\n" not in msg and os.path.join(folder, "config.json") in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("theta", [float("inf"), True, 0, float("nan"), -5.0, "abc"],
                         ids=["inf", "true", "zero", "nan", "negative", "string"])
def test_rope_theta_must_be_a_positive_finite_number(tmp_path, family, theta):
    """rope_theta went through float() alone: inf and true were accepted (true as a base of
    1.0), 0, NaN and negative bases failed later as a 'non-finite state', and "abc" gave
    float()'s message, which names no key."""
    _refused(_llama_folder(tmp_path / "m", family, rope_theta=theta), "rope_theta=", "positive finite number")
    _refused(_llama_folder(tmp_path / "p", family, rope_parameters={"rope_type": "default", "rope_theta": theta}),
             "rope_parameters.rope_theta=")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_valid_rope_theta_loads(tmp_path, family):
    assert load(_llama_folder(tmp_path / "m", family, rope_theta=123)).config.rope_theta == 123.0


@pytest.mark.parametrize("family,extra", [("mistral", {}), ("qwen2", {"use_sliding_window": True,
                                                                       "max_window_layers": 0})])
def test_a_sliding_window_past_int32_names_the_key(tmp_path, family, extra):
    """sliding_window >= 2**31 was an OverflowError from NumPy that named no key."""
    _refused(_llama_folder(tmp_path / "m", family, sliding_window=2 ** 31, **extra), "sliding_window=2147483648",
             "too large")
    model = load(_llama_folder(tmp_path / "ok", family, sliding_window=2 ** 31 - 1, **extra))
    assert int(np.asarray(model.layers.window)[0]) == 2 ** 31 - 1


def test_layer_config_rope_theta_is_checked():
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1e4"):
        with pytest.raises(ValueError, match="LayerConfig.rope_theta must be a positive finite number"):
            LayerConfig(d_model=4, n_heads=1, d_head=4, rope_theta=bad)


# ----------------------------------------------------------------------------- 3. the Python API

@pytest.fixture(scope="module")
def system():
    layers = pl.synthetic_system([2.0, 0.5 + 1.0j, 0.3], kind="normal", heads=2, d=8, steps=5)
    subs = pl.reference_subspaces(pl.spectra_of(layers))
    x0 = pl.sphere_tokens(np.random.default_rng(0), 6, 8)
    return layers, subs, x0


def test_run_refuses_what_simulate_batch_refuses(system):
    """pl.run returned gamma 0.0 for an all-False mask, dropped the imaginary part of complex
    tokens, and clamped a schedule index past the layers."""
    layers, subs, x0 = system
    kw = dict(rule="paper", attention="softmax", observers={"final": pl.final()})
    with pytest.raises(ValueError, match="no valid token"):
        pl.run(layers, x0, np.zeros(6, bool), **kw)
    with pytest.raises(ValueError, match=r"x0 must be an array of real numbers .* complex128"):
        pl.run(layers, x0 + 1j, None, **kw)
    with pytest.raises(ValueError, match=r"schedule refers to layer\(s\) \[5\] but only 1 exist"):
        pl.run(layers, x0, None, schedule=np.array([0, 5]), **kw)
    with pytest.raises(ValueError, match="schedule must hold integer layer indices"):
        pl.run(layers, x0, None, schedule=np.array([0.0, 0.7]), **kw)
    with pytest.raises(ValueError, match=r"run takes one prompt x0 of shape \(n, 8\)"):
        pl.run(layers, x0[None], None, **kw)
    for call in (lambda: pl.simulate_batch(layers, x0[None] + 1j, subs),
                 lambda: pl.simulate_batch(layers, x0[None], subs, schedule=np.array([0, 5])),
                 lambda: pl.run_batch(layers, x0, schedule=np.array([-1]))):
        with pytest.raises(ValueError, match="real numbers|schedule refers"):
            call()


def test_run_stays_jit_vmap_and_grad_friendly(system):
    """The value checks run only on concrete inputs: pl.run under jit, vmap and grad gives the
    eager numbers."""
    layers, subs, x0 = system
    valid = np.ones(6, bool)
    valid[5] = False
    obs = {"final": pl.final()}
    f = lambda x, v, s: pl.run(layers, x, v, rule="paper", attention="softmax", schedule=s, observers=obs)["final"]
    sched = np.array([0, 0, 0])
    eager = np.asarray(f(x0, valid, sched))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x0, valid, sched)), eager, rtol=1e-5, atol=1e-6)
    batched = jax.vmap(f, (0, 0, None))(jnp.stack([x0, x0]), jnp.stack([valid, valid]), sched)
    np.testing.assert_allclose(np.asarray(batched)[1], eager, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda x: jnp.sum(f(x, valid, sched)[:5] ** 3))(jnp.asarray(x0, jnp.float32))
    assert np.all(np.isfinite(np.asarray(g))) and np.abs(np.asarray(g)[:5]).max() > 0
    assert np.all(np.asarray(g)[5] == 0)                      # the padding row is inert: no gradient


def test_simulate_batch_names_the_overflow_instead_of_all_nan(system):
    """x0 x 1e20: the first step's attention scores overflow float32 and every gamma was NaN,
    without an error."""
    layers, subs, x0 = system
    with pytest.raises(ValueError) as err:
        pl.simulate_batch(layers, x0[None] * 1e20, subs)
    msg = str(err.value)
    assert "\n" not in msg
    for needle in ("prompt 0", "non-finite at step 1 of 5", "overflowed the float32 range", "attention scores",
                   f"x0 is {np.abs(x0).max() * 1e20:.3g}"):
        assert needle in msg, msg
    traj = pl.simulate_batch(layers, x0[None] * 1e20, subs, check_finite=False)
    assert bool(traj.finite[0, 0]) and not np.asarray(traj.finite[0, 1:]).any()
    assert np.isnan(np.asarray(traj.gamma)).all()
    ok = pl.simulate_batch(layers, x0[None] * 1e3, subs)            # the paper rule is scale-free after one step
    assert np.asarray(ok.finite).all() and np.isfinite(np.asarray(ok.gamma)[:, :, 0]).all()


def test_tokens_beyond_the_systems_dtype_are_refused(system):
    """float64 tokens of 1e39 became inf when cast to the float32 system."""
    layers, subs, x0 = system
    big = x0[None].copy()
    big[0, 2, 3] = 1e39
    with pytest.raises(ValueError, match=r"x0 has values up to 1e\+39, beyond the range of the system's float32"):
        pl.simulate_batch(layers, big, subs)
    with pytest.raises(ValueError, match=r"beyond the range of the system's float32"):
        pl.run(layers, big[0], None, rule="paper", attention="softmax", observers={"final": pl.final()})


# ----------------------------------------------------------------------------- 4. overflow outside sweeps

def test_norms_of_an_overflowing_row_are_nan_not_zero():
    """LN(x) with var(x) = inf was x * 0 = 0 (so a pre-LN step silently added only its constant)."""
    X = jnp.asarray(np.array([[3e19, -1e19, 2e19, 1.0], [1.0, -2.0, 3.0, 0.5]], np.float32))
    for Y in (layer_norm(X), rms_norm(X), l2_normalize(X)):
        Y = np.asarray(Y)
        assert np.isnan(Y[0]).all() and np.isfinite(Y[1]).all()
    np.testing.assert_allclose(np.asarray(layer_norm(X))[1], np.asarray(layer_norm(X[1:]))[0])
    x = np.asarray(X[1], np.float64)
    np.testing.assert_allclose(np.asarray(layer_norm(X))[1], (x - x.mean()) / np.sqrt(x.var() + 1e-5), rtol=1e-5)


def _scaled_weights(path, factor):
    layers = pl.synthetic_system([1.5, 0.5], kind="normal", d=6, heads=2, seed=0, dtype=np.float64)
    np.savez(path, **{k: np.asarray(getattr(layers, k), np.float64)[0] * factor for k in ("W_q", "W_k", "W_v", "W_o")})
    return str(path)


def test_pre_ln_whose_layernorm_overflows_float32_is_refused(tmp_path, capsys):
    """Weights x 1e18, rule pre_ln: the states (~1e36) are finite in float32 but their LayerNorm
    is not (the squares overflow). The run exited 0 with gamma 0.80 (0.30 with --x64) from states
    that stopped moving after step 1; now it is refused, naming the step, and --x64 runs."""
    path = _scaled_weights(tmp_path / "big.npz", 1e18)
    argv = ["simulate", "--weights", path, "--rule", "pre_ln", "--steps", "6", "--tokens", "8", "--quiet"]
    code, _, err = _cli(argv + ["--out", str(tmp_path / "a")], capsys)
    assert code == 2, err
    line = _one_line(err, "simulate")
    for needle in ("non-finite at step 2 of 6", "rule pre_ln", "float32", "overflowed", "--x64"):
        assert needle in line, line
    assert not (tmp_path / "a").exists()
    code, _, err = _cli(argv + ["--x64", "--out", str(tmp_path / "b")], capsys)
    assert code == 0, err
    steps = json.loads((tmp_path / "b" / "metrics.json").read_text())["steps"]
    assert len(steps) == 7 and all(row["gamma"] is not None for row in steps)
