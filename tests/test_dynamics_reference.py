"""The JAX dynamics against the plain NumPy reference (tests/reference_numpy.py, the oracle).

Random systems exercise every attention mode x rule, with grouped-query attention,
all four biases, keep_bias on and off, a causal mask with a local window, padding
tokens, a layer-varying schedule, layernorm/rmsnorm parameters and RoPE. The JAX
path runs in float32, the reference in float64 on the same (float32) weights, so
the agreement expected is float32 rounding: ~1e-5 after a few steps.
"""
import dataclasses

import jax
import numpy as np
import jax.numpy as jnp
import pytest

import reference_numpy as R

from powerlens._src.analysis.spectra import layer_spectra, reference_subspaces
from powerlens._src.dynamics.layer import layer_step
from powerlens._src.dynamics.options import Dynamics
from powerlens._src.dynamics.params import LayerConfig, layer_matrices, make_layers
from powerlens._src.dynamics.simulate import simulate, simulate_batch, simulate_jit
from powerlens._src.dynamics.synthetic import synthetic_system

TOL = 1e-5


def _system(*, causal, window, norm, rope_theta=None, rope_dim=None, heads=4, kv_heads=2, d=8, e=4,
            seed=0, schedule=(0, 1, 1, 0, 1), biases=True):
    """Two unique layers. Layer 0 has a dominant complex pair (rotation measured), layer 1
    a dominant real eigenvalue. W_v is shared by the query heads of each kv group, so F is
    split by the synthetic builder over the G kv heads and W_o's columns duplicated / group."""
    rng = np.random.default_rng(seed)
    group = heads // kv_heads
    split = [synthetic_system([0.9 + 0.8j, 0.3, -0.4, 0.2], kind="nonnormal", nonnormality=0.3, heads=kv_heads,
                              d=d, d_head=e, seed=seed, dtype=np.float64),
             synthetic_system([1.2, 0.5, -0.6, 0.1], kind="normal", heads=kv_heads, d=d, d_head=e, seed=seed + 1,
                              dtype=np.float64)]
    W_v, W_o = [], []
    for one in split:
        V, O = one.W_v[0], one.W_o[0]                     # O (d, G e)
        # each kv head g serves `group` query heads: split its output block evenly
        O_full = np.concatenate([O[:, g * e:(g + 1) * e] / group for g in range(kv_heads) for _ in range(group)],
                                axis=1)
        W_v.append(V)
        W_o.append(O_full)
    W_v, W_o = np.stack(W_v), np.stack(W_o)
    U = 2
    arr = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
    cfg = LayerConfig(d_model=d, n_heads=heads, n_kv_heads=kv_heads, d_head=e, causal=causal, norm=norm,
                      norm_eps=1e-5, rope_theta=rope_theta, rope_dim=rope_dim, schedule=schedule)
    extra = {}
    if biases:
        extra = dict(b_q=arr(U, heads, e), b_k=arr(U, kv_heads, e), b_v=arr(U, kv_heads, e), b_o=arr(U, d))
    if norm != "l2":
        extra.update(norm_scale=(1 + arr(U, d)).astype(np.float32), norm_bias=arr(U, d))
    layers = make_layers(W_v.astype(np.float32), W_o.astype(np.float32),
                         W_q=(rng.standard_normal((U, heads, e, d))).astype(np.float32),
                         W_k=(rng.standard_normal((U, kv_heads, e, d))).astype(np.float32),
                         scale=np.array([1.0, 0.7], np.float32), window=np.array(window, np.int32),
                         config=cfg, **extra)
    return layers


@pytest.fixture(scope="module")
def sys_causal():
    """Causal, window 3 on layer 0 (global on layer 1), layernorm, GQA 4/2, all biases."""
    layers = _system(causal=True, window=(3, 0), norm="layernorm")
    sub = reference_subspaces(layer_spectra(layer_matrices(layers)), seed=1)
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal((7, 8)).astype(np.float32)
    x0 /= np.linalg.norm(x0, axis=1, keepdims=True)
    valid = np.array([1, 1, 0, 1, 1, 1, 0], bool)          # a padded token inside and at the end
    return layers, sub, x0, valid


