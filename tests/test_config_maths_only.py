"""``LayerConfig`` holds the maths only: how attention is computed is the run's
``Dynamics.attention_block``, and a model's family is ``ModelInfo.family``.

* LayerConfig has no ``attention_block`` and no ``family`` field: passing either is a
  TypeError, as for any unknown field.
* ``Dynamics(attention_block=...)`` is validated in one line, hashable, and reaches the
  attention of every entry point that takes ``dynamics=`` (cuDNN's setting, refused on a CPU
  inside the attention, proves it arrived).
* Key blocks change how A is computed, not the states: a run by blocks of 2 keys gives the
  states of a float64 NumPy reference of the paper rule written here from design.md §1, and
  the dense run's.
* Edit files record the family of the model they were made from, ``model.info.family``;
  ``checkpoint_delta`` takes the family from the caller.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl
from powerlens._src.dynamics.options import Dynamics
from powerlens._src.dynamics.params import LayerConfig, make_layers
from powerlens._src.models.base import Model, ModelInfo

U, H, G, E, D, N = 2, 4, 2, 3, 8, 7       # 4 query heads over 2 key/value heads
SCALE = np.array([0.7, 0.4])


def paper_layers(causal: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    cfg = LayerConfig(d_model=D, n_heads=H, n_kv_heads=G, d_head=E, causal=causal, norm="l2")
    W = dict(W_q=r(U, H, E, D), W_k=r(U, G, E, D), W_v=r(U, G, E, D) / 2, W_o=r(U, D, H * E) / 2)
    return make_layers(W["W_v"], W["W_o"], W_q=W["W_q"], W_k=W["W_k"], scale=SCALE.astype(np.float32),
                       config=cfg), W


def reference_states(W, x0, causal: bool):
    """The paper rule X <- N2(X + sum_h O_h A_h X V_g(h)^T) in float64, one layer a step
    (schedule 0, 1), A_h = softmax(scale q k^T) over the allowed keys: "float[U+1 n d]"."""
    X = np.asarray(x0, np.float64)
    out = [X]
    n = X.shape[0]
    allowed = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    for u in range(U):
        heads = []
        for h in range(H):
            g = h // (H // G)
            q, k, v = (X @ np.asarray(W[name][u, i], np.float64).T for name, i in
                       (("W_q", h), ("W_k", g), ("W_v", g)))
            s = np.where(allowed, SCALE[u] * q @ k.T, -np.inf)
            A = np.exp(s - s.max(-1, keepdims=True))
            heads.append((A / A.sum(-1, keepdims=True)) @ v)
        Y = X + np.concatenate(heads, axis=1) @ np.asarray(W["W_o"][u], np.float64).T
        X = Y / np.linalg.norm(Y, axis=1, keepdims=True)
        out.append(X)
    return np.stack(out)


# ------------------------------------------------------------------ the config

@pytest.mark.parametrize("field, value", [("attention_block", 4), ("attention_block", "cudnn"), ("family", "llama")])
def test_layer_config_has_no_execution_or_report_field(field, value):
    assert field not in {f.name for f in dataclasses.fields(LayerConfig)}
    with pytest.raises(TypeError, match=field):
        LayerConfig(d_model=4, n_heads=1, d_head=4, **{field: value})
    with pytest.raises(TypeError, match=field):
        dataclasses.replace(LayerConfig(d_model=4, n_heads=1, d_head=4), **{field: value})


def test_converted_models_carry_the_family_in_their_info_only():
    model = pl.load("minilm")
    assert model.info.family == "bert"
    assert not hasattr(model.layers.config, "family") and not hasattr(model.layers.config, "attention_block")


# ------------------------------------------------------------------ the run option

@pytest.mark.parametrize("bad", [-1, 2.5, True, np.bool_(False), "xla", "CUDNN", "128", np.float32(4.0)])
def test_a_bad_attention_block_is_one_line_naming_the_option(bad):
    with pytest.raises(ValueError) as exc:
        Dynamics(attention_block=bad)
    msg = str(exc.value)
    assert msg == (f"Dynamics.attention_block must be None (automatic), 0 (dense), a positive block size or "
                   f"'cudnn', got {bad!r}")


def test_attention_block_is_a_hashable_field_with_one_default():
    assert Dynamics().attention_block is None and Dynamics.full().attention_block is None
    a, b = Dynamics(attention_block=np.int64(4)), Dynamics(attention_block=4)
    assert a == b and hash(a) == hash(b) and type(a.attention_block) is int
    assert Dynamics.full(attention_block="cudnn") == Dynamics("full", attention_block="cudnn")
    assert len({Dynamics(), Dynamics(attention_block=0), Dynamics(attention_block=4), b}) == 3
    assert Dynamics.faithful(attention_block=2).resolved(
        LayerConfig(d_model=4, n_heads=1, d_head=4, norm_placement="pre")) == Dynamics("pre_ln", attention_block=2)


@pytest.mark.parametrize("causal", [False, True])
def test_key_blocks_give_the_reference_states(causal):
    """Blocks of 2 keys over 7 tokens (a last block of one key; GQA, a scale per layer, a
    padded second prompt): the float64 NumPy states of the paper rule, and the dense run's."""
    layers, W = paper_layers(causal)
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((2, N, D)).astype(np.float32)
    valid = np.ones((2, N), bool)
    valid[1, 5:] = False
    states = lambda block: np.asarray(pl.run_batch(layers, x0, valid, dynamics=Dynamics(attention_block=block),
                                                   observe=("states",))["states"])
    blocked, dense = states(2), states(0)
    for b, n in ((0, N), (1, 5)):               # padding keys are never read: the valid prefix alone
        want = reference_states(W, x0[b, :n], causal)
        np.testing.assert_allclose(blocked[b, :, :n], want, atol=2e-6)
        np.testing.assert_allclose(dense[b, :, :n], want, atol=2e-6)
    np.testing.assert_allclose(blocked[valid[:, None].repeat(U + 1, 1)], dense[valid[:, None].repeat(U + 1, 1)],
                               atol=2e-6)
    single = pl.run(layers, x0[0], None, dynamics=Dynamics(attention_block=3), observers={"final": pl.final()})
    np.testing.assert_allclose(np.asarray(single["final"]), reference_states(W, x0[0], causal)[-1], atol=2e-6)


