"""GPT-NeoX, OPT, Phi and Phi-3 converters against transformers + torch.

Tiny random models (tests/hf_tiny_decoders.py ``OTHER_DECODERS``: 2 layers, 7-token prompts)
are saved with ``save_pretrained`` and read back with ``powerlens._src.models.load``. Checked in
float32 at the valid positions of right- and left-padded batches: every HF hidden state and
the logits to <= 1e-4, F_t against W_o V_cat formed from the torch weights (the fused
``query_key_value`` / ``qkv_proj`` split here independently of the converter), the static
facts (parallel block, partial rotary, placements, windows), older config styles, and the
allow-lists.

Covered: GPT-NeoX with ``use_parallel_residual`` True and False (rotary_pct 0.25: 4 of 16
dimensions rotated); OPT pre-LN and post-LN, with ``word_embed_proj_dim`` 24 != d = 48 (the
opt-350m shape) and without; Phi (parallel block with one shared LayerNorm, partial rotary
0.5, GQA, lm_head bias); Phi-3 (fused projections, GQA, sliding window 3 < the prompt).
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import hf_tiny_decoders as T  # noqa: E402
import zero_pad as Z  # noqa: E402
from powerlens._src.dynamics.layer import faithful_rule  # noqa: E402
from powerlens._src.dynamics.params import layer_matrices  # noqa: E402
from powerlens._src.models import CheckpointError, load  # noqa: E402

TOL = 1e-4

CONFIGS = {
    "neox_parallel": ("gpt_neox", dict()),
    "neox_sequential": ("gpt_neox", dict(use_parallel_residual=False, rotary_emb_base=500.0, attention_bias=False,
                                         tie_word_embeddings=True)),
    "opt_pre": ("opt", dict()),
    "opt_pre_proj": ("opt", dict(word_embed_proj_dim=24)),
    "opt_post_proj": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=24)),   # opt-350m's shape
    "phi": ("phi", dict()),
    "phi_qk_layernorm": ("phi", dict(qk_layernorm=True)),     # LayerNorm (with bias) on each head's q and k
    "phi3": ("phi3", dict()),
}


_states = T.states


def _hf_states(hf, ids, mask):
    """HF's hidden states as a list (OPT with a projection: the last one is E wide, the others d)."""
    with torch.no_grad():
        out = hf.base_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
    return [h.double().numpy() for h in out.hidden_states]


def _sd(hf):
    return {k: v.double().numpy() for k, v in hf.state_dict().items()}


case = T.case_fixture(CONFIGS, seed=20)


def _project_out(case):
    """OPT's project_out (E, d) from the torch weights, or None."""
    sd = _sd(case["hf"])
    return sd.get("model.decoder.project_out.weight")


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_hidden_states_and_logits_match_hf(case, left):
    """Left padding: RoPE families count positions 0..n-1 over the pads (as HF does without
    position_ids); OPT counts its learned positions from the mask, so a pad shifts nothing."""
    model, hf = case["model"], case["hf"]
    ids, mask = T.batch(left=left)
    valid = mask.astype(bool)
    hs, ref = _states(model, ids, mask), _hf_states(hf, ids, mask)
    assert len(hs) == len(ref) == hf.config.num_hidden_layers + 1
    P_out = _project_out(case)
    last = hs[-1] if P_out is None else hs[-1] @ P_out.T       # OPT: HF's last state is project_out of ours
    errs = [T.max_err(hs[k], ref[k], valid) for k in range(len(ref) - 1)] + [T.max_err(last, ref[-1], valid)]
    assert max(errs) <= TOL, f"{case['name']}: per-state max abs errors {errs}"
    lg, ref_lg = T.model_logits(model, ids, mask), T.hf_logits(hf, ids, mask)
    assert T.max_err(lg, ref_lg, valid) <= TOL * max(1.0, np.abs(ref_lg).max())