@pytest.fixture(scope="module")
def sys_rope():
    """Bidirectional, window 2 on layer 1, rmsnorm, RoPE on 2 of 4 head dims, MHA."""
    layers = _system(causal=False, window=(0, 2), norm="rmsnorm", rope_theta=100.0, rope_dim=2, heads=3,
                     kv_heads=3, e=4, seed=3, schedule=(1, 0, 1, 1))
    sub = reference_subspaces(layer_spectra(layer_matrices(layers)), seed=2)
    rng = np.random.default_rng(6)
    x0 = rng.standard_normal((6, 8)).astype(np.float32)
    valid = np.array([1, 1, 1, 1, 1, 0], bool)
    return layers, sub, x0, valid


def _compare(traj, ref, valid, tol=TOL):
    g = np.asarray(traj.gamma)
    assert g.shape == ref["gamma"].shape
    np.testing.assert_allclose(g, ref["gamma"], atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(traj.gamma_before), ref["gamma_before"], atol=tol, rtol=tol)
    # rho counts strict inequalities: equal wherever no token is within rounding of a tie
    rho = np.asarray(traj.rho)
    clear = ref["rho_margin"] > 1e-4
    np.testing.assert_allclose(rho[clear], ref["rho"][clear], atol=1e-6)
    n = int(valid.sum())
    assert np.all(np.abs(rho - ref["rho"])[~np.isnan(rho)] <= 1.0 / n + 1e-6)
    np.testing.assert_array_equal(np.isnan(rho), np.isnan(ref["rho"]))
    rot = np.asarray(traj.rotation)
    np.testing.assert_array_equal(np.isnan(rot), np.isnan(ref["rotation"]))
    np.testing.assert_allclose(rot[~np.isnan(rot)], ref["rotation"][~np.isnan(rot)], atol=tol)
    for key in ("consensus", "rank_collapse", "pairwise_cos"):
        np.testing.assert_allclose(np.asarray(getattr(traj, key)), ref[key], atol=tol, rtol=tol, err_msg=key)
    fin = np.asarray(traj.final)[valid]
    scale = 1 + np.abs(ref["final"][valid]).max()
    np.testing.assert_allclose(fin, ref["final"][valid], atol=tol * scale, rtol=0)
    assert int(traj.n_valid) == n


@pytest.mark.parametrize("measure_after", [False, True])
@pytest.mark.parametrize("attention", ["softmax", "uniform", "identity"])
@pytest.mark.parametrize("rule", ["paper", "post_ln", "pre_ln"])
def test_causal_window_padding_gqa(sys_causal, attention, rule, measure_after):
    """Every measure, inside the scan and (measure_after) from all the states afterwards."""
    layers, sub, x0, valid = sys_causal
    traj = simulate_jit(layers, jnp.asarray(x0), sub, valid=jnp.asarray(valid), rule=rule, attention=attention,
                        measure_after=measure_after)
    ref = R.simulate_layers(layers, x0, sub, valid=valid, rule=rule, attention=attention)
    _compare(traj, ref, valid)
    # the dominant complex pair of layer 0 makes the rotation defined on its steps only
    sched = np.array(layers.schedule)
    assert np.all(np.isnan(np.asarray(traj.rotation)[sched == 1]))
    assert np.all(np.isfinite(np.asarray(traj.rotation)[sched == 0]))


@pytest.mark.parametrize("rule,keep_bias", [("paper", True), ("post_ln", False), ("pre_ln", False)])
def test_keep_bias_flipped(sys_causal, rule, keep_bias):
    """keep_bias opposite to each rule's default, and the constant c = O b_v + b_o really
    enters: the result differs from the default by more than rounding."""
    layers, sub, x0, valid = sys_causal
    traj = simulate_jit(layers, jnp.asarray(x0), sub, valid=jnp.asarray(valid), rule=rule,
                        attention="softmax", keep_bias=keep_bias)
    ref = R.simulate_layers(layers, x0, sub, valid=valid, rule=rule, attention="softmax", keep_bias=keep_bias)
    _compare(traj, ref, valid)
    other = R.simulate_layers(layers, x0, sub, valid=valid, rule=rule, attention="softmax")
    assert np.abs(other["final"] - ref["final"])[valid].max() > 1e-2


