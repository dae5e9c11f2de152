"""Tiny random Hugging Face decoders (GPT-2, GPT-Neo, Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3) for the
equivalence tests.

The default HF initialisation (std 0.02) gives almost uniform attention and near-identity
blocks, which would hide a wrong mask or a wrong transpose; ``randomize`` redraws every
parameter at a scale where attention is sharp and every sub-layer matters.
"""
from __future__ import annotations

import math

import numpy as np
import torch

VOCAB = 61

# Llama-style families: (config class, causal-LM class, base class, defaults); 4 query heads
# over 2 key/value heads and head_dim 16 != d / H, windows 3 < the 7-token prompts
LLAMA_LIKE = {
    "mistral": ("MistralConfig", "MistralForCausalLM", "MistralModel", dict(sliding_window=3)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2Model",
              dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    # q/k RMSNorm per head
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3Model",
              dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    # (1 + w) RMSNorm, sqrt(d) embedding scale, GELU-tanh GLU
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "GemmaModel", dict()),
    # + sandwich norms, query_pre_attn_scalar 24 != head_dim, soft-capping small enough to bite,
    # sliding layers 0 and 2
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "Gemma2Model",
               dict(sliding_window=3, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                    final_logit_softcapping=4.0)),
    # + q/k norms, sliding layers 0 and 2 (pattern 2), separate RoPE bases far apart
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma3TextModel",
                    dict(sliding_window=3, query_pre_attn_scalar=24, sliding_window_pattern=2,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 30.0},
                                          "full_attention": {"rope_type": "default", "rope_theta": 3000.0}})),
}
LLAMA_LIKE_BASE = dict(vocab_size=VOCAB, max_position_embeddings=32, hidden_size=48, intermediate_size=40,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-5)

# GPT-NeoX, OPT, Phi, Phi-3: (config class, causal-LM class, base class, sizes and defaults)
OTHER_DECODERS = {
    # head size 16, a quarter of it rotated (4 dimensions)
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "GPTNeoXModel",
                 dict(vocab_size=VOCAB, max_position_embeddings=32, hidden_size=64, intermediate_size=80,
                      num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25)),
    "opt": ("OPTConfig", "OPTForCausalLM", "OPTModel",
            dict(vocab_size=VOCAB, max_position_embeddings=32, hidden_size=48, ffn_dim=40, num_hidden_layers=2,
                 num_attention_heads=4, word_embed_proj_dim=48, pad_token_id=1)),
    # 4 query heads over 2 key/value heads, head size 12, half of it rotated
    "phi": ("PhiConfig", "PhiForCausalLM", "PhiModel",
            dict(vocab_size=VOCAB, max_position_embeddings=32, hidden_size=48, intermediate_size=40,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    # fused qkv_proj / gate_up_proj; window 3 < the 7-token prompts
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "Phi3Model",
             dict(vocab_size=VOCAB, max_position_embeddings=32, original_max_position_embeddings=32, hidden_size=48,
                  intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  sliding_window=3, pad_token_id=0, eos_token_id=2)),
}