def _state_errors(model, hf, ids, mask):
    """Every state's max abs error at the valid tokens (OPT with a projection: HF's last state
    is project_out of ours)."""
    valid = mask.astype(bool)
    hs, ref = _states(model, ids, mask), _hf_states(hf, ids, mask)
    P_out = _sd(hf).get("model.decoder.project_out.weight")
    last = hs[-1] if P_out is None else hs[-1] @ P_out.T
    return [T.max_err(hs[k], ref[k], valid) for k in range(len(ref) - 1)] + [T.max_err(last, ref[-1], valid)]


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_a_zero_pad_row_is_validated_out_and_inert(case, left):
    """The pad token's embedding row zero in both models (as transformers' ``padding_idx``
    leaves it): the padded rows of x0 are zero (OPT adds learned positions), yet the valid
    tokens' hidden states are transformers' own, and under the paper rule with uniform
    attention (where a padded query with no key is N2(0) = NaN unless padding is inert) every
    valid state is finite."""
    Z.check_zero_pad_row(case["model"], case["hf"], *T.batch(left=left), _state_errors, TOL,
                         zero_x0=case["kind"] != "opt")


@pytest.mark.parametrize("case", ["opt_pre_proj", "opt_post_proj"], indirect=True)
def test_opt_350m_shape_reports_the_residual_stream(case):
    """With word_embed_proj_dim E != d every state powerlens reports is d wide; HF's last is E wide."""
    model, hf = case["model"], case["hf"]
    ids, mask = T.batch()
    hs, ref = _states(model, ids, mask), _hf_states(hf, ids, mask)
    d, E = hf.config.hidden_size, hf.config.word_embed_proj_dim
    assert hs.shape[-1] == d == ref[0].shape[-1] and ref[-1].shape[-1] == E != d
    assert model.embeddings["word"].shape == (hf.config.vocab_size, d) and model.lm_head.shape == (hf.config.vocab_size, d)


def _value_output(case):
    """(W_o (d, H e), W_v (G e, d), H, G, e) per layer, from the torch weights."""
    kind, c, sd = case["kind"], case["hf"].config, _sd(case["hf"])
    H = c.num_attention_heads
    G = getattr(c, "num_key_value_heads", None) or H
    d = c.hidden_size
    e = d // H
    out = []
    for i in range(c.num_hidden_layers):
        if kind == "gpt_neox":
            p = f"gpt_neox.layers.{i}.attention."
            Wv = sd[p + "query_key_value.weight"].reshape(H, 3 * e, d)[:, 2 * e:].reshape(H * e, d)
            Wo = sd[p + "dense.weight"]
        elif kind == "opt":
            p = f"model.decoder.layers.{i}.self_attn."
            Wv, Wo = sd[p + "v_proj.weight"], sd[p + "out_proj.weight"]
        elif kind == "phi":
            p = f"model.layers.{i}.self_attn."
            Wv, Wo = sd[p + "v_proj.weight"], sd[p + "dense.weight"]
        else:
            p = f"model.layers.{i}.self_attn."
            Wv, Wo = sd[p + "qkv_proj.weight"][(H + G) * e:], sd[p + "o_proj.weight"]
        out.append((Wo, Wv))
    return out, H, G, e


def test_layer_matrices_match_torch_weights(case):
    per_layer, H, G, e = _value_output(case)
    g = lambda h: h // (H // G)
    Ft = np.stack([sum(Wo[:, h * e:(h + 1) * e] @ Wv[g(h) * e:(g(h) + 1) * e] for h in range(H))
                   for Wo, Wv in per_layer])
    F = np.asarray(layer_matrices(case["model"].layers), np.float64)
    assert np.max(np.abs(F - Ft)) <= 1e-5 * max(1.0, np.abs(Ft).max())
    assert np.max(np.abs(Ft - np.swapaxes(Ft, 1, 2))) > 0.1      # a transposed F would fail above