@pytest.mark.parametrize("measure_after", [False, True])
@pytest.mark.parametrize("attention", ["softmax", "uniform"])
@pytest.mark.parametrize("rule", ["paper", "post_ln", "pre_ln"])
def test_rope_window_rmsnorm(sys_rope, attention, rule, measure_after):
    layers, sub, x0, valid = sys_rope
    traj = simulate_jit(layers, jnp.asarray(x0), sub, valid=jnp.asarray(valid), rule=rule, attention=attention,
                        measure_after=measure_after)
    ref = R.simulate_layers(layers, x0, sub, valid=valid, rule=rule, attention=attention)
    _compare(traj, ref, valid)


def test_rope_changes_softmax(sys_rope):
    """RoPE really acts: dropping it changes one softmax step by far more than rounding,
    in both implementations alike."""
    layers, _, x0, valid = sys_rope
    p = R.layer_dicts(layers)[1]
    kw = R.static_kwargs(layers.config)
    with_rope = R.layer_step(p, x0.astype(np.float64), valid, attention="softmax", **kw)
    kw.update(rope_theta=None)
    without = R.layer_step(p, x0.astype(np.float64), valid, attention="softmax", **kw)
    assert np.abs(with_rope - without)[valid].max() > 1e-3
    jx = layer_step(layers.layer(1), jnp.asarray(x0), jnp.asarray(valid), rule="paper", attention="softmax")
    np.testing.assert_allclose(np.asarray(jx)[valid], with_rope[valid], atol=TOL)


def test_attention_patterns_by_hand():
    """The reference's masks on a 4-token example, written out by hand:
    causal window 2 -> token i sees {i-1, i}; token 2 is padding and is nobody's key."""
    ok = R.allowed(4, np.array([1, 1, 0, 1], bool), causal=True, window=2)
    np.testing.assert_array_equal(ok, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]])
    ok = R.allowed(4, np.ones(4, bool), causal=False, window=2)
    np.testing.assert_array_equal(ok, [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]])
    p = {"W_v": np.zeros((1, 2, 3)), "W_o": np.zeros((3, 2))}
    A = R.attention_matrices(p, np.ones((3, 3)), np.ones(3, bool), mode="uniform", causal=True)[0]
    np.testing.assert_allclose(A, [[1, 0, 0], [.5, .5, 0], [1 / 3, 1 / 3, 1 / 3]])


def test_batch_matches_reference_per_prompt(sys_causal):
    """simulate_batch over 3 prompts with different padding equals the reference prompt by prompt."""
    layers, sub, x0, _ = sys_causal
    rng = np.random.default_rng(9)
    X0 = np.stack([x0, np.roll(x0, 1, axis=0), rng.standard_normal(x0.shape).astype(np.float32)])
    valid = np.ones((3, 7), bool)
    valid[0, 5:] = False
    valid[2, 0] = False
    traj = simulate_batch(layers, X0, sub, valid=valid, rule="paper", attention="softmax")
    for b in range(3):
        ref = R.simulate_layers(layers, X0[b], sub, valid=valid[b], rule="paper", attention="softmax")
        one = type(traj)(**{k: (None if v is None else v[b]) for k, v in vars(traj).items()})
        _compare(one, ref, valid[b])


