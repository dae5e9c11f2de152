"""Qwen3 and Gemma 1/2/3 converters (HF folders and GGUF) against transformers + torch.

Tiny random models (tests/hf_tiny_decoders.py: d = 48, 3 layers, 4 query heads over 2
key/value heads, head_dim 16 != d / H, sliding windows of 3 < the 7-token prompts, Gemma 2
soft-capping at 3 (scores) and 4 (logits) so that it bites, Gemma 3 RoPE bases 30 (local)
and 3000 (global)) are saved with ``save_pretrained`` and read back with
``powerlens._src.models.load``. Checked in float32 at the valid positions of right- and
left-padded batches: every HF hidden state and the logits to <= 1e-4, F_t against
W_o V_cat from the torch weights, the windows, RoPE bases and scales against what
transformers derives from the same config.json, and that each feature matters (removing it
breaks the match).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import hf_tiny_decoders as T  # noqa: E402
import zero_pad as Z  # noqa: E402
from powerlens._src.dynamics.params import layer_matrices  # noqa: E402
from powerlens._src.models import CheckpointError, embed_ids, load, run_states  # noqa: E402
from powerlens._src.models.gguf_llama import ARCHITECTURES  # noqa: E402

TOL = 1e-4

CONFIGS = {
    # q/k norms; window 3 on layers >= max_window_layers = 1; RoPE base 2000; untied head
    "qwen3_a": ("qwen3", dict(rope_theta=2000.0)),
    # one KV head, biases on q, k, v and o, no window, tied head
    "qwen3_b": ("qwen3", dict(use_sliding_window=False, attention_bias=True, num_key_value_heads=1,
                              tie_word_embeddings=True)),
    # (1 + w) norms, sqrt(d) embeddings, GELU-tanh GLU, tied head
    "gemma_a": ("gemma", dict(rope_theta=500.0)),
    # attention biases, untied head, multi-head attention
    "gemma_b": ("gemma", dict(attention_bias=True, num_key_value_heads=4, tie_word_embeddings=False)),
    # sandwich norms, soft-capping, query_pre_attn_scalar 24, windows on layers 0 and 2
    "gemma2_a": ("gemma2", dict()),
    # q/k norms, sandwich norms, layer types sliding/full/sliding with RoPE bases 30/3000
    "gemma3_a": ("gemma3_text", dict()),
    # final-logit soft-capping, biases, pattern 3 (layer 2 global), untied head
    "gemma3_b": ("gemma3_text", dict(final_logit_softcapping=5.0, attention_bias=True, sliding_window_pattern=3,
                                     tie_word_embeddings=False)),
}
EXPECTED_WINDOWS = {"qwen3_a": [0, 3, 3], "qwen3_b": [0, 0, 0], "gemma_a": [0, 0, 0], "gemma_b": [0, 0, 0],
                    "gemma2_a": [3, 0, 3], "gemma3_a": [3, 0, 3], "gemma3_b": [3, 3, 0]}


_states = T.states
_errors = T.state_errors
case = T.case_fixture(CONFIGS, seed=20)


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_hidden_states_and_logits_match_hf(case, left):
    model, hf = case["model"], case["hf"]
    ids, mask = T.batch(left=left)
    valid = mask.astype(bool)
    hs, errs = _errors(model, hf, ids, mask)
    assert max(errs) <= TOL, f"{case['name']}: per-layer max abs errors {errs}"
    lg, ref_lg = T.model_logits(model, ids, mask), T.hf_logits(hf, ids, mask)
    assert T.max_err(lg, ref_lg, valid) <= TOL * max(1.0, np.abs(ref_lg).max())
    assert (model.lm_head is None) == (hf.config.tie_word_embeddings is True)


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_a_zero_pad_row_is_validated_out_and_inert(case, left):
    """The pad token's embedding row zero in both models (Gemma's ``padding_idx``): the padded
    rows of x0 are zero, yet the valid tokens' hidden states are transformers' own, and under
    the paper rule with uniform attention (where a padded query with no key is N2(0) = NaN
    unless padding is inert) every valid state is finite."""
    Z.check_zero_pad_row(case["model"], case["hf"], *T.batch(left=left), lambda *a: _errors(*a)[1], TOL)


def test_structure_is_what_transformers_derives(case):
    model, c = case["model"], case["hf"].config
    cfg, layers, kind = model.config, model.layers, case["kind"]
    family = "gemma3" if kind == "gemma3_text" else kind
    assert model.info.family == family and cfg.causal and cfg.norm == "rmsnorm"
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.d_head) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    expect = [c.sliding_window if t == "sliding_attention" and c.sliding_window else 0 for t in types]
    assert expect == EXPECTED_WINDOWS[case["name"]]
    np.testing.assert_array_equal(np.asarray(layers.window), expect)
    qpas = getattr(c, "query_pre_attn_scalar", None) or c.head_dim
    np.testing.assert_allclose(np.asarray(layers.scale), qpas ** -0.5, rtol=1e-6)
    gemma = kind.startswith("gemma")
    assert cfg.ffn_activation == ("gelu_glu" if gemma else "silu_glu")
    assert (model.info.embed_scale is not None) == gemma
    if gemma:
        assert model.info.embed_scale == pytest.approx(c.hidden_size ** 0.5, rel=1e-7)
    assert cfg.attn_softcap == (c.attn_logit_softcapping if kind == "gemma2" else None)
    assert model.info.final_logit_softcap == getattr(c, "final_logit_softcapping", None)
    assert (layers.q_norm_scale is not None) == (layers.k_norm_scale is not None) == (kind in ("qwen3", "gemma3_text"))
    sandwich = kind in ("gemma2", "gemma3_text")
    assert (layers.post_attn_norm_scale is not None) == (layers.post_ffn_norm_scale is not None) == sandwich
    if kind == "gemma3_text":
        bases = [c.rope_parameters[t]["rope_theta"] for t in types]
        np.testing.assert_array_equal(np.asarray(layers.rope_base), bases)
        assert cfg.rope_theta == c.rope_parameters["full_attention"]["rope_theta"]
    else:
        assert layers.rope_base is None and cfg.rope_theta == c.rope_parameters["rope_theta"]
    assert (layers.b_o is not None) == bool(c.attention_bias)


@pytest.mark.parametrize("case", ["gemma_a", "gemma_b", "gemma2_a", "gemma3_a", "gemma3_b"], indirect=True)
def test_gemma_norms_are_stored_as_one_plus_w(case):
    sd = case["hf"].state_dict()
    w = sd["model.layers.1.input_layernorm.weight"].numpy()
    np.testing.assert_allclose(np.asarray(case["model"].layers.norm_scale[1]), 1.0 + w, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(case["model"].final_norm_scale), 1.0 + sd["model.norm.weight"].numpy(),
                               rtol=1e-6)


# feature -> (cases, how to remove it from the powerlens model)
def _no_window(m):
    return m.replace(layers=m.layers.replace(window=np.zeros_like(np.asarray(m.layers.window))))


def _no_softcap(m):
    import dataclasses
    return m.replace(layers=m.layers.replace(config=dataclasses.replace(m.config, attn_softcap=None)))


def _swapped_bases(m):
    """The local layers get the global base and vice versa."""
    b = np.asarray(m.layers.rope_base)
    return m.replace(layers=m.layers.replace(rope_base=np.where(b == b.min(), b.max(), b.min())))


def _no_qk_norm(m):
    return m.replace(layers=m.layers.replace(q_norm_scale=None, k_norm_scale=None))


def _no_post_norms(m):
    return m.replace(layers=m.layers.replace(post_attn_norm_scale=None, post_ffn_norm_scale=None))


def _no_embed_scale(m):
    import dataclasses
    return m.replace(info=dataclasses.replace(m.info, embed_scale=None))


FEATURES = [("qwen3_a", _no_window), ("qwen3_a", _no_qk_norm), ("gemma_a", _no_embed_scale),
            ("gemma2_a", _no_window), ("gemma2_a", _no_softcap), ("gemma2_a", _no_post_norms),
            ("gemma3_a", _swapped_bases), ("gemma3_a", _no_qk_norm), ("gemma3_a", _no_window)]


@pytest.mark.parametrize("case,remove", FEATURES, indirect=["case"], ids=[f"{c}-{f.__name__[1:]}" for c, f in FEATURES])
def test_each_feature_matters(case, remove):
    ids, mask = T.batch()
    _, errs = _errors(remove(case["model"]), case["hf"], ids, mask)
    assert errs[-1] > 1e-2, errs


@pytest.mark.parametrize("case", ["gemma2_a", "gemma3_b"], indirect=True)
def test_final_logit_softcap_bites(case):
    model, hf = case["model"], case["hf"]
    ids, mask = T.batch()
    ref = T.hf_logits(hf, ids, mask)
    cap = model.info.final_logit_softcap
    assert np.abs(ref).max() <= cap
    import dataclasses
    raw = T.model_logits(model.replace(info=dataclasses.replace(model.info, final_logit_softcap=None)), ids, mask)
    assert T.max_err(raw, ref, mask.astype(bool)) > 0.1


def test_layer_matrices_match_torch_weights(case):
    F = np.asarray(layer_matrices(case["model"].layers), np.float64)
    Ft = T.llama_F(case["hf"])
    assert np.max(np.abs(F - Ft)) <= 1e-5 * max(1.0, np.abs(Ft).max())
    assert np.max(np.abs(Ft - np.swapaxes(Ft, 1, 2))) > 0.1


@pytest.mark.parametrize("case", ["gemma2_a", "gemma3_a"], indirect=True)
def test_pre_ln_of_a_sandwich_block_is_x_plus_postnorm_attn_prenorm_x(case):
    """With the FFN's output weight zeroed, ``full`` (checked against transformers above) is
    x + PostNorm(attn(PreNorm x)) + PostFFNNorm(0) = the ``pre_ln`` step: the rule keeps
    the attention post-norm."""
    model = case["model"]
    zero = model.replace(layers=model.layers.replace(W_out=np.zeros_like(np.asarray(model.layers.W_out))))
    x0, valid = embed_ids(model, *T.batch())
    a = np.asarray(run_states(zero, x0, valid, rule="pre_ln"))
    b = np.asarray(run_states(zero, x0, valid, rule="full"))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    c = np.asarray(run_states(_no_post_norms(zero), x0, valid, rule="pre_ln"))
    assert np.abs(c - a).max() > 1e-2


# ----------------------------------------------------------------------------- config styles
_edited = T.edited_copy


def _old_gemma3(cfg):
    """A transformers 4.5x Gemma 3 config.json: rope_theta / rope_local_base_freq / rope_scaling,
    the layer pattern as an int, no layer_types."""
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["full_attention"]["rope_theta"], rope_local_base_freq=rope["sliding_attention"]
               ["rope_theta"], rope_scaling=None, sliding_window_pattern=cfg.pop("_sliding_window_pattern", 6))
    cfg.pop("layer_types")


@pytest.mark.parametrize("case", ["gemma3_a", "gemma3_b"], indirect=True)
def test_old_style_gemma3_config_reads_the_same(case, tmp_path):
    folder = _edited(case["folder"], tmp_path, _old_gemma3)
    c = tf.AutoConfig.from_pretrained(folder)
    model, ref = load(folder), case["model"]
    expect = [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types]
    np.testing.assert_array_equal(np.asarray(model.layers.window), expect)
    np.testing.assert_array_equal(np.asarray(model.layers.window), np.asarray(ref.layers.window))
    np.testing.assert_array_equal(np.asarray(model.layers.rope_base),
                                  [c.rope_parameters[t]["rope_theta"] for t in c.layer_types])
    np.testing.assert_array_equal(np.asarray(model.layers.rope_base), np.asarray(ref.layers.rope_base))


@pytest.mark.parametrize("case", ["gemma2_a"], indirect=True)
def test_old_style_gemma2_config_reads_the_same(case, tmp_path):
    """A transformers 4.4x Gemma 2 config.json: rope_theta, hidden_act beside hidden_activation,
    cache_implementation, no layer_types (sliding on even layers)."""

    def edit(cfg):
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg.pop("layer_types")
        cfg.update(hidden_act="gelu_pytorch_tanh", cache_implementation="hybrid")
    folder = _edited(case["folder"], tmp_path, edit)
    c = tf.AutoConfig.from_pretrained(folder)
    model = load(folder)
    np.testing.assert_array_equal(np.asarray(model.layers.window),
                                  [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types])
    assert model.config.attn_softcap == case["model"].config.attn_softcap == 3.0


@pytest.mark.parametrize("case", ["gemma_b"], indirect=True)
def test_legacy_gemma_gelu_is_the_tanh_gelu(case, tmp_path):
    """google/gemma-2b's config.json says hidden_act "gelu"; GemmaConfig reads it as
    gelu_pytorch_tanh, and so does powerlens: the same states as transformers."""
    folder = _edited(case["folder"], tmp_path, lambda c: c.update(hidden_act="gelu"))
    assert tf.AutoConfig.from_pretrained(folder).hidden_act == "gelu_pytorch_tanh"
    model = load(folder)
    assert model.config.ffn_activation == "gelu_glu"
    _, errs = _errors(model, case["hf"], *T.batch())
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("case", ["qwen3_a"], indirect=True)
@pytest.mark.parametrize("settings", [dict(use_sliding_window=True, sliding_window=2, max_window_layers=0),
                                      dict(use_sliding_window=False, sliding_window=4, max_window_layers=1),
                                      dict(use_sliding_window=True, sliding_window=3)],
                         ids=["all", "off", "default28"])
def test_qwen3_windows_of_old_configs_agree_with_transformers(case, tmp_path, settings):
    def edit(cfg):
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg.pop("layer_types")
        cfg.pop("max_window_layers", None)
        cfg.update(settings)
    folder = _edited(case["folder"], tmp_path, edit)
    model, c = load(folder), tf.AutoConfig.from_pretrained(folder)
    np.testing.assert_array_equal(np.asarray(model.layers.window),
                                  [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types])
    assert model.config.rope_theta == 2000.0


@pytest.mark.parametrize("case,edit,needles", [
    ("qwen3_a", {"my_new_trick": 1, "qk_layernorm": True},
     ["2 config attribute(s)", "my_new_trick=1 is unknown", "qk_layernorm=True is unknown"]),
    ("gemma_a", {"hidden_act": "relu"}, ["hidden_act='relu'"]),
    ("gemma_a", {"query_pre_attn_scalar": 24}, ["query_pre_attn_scalar=24 is unknown"]),
    ("gemma_a", {"use_bidirectional_attention": True}, ["use_bidirectional_attention=True is not supported"]),
    ("gemma2_a", {"final_logit_softcapping": -1.0}, ["final_logit_softcapping=-1.0"]),
    ("gemma2_a", {"sliding_window": None}, ["no sliding window"]),
    ("gemma3_a", {"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping=50.0 is not supported"]),
    ("gemma3_a", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, ["rope_scaling", "'linear'"]),
    ("gemma3_a", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, ["nested by layer type"]),
    ("gemma3_a", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     ["rope_type='yarn'"]),
    ("gemma3_a", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, ["layer_types"]),
    ("gemma3_a", {"use_bidirectional_attention": True, "vision_config": {}},
     ["use_bidirectional_attention=True is not supported", "vision_config={} is unknown"]),
], indirect=["case"])
def test_unsupported_configs_are_one_error_naming_file_and_attributes(case, tmp_path, edit, needles):
    folder = _edited(case["folder"], tmp_path, lambda c: c.update(edit))
    with pytest.raises(CheckpointError) as err:
        load(folder)
    msg = str(err.value)
    assert "\n" not in msg and os.path.join(folder, "config.json") in msg
    for needle in needles:
        assert needle in msg, msg


# ----------------------------------------------------------------------------- GGUF
def test_tiny_qwen3_gguf_matches_transformers(tmp_path):
    hf = T.build("qwen3", str(tmp_path / "hf"), seed=6, use_sliding_window=False, rope_theta=700.0)
    path = T.write_gguf(tmp_path / "tiny-qwen3.gguf", hf, "qwen3", permute=ARCHITECTURES["qwen3"].permuted_qk,
                        names=T.GGUF_QK_NORM_NAMES)
    model = load(path)
    assert model.info.family == "qwen3" and model.config.rope_theta == 700.0 and model.layers.q_norm_scale is not None
    T.check_gguf_model(model, hf, TOL)


def test_tiny_gemma3_gguf_matches_transformers(tmp_path):
    """What the file does not say is what llama.cpp assumes: every 6th layer global (so 6
    layers here), local RoPE base 1e4, softmax scale key_length^-1/2 (so the HF model has
    query_pre_attn_scalar = head_dim), sqrt(d) embeddings; norms stored as 1 + w."""
    hf = T.build("gemma3_text", str(tmp_path / "hf"), seed=7, num_hidden_layers=6, sliding_window=3,
                 query_pre_attn_scalar=16, sliding_window_pattern=6, final_logit_softcapping=6.0,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 50.0}})
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]

    def meta(w):
        w.add_sliding_window(3)
        w.add_final_logit_softcapping(6.0)
    path = T.write_gguf(tmp_path / "tiny-gemma3.gguf", hf, "gemma3", permute=ARCHITECTURES["gemma3"].permuted_qk,
                        names=T.GGUF_GEMMA3_NAMES, norm_shift=1.0, meta=meta)
    model = load(path)
    assert model.info.family == "gemma3" and model.info.final_logit_softcap == 6.0
    np.testing.assert_array_equal(np.asarray(model.layers.window), [3, 3, 3, 3, 3, 0])
    np.testing.assert_array_equal(np.asarray(model.layers.rope_base), [1e4] * 5 + [50.0])
    T.check_gguf_model(model, hf, TOL)