def tiny_decoder(family: str = "llama", seed: int = 0) -> Model:
    """Two pre-norm causal blocks (RMSNorm, gated FFN), a tied head, ``info.family`` = ``family``."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.5 * rng.normal(size=(U,) + s)).astype(np.float32)
    cfg = LayerConfig(d_model=D, n_heads=H, n_kv_heads=G, d_head=E, norm="rmsnorm", norm_placement="pre",
                      causal=True, ffn_activation="silu_glu")
    layers = make_layers(W_v=r(G, E, D), W_o=r(D, H * E), W_q=r(H, E, D), W_k=r(G, E, D), norm_scale=1 + r(D),
                         ffn_norm_scale=1 + r(D), W_in=r(5, D), W_gate=r(5, D), W_out=r(D, 5), config=cfg)
    word = rng.normal(size=(11, D)).astype(np.float32)
    return Model(layers=layers, embeddings={"word": word},
                 info=ModelInfo(family=family, source="", decoder=True, pad_token_id=0, name="tiny"))


def test_the_model_forward_is_the_same_by_key_blocks():
    model = tiny_decoder()
    ids = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    from powerlens._src.models.embed import pad_ids
    x, valid = pl.embed_ids(model, *pad_ids(ids, 0))
    dense = np.asarray(pl.run_states(model, x, valid))
    blocked = np.asarray(pl.run_states(model, x, valid, dynamics=Dynamics.full(attention_block=2)))
    keep = np.broadcast_to(np.asarray(valid)[None], dense.shape[:3])
    np.testing.assert_allclose(blocked[keep], dense[keep], atol=1e-5)
    tr = pl.trace(model, ids, dynamics=Dynamics.full(attention_block=2))
    np.testing.assert_allclose(np.asarray(tr.states)[keep], dense[keep], atol=1e-5)


def test_every_entry_point_hands_the_setting_to_the_attention():
    """cuDNN's setting is refused inside the attention on a CPU (and for a float32 system
    anywhere): each entry point's refusal shows that its ``dynamics`` reached the mix."""
    layers, _ = paper_layers(True)
    x0 = np.random.default_rng(2).standard_normal((N, D)).astype(np.float32)
    fused = Dynamics(attention_block="cudnn")
    subs = pl.reference_subspaces(pl.spectra_of(layers))
    model = tiny_decoder()
    x, valid = pl.embed_ids(model, np.array([[1, 2, 3]]), np.ones((1, 3), bool))
    calls = {
        "run": lambda: pl.run(layers, x0, None, dynamics=fused, observers={"final": pl.final()}),
        "run_batch": lambda: pl.run_batch(layers, x0[None], dynamics=fused),
        "simulate": lambda: pl.simulate(layers, x0, subs, dynamics=fused),
        "simulate_batch": lambda: pl.simulate_batch(layers, x0[None], subs, dynamics=fused),
        "simulate_sweep": lambda: pl.simulate_sweep(
            pl.stack_systems([layers]), x0[None], jax.tree_util.tree_map(lambda a: jnp.stack([a]), subs),
            dynamics=fused, shard=False),
        "run_system": lambda: pl.run_system(layers, x0, dynamics=fused, progress=False),
        "run_states": lambda: pl.run_states(model, x, valid, dynamics=Dynamics.full(attention_block="cudnn")),
        "trace": lambda: pl.trace(model, [[1, 2, 3]], dynamics=Dynamics.full(attention_block="cudnn")),
        "align": lambda: pl.align(model, [[1, 2, 3]], dynamics=fused),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"^Dynamics\.attention_block='cudnn' needs (an NVIDIA GPU|a float16)"):
            call()
    # without a Dynamics (generation's KV cache) the automatic default: the greedy tokens of the forward pass
    out = pl.generate(model, [[1, 2, 3]], max_new_tokens=2)
    assert len(out.new_ids[0]) == 2