def test_fast_reference_equals_loop_reference(sys_causal):
    """The vectorised NumPy path used as benchmark baseline is the same maths as the loops."""
    layers, sub, x0, valid = sys_causal
    for attention in ("softmax", "uniform"):
        a = R.simulate_layers(layers, x0, sub, valid=valid, rule="paper", attention=attention)
        b = R.simulate_layers(layers, x0, sub, valid=valid, rule="paper", attention=attention, fast=True)
        for key in ("gamma", "gamma_before", "rho", "rotation", "consensus", "rank_collapse", "pairwise_cos",
                    "final"):
            np.testing.assert_allclose(b[key], a[key], atol=1e-12, err_msg=key)


def _without_rope(layers):
    return layers.replace(config=dataclasses.replace(layers.config, rope_theta=None, rope_dim=None))


@pytest.fixture(scope="module")
def sys_rope_causal():
    """Causal GQA 4/2 with RoPE on every head dim (theta 10: fast rotations), window 3 on
    layer 0, all biases, one padded token."""
    layers = _system(causal=True, window=(3, 0), norm="l2", rope_theta=10.0, rope_dim=None, seed=4)
    sub = reference_subspaces(layer_spectra(layer_matrices(layers)), seed=3)
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal((7, 8)).astype(np.float32)
    valid = np.array([1, 1, 1, 0, 1, 1, 1], bool)
    return layers, sub, x0, valid


@pytest.mark.parametrize("which", ["sys_rope", "sys_rope_causal"])
def test_rope_jax_vs_fast_and_loop_reference(which, request):
    """With RoPE on (rope_dim 2 of 4 and full rope_dim), the JAX simulate equals both the
    vectorised reference (simulate_fast) and the loop reference; and RoPE really acts in each
    of the three: dropping it (rope_theta=None) moves the result by far more than rounding.
    simulate_fast once accepted rope_theta without passing it on; this test fails then."""
    layers, sub, x0, valid = request.getfixturevalue(which)
    kw = dict(valid=valid, rule="paper", attention="softmax")
    assert layers.config.rope_theta is not None and layers.W_q is not None and layers.W_k is not None
    traj = simulate(layers, jnp.asarray(x0), sub, valid=jnp.asarray(valid), rule="paper", attention="softmax")
    fast = R.simulate_layers(layers, x0, sub, fast=True, **kw)
    loop = R.simulate_layers(layers, x0, sub, **kw)
    _compare(traj, fast, valid)
    _compare(traj, loop, valid)
    for key in ("gamma", "gamma_before", "rho", "rotation", "consensus", "rank_collapse", "pairwise_cos",
                "final"):
        np.testing.assert_allclose(fast[key], loop[key], atol=1e-12, err_msg=key)
    # without RoPE: every implementation changes, and agrees with the others again
    fast0 = R.simulate_layers(layers, x0, sub, fast=True, **{**kw, "rope_theta": None})
    loop0 = R.simulate_layers(layers, x0, sub, **{**kw, "rope_theta": None})
    traj0 = simulate(_without_rope(layers), jnp.asarray(x0), sub, valid=jnp.asarray(valid), rule="paper",
                     attention="softmax")
    np.testing.assert_allclose(fast0["final"], loop0["final"], atol=1e-12)
    _compare(traj0, loop0, valid)
    for a, b in ((fast, fast0), (loop, loop0)):
        assert np.abs(a["final"] - b["final"])[valid].max() > 1e-2
    assert np.abs(np.asarray(traj.final) - np.asarray(traj0.final))[valid].max() > 1e-2


def test_rope_fast_by_hand():
    """rope_fast on one 4-dim vector at position 3, theta 100: pair (a, a + 2) turns by
    3 * 100^(-a/2), i.e. 3 rad and 0.3 rad; the loop rope gives the same."""
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    got = R.rope_fast(x[None], np.array([3]), 100.0)[0]
    c0, s0, c1, s1 = np.cos(3.0), np.sin(3.0), np.cos(0.3), np.sin(0.3)
    want = np.array([[1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]])
    np.testing.assert_allclose(got, want, atol=1e-15)
    np.testing.assert_allclose(R.rope(x, np.array([3]), 100.0), want, atol=1e-15)
    # rope_dim 2 of 4: only the pair (0, 1) turns, by the full angle 3 rad
    got = R.rope_fast(x[None], np.array([3]), 100.0, rope_dim=2)[0]
    np.testing.assert_allclose(got, [[1 * c0 - 2 * s0, 2 * c0 + 1 * s0, 3.0, 4.0]], atol=1e-15)