EXPECT = {   # parallel, norm, placement, rope_dim, window per layer, lm_head bias
    "neox_parallel": (True, "layernorm", "pre", 4, [0, 0], False),
    "neox_sequential": (False, "layernorm", "pre", 4, [0, 0], False),
    "opt_pre": (False, "layernorm", "pre", None, [0, 0], False),
    "opt_pre_proj": (False, "layernorm", "pre", None, [0, 0], False),
    "opt_post_proj": (False, "layernorm", "post", None, [0, 0], False),
    "phi": (True, "layernorm", "pre", 6, [0, 0], True),
    "phi_qk_layernorm": (True, "layernorm", "pre", 6, [0, 0], True),
    "phi3": (False, "rmsnorm", "pre", None, [3, 3], False),
}


def test_static_facts_are_where_transformers_puts_them(case):
    model, c = case["model"], case["hf"].config
    cfg, layers = model.config, model.layers
    parallel, norm, placement, rope_dim, window, head_bias = EXPECT[case["name"]]
    assert model.info.family == case["kind"] and cfg.causal
    assert (cfg.parallel_residual, cfg.norm, cfg.norm_placement, cfg.rope_dim) == (parallel, norm, placement, rope_dim)
    assert faithful_rule(cfg) == ("post_ln" if placement == "post" else "pre_ln")
    np.testing.assert_array_equal(np.asarray(layers.window), window)
    np.testing.assert_allclose(np.asarray(layers.scale), cfg.d_head ** -0.5, rtol=1e-6)
    assert (model.lm_head_bias is not None) == head_bias
    if case["kind"] == "opt":
        assert cfg.rope_theta is None and model.info.position_offset == 2
        assert model.info.max_positions == c.max_position_embeddings + 2
        assert (model.final_norm_scale is not None) == c.do_layer_norm_before == model.info.final_norm_in_hidden_states
    else:
        assert cfg.rope_theta == c.rope_parameters["rope_theta"]
    if case["kind"] == "phi":
        assert layers.ffn_norm_scale is None and layers.norm_bias is not None     # one shared LayerNorm
        qk = case["cfg"].get("qk_layernorm", False)
        assert all((getattr(layers, f"{a}_norm_{b}") is not None) == qk for a in "qk" for b in ("scale", "bias"))
        if qk:                 # the torch LayerNorm(head_dim) weights, per layer
            sd = _sd(case["hf"])
            np.testing.assert_allclose(np.asarray(layers.k_norm_bias[1]),
                                       sd["model.layers.1.self_attn.k_layernorm.bias"], rtol=1e-6)
    if case["name"] == "neox_sequential":
        assert cfg.rope_theta == 500.0 and layers.b_q is None and layers.b_o is None and model.lm_head is None


@pytest.mark.parametrize("case", ["neox_parallel", "phi"], indirect=True)
def test_the_parallel_block_matters(case):
    """Run as a sequential block, the parallel models no longer match HF."""
    model = case["model"]
    seq = model.replace(layers=model.layers.replace(
        config=dataclasses.replace(model.config, parallel_residual=False),
        ffn_norm_scale=model.layers.ffn_norm_scale if model.layers.ffn_norm_scale is not None else model.layers.norm_scale,
        ffn_norm_bias=model.layers.ffn_norm_bias if model.layers.ffn_norm_bias is not None else model.layers.norm_bias))
    ids, mask = T.batch()
    ref = _hf_states(case["hf"], ids, mask)[-1]
    assert T.max_err(_states(seq, ids, mask)[-1], ref, mask.astype(bool)) > 1e-2


@pytest.mark.parametrize("case", ["phi3"], indirect=True)
def test_the_phi3_window_matters(case):
    model = case["model"]
    ids, mask = T.batch()
    glob = model.replace(layers=model.layers.replace(window=np.zeros_like(np.asarray(model.layers.window))))
    assert T.max_err(_states(glob, ids, mask)[-1], _hf_states(case["hf"], ids, mask)[-1], mask.astype(bool)) > 1e-2


# ----------------------------------------------------------------------------- config styles
_edited = T.edited_copy


def _neox_old(cfg):
    """A Pythia config.json of transformers 4: rotary_pct and rotary_emb_base."""
    rope = cfg.pop("rope_parameters")
    cfg.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"], rope_scaling=None)