# ------------------------------------------------------------------ the family

@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_edit_file_records_the_models_family(tmp_path, family):
    from powerlens._src.steering.edit_file import load_edit, make_edit, save_edit
    model = tiny_decoder(family)
    delta = np.random.default_rng(3).standard_normal((D, H * E)).astype(np.float32) / 10
    path = save_edit(str(tmp_path / "e.npz"), make_edit(model, "delta_O", 1, delta_O=delta))
    edit = load_edit(path)
    assert edit.model["family"] == model.info.family == family and edit.model["name"] == "tiny"
    np.testing.assert_array_equal(edit.delta_O, delta)
    applied = pl.apply_edit(model, path)
    np.testing.assert_array_equal(np.asarray(applied.layers.W_o[1]), np.asarray(model.layers.W_o[1]) + delta)


def test_checkpoint_delta_takes_the_family_from_the_caller():
    """The layers alone do not know their family: ``Rank1Result.checkpoint_delta`` needs it, and
    gives GPT-2's Conv1D layout (ΔO^T) for a gpt2 model, ΔO itself for a Linear one."""
    from powerlens._src.steering.rank1 import rank1
    model = tiny_decoder("gpt2")
    res = rank1(model.layers, np.eye(D)[0], alpha=0.5, w="value", spectrum=False)
    with pytest.raises(TypeError):
        res.checkpoint_delta()
    np.testing.assert_array_equal(res.checkpoint_delta(model), np.asarray(res.delta_O).T)
    np.testing.assert_array_equal(res.checkpoint_delta(model.info), np.asarray(res.delta_O).T)
    np.testing.assert_array_equal(res.checkpoint_delta("llama"), np.asarray(res.delta_O))


def test_a_weights_file_round_trips_without_a_family(tmp_path):
    """``save_weights_npz`` writes the attention part and ``causal`` (never a family or an
    attention block: the format has no such key); reading it back gives the same arrays and
    the same config."""
    rng = np.random.default_rng(4)
    r = lambda *s: rng.standard_normal((U,) + s).astype(np.float32)
    cfg = LayerConfig(d_model=D, n_heads=2, d_head=E, causal=True, norm="l2")
    layers = make_layers(r(2, E, D), r(D, 2 * E), W_q=r(2, E, D), W_k=r(2, E, D), b_o=r(D),
                         scale=SCALE.astype(np.float32), config=cfg)
    path = pl.save_weights_npz(str(tmp_path / "w.npz"), layers)
    with np.load(path) as z:
        assert sorted(z.files) == ["W_k", "W_o", "W_q", "W_v", "b_o", "causal", "scale", "window"]
    back = pl.load_weights_npz(path)
    assert back.config == layers.config
    assert back.attn.arrays().keys() == layers.attn.arrays().keys()
    for name, a in layers.attn.arrays().items():
        np.testing.assert_array_equal(np.asarray(back.attn.arrays()[name]), np.asarray(a))