def test_benchmark_baseline_equals_reference():
    """benchmarks/numpy_baseline.py (the baseline benchmarks/simulate.py times, kept apart from
    this oracle) computes the same trajectory and measures as the oracle, in float64, on a
    shared-weight synthetic system with a complex pair (rotation defined)."""
    import importlib.util
    import os

    from powerlens._src.dynamics.synthetic import sphere_tokens, synthetic_system
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "numpy_baseline.py")
    spec = importlib.util.spec_from_file_location("numpy_baseline", path)
    NB = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(NB)
    layers = synthetic_system([0.8 + 1.1j, 0.5, -0.3], kind="normal", heads=2, d=8, seed=1, steps=12)
    sub = reference_subspaces(layer_spectra(layer_matrices(layers)), seed=0)
    x0 = sphere_tokens(np.random.default_rng(2), 9, 8)
    ref = R.simulate_layers(layers, x0, sub, rule="paper", attention="softmax", fast=True)
    p = NB.layer_arrays(layers, dtype=np.float64)
    got = NB.simulate(p, x0, np.asarray(sub.basis, np.float64)[0], np.asarray(sub.dim)[0], 12, dtype=np.float64)
    assert np.all(np.isfinite(ref["rotation"]))
    for key in ("gamma", "gamma_before", "rho", "rotation", "consensus", "rank_collapse", "pairwise_cos", "final"):
        np.testing.assert_allclose(got[key], ref[key], atol=1e-12, err_msg=key)


def test_projections_cached_per_weights_never_stale(sys_causal):
    """run_batch passes the (in, out) copies of the attention weights, built once per
    (W_q, W_k, W_v, W_o), into the compiled program: the same numbers, to float32 rounding, as
    reading the weights in place (what a program without them does), and a layer with a new
    W_q or W_o gets its own."""
    import importlib
    from powerlens._src.dynamics.projections import prepared_projections, qkv_weight
    from powerlens._src.dynamics.run import run_batch
    run_mod = importlib.import_module("powerlens._src.dynamics.run")
    layers, _, x0, valid = sys_causal
    P = prepared_projections(layers)
    assert P is prepared_projections(layers)                            # built once
    np.testing.assert_array_equal(np.asarray(P.qkv), np.asarray(qkv_weight(layers)))
    np.testing.assert_array_equal(np.asarray(P.out), np.swapaxes(np.asarray(layers.W_o), 1, 2))
    U, d, H, e = layers.W_q.shape[0], layers.W_o.shape[1], layers.W_q.shape[1], layers.W_q.shape[2]
    assert P.qkv.shape == (U, d, (H + 2 * layers.W_k.shape[1]) * e) and P.out.shape == (U, H * e, d)
    assert prepared_projections(layers.replace(W_q=np.asarray(layers.W_q))) is None   # NumPy: mutable, never cached
    uniform = prepared_projections(layers, "uniform")                   # no q/k/v projection to fuse
    assert uniform.qkv is None
    np.testing.assert_array_equal(np.asarray(uniform.out), np.asarray(P.out))
    X0, V = jnp.asarray(x0[None]), jnp.asarray(valid[None])
    for attention in ("softmax", "uniform"):
        inside = run_mod._run_batch(layers, X0, V, None, None, None, dynamics=Dynamics(attention=attention),
                                    observe=("final",))["final"]
        np.testing.assert_allclose(np.asarray(run_batch(layers, X0, V, attention=attention)["final"]),
                                   np.asarray(inside), rtol=0, atol=1e-5)
    other = layers.replace(W_q=layers.W_q * 2, W_o=layers.W_o * 3)
    Q = prepared_projections(other)
    assert Q is not P
    np.testing.assert_allclose(np.asarray(Q.qkv[..., :4 * 4]), 2 * np.asarray(P.qkv[..., :4 * 4]))
    np.testing.assert_allclose(np.asarray(Q.out), 3 * np.asarray(P.out))
    ref = R.simulate_layers(other, x0, reference_subspaces(layer_spectra(layer_matrices(other)), seed=1),
                            valid=valid, rule="paper", attention="softmax")
    got = np.asarray(run_batch(other, X0, V)["final"])[0][valid]
    np.testing.assert_allclose(got, ref["final"][valid], atol=TOL * (1 + np.abs(ref["final"][valid]).max()))