def _rope_theta_old(cfg):
    """A Phi / Phi-3 config.json of transformers 4: rope_theta, partial_rotary_factor, rope_scaling null."""
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=None)


@pytest.mark.parametrize("case,edit", [("neox_parallel", _neox_old), ("neox_sequential", _neox_old),
                                       ("phi", _rope_theta_old), ("phi3", _rope_theta_old)], indirect=["case"])
def test_old_style_configs_read_the_same(case, tmp_path, edit):
    old = load(_edited(case["folder"], tmp_path, edit))
    assert (old.config.rope_theta, old.config.rope_dim) == (case["model"].config.rope_theta, case["model"].config.rope_dim)
    ids, mask = T.batch()
    np.testing.assert_allclose(_states(old, ids, mask), _states(case["model"], ids, mask), atol=1e-6)


@pytest.mark.parametrize("case", ["neox_parallel"], indirect=True)
def test_neox_rotary_pct_defaults_to_a_quarter(case, tmp_path):
    """A config.json without any rotary fraction: GPTNeoXConfig's default 0.25, as transformers reads it."""
    def edit(cfg):
        _neox_old(cfg)
        del cfg["rotary_pct"]
    folder = _edited(case["folder"], tmp_path, edit)
    assert tf.AutoConfig.from_pretrained(folder).rope_parameters["partial_rotary_factor"] == 0.25
    assert load(folder).config.rope_dim == 4


@pytest.mark.parametrize("case", ["opt_pre"], indirect=True)
def test_opt_remove_final_layer_norm(case, tmp_path):
    """``_remove_final_layer_norm`` (pre-4.20 fine-tunes): no final LayerNorm, as OPTDecoder builds it."""
    folder = _edited(case["folder"], tmp_path, lambda cfg: cfg.update(_remove_final_layer_norm=True))
    model = load(folder)
    assert model.final_norm_scale is None and not model.info.final_norm_in_hidden_states
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.model.decoder.final_layer_norm is None
    ids, mask = T.batch(left=True)
    valid = mask.astype(bool)
    hs, ref = _states(model, ids, mask), _hf_states(hf, ids, mask)
    assert max(T.max_err(hs[k], ref[k], valid) for k in range(len(ref))) <= TOL
    assert T.max_err(T.model_logits(model, ids, mask), T.hf_logits(hf, ids, mask), valid) <= 1e-3


@pytest.mark.parametrize("case,edit,needles", [
    ("neox_parallel", {"my_new_trick": 1}, ["gpt_neox converter", "my_new_trick=1 is unknown"]),
    ("neox_parallel", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2}},
     ["rope_parameters.partial_rotary_factor=0.2", "odd head size 3"]),
    ("neox_parallel", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     ["rope_type='linear'"]),
    ("opt_pre", {"layer_norm_elementwise_affine": False, "scale_embedding": True},
     ["layer_norm_elementwise_affine=False is not supported", "scale_embedding=True is unknown"]),
    ("opt_post_proj", {"do_layer_norm_before": "no"}, ["do_layer_norm_before='no' must be true or false"]),
    ("phi", {"qk_layernorm": "yes"}, ["qk_layernorm='yes' must be true or false"]),
    ("phi", {"attention_bias": True}, ["attention_bias=True is unknown"]),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 6,
                                  "long_factor": [1.0] * 6, "partial_rotary_factor": 1.0}}, ["rope_type='longrope'"]),
    ("phi3", {"attention_bias": True}, ["attention_bias=True is not supported"]),
    ("phi3", {"sliding_window": 0}, ["sliding_window=0 must be a positive integer"]),
], indirect=["case"])
def test_bad_configs_are_named(case, tmp_path, edit, needles):
    folder = _edited(case["folder"], tmp_path, lambda cfg: cfg.update(edit))
    with pytest.raises(CheckpointError) as err:
        load(folder)
    msg = str(err.value)
    assert msg.startswith(folder) and "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


