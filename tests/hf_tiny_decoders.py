"""Tiny random Hugging Face decoders (GPT-2, GPT-Neo, Llama) for the equivalence tests.

The default HF initialisation (std 0.02) gives almost uniform attention and near-identity
blocks, which would hide a wrong mask or a wrong transpose; ``randomize`` redraws every
parameter at a scale where attention is sharp and every sub-layer matters.
"""
from __future__ import annotations

import math

import numpy as np
import torch

VOCAB = 61


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


def batch(n: int = 7, lengths=(7, 4), seed: int = 0):
    """Right-padded random token ids (B, n) and attention mask (B, n) (zeros at the end)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(len(lengths), n))
    mask = np.zeros((len(lengths), n), np.int64)
    for b, L in enumerate(lengths):
        mask[b, :L] = 1
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
