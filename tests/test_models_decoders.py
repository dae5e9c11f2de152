"""Decoder converters (GPT-2, GPT-Neo, HF Llama) against transformers + torch.

Tiny random models (tests/hf_tiny_decoders.py) are saved with ``save_pretrained`` and
read back with ``powerlens._src.models.load``. Checked, in float32, at valid positions of a
right-padded batch (lengths 7 and 4):

* every entry of HF ``hidden_states`` (rule ``full``) to <= 1e-4 max abs;
* each attention sub-layer, ``layer_step(rule='pre_ln')`` = X + attn_module(norm_1 X), to <= 1e-4;
* LM-head logits of the ...LMHeadModel / ...ForCausalLM classes to <= 1e-4;
* F_t = W_o V_cat against the torch weights directly (a wrong Conv1D transpose keeps
  the eigenvalues but not F), plus the per-layer softmax scale, the GPT-Neo windows
  and the RoPE base against their analytic values.
"""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_tiny_decoders as T  # noqa: E402
import zero_pad as Z  # noqa: E402
from powerlens._src.dynamics.layer import layer_step  # noqa: E402
from powerlens._src.dynamics.params import layer_matrices  # noqa: E402
from powerlens._src.models import CheckpointError, embed_ids, hidden_states, load, logits, run_states  # noqa: E402
from powerlens._src.models.llama import rope_theta  # noqa: E402

TOL = 1e-4

CONFIGS = {
    # GPT-2: default (tied head, eager); odd heads + 1/(layer+1) scaling + relu + sdpa;
    # reorder_and_upcast_attn + unscaled scores + exact gelu + untied head
    "gpt2_a": ("gpt2", dict(), dict(head=True)),
    "gpt2_b": ("gpt2", dict(n_embd=24, n_head=3, scale_attn_by_inverse_layer_idx=True, activation_function="relu",
                            n_inner=40), dict(head=False, attn="sdpa")),
    "gpt2_c": ("gpt2", dict(reorder_and_upcast_attn=True, scale_attn_weights=False, activation_function="gelu",
                            tie_word_embeddings=False), dict(head=True)),
    # GPT-Neo: global, local, local with window 3 < 7 tokens; odd heads, local-first, window 2
    "neo_a": ("gpt_neo", dict(), dict(head=True)),
    "neo_b": ("gpt_neo", dict(hidden_size=24, num_heads=3, num_layers=4, window_size=2, activation_function="gelu",
                              attention_types=[[["local", "global"], 2]]), dict(head=False)),
    # Llama: 3 query heads / 1 KV head, rope_theta 500, untied head;
    # 4 / 2 heads, head_dim 12 != d/H, attention + mlp biases (gate bias zero), tied head
    "llama_a": ("llama", dict(rope_theta=500.0), dict(head=True)),
    "llama_b": ("llama", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                              attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=10000.0),
                dict(head=True, zero=("gate_proj.bias",))),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    kind, cfg, opts = CONFIGS[request.param]
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = T.build(kind, folder, seed=sorted(CONFIGS).index(request.param), **cfg, **opts)
    model = load(folder)
    ids, mask = T.batch()
    x0, valid = embed_ids(model, ids, mask.astype(bool))
    return dict(name=request.param, kind=kind, cfg=cfg, opts=opts, hf=hf, model=model, folder=folder,
                ids=ids, mask=mask, valid=mask.astype(bool), x0=x0, jvalid=valid,
                ref_hs=T.hf_hidden_states(hf, ids, mask))


def _max_err(a, b, valid):
    return float(np.max(np.abs(np.asarray(a, np.float64)[..., valid, :] - np.asarray(b, np.float64)[..., valid, :])))


def test_hidden_states_match_hf(case):
    hs = np.asarray(hidden_states(case["model"], case["x0"], case["jvalid"]).hf)
    ref = case["ref_hs"]
    assert hs.shape == ref.shape, (hs.shape, ref.shape)
    errs = [_max_err(hs[k], ref[k], case["valid"]) for k in range(len(ref))]
    assert max(errs) <= TOL, f"{case['name']}: per-layer max abs errors {errs}"
    # the last HF entry has the final norm applied (info.final_norm_in_hidden_states):
    # without it the error is O(1), so the check above is sensitive to it
    raw = np.asarray(run_states(case["model"], case["x0"], case["jvalid"]))[-1]
    assert _max_err(raw, ref[-1], case["valid"]) > 1e-2


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
def test_a_zero_pad_row_is_validated_out_and_inert(case, left):
    """The pad token's embedding row zero in both models (as transformers' ``padding_idx``
    leaves it): the padded rows of x0 are zero (GPT-2 and GPT-Neo add learned positions), yet
    the valid tokens' hidden states are transformers' own, and under the paper rule with
    uniform attention (where a padded query with no key is N2(0) = NaN unless padding is
    inert) every valid state is finite."""
    Z.check_zero_pad_row(case["model"], case["hf"], *T.batch(left=left), lambda *a: T.state_errors(*a)[1], TOL,
                         zero_x0=case["kind"] == "llama")