def randomize(model, seed: int, *, std: float = 1.2, zero=()):
    """Redraw all float parameters: norms ~ 1 + 0.2 N, biases ~ 0.2 N, matrices ~ std/sqrt(fan_in) N.

    ``zero``: name suffixes set to 0 (e.g. a gate bias that powerlens cannot represent).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            r = torch.randn(shape, generator=g, dtype=torch.float64)
            if any(name.endswith(z) for z in zero):
                p.zero_()
                continue
            lname = name.lower()
            if ("ln" in lname or "norm" in lname) and p.ndim == 1 and name.endswith("weight"):
                v = 1.0 + 0.2 * r
            elif p.ndim == 1:
                v = 0.2 * r
            elif "wte" in name or "wpe" in name or "embed" in name:
                v = r
            else:
                # Conv1D (GPT-2) stores (in, out); nn.Linear stores (out, in)
                fan_in = shape[0] if type(_owner(model, name)).__name__ == "Conv1D" else shape[1]
                v = std * r / math.sqrt(fan_in)
            p.copy_(v.to(p.dtype))
    return model


def _owner(model, pname):
    mod = model
    for part in pname.split(".")[:-1]:
        mod = getattr(mod, part)
    return mod


def build(kind: str, folder: str, *, seed: int = 0, head: bool = True, attn: str = "eager", zero=(), **cfg):
    """Build, randomize and ``save_pretrained`` a tiny model; returns the torch model (eval, float32)."""
    import transformers as tf
    if kind == "gpt2":
        base = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=3, n_head=4)
        config = tf.GPT2Config(**{**base, **cfg})
        cls = tf.GPT2LMHeadModel if head else tf.GPT2Model
    elif kind == "gpt_neo":
        base = dict(vocab_size=VOCAB, max_position_embeddings=16, hidden_size=32, num_layers=3, num_heads=4,
                    attention_types=[[["global", "local", "local"], 1]], window_size=3)
        config = tf.GPTNeoConfig(**{**base, **cfg})
        cls = tf.GPTNeoForCausalLM if head else tf.GPTNeoModel
    elif kind == "llama":
        base = dict(vocab_size=VOCAB, max_position_embeddings=32, hidden_size=48, intermediate_size=40,
                    num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, rms_norm_eps=1e-5)
        config = tf.LlamaConfig(**{**base, **cfg})
        cls = tf.LlamaForCausalLM if head else tf.LlamaModel
    elif kind in LLAMA_LIKE:
        config_cls, lm_cls, base_cls, defaults = LLAMA_LIKE[kind]
        config = getattr(tf, config_cls)(**{**LLAMA_LIKE_BASE, **defaults, **cfg})
        cls = getattr(tf, lm_cls if head else base_cls)
    elif kind in OTHER_DECODERS:
        config_cls, lm_cls, base_cls, defaults = OTHER_DECODERS[kind]
        config = getattr(tf, config_cls)(**{**defaults, **cfg})
        cls = getattr(tf, lm_cls if head else base_cls)
    else:
        raise ValueError(kind)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config)
    randomize(model, seed, zero=zero)
    if head and getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.eval()
    model.save_pretrained(folder)
    return model


def batch(n: int = 7, lengths=(7, 4), seed: int = 0, *, left: bool = False):
    """Right-padded random token ids (B, n) and attention mask (B, n) (zeros at the end);
    ``left``: left-padded instead (zeros at the start)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(len(lengths), n))
    mask = np.zeros((len(lengths), n), np.int64)
    for b, L in enumerate(lengths):
        mask[b, slice(n - L, n) if left else slice(0, L)] = 1
    return ids, mask


def causal_mask_4d(mask, *, window: int = 0, causal: bool = True):
    """Additive float mask (B, 1, n, n): 0 where query i may see key j, float32 min elsewhere."""
    mask = np.asarray(mask, bool)
    B, n = mask.shape
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    ok = np.broadcast_to(mask[:, None, None, :], (B, 1, n, n)).copy()
    if causal:
        ok &= (j <= i)
    if window:
        ok &= (j > i - window)
    return torch.tensor(np.where(ok, 0.0, np.finfo(np.float32).min), dtype=torch.float32)


