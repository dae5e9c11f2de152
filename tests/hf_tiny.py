"""Tiny random Hugging Face encoders (transformers + torch, test oracle only).

``build(family, folder, **overrides)`` makes a small model of one family with every
parameter re-drawn at random (HF initialises biases to 0 and LayerNorms to 1, which
would hide bias and norm bugs), saves it with ``save_pretrained`` (safetensors) into
``folder`` and returns the torch model in eval mode with eager attention.
"""
from __future__ import annotations

import copy
import math
import os

import numpy as np
import torch
import transformers

VOCAB = 100

DEFAULTS = {
    "bert": dict(vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                 intermediate_size=37, max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu",
                 layer_norm_eps=1e-12, pad_token_id=0),
    "roberta": dict(vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=37, max_position_embeddings=64, type_vocab_size=1, hidden_act="gelu",
                    layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2),
    "distilbert": dict(vocab_size=VOCAB, dim=36, n_layers=2, n_heads=3, hidden_dim=37,
                       max_position_embeddings=64, activation="gelu", pad_token_id=0),
    "albert": dict(vocab_size=VOCAB, embedding_size=20, hidden_size=36, num_hidden_layers=3,
                   num_attention_heads=3, intermediate_size=37, num_hidden_groups=2, inner_group_num=2,
                   max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu_new",
                   layer_norm_eps=1e-12, pad_token_id=0),
}

CLASSES = {
    "bert": (transformers.BertConfig, transformers.BertModel),
    "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
    "distilbert": (transformers.DistilBertConfig, transformers.DistilBertModel),
    "albert": (transformers.AlbertConfig, transformers.AlbertModel),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter: Linear weights N(0, 1/fan_in) (non-trivial attention
    patterns), embeddings N(0, 1), biases N(0, 0.1^2), norm scales 1 + N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            norm = "LayerNorm" in name or "layer_norm" in name
            if norm and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif "embeddings" in name and "mapping" not in name:
                p.copy_(r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))


def build(family: str, folder, *, seed: int = 0, dtype=None, **overrides):
    """Save a tiny random model of ``family`` into ``folder``; return the float32 torch model."""
    cfg_cls, model_cls = CLASSES[family]
    kw = dict(DEFAULTS[family])
    kw.update(overrides)
    config = cfg_cls(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    if dtype is not None:
        half = copy.deepcopy(model).to(dtype)
        half.save_pretrained(str(folder))
        # the reference is the rounded checkpoint, upcast back to float32
        model.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    else:
        model.save_pretrained(str(folder))
    return model


def random_batch(lengths, n=None, *, seed=0, vocab=VOCAB, avoid=(0, 1, 2), pad_id=0):
    """Token ids (B, n) right-padded with ``pad_id`` and the mask (B, n) for the given lengths.

    Valid tokens avoid the ids in ``avoid`` (pad/special ids, so RoBERTa positions that
    Hugging Face derives from ``input_ids != pad`` equal those derived from the mask).
    """
    rng = np.random.default_rng(seed)
    n = n or max(lengths)
    allowed = np.setdiff1d(np.arange(vocab), np.asarray(avoid))
    ids = np.full((len(lengths), n), pad_id, np.int64)
    mask = np.zeros((len(lengths), n), np.int64)
    for b, m in enumerate(lengths):
        ids[b, :m] = rng.choice(allowed, m)
        mask[b, :m] = 1
    return ids, mask


def torch_hidden_states(model, ids, mask):
    """Hugging Face's ``hidden_states`` as a float64 array (K+1, B, n, d)."""
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                    output_hidden_states=True)
    return np.stack([h.double().numpy() for h in out.hidden_states])


def additive_mask(mask, dtype=torch.float32):
    """Eager-attention additive mask (B, 1, 1, n): 0 on valid keys, dtype min on padding."""
    m = torch.as_tensor(np.asarray(mask, bool))
    return torch.where(m, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]


def bert_with_minilm_tokenizer(folder, seed: int = 0):
    """A tiny random BERT folder (``build("bert")``) with the real MiniLM tokenizer files, so
    that text prompts tokenize as they do for ``minilm``; returns the folder."""
    import shutil
    from powerlens._src.models.load import resolve
    build("bert", folder, seed=seed, vocab_size=30522)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(resolve("minilm"), name), os.path.join(folder, name))
    return folder