_step = jax.jit(jax.vmap(lambda lp, X, v: layer_step(lp, X, v, rule="pre_ln", attention="softmax"),
                         in_axes=(None, 0, 0)))


def _torch_blocks(case):
    hf = case["hf"]
    base = hf.base_model
    return base.layers if case["kind"] == "llama" else base.h


def _torch_attention_sublayer(case, layer, X):
    """X + attn(norm_1 X) with the torch modules (X: (B, n, d) torch float32)."""
    blk = _torch_blocks(case)[layer]
    n = X.shape[1]
    mask4 = T.causal_mask_4d(case["mask"])
    with torch.no_grad():
        if case["kind"] == "gpt2":
            return X + blk.attn(blk.ln_1(X), attention_mask=mask4)[0]
        if case["kind"] == "gpt_neo":   # the module adds its own causal/local mask
            return X + blk.attn(blk.ln_1(X), attention_mask=mask4)[0]
        pos = torch.arange(n)[None]
        cos_sin = case["hf"].base_model.rotary_emb(X, pos)
        return X + blk.self_attn(blk.input_layernorm(X), position_embeddings=cos_sin, attention_mask=mask4)[0]


def test_attention_sublayer_matches_torch(case):
    model = case["model"]
    L = model.layers.n_unique
    for layer in range(L):
        X = case["ref_hs"][layer].astype(np.float32)          # realistic inputs: HF states entering the layer
        ref = _torch_attention_sublayer(case, layer, torch.tensor(X)).numpy()
        out = np.asarray(_step(model.layers.layer(layer), X, case["jvalid"]))
        err = _max_err(out, ref, case["valid"])
        assert err <= TOL, f"{case['name']} layer {layer}: attention sub-layer error {err}"
        if int(model.layers.window[layer]):
            # the local window is shorter than the prompt, so it must matter
            glob = model.layers.layer(layer).replace(window=np.int32(0))
            assert _max_err(np.asarray(_step(glob, X, case["jvalid"])), ref, case["valid"]) > 1e-2


def test_logits_match_hf_lm_head(case):
    if not case["opts"].get("head"):
        pytest.skip("base model without LM head")
    model = case["model"]
    tied = case["cfg"].get("tie_word_embeddings", case["kind"] != "llama")
    assert (model.lm_head is None) == tied
    h = run_states(model, case["x0"], case["jvalid"])[-1]       # before the final norm
    lg = np.asarray(logits(model, h))
    ref = T.hf_logits(case["hf"], case["ids"], case["mask"])
    assert lg.shape == ref.shape
    assert _max_err(lg, ref, case["valid"]) <= TOL * max(1.0, np.abs(ref).max())
    # the obvious call on the hidden states, and the HiddenStates itself, give the same logits
    hs = hidden_states(model, case["x0"], case["jvalid"])
    for lg in (logits(model, hs[-1]), logits(model, hs)):
        assert _max_err(np.asarray(lg), ref, case["valid"]) <= TOL * max(1.0, np.abs(ref).max())


