"""GPT-2 converter (Hugging Face ``model_type`` ``gpt2``).

GPT-2 stores its projections as ``Conv1D`` weights of shape (in, out) and applies
them as ``y = x @ W + b``. In the column-vector convention of powerlens
(``y = W x``) every Conv1D weight is therefore transposed once::

    c_attn.weight (d, 3d) = [W_q^T | W_k^T | W_v^T]   ->  W_q = c_attn[:, :d].T.reshape(H, e, d)
    attn.c_proj.weight (H*e, d)                        ->  W_o = c_proj.T            (d, H*e)
    mlp.c_fc.weight (d, f)                             ->  W_in = c_fc.T             (f, d)
    mlp.c_proj.weight (f, d)                           ->  W_out = c_proj.T          (d, f)

A wrong transpose keeps the eigenvalues of F = W_o V_cat (F and F^T share them) but
not its eigenvectors, so the tests compare F with the torch weights directly.

Block (pre-LN): h = x + attn(ln_1 x); out = h + mlp(ln_2 h); final ``ln_f``. Softmax
scale: 1/sqrt(e) if ``scale_attn_weights`` (else 1), divided by (layer_idx + 1) when
``scale_attn_by_inverse_layer_idx``. ``reorder_and_upcast_attn`` only changes the
numerics of half-precision runs (the scores are computed in float32), so it is
accepted for float32/float64 models.
"""
from __future__ import annotations

import os
import warnings
from typing import Dict, Optional, Sequence, Tuple

import jax
import numpy as np

from ..dynamics.params import LayerConfig, make_layers
from .base import Model, ModelInfo, register
from .reader import CheckpointError

# HF activation names -> powerlens FFN activations (``gelu_pytorch_tanh`` is the tanh
# approximation, identical to ``gelu_new``).
ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu",
               "relu": "relu"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


# ---------------------------------------------------------------------- shared helpers
def require(config: dict, key: str, source: str, *aliases: str):
    """``config[key]`` (or the first alias present), or a CheckpointError naming it."""
    for k in (key,) + aliases:
        if config.get(k) is not None:
            return config[k]
    raise CheckpointError(f"{source}: config.json has no {key!r} (needed by the {config.get('model_type')} converter)")


def activation(config: dict, key: str, source: str) -> str:
    """Map the HF activation name ``config[key]`` to a powerlens FFN activation or reject it."""
    name = config.get(key, "gelu_new")
    act = ACTIVATIONS.get(name)
    if act is None:
        raise CheckpointError(
            f"{source}: unsupported {key}={name!r} in config.json "
            f"(supported: {sorted(ACTIVATIONS)})")
    return act


class Stack:
    """Stacked arrays (L, ...) filled one layer at a time, allocated on first use.

    Each tensor is read once from the checkpoint and copied into its slot, so a
    checkpoint is never held twice. ``done(key)`` hands a filled stacked array to JAX
    and drops its NumPy copy at once (a reader that fills one key after the other keeps
    at most one stacked NumPy array alive); ``finish`` does the same for the rest.
    """

    def __init__(self, n_layers: int, dtype, shapes: Dict[str, Tuple[int, ...]]):
        self.n_layers, self.dtype = n_layers, np.dtype(dtype)
        self.shapes = {k: tuple(s) for k, s in shapes.items()}
        self.arrays: Dict[str, np.ndarray] = {}
        self.device: Dict[str, jax.Array] = {}

    def __getitem__(self, key) -> np.ndarray:
        if key in self.device:
            raise KeyError(f"stacked array {key!r} was already handed to JAX")
        if key not in self.arrays:
            self.arrays[key] = np.empty((self.n_layers,) + self.shapes[key], self.dtype)
        return self.arrays[key]

    def done(self, key) -> None:
        self.device[key] = to_device(self.arrays.pop(key))

    def finish(self) -> Dict[str, jax.Array]:
        missing = [k for k in self.shapes if k not in self.arrays and k not in self.device]
        if missing:
            raise ValueError(f"stacked arrays never filled: {missing}")
        for k in list(self.arrays):
            self.done(k)
        return dict(self.device)


def to_device(a: np.ndarray) -> jax.Array:
    """Copy a NumPy array into a JAX array and wait for the copy (``device_put`` is
    asynchronous: without waiting, the NumPy source of every pending transfer stays
    alive and the peak memory doubles)."""
    out = jax.device_put(a)
    out.block_until_ready()
    return out


def tokenizer_folder(folder: str) -> Optional[str]:
    """The folder itself when it ships tokenizer files (for ``AutoTokenizer``), else None."""
    return folder if any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES) else None


def lm_head(config: dict, reader, shape: Tuple[int, int], source: str):
    """Untied LM head (V, d), or None when tied to the word embeddings."""
    if config.get("tie_word_embeddings", True):
        return None
    if reader.has("lm_head.weight"):
        return to_device(reader.get("lm_head.weight", shape))
    warnings.warn(f"{source}: tie_word_embeddings is false but the checkpoint has no lm_head.weight "
                  f"(a base model without its LM head); logits() will use the word embeddings")
    return None


