"""Gemma, Gemma 2 and Gemma 3 converters, Hugging Face format (``model_type`` ``gemma``,
``gemma2``, ``gemma3_text``).

All three are the Llama block of :mod:`powerlens._src.models.llama` (RMSNorm, RoPE with
``rotate_half``, grouped-query attention, a gated FFN), read by the same
:func:`~powerlens._src.models.llama.convert_hf_llama`, with these differences:

* **(1 + w) RMSNorm.** Gemma's norms compute ``x / rms(x) * (1 + w)``. The stored scale is
  folded at conversion, ``norm_scale = w + 1`` (every block norm, the q/k norms and the
  final norm), so the plain RMSNorm of :mod:`powerlens._src.dynamics.norms` computes the same.
* **Embedding scale.** The word embeddings are multiplied by sqrt(d), rounded to float32
  first as transformers' ``ScaledWordEmbedding`` does (``ModelInfo.embed_scale``); a tied
  LM head reads the unscaled table.
* **FFN**: GELU-tanh GLU, ``down(gelu_tanh(gate x) * up x)`` (``gelu_glu``); Gemma reads
  ``hidden_act``, Gemma 2/3 ``hidden_activation`` (Gemma 2 configs also carry an unused
  ``hidden_act``). The legacy ``hidden_act: "gelu"`` of the original Gemma releases means the
  tanh GELU, as GemmaConfig rewrites it. ``head_dim`` defaults to 256.
* **Gemma 2 and 3 — sandwich norms**: h = x + PostNorm(attn(PreNorm x)),
  out = h + PostFFNNorm(FFN(PreFFNNorm h)). In these checkpoints ``post_attention_layernorm``
  is the attention *post*-norm (in Llama it is the pre-FFN norm) and
  ``pre_feedforward_layernorm`` the pre-FFN norm::

      input_layernorm -> norm_scale            post_attention_layernorm -> post_attn_norm_scale
      pre_feedforward_layernorm -> ffn_norm_scale   post_feedforward_layernorm -> post_ffn_norm_scale

* **Gemma 2 and 3 — softmax scale** ``query_pre_attn_scalar ** -0.5`` (default 256), not
  ``head_dim ** -0.5``.
* **Gemma 2 — soft-capping**: attention scores s -> 50 tanh(s / 50) and logits
  z -> 30 tanh(z / 30) by default (``attn_logit_softcapping``, ``final_logit_softcapping``;
  null turns either off).
* **Local / global layers** (window w: token i sees j with i - w < j <= i), exactly where
  transformers puts them: ``layer_types`` when present, else Gemma 2's alternation
  (layers 0, 2, 4, ... sliding) and Gemma 3's ``sliding_window_pattern`` (default 6: every
  6th layer, 5, 11, 17, ..., global). The window is ``sliding_window``.
* **Gemma 3 — q/k RMSNorm** (``self_attn.q_norm``, ``k_norm``, over each head, before RoPE)
  and **a RoPE base per layer type**: ``rope_parameters`` nested by layer type
  (transformers 5) or ``rope_theta`` (global, default 1e6) with ``rope_local_base_freq``
  (sliding, default 1e4) in older files. Scaled RoPE (e.g. Gemma 3 4B's linear factor 8) is
  rejected by name. Gemma 3's attention ignores ``attn_logit_softcapping`` in transformers,
  so only null is accepted. ``use_bidirectional_attention`` (EmbeddingGemma) is rejected.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from .base import Model, register
from .convert import WINDOW_MAX, check_config, config_file, require, short_repr
from .layout import LINEAR, declare_output_layout
from .llama import ATTENTION_BIASES, LLAMA_HANDLED, QK_NORMS, SANDWICH_NORMS, convert_hf_llama
from .mistral_qwen import layer_types, windows_from_types
from .reader import CheckpointError

GEMMA_HEAD_DIM = 256
# Gemma's own: Llama's set without the MLP bias switch (Gemma has none)
GEMMA_HANDLED = LLAMA_HANDLED - {"mlp_bias"}
GEMMA_NEUTRAL = frozenset({"attention_dropout"})
GEMMA_ONLY = {"use_bidirectional_attention": (False,), "hidden_activation": (None,)}
GEMMA2_HANDLED = (GEMMA_HANDLED - {"hidden_act"}) | {"hidden_activation", "query_pre_attn_scalar", "sliding_window",
                                                     "layer_types", "final_logit_softcapping",
                                                     "attn_logit_softcapping"}
# ``hidden_act`` is saved beside ``hidden_activation`` but unused by Gemma2MLP; the cache layout
# ("hybrid") only matters for generation
GEMMA2_NEUTRAL = GEMMA_NEUTRAL | {"hidden_act", "cache_implementation"}
GEMMA2_ONLY = {"use_bidirectional_attention": (False,)}
GEMMA3_HANDLED = GEMMA2_HANDLED | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}
GEMMA3_NEUTRAL = GEMMA2_NEUTRAL
GEMMA3_ONLY = {"use_bidirectional_attention": (False,), "attn_logit_softcapping": (None,)}

# Gemma 2/3 block norms (stacked key -> tensor after ``layers.N.``, stored shape)
SANDWICH_TENSORS = {
    "ffn_norm_scale": ("pre_feedforward_layernorm.weight", lambda s: (s.d,)),
    "post_attn_norm_scale": ("post_attention_layernorm.weight", lambda s: (s.d,)),
    "post_ffn_norm_scale": ("post_feedforward_layernorm.weight", lambda s: (s.d,)),
}
declare_output_layout(LINEAR, "gemma3")      # the family name of gemma3_text folders and gemma3 GGUF files

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}   # Gemma3TextConfig.default_theta


def _biases(config: dict, src: str):
    bias = config.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise CheckpointError(f"{src}: attention_bias={short_repr(bias)} must be true or false")
    return ATTENTION_BIASES if bias else ()


def _optional_positive(config: dict, key: str, src: str, default):
    """``config[key]`` as a positive float; ``default`` when absent; None when null (off)."""
    if key not in config:
        return default
    if config[key] is None:
        return None
    return require(config, key, src, kind=float)


def embed_scale(d: int) -> float:
    """sqrt(d) rounded to float32 (transformers keeps it as a float32 buffer)."""
    return float(np.float32(d ** 0.5))


def _window(config: dict, src: str):
    """``sliding_window`` (default 4096, the Gemma 2/3 configs'); None when null (then any
    sliding_attention layer is an error, see :func:`windows_from_types`)."""
    if "sliding_window" in config and config["sliding_window"] is None:
        return None
    return require(config, "sliding_window", src, default=4096, maximum=WINDOW_MAX)


def _gemma_windows(config: dict, L: int, src: str, default_types: List[str]) -> List[int]:
    types = layer_types(config, L, src)
    return windows_from_types(default_types if types is None else types, _window(config, src), src)


def gemma3_layer_types(config: dict, L: int, src: str) -> List[str]:
    """``layer_types``, or (absent) what Gemma3TextConfig derives: layer i is global when
    (i + 1) is a multiple of ``sliding_window_pattern`` (default 6)."""
    types = layer_types(config, L, src)
    if types is not None:
        return types
    pattern = require(config, "sliding_window_pattern", src, default=6)
    legacy = config.get("_sliding_window_pattern")
    if legacy is not None and legacy != pattern:
        raise CheckpointError(f"{src}: _sliding_window_pattern={short_repr(legacy)} without layer_types: "
                              f"transformers derives the layers from sliding_window_pattern={pattern} instead; "
                              f"write layer_types explicitly")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]


def gemma3_rope_bases(config: dict, src: str) -> Tuple[float, float]:
    """(global base, local base) of a Gemma 3 config, from ``rope_parameters`` nested by
    layer type, or ``rope_theta`` / ``rope_local_base_freq``; scaled RoPE is rejected."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default"):
            raise CheckpointError(f"{src}: rope_scaling with rope_type={kind!r} is not supported (only plain "
                                  f"RoPE, rope_type 'default'); rope_scaling={short_repr(scaling)}")
    legacy = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
    if params is not None and (not isinstance(params, dict) or set(params) - set(legacy)):
        raise CheckpointError(f"{src}: rope_parameters={short_repr(params)} must be nested by layer type "
                              f"(keys full_attention, sliding_attention), as Gemma3TextConfig writes it")
    bases = {}
    for kind, key in legacy.items():
        spec = (params or {}).get(kind) or {}
        if not isinstance(spec, dict):
            raise CheckpointError(f"{src}: rope_parameters[{kind!r}]={short_repr(spec)} must be a dict")
        rtype = spec.get("rope_type", spec.get("type", "default"))
        if rtype not in (None, "default"):
            raise CheckpointError(f"{src}: rope_parameters[{kind!r}] with rope_type={rtype!r} is not supported "
                                  f"(only plain RoPE, rope_type 'default'); {short_repr(spec)}")
        unknown = set(spec) - {"rope_type", "type", "rope_theta"}
        if unknown:
            raise CheckpointError(f"{src}: rope_parameters[{kind!r}] has unknown key(s) {sorted(unknown)}")
        if spec.get("rope_theta") is not None:
            bases[kind] = require(spec, "rope_theta", f"{src}: rope_parameters[{kind!r}]", kind=float)
        else:
            bases[kind] = require(config, key, src, kind=float, default=DEFAULT_THETA[kind])
    return bases["full_attention"], bases["sliding_attention"]