def _torch_F(case):
    """F_t = O_t V_t from the torch state dict, written out per family (float64)."""
    sd = {k: v.double().numpy() for k, v in case["hf"].base_model.state_dict().items()}
    Fs = []
    for i in range(case["model"].layers.n_unique):
        if case["kind"] == "gpt2":
            d = sd["wte.weight"].shape[1]
            Wc = sd[f"h.{i}.attn.c_attn.weight"]                      # (in, 3 out): y = x @ W
            Fs.append(sd[f"h.{i}.attn.c_proj.weight"].T @ Wc[:, 2 * d:].T)
        elif case["kind"] == "gpt_neo":
            a = f"h.{i}.attn.attention."
            Fs.append(sd[a + "out_proj.weight"] @ sd[a + "v_proj.weight"])
        else:
            a = f"layers.{i}.self_attn."
            cfg = case["hf"].config
            H, G, e = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            Wo, Wv = sd[a + "o_proj.weight"], sd[a + "v_proj.weight"]
            Fs.append(sum(Wo[:, h * e:(h + 1) * e] @ Wv[(h // (H // G)) * e:(h // (H // G) + 1) * e]
                          for h in range(H)))
    return np.stack(Fs)


def test_layer_matrices_match_torch_weights(case):
    F = np.asarray(layer_matrices(case["model"].layers), np.float64)
    Ft = _torch_F(case)
    assert np.max(np.abs(F - Ft)) <= 1e-5 * max(1.0, np.abs(Ft).max())
    # F is far from symmetric, so a transposed F (same eigenvalues) would fail above
    assert np.max(np.abs(Ft - np.swapaxes(Ft, 1, 2))) > 0.1
    # eigenvector check on the torch side: the principal eigenvector of powerlens's F is one of Ft's
    lam, vec = np.linalg.eig(F[0])
    k = int(np.argmax(np.abs(lam)))
    v = vec[:, k]
    assert np.linalg.norm(Ft[0] @ v - lam[k] * v) <= 1e-4 * max(1.0, abs(lam[k]))


def test_static_config_matches_analytic_values(case):
    cfg, layers = case["model"].config, case["model"].layers
    kind, c = case["kind"], case["cfg"]
    assert cfg.causal and cfg.norm_placement == "pre"
    assert case["model"].info.decoder and case["model"].info.final_norm_in_hidden_states
    L = layers.n_unique
    if kind == "gpt2":
        e = cfg.d_head
        base = e ** -0.5 if c.get("scale_attn_weights", True) else 1.0
        expect = base / (np.arange(L) + 1.0) if c.get("scale_attn_by_inverse_layer_idx") else np.full(L, base)
        np.testing.assert_allclose(np.asarray(layers.scale), expect, rtol=1e-6)
        assert cfg.norm == "layernorm" and cfg.ffn_activation == {"relu": "relu", "gelu": "gelu"}.get(
            c.get("activation_function"), "gelu_new")
    elif kind == "gpt_neo":
        np.testing.assert_array_equal(np.asarray(layers.scale), np.ones(L))
        kinds = case["hf"].config.attention_layers
        w = c.get("window_size", 3)
        np.testing.assert_array_equal(np.asarray(layers.window), [w if k == "local" else 0 for k in kinds])
    else:
        hc = case["hf"].config
        assert cfg.norm == "rmsnorm" and cfg.ffn_activation == "silu_glu"
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.d_head) == (hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
        assert cfg.rope_theta == c["rope_theta"]
        np.testing.assert_allclose(np.asarray(layers.scale), np.full(L, hc.head_dim ** -0.5), rtol=1e-6)


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def small_folders(tmp_path_factory):
    out = {}
    for kind in ("gpt2", "gpt_neo", "llama"):
        folder = str(tmp_path_factory.mktemp(f"bad_{kind}"))
        T.build(kind, folder, head=False, n_layer=1) if kind == "gpt2" else T.build(
            kind, folder, head=False, **({"num_layers": 1, "attention_types": [[["local"], 1]]} if kind == "gpt_neo"
                                         else {"num_hidden_layers": 1}))
        out[kind] = folder
    return out


def _variant(src, tmp_path, edit_config=None, edit_tensors=None):
    dst = tmp_path / "variant"
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.load(open(dst / "config.json"))
        edit_config(cfg)
        json.dump(cfg, open(dst / "config.json", "w"))
    if edit_tensors:
        from safetensors.numpy import load_file, save_file
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("kind,key,value,needle", [
    ("gpt2", "activation_function", "quick_gelu", "activation_function='quick_gelu'"),
    ("gpt2", "add_cross_attention", True, "add_cross_attention"),
    ("gpt_neo", "attention_types", [[["sparse"], 1]], "sparse"),
    ("llama", "hidden_act", "relu", "hidden_act='relu'"),
    ("llama", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "rope_type='linear'"),
    ("llama", "rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling"),
])
def test_unsupported_config_is_rejected(small_folders, tmp_path, kind, key, value, needle):
    folder = _variant(small_folders[kind], tmp_path, edit_config=lambda c: c.update({key: value}))
    with pytest.raises(CheckpointError) as err:
        load(folder)
    assert needle in str(err.value) and folder in str(err.value)


@pytest.mark.parametrize("kind,tensor", [
    ("gpt2", "h.0.attn.c_attn.bias"), ("gpt_neo", "h.0.attn.attention.v_proj.weight"),
    ("llama", "layers.0.self_attn.k_proj.weight"),
])
def test_missing_tensor_is_named(small_folders, tmp_path, kind, tensor):
    folder = _variant(small_folders[kind], tmp_path, edit_tensors=lambda t: t.pop(
        next(k for k in t if k.endswith(tensor))))
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        load(folder)


def test_wrong_shape_is_named(small_folders, tmp_path):
    name = "layers.0.self_attn.q_proj.weight"

    def cut(t):
        k = next(k for k in t if k.endswith(name))
        t[k] = np.ascontiguousarray(t[k][:-1])
    folder = _variant(small_folders["llama"], tmp_path, edit_tensors=cut)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*shape"):
        load(folder)


def test_rope_theta_from_old_and_new_configs():
    assert rope_theta({"rope_theta": 5e5, "rope_scaling": None}, "x") == 5e5
    assert rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}, "x") == 123.0
    assert rope_theta({}, "x") == 10000.0
    with pytest.raises(CheckpointError, match="rope_scaling"):
        rope_theta({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "x")