def test_prompt_chunks_give_the_numbers_of_one_vmap(sys_causal, monkeypatch):
    """On a CPU a batch of short prompts runs in lax.map steps of about CHUNK_TOKENS_CPU tokens
    (prompt_chunk); the last step takes the remainder. Chunked, every observer agrees with
    one vmap over the batch to float32 rounding, the states keep their "float[T+1 B n d]"
    order, and simulate_batch's whole Trajectory agrees too."""
    import importlib
    run_mod = importlib.import_module("powerlens._src.dynamics.run")
    sim = importlib.import_module("powerlens._src.dynamics.simulate")
    from powerlens._src.dynamics.execution import TUNING
    from powerlens._src.dynamics.run import prompt_chunk, run_batch
    CHUNK_TOKENS_CPU = TUNING.chunk_tokens_cpu
    assert prompt_chunk(32, 128, "cpu") == CHUNK_TOKENS_CPU // 128 == 8
    assert prompt_chunk(8, 128, "cpu") is None                          # one chunk already
    assert prompt_chunk(8, 512, "cpu") is None                          # query blocks: no gain measured
    assert prompt_chunk(32, 128, "gpu") is None
    layers, sub, x0, valid = sys_causal
    assert run_mod.platform_of(layers.W_v) == run_mod.platform_of(np.zeros(3)) == jax.default_backend()
    rng = np.random.default_rng(11)
    X0 = np.stack([x0] + [rng.standard_normal(x0.shape).astype(np.float32) for _ in range(6)])   # B = 7
    V = np.stack([valid] * 4 + [np.ones_like(valid)] * 3)
    whole = run_batch(layers, X0, V, observe=("states", "consensus", "final"), steps_first=True)
    from powerlens._src.dynamics import execution                             # chunks of 3 prompts: 3 + 3 + 1
    monkeypatch.setattr(execution, "TUNING", dataclasses.replace(execution.TUNING, chunk_tokens_cpu=3 * X0.shape[1]))
    monkeypatch.setattr(sim, "prompt_chunk", lambda b, n, platform: 3)
    assert run_mod.prompt_chunk(7, X0.shape[1], "cpu") == 3
    chunked = run_batch(layers, X0, V, observe=("states", "consensus", "final"), steps_first=True)
    assert chunked["states"].shape == whole["states"].shape == (len(layers.schedule) + 1,) + X0.shape
    for a, b in zip(jax.tree_util.tree_leaves(chunked), jax.tree_util.tree_leaves(whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    t_chunked = sim.simulate_batch(layers, X0, sub, valid=V, save_states=True)
    t_whole = sim.simulate_batch_jit(layers, X0, sub, V, None, None, dynamics=Dynamics(),
                                     save_states=True, measure_after=False)
    for a, b in zip(jax.tree_util.tree_leaves(t_chunked), jax.tree_util.tree_leaves(t_whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("B", [6, 7, 2])
def test_map_prompts_puts_each_chunk_on_its_prompt_axis(B):
    """map_prompts in chunks of 3 (B = 6: two whole steps; 7: a remainder of 1; 2: fewer
    prompts than a chunk, one vmap) returns what one vmap returns, bit for bit, with each
    output's prompt axis where out_axes puts it: axis 1 of a step-major "float[T B d]", axis 0
    elsewhere."""
    from powerlens._src.dynamics.run import map_prompts
    rng = np.random.default_rng(B)
    X0 = jnp.asarray(rng.standard_normal((B, 4, 5)).astype(np.float32))
    valid = jnp.asarray(rng.random((B, 4)) > 0.3)

    def one(x, v):          # a step-major stack "float[T d]" (T = 3), and a per-prompt scalar
        steps = jnp.stack([jnp.sum(x * v[:, None], 0) * k for k in (1.0, 2.0, -0.5)])
        return {"steps": steps, "count": jnp.sum(v)}

    out_axes = {"steps": 1, "count": 0}
    want = jax.vmap(one, out_axes=out_axes)(X0, valid)
    got = jax.jit(lambda x, v: map_prompts(one, x, v, 3, out_axes=out_axes))(X0, valid)
    assert got["steps"].shape == (3, B, 5) and got["count"].shape == (B,)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))
    first = map_prompts(one, X0, valid, 3)                       # every output prompt-first
    np.testing.assert_array_equal(np.asarray(first["steps"]), np.asarray(jax.vmap(one)(X0, valid)["steps"]))


def test_select_keeps_the_applied_layers_and_renumbers_the_schedule(sys_causal):
    """select of consecutive layers (a slice) and of scattered ones (a gather) keeps exactly
    the layers the schedule applies, renumbered onto them: the same arrays as indexing the
    stack, and the same final states as running the whole stack under that schedule."""
    from powerlens._src.dynamics.run import run_batch
    base, _, x0, valid = sys_causal
    four = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, 1.5 * a if a.dtype.kind == "f" else a]), base)
    four = four.replace(config=dataclasses.replace(base.config, schedule=None))
    X0, V = jnp.asarray(x0[None]), jnp.asarray(valid[None])
    for schedule, used, renumbered in (((1, 2), [1, 2], (0, 1)), ((3, 1, 3), [1, 3], (1, 0, 1))):
        sub = four.select(schedule)
        assert tuple(sub.schedule) == renumbered
        for got, full in zip(jax.tree_util.tree_leaves(sub), jax.tree_util.tree_leaves(four)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(full)[used])
        np.testing.assert_allclose(np.asarray(run_batch(sub, X0, V)["final"]),
                                   np.asarray(run_batch(four.with_schedule(schedule), X0, V)["final"]),
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("schedule", [(0, 1), "shared", None], ids=["one-per-layer", "shared", "array"])
def test_measure_after_equals_measure_inside(sys_causal, schedule, monkeypatch):
    """``measure_after`` gives the numbers of the step-by-step observers (float32 rounding of a
    batched matmul at most) for a compact static schedule (0, 1), a shared-weight system, and an
    "int[T]" schedule array; an observer without ``of_states`` keeps the whole run in the scan;
    simulate_batch measures a small batch afterwards and a large one inside."""
    import importlib
    from powerlens._src.dynamics.observers import READY, Observer, alignment
    from powerlens._src.dynamics.run import measure_after_pays, run
    layers, sub, x0, valid = sys_causal
    kw = dict(rule="paper", attention="softmax")
    if schedule is None:
        sched_arr = jnp.asarray([1, 0, 0, 1, 1, 0], jnp.int32)
    elif schedule == "shared":                       # one unique layer: its projections carried
        layers, sched_arr = layers.shared(0, 4), None
        sub = type(sub)(basis=sub.basis[:1], dim=sub.dim[:1], names=sub.names)
    else:
        layers = dataclasses.replace(layers, config=dataclasses.replace(layers.config, schedule=schedule))
        sched_arr = None
    obs = lambda: {**{k: READY[k]() for k in ("consensus", "states", "finite", "final")},
                   "alignment": alignment(sub)}
    go = jax.jit(lambda x, v, s, after: run(layers, x, v, observers=obs(), schedule=s, measure_after=after, **kw),
                 static_argnums=3)
    inside = go(jnp.asarray(x0), jnp.asarray(valid), sched_arr, False)
    after = go(jnp.asarray(x0), jnp.asarray(valid), sched_arr, True)
    flat = lambda tree: jax.tree_util.tree_leaves(tree)
    for a, b in zip(flat(inside), flat(after)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=2e-6)
    assert np.isfinite(np.asarray(inside["alignment"].rotation)).any()   # the complex pair of layer 0 is seen
    # a custom observer without of_states: everything is measured inside the scan, no error
    calls = []
    bare = Observer(init=lambda x0, v, lay: 0.0,
                    update=lambda c, X, Y, st: (c + jnp.sum(Y), calls.append("update")),
                    finish=lambda c, outs: c)
    mixed = run(layers, jnp.asarray(x0), jnp.asarray(valid), observers={"sum": bare, "final": READY["final"]()},
                schedule=sched_arr, measure_after=True, **kw)
    assert calls == ["update"]
    np.testing.assert_allclose(np.asarray(mixed["final"]), np.asarray(inside["final"]), atol=2e-6)
    # the rule simulate_batch follows: bytes of all prompts' states against the bound
    assert measure_after_pays(layers, x0[None], sched_arr)
    assert not measure_after_pays(layers, np.zeros((2, 2 ** 20, 1), np.float32), sched_arr)
    sim = importlib.import_module("powerlens._src.dynamics.simulate")
    seen = []
    real = sim.simulate_batch_jit
    T = len(layers.schedule) if sched_arr is None else len(sched_arr)
    bound = (T + 1) * 7 * 8 * 4                      # one prompt's states, float32
    monkeypatch.setattr(sim, "simulate_batch_jit", lambda *a, **k: seen.append(k["measure_after"]) or real(*a, **k))
    execution = importlib.import_module("powerlens._src.dynamics.execution")
    monkeypatch.setattr(execution, "TUNING", dataclasses.replace(execution.TUNING, measure_after_bytes=bound))
    one = simulate_batch(layers, x0[None], sub, valid=valid[None], schedule=sched_arr)
    two = simulate_batch(layers, np.repeat(x0[None], 2, 0), sub, valid=np.repeat(valid[None], 2, 0), schedule=sched_arr)
    assert seen == [True, False]
    np.testing.assert_allclose(np.asarray(one.consensus[0]), np.asarray(two.consensus[1]), atol=2e-6)


def test_rotation_planes_cached_per_arrays_and_equal_to_computing_them_inside(sys_causal):
    """simulate_batch hands the alignment observer the complex-pair planes computed once per
    (basis, dim, W_o, W_v): layer 0 of this system has a complex top pair, layer 1 a real one.
    The cached array is reused, recomputed for a new W_o, never built from NumPy or traced
    arrays, and simulate gives the same trajectory with it as without."""
    import jax
    from powerlens._src.dynamics.observers import complex_pair_planes, rotation_planes
    layers, sub, x0, valid = sys_causal
    planes = rotation_planes(sub, layers)
    np.testing.assert_array_equal(np.asarray(planes), [True, False])
    np.testing.assert_array_equal(np.asarray(planes), np.asarray(complex_pair_planes(sub, layers, 0)))
    assert rotation_planes(sub, layers) is planes                                   # computed once
    other = layers.replace(W_o=layers.W_o * 1.0)
    assert rotation_planes(sub, other) is not planes                                # a new W_o: its own
    assert rotation_planes(sub, layers.replace(W_o=np.asarray(layers.W_o))) is None  # NumPy: never cached
    seen = []
    jax.jit(lambda b: seen.append(rotation_planes(type(sub)(basis=b, dim=sub.dim, names=sub.names), layers))
            or b)(sub.basis)
    assert seen == [None]                                                           # traced: never cached
    kw = dict(valid=jnp.asarray(valid), rule="paper", attention="softmax")
    given = simulate_jit(layers, jnp.asarray(x0), sub, planes=planes, **kw)
    inside = simulate_jit(layers, jnp.asarray(x0), sub, **kw)
    for a, b in zip(jax.tree_util.tree_leaves(given), jax.tree_util.tree_leaves(inside)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(given.rotation)).any()