def hf_hidden_states(model, ids, mask):
    """HF ``hidden_states`` as a (K+1, B, n, d) float64 array, run through the base model."""
    base = model.base_model if hasattr(model, "base_model") else model
    with torch.no_grad():
        out = base(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
    return np.stack([h.double().numpy() for h in out.hidden_states])


def hf_logits(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    return out.logits.double().numpy()


def max_err(a, b, valid):
    """Max abs difference of a and b (..., B, n, d) at the valid (B, n) positions."""
    return float(np.max(np.abs(np.asarray(a, np.float64)[..., valid, :] - np.asarray(b, np.float64)[..., valid, :])))


def llama_F(model):
    """F_t = W_o concat_h(W_v of head h's key/value group), from the torch weights of a
    Llama-style model (Llama, Mistral, Qwen2): (L, d, d) float64, written out per head."""
    base = model.base_model if hasattr(model, "base_model") else model
    sd = {k: v.double().numpy() for k, v in base.state_dict().items()}
    c = model.config
    H, G = c.num_attention_heads, c.num_key_value_heads
    e = getattr(c, "head_dim", None) or c.hidden_size // H
    Fs = []
    for i in range(c.num_hidden_layers):
        Wo, Wv = sd[f"layers.{i}.self_attn.o_proj.weight"], sd[f"layers.{i}.self_attn.v_proj.weight"]
        g = lambda h: h // (H // G)
        Fs.append(sum(Wo[:, h * e:(h + 1) * e] @ Wv[g(h) * e:(g(h) + 1) * e] for h in range(H)))
    return np.stack(Fs)


# Hugging Face tensor name -> GGUF tensor name (llama.cpp's gguf-py tensor_mapping.py)
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_BLOCK_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w, n_head):
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py (HF rotate_half rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's names for the Qwen3 / Gemma 3 extras (Gemma 2/3's ``post_attention_layernorm`` is the
# attention post-norm there, and ``pre_feedforward_layernorm`` the FFN norm)
GGUF_QK_NORM_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GGUF_GEMMA3_NAMES = dict(GGUF_QK_NORM_NAMES, post_attention_layernorm="post_attention_norm",
                         pre_feedforward_layernorm="ffn_norm", post_feedforward_layernorm="post_ffw_norm")


def write_gguf(path, model, arch: str, *, permute: bool, names=None, norm_shift: float = 0.0, meta=None):
    """Write a tiny Llama-style causal LM as an F32 GGUF of architecture ``arch``, the way
    llama.cpp's converter does: metadata ``{arch}.…``, tensors renamed, no ``output`` when
    the head is tied, and (``permute``: its ``llama`` converter) the rows of q/k weights and
    biases permuted for the interleaved RoPE. ``names``: extra HF module -> GGUF names;
    ``norm_shift``: added to every ``*norm.weight`` (llama.cpp's Gemma 3 ``norm_shift`` 1);
    ``meta``: called with the writer to add further metadata."""
    import gguf
    c = model.config
    block_names = dict(GGUF_BLOCK_NAMES, **(names or {}))
    H, G = c.num_attention_heads, c.num_key_value_heads
    e = getattr(c, "head_dim", None) or c.hidden_size // H
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_key_length(e)
    w.add_value_length(e)
    w.add_rope_dimension_count(e)
    rope = c.rope_parameters
    w.add_rope_freq_base((rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if meta is not None:
        meta(w)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if name in GGUF_NAMES:
            out = GGUF_NAMES[name]
        else:
            _, _, i, rest = name.split(".", 3)                 # model.layers.N.<module>.<weight|bias>
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{i}.{block_names[module]}.{kind}"
            if permute and module in ("self_attn.q_proj", "self_attn.k_proj"):
                arr = llama_cpp_permute(arr, H if module == "self_attn.q_proj" else G)
        if norm_shift and name.endswith("norm.weight"):
            arr = arr + norm_shift
        w.add_tensor(out, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ----------------------------------------------------------------------------- shared by the decoder tests

def states(model, ids, mask):
    """powerlens's hidden states "float64[K+1 B n d]" of token ids (B, n) with mask (B, n), in
    transformers' convention (``HiddenStates.hf``: the last one normed where HF norms it)."""
    from powerlens._src.models import embed_ids, hidden_states
    x0, valid = embed_ids(model, ids, mask.astype(bool))
    return np.asarray(hidden_states(model, x0, valid).hf, np.float64)


def model_logits(model, ids, mask):
    """powerlens's logits "float64[B n V]" of token ids (B, n), by the obvious call
    ``logits(model, hidden_states(model, x0, valid)[-1])``."""
    from powerlens._src.models import embed_ids, hidden_states, logits
    x0, valid = embed_ids(model, ids, mask.astype(bool))
    return np.asarray(logits(model, hidden_states(model, x0, valid)[-1]), np.float64)


def state_errors(model, hf, ids, mask):
    """(powerlens states, the max abs error of each against :func:`hf_hidden_states`) on the valid tokens."""
    valid = mask.astype(bool)
    hs = states(model, ids, mask)
    ref = hf_hidden_states(hf, ids, mask)
    assert len(hs) == len(ref) and all(h.shape == np.shape(r) for h, r in zip(hs, ref))
    return hs, [max_err(hs[k], ref[k], valid) for k in range(len(ref))]


def case_fixture(configs: dict, seed: int):
    """A module-scoped fixture ``case`` over ``configs`` (name -> (kind, config)): the tiny HF
    model built in a folder, and powerlens's model loaded from it."""
    import pytest

    from powerlens._src.models import load

    @pytest.fixture(scope="module", params=sorted(configs))
    def case(request, tmp_path_factory):
        kind, cfg = configs[request.param]
        folder = str(tmp_path_factory.mktemp(request.param))
        hf = build(kind, folder, seed=seed + sorted(configs).index(request.param), **cfg)
        return dict(name=request.param, kind=kind, cfg=cfg, hf=hf, folder=folder, model=load(folder))

    return case


def edited_copy(src, tmp_path, edit, name="variant"):
    """A copy of the model folder ``src`` whose config.json went through ``edit(cfg)``."""
    import json
    import shutil
    dst = tmp_path / name
    shutil.copytree(src, dst)
    cfg = json.load(open(dst / "config.json"))
    edit(cfg)
    json.dump(cfg, open(dst / "config.json", "w"))
    return str(dst)


def check_gguf_model(model, hf, tol: float):
    """A model read from a tiny GGUF file against the HF model it was written from: every hidden
    state and the logits on right- and left-padded batches, and F_t = W_o V against the torch weights."""
    from powerlens._src.dynamics.params import layer_matrices
    for left in (False, True):
        ids, mask = batch(left=left)
        hs, errs = state_errors(model, hf, ids, mask)
        assert max(errs) <= tol, errs
        ref_lg = hf_logits(hf, ids, mask)
        assert max_err(model_logits(model, ids, mask), ref_lg, mask.astype(bool)) <= \
            tol * np.abs(ref_lg).max()
    np.testing.assert_allclose(np.asarray(layer_matrices(model.layers)), llama_F(hf), atol=1e-5)