@register("gemma", output_layout=LINEAR)
def convert_gemma(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "gemma", handled=GEMMA_HANDLED, neutral=GEMMA_NEUTRAL, only=GEMMA_ONLY)
    d = require(config, "hidden_size", src)
    if config.get("hidden_act") == "gelu":     # GemmaConfig: the legacy value targets the tanh approximation
        config = dict(config, hidden_act="gelu_pytorch_tanh")
    return convert_hf_llama(config, reader, dtype, name, family="gemma", biases=_biases(config, src),
                            default_tied=True, norm_offset=1.0, act_default="gelu_pytorch_tanh",
                            head_dim_default=GEMMA_HEAD_DIM, info_extra=dict(embed_scale=embed_scale(d)))


@register("gemma2", output_layout=LINEAR)
def convert_gemma2(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "gemma2", handled=GEMMA2_HANDLED, neutral=GEMMA2_NEUTRAL, only=GEMMA2_ONLY)
    d, L = require(config, "hidden_size", src), require(config, "num_hidden_layers", src)
    window = _gemma_windows(config, L, src, ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(L)])
    qpas = require(config, "query_pre_attn_scalar", src, kind=float, default=256.0)
    return convert_hf_llama(
        config, reader, dtype, name, family="gemma2", biases=_biases(config, src), window=window,
        default_tied=True, norms=SANDWICH_NORMS, tensors=SANDWICH_TENSORS, norm_offset=1.0,
        act_key="hidden_activation", act_default="gelu_pytorch_tanh", head_dim_default=GEMMA_HEAD_DIM,
        scale=qpas ** -0.5, attn_softcap=_optional_positive(config, "attn_logit_softcapping", src, 50.0),
        info_extra=dict(embed_scale=embed_scale(d),
                        final_logit_softcap=_optional_positive(config, "final_logit_softcapping", src, 30.0)))


@register("gemma3_text", output_layout=LINEAR)
def convert_gemma3(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "gemma3_text", handled=GEMMA3_HANDLED, neutral=GEMMA3_NEUTRAL, only=GEMMA3_ONLY)
    d, L = require(config, "hidden_size", src), require(config, "num_hidden_layers", src)
    types = gemma3_layer_types(config, L, src)
    window = windows_from_types(types, _window(config, src), src)
    global_base, local_base = gemma3_rope_bases(config, src)
    qpas = require(config, "query_pre_attn_scalar", src, kind=float, default=256.0)
    return convert_hf_llama(
        config, reader, dtype, name, family="gemma3", biases=_biases(config, src), window=window,
        default_tied=True, norms=QK_NORMS + SANDWICH_NORMS, tensors=SANDWICH_TENSORS, norm_offset=1.0,
        act_key="hidden_activation", act_default="gelu_pytorch_tanh", head_dim_default=GEMMA_HEAD_DIM,
        theta=global_base, scale=qpas ** -0.5,
        rope_base=[local_base if t == "sliding_attention" else global_base for t in types],
        info_extra=dict(embed_scale=embed_scale(d),
                        final_logit_softcap=_optional_positive(config, "final_logit_softcapping", src, None)))