def reject(config: dict, source: str, checks: Sequence[Tuple[str, object]]):
    """Error for config attributes that change the maths and are not handled.

    ``checks`` holds (key, allowed default): the key is rejected when present with
    a value other than the default (a callable default is a predicate).
    """
    for key, ok in checks:
        if key not in config:
            continue
        v = config[key]
        good = ok(v) if callable(ok) else v == ok
        if not good:
            raise CheckpointError(
                f"{source}: config attribute {key}={v!r} changes the model's maths and is not supported "
                f"by the {config.get('model_type')} converter")


# ---------------------------------------------------------------------- converter
@register("gpt2")
def convert_gpt2(config: dict, reader, dtype, name: str) -> Model:
    src = reader.folder
    reject(config, src, [("add_cross_attention", False)])
    d = int(require(config, "n_embd", src, "hidden_size"))
    H = int(require(config, "n_head", src, "num_attention_heads"))
    L = int(require(config, "n_layer", src, "num_hidden_layers"))
    P = int(require(config, "n_positions", src, "max_position_embeddings"))
    V = int(require(config, "vocab_size", src))
    if d % H:
        raise CheckpointError(f"{src}: n_embd={d} is not a multiple of n_head={H}")
    e = d // H
    f = int(config.get("n_inner") or 4 * d)
    act = activation(config, "activation_function", src)
    eps = float(config.get("layer_norm_epsilon", 1e-5))

    scale = np.full((L,), e ** -0.5 if config.get("scale_attn_weights", True) else 1.0, np.float64)
    if config.get("scale_attn_by_inverse_layer_idx", False):
        scale = scale / (np.arange(L) + 1.0)

    st = Stack(L, dtype, {
        "W_q": (H, e, d), "W_k": (H, e, d), "W_v": (H, e, d), "W_o": (d, d),
        "b_q": (H, e), "b_k": (H, e), "b_v": (H, e), "b_o": (d,),
        "norm_scale": (d,), "norm_bias": (d,), "ffn_norm_scale": (d,), "ffn_norm_bias": (d,),
        "W_in": (f, d), "b_in": (f,), "W_out": (d, f), "b_out": (d,),
    })
    for i in range(L):
        p = f"h.{i}."
        c = reader.get(p + "attn.c_attn.weight", (d, 3 * d))           # (in, out)
        cb = reader.get(p + "attn.c_attn.bias", (3 * d,))
        for j, w in enumerate(("q", "k", "v")):
            st[f"W_{w}"][i] = c[:, j * d:(j + 1) * d].T.reshape(H, e, d)
            st[f"b_{w}"][i] = cb[j * d:(j + 1) * d].reshape(H, e)
        del c
        st["W_o"][i] = reader.get(p + "attn.c_proj.weight", (d, d)).T
        st["b_o"][i] = reader.get(p + "attn.c_proj.bias", (d,))
        st["norm_scale"][i] = reader.get(p + "ln_1.weight", (d,))
        st["norm_bias"][i] = reader.get(p + "ln_1.bias", (d,))
        st["ffn_norm_scale"][i] = reader.get(p + "ln_2.weight", (d,))
        st["ffn_norm_bias"][i] = reader.get(p + "ln_2.bias", (d,))
        st["W_in"][i] = reader.get(p + "mlp.c_fc.weight", (d, f)).T
        st["b_in"][i] = reader.get(p + "mlp.c_fc.bias", (f,))
        st["W_out"][i] = reader.get(p + "mlp.c_proj.weight", (f, d)).T
        st["b_out"][i] = reader.get(p + "mlp.c_proj.bias", (d,))

    return pre_ln_decoder("gpt2", config, reader, st, d=d, H=H, e=e, eps=eps, act=act, V=V, P=P,
                          scale=scale, window=0, src=src, name=name)


def pre_ln_decoder(family, config, reader, st, *, d, H, e, eps, act, V, P, scale, window, src, name) -> Model:
    """The part GPT-2 and GPT-Neo share: a causal pre-LN stack with word + position
    embeddings (wte, wpe), a final LayerNorm (ln_f) and a tied or separate LM head."""
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=True, norm="layernorm", norm_eps=eps,
                      norm_placement="pre", ffn_activation=act, family=family)
    arrays = st.finish()
    layers = make_layers(arrays.pop("W_v"), arrays.pop("W_o"), W_q=arrays.pop("W_q"), W_k=arrays.pop("W_k"),
                         scale=scale, window=window, config=cfg, **arrays)
    embeddings = {"word": to_device(reader.get("wte.weight", (V, d))),
                  "position": to_device(reader.get("wpe.weight", (P, d)))}
    info = ModelInfo(family=family, source=src, tokenizer=tokenizer_folder(src), max_positions=P, decoder=True,
                     final_norm_in_hidden_states=True, pad_token_id=config.get("pad_token_id"),
                     bos_token_id=config.get("bos_token_id"), name=name)
    return Model(layers=layers, embeddings=embeddings,
                 final_norm_scale=to_device(reader.get("ln_f.weight", (d,))),
                 final_norm_bias=to_device(reader.get("ln_f.bias", (d,))),
                 lm_head=lm_head(config, reader, (V, d), src), info=info)