@pytest.mark.parametrize("case", ["neox_parallel"], indirect=True)
def test_pythia_head_under_either_name_is_read(case, tmp_path):
    """Pythia checkpoints name the LM head ``embed_out`` (transformers 5 too, when saving); the
    module is ``lm_head`` in transformers 5, and a file written from its state dict uses that name."""
    from safetensors.numpy import load_file, save_file
    dst = tmp_path / "pythia"
    shutil.copytree(case["folder"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    np.testing.assert_array_equal(np.asarray(load(str(dst)).lm_head), np.asarray(case["model"].lm_head))


# ----------------------------------------------------------------------------- GGUF phi3
# llama.cpp's Phi3MiniModel keeps HF's fused tensors: qkv_proj -> attn_qkv, gate_up_proj -> ffn_up
PHI3_GGUF_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def _phi3_meta(window, extra=None):
    def meta(w):
        w.add_sliding_window(window)        # phi3.attention.sliding_window, as llama.cpp writes it
        w.add_vocab_size(T.VOCAB)           # transformers' GGUF loader reads V from it (no tokenizer here)
        if extra is not None:
            extra(w)
    return meta


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory):
    """A tiny Phi-3 (GQA, no window: what both GGUF readers run) and its F32 GGUF file, written
    the way llama.cpp's converter does, with the window 3 in its metadata."""
    root = tmp_path_factory.mktemp("phi3_gguf")
    hf = T.build("phi3", str(root / "hf"), seed=31, sliding_window=None)
    path = T.write_gguf(root / "phi3.gguf", hf, "phi3", permute=False, names=PHI3_GGUF_NAMES, meta=_phi3_meta(3))
    return hf, path, load(path)


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_phi3_gguf_matches_transformers(phi3_gguf, left):
    hf, _, model = phi3_gguf
    assert model.info.family == "phi3" and model.config.n_kv_heads == 2
    ids, mask = T.batch(left=left)
    valid = mask.astype(bool)
    hs, ref = _states(model, ids, mask), _hf_states(hf, ids, mask)
    errs = [T.max_err(hs[k], ref[k], valid) for k in range(len(ref))]
    assert max(errs) <= TOL, errs
    ref_lg = T.hf_logits(hf, ids, mask)
    assert T.max_err(T.model_logits(model, ids, mask), ref_lg, valid) <= TOL * np.abs(ref_lg).max()
    per_layer, H, G, e = _value_output(dict(kind="phi3", hf=hf))
    g = lambda h: h // (H // G)
    Ft = np.stack([sum(Wo[:, h * e:(h + 1) * e] @ Wv[g(h) * e:(g(h) + 1) * e] for h in range(H)) for Wo, Wv in per_layer])
    np.testing.assert_allclose(np.asarray(layer_matrices(model.layers)), Ft, atol=1e-5)


def test_phi3_gguf_window_is_not_applied_as_by_transformers_gguf_loader(phi3_gguf):
    """``phi3.attention.sliding_window`` = 3 is in the file, but transformers' GGUF loader (and
    llama.cpp) run every layer globally: so does powerlens, and the two agree on the file."""
    hf, path, model = phi3_gguf
    ref_model = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                        dtype=torch.float32, pad_token_id=0)
    ref_model.eval()
    assert ref_model.config.sliding_window is None
    np.testing.assert_array_equal(np.asarray(model.layers.window), [0, 0])
    ids, mask = T.batch()
    valid = mask.astype(bool)
    hs, ref = _states(model, ids, mask), _hf_states(ref_model, ids, mask)
    assert max(T.max_err(hs[k], ref[k], valid) for k in range(len(ref))) <= TOL


def test_phi3_gguf_longrope_is_rejected(phi3_gguf, tmp_path):
    hf = phi3_gguf[0]
    longrope = lambda w: w.add_tensor("rope_factors_long.weight", np.ones(6, np.float32))
    path = T.write_gguf(tmp_path / "long.gguf", hf, "phi3", permute=False, names=PHI3_GGUF_NAMES,
                        meta=_phi3_meta(0, longrope))
    with pytest.raises(CheckpointError, match=r"long\.gguf: tensor 'rope_factors_long\.weight' \(longrope"):
        load(path)
