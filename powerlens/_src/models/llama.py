"""Llama converter, Hugging Face format (``model_type`` ``llama``); its block is shared with the
GGUF reader and, through :func:`convert_hf_llama`, with the Mistral and Qwen2 converters.

Block (pre-norm, RMSNorm with ``rms_norm_eps``)::

    h   = x + attn(rms_1 x)                      rms_1 = input_layernorm
    out = h + down(silu(gate(rms_2 h)) * up(rms_2 h))   rms_2 = post_attention_layernorm
    final: norm; logits: lm_head (or embed_tokens when tie_word_embeddings)

Weights are ``nn.Linear`` (out, in)::

    q_proj (H*e, d) -> W_q (H, e, d)     k_proj, v_proj (G*e, d) -> W_k, W_v (G, e, d)
    o_proj (d, H*e) -> W_o               gate_proj, up_proj (f, d) -> W_gate, W_in
    down_proj (d, f) -> W_out

Grouped-query attention: query head h uses key/value head ``h // (H/G)`` (HF
``repeat_kv``), also when forming F = W_o V_cat. RoPE: HF ``rotate_half`` layout with
base ``rope_theta`` on the whole head (e = ``head_dim``, which may differ from d/H).
Scaled RoPE variants (``rope_scaling`` / ``rope_parameters`` with a ``rope_type`` other
than ``default``) are rejected with an error naming them.

The same block with the decoder refinements of later families (Qwen3, Gemma 1/2/3, see
:mod:`powerlens._src.models.gemma`, :mod:`powerlens._src.models.qwen3`) is read by the same
:func:`convert_hf_llama`: per-head q/k norms and sandwich norms (``norms``, from
:data:`QK_NORMS` and :data:`SANDWICH_NORMS`), renamed tensors, a softmax ``scale``, soft-capping,
per-layer RoPE bases, and ``norm_offset`` (Gemma's RMSNorm multiplies by 1 + w: the stored
scale is w + 1, so powerlens' plain RMSNorm computes the same).
"""
from __future__ import annotations

from typing import Collection, NamedTuple

import numpy as np

from ..dynamics.params import SANDWICH_NORMS, LayerConfig, make_layers, wide
from ..dynamics.parts import FFN, Attention, Norms
from .base import Model, ModelInfo, register
from .convert import (Stack, activation, check_config, check_layer_count, config_file, lm_head, read_tensors,
                      require, require_all, short_repr, tokenizer_folder, wanted)
from .layout import LINEAR
from .reader import CheckpointError

GLU_ACTIVATIONS = {"silu": "silu_glu", "swish": "silu_glu", "gelu_pytorch_tanh": "gelu_glu", "gelu_new": "gelu_glu"}

LLAMA_HANDLED = frozenset({"hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                           "intermediate_size", "vocab_size", "head_dim", "hidden_act", "rope_theta", "rope_scaling",
                           "rope_parameters", "rms_norm_eps", "attention_bias", "mlp_bias", "max_position_embeddings",
                           "tie_word_embeddings", "pad_token_id", "bos_token_id"})
# dropout; ``pretraining_tp`` > 1 only splits the projections into slices (same sums);
# ``is_llama_config`` is a marker some hub configs carry (e.g. SmolLM2)
LLAMA_NEUTRAL = frozenset({"attention_dropout", "pretraining_tp", "is_llama_config"})
# written by nanotron: False is the Hugging Face RoPE layout (rotate_half)
LLAMA_ONLY = {"rope_interleaved": (False,)}


ATTENTION_BIASES = ("b_q", "b_k", "b_v", "b_o")
MLP_BIASES = ("b_in", "b_out")
QK_NORMS = ("q_norm_scale", "k_norm_scale")                     # per-head RMSNorm of q, k (Qwen3, Gemma 3)
NORM_KEYS = ("norm_scale", "ffn_norm_scale") + QK_NORMS + SANDWICH_NORMS


def llama_shapes(d: int, H: int, G: int, e: int, f: int, *, biases: Collection[str] = (),
                 norms: Collection[str] = ()):
    """Per-layer shapes of the stacked arrays of a Llama block; ``biases``: which of
    :data:`ATTENTION_BIASES` and :data:`MLP_BIASES` the checkpoint has; ``norms``: which of
    :data:`QK_NORMS` and :data:`SANDWICH_NORMS`."""
    shapes = {"W_q": (H, e, d), "W_k": (G, e, d), "W_v": (G, e, d), "W_o": (d, H * e),
              "norm_scale": (d,), "ffn_norm_scale": (d,), "W_gate": (f, d), "W_in": (f, d), "W_out": (d, f)}
    every = {"b_q": (H, e), "b_k": (G, e), "b_v": (G, e), "b_o": (d,), "b_in": (f,), "b_out": (d,)}
    extra = {"q_norm_scale": (e,), "k_norm_scale": (e,), "post_attn_norm_scale": (d,), "post_ffn_norm_scale": (d,)}
    unknown = set(biases) - set(every)
    if unknown:
        raise ValueError(f"unknown bias keys {sorted(unknown)}")
    if set(norms) - set(extra):
        raise ValueError(f"unknown norm keys {sorted(set(norms) - set(extra))}")
    shapes.update({k: every[k] for k in every if k in biases})
    shapes.update({k: extra[k] for k in extra if k in norms})
    return shapes


def llama_model(stack: Stack, *, d, H, G, e, eps, theta, act, embeddings, final_norm, head,
                info: ModelInfo, window=0, scale=None, attn_softcap=None, rope_base=None) -> Model:
    """Assemble a :class:`Model` from filled Llama stacked arrays (HF or GGUF source).

    ``window``: the local attention window of every layer, an int or one per layer (0 =
    global; Mistral / Qwen2 sliding windows). The family name is ``info.family``.
    ``scale``: the softmax scale (default e^-1/2; Gemma: ``query_pre_attn_scalar``^-1/2);
    ``attn_softcap``: Gemma 2's attention-logit cap; ``rope_base``: one RoPE base per layer
    (Gemma 3), ``theta`` then being the global layers' base.
    ``mlp_bias`` biases are stored as ``b_in`` (up_proj) and ``b_out`` (down_proj); the
    FFN of powerlens has no gate bias, so a non-zero ``gate_proj.bias`` is rejected.
    """
    cfg = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G, d_head=e, causal=True, norm="rmsnorm", norm_eps=eps,
                      norm_placement="pre", rope_theta=float(theta), rope_dim=None, ffn_activation=act,
                      attn_softcap=attn_softcap)
    a = stack.finish()  # attention (biases, q/k norms, per-layer RoPE bases), RMS norms (sandwich), gated FFN
    bases = None if rope_base is None else np.asarray(rope_base, np.promote_types(stack.dtype_of("W_v"), np.float32))
    attn = Attention.take(a, scale=e ** -0.5 if scale is None else scale, window=np.asarray(window, np.int32),
                          rope_base=bases)
    layers = make_layers(attn=attn, norms=Norms.take(a), ffn=FFN.take(a), config=cfg, **a)
    return Model(layers=layers, embeddings=embeddings, final_norm_scale=final_norm, final_norm_bias=None,
                 lm_head=head, info=info)


def rope_theta(config: dict, source: str) -> float:
    """RoPE base from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` (default 10000):
    a positive finite number (``true``, a string, 0, NaN, inf or a negative base is an error
    naming the file and the key, never a cast); rejects scaled RoPE."""
    params = config.get("rope_parameters") or {}
    for key, spec in (("rope_scaling", config.get("rope_scaling")), ("rope_parameters", params)):
        if spec and not isinstance(spec, dict):
            raise CheckpointError(f"{source}: {key}={short_repr(spec)} must be a mapping")
        if spec:
            kind = spec.get("rope_type", spec.get("type", "default"))
            if kind not in (None, "default"):
                raise CheckpointError(
                    f"{source}: {key} with rope_type={kind!r} is not supported (only plain RoPE, "
                    f"rope_type 'default'); {key}={spec!r}")
    if params.get("rope_theta") is not None:
        return require({"rope_parameters.rope_theta": params["rope_theta"]}, "rope_parameters.rope_theta", source,
                       kind=float)
    return require(config, "rope_theta", source, kind=float, default=10000.0)


def check_rope_head_size(e: int, source: str, key: str) -> None:
    """RoPE rotates pairs of coordinates: the head size must be even."""
    if e % 2:
        raise CheckpointError(f"{source}: {key} gives an odd head size {e}; RoPE needs an even one")


def llama_info(*, source, tokenizer, max_positions, pad, bos, name, family: str = "llama", **extra) -> ModelInfo:
    """``extra``: further :class:`ModelInfo` fields (``embed_scale``, ``final_logit_softcap``)."""
    return ModelInfo(family=family, source=source, tokenizer=tokenizer, max_positions=max_positions, decoder=True,
                     final_norm_in_hidden_states=True, pad_token_id=pad, bos_token_id=bos, name=name, **extra)


class Sizes(NamedTuple):
    """The sizes of a Llama-style ``config.json``, each validated (:func:`hf_sizes`)."""
    d: int
    H: int
    G: int
    e: int
    L: int
    f: int
    V: int


def hf_sizes(config: dict, src: str, head_dim_default=None) -> Sizes:
    """d, H, G, e (``head_dim``, default ``head_dim_default`` or d / H), L, f, V of a Llama /
    Mistral / Qwen2 config: each a positive integer, H a multiple of G, e even (errors name the
    file and the key)."""
    d, H, L, f, V = require_all(config, src, d="hidden_size", H="num_attention_heads", L="num_hidden_layers",
                                f="intermediate_size", V="vocab_size")
    G = require(config, "num_key_value_heads", src, default=H)
    e = require(config, "head_dim", src, default=d // H if head_dim_default is None else head_dim_default)
    if H % G:
        raise CheckpointError(f"{src}: num_attention_heads={H} is not a multiple of num_key_value_heads={G}")
    check_rope_head_size(e, src, "head_dim (or hidden_size / num_attention_heads)")
    return Sizes(d=d, H=H, G=G, e=e, L=L, f=f, V=V)


# stacked key -> (tensor name after ``layers.N.``, stored shape from the sizes)
HF_TENSORS = {
    "W_q": ("self_attn.q_proj.weight", lambda s: (s.H * s.e, s.d)),
    "W_k": ("self_attn.k_proj.weight", lambda s: (s.G * s.e, s.d)),
    "W_v": ("self_attn.v_proj.weight", lambda s: (s.G * s.e, s.d)),
    "W_o": ("self_attn.o_proj.weight", lambda s: (s.d, s.H * s.e)),
    "b_q": ("self_attn.q_proj.bias", lambda s: (s.H * s.e,)),
    "b_k": ("self_attn.k_proj.bias", lambda s: (s.G * s.e,)),
    "b_v": ("self_attn.v_proj.bias", lambda s: (s.G * s.e,)),
    "b_o": ("self_attn.o_proj.bias", lambda s: (s.d,)),
    "norm_scale": ("input_layernorm.weight", lambda s: (s.d,)),
    "ffn_norm_scale": ("post_attention_layernorm.weight", lambda s: (s.d,)),
    "W_gate": ("mlp.gate_proj.weight", lambda s: (s.f, s.d)),
    "W_in": ("mlp.up_proj.weight", lambda s: (s.f, s.d)),
    "W_out": ("mlp.down_proj.weight", lambda s: (s.d, s.f)),
    "b_in": ("mlp.up_proj.bias", lambda s: (s.f,)),
    "b_out": ("mlp.down_proj.bias", lambda s: (s.d,)),
    "q_norm_scale": ("self_attn.q_norm.weight", lambda s: (s.e,)),
    "k_norm_scale": ("self_attn.k_norm.weight", lambda s: (s.e,)),
}


def convert_hf_llama(config: dict, reader, dtype, name: str, *, family: str, biases: Collection[str] = (),
                     window=0, default_tied: bool = False, norms: Collection[str] = (), tensors=None,
                     norm_offset: float = 0.0, act_key: str = "hidden_act", act_default: str = "silu",
                     head_dim_default=None, theta=None, scale=None, attn_softcap=None, rope_base=None,
                     info_extra=None) -> Model:
    """A Hugging Face Llama-style folder (Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3) as a :class:`Model`.

    The caller has checked ``config.json`` against its family's allow-list; ``biases``:
    the stacked bias keys the family's checkpoints carry (:data:`ATTENTION_BIASES`,
    :data:`MLP_BIASES`); ``window``: per-layer local windows (0 = global); ``norms``: the
    extra norm keys (:data:`QK_NORMS`, :data:`SANDWICH_NORMS`); ``tensors``: stacked key ->
    (tensor name, stored shape) overriding :data:`HF_TENSORS` (Gemma 2/3 name their norms
    differently); ``norm_offset``: added to every stored norm weight, the final norm included
    (Gemma: 1, for its (1 + w) RMSNorm); ``act_key`` / ``act_default``: where the activation
    is named; ``head_dim_default``: the family's ``head_dim`` when the config has none (else
    d / H); ``theta``: the RoPE base when the caller has read it (else :func:`rope_theta`);
    ``scale``, ``attn_softcap``, ``rope_base``: see :func:`llama_model`; ``info_extra``:
    further :class:`ModelInfo` fields.
    """
    src = config_file(reader)
    s = hf_sizes(config, src, head_dim_default)
    act = activation(config, act_key, src, act_default, GLU_ACTIVATIONS)
    theta = rope_theta(config, src) if theta is None else theta
    eps = require(config, "rms_norm_eps", src, kind=float, default=1e-6)
    check_layer_count(s.L, "num_hidden_layers", reader.names(), "layers.", src)
    table = dict(HF_TENSORS, **(tensors or {}))
    tied = config.get("tie_word_embeddings")
    table_bytes = {"word embeddings": s.V * s.d * np.dtype(dtype).itemsize if wanted("word") else 0,
                   "LM head": s.V * s.d * np.dtype(dtype).itemsize
                   if wanted("lm_head") and not (default_tied if tied is None else tied) else 0}
    st = Stack(s.L, dtype, llama_shapes(s.d, s.H, s.G, s.e, s.f, biases=biases, norms=norms), reader.folder,
               extra={k: v for k, v in table_bytes.items() if v})
    kept = [key for key in st.shapes if st.wants(key)]
    for key in kept:                                 # every shape (headers only), then the memory, then the reads
        for i in range(s.L):
            reader.check(f"layers.{i}.{table[key][0]}", table[key][1](s))
    st.check_memory()
    for key in kept:
        tensor, stored = table[key]
        for i in range(s.L):
            st.read(key, i, reader, f"layers.{i}.{tensor}", stored(s))
        st.done(key)                                            # one stacked NumPy array alive at a time
        if norm_offset and key in NORM_KEYS:
            st.device[key] = wide(st.device[key]) + norm_offset     # w + 1 (Gemma), at least float32
    if "b_in" in biases:
        reject_gate_bias(reader, s)
    folder = reader.folder
    info = llama_info(source=folder, tokenizer=tokenizer_folder(folder),
                      max_positions=require(config, "max_position_embeddings", src, default=None),
                      pad=config.get("pad_token_id"), bos=config.get("bos_token_id"), name=name, family=family,
                      **(info_extra or {}))
    tensors = read_tensors(reader, {"word": "embed_tokens.weight", "norm": "norm.weight"},
                           {"word": (s.V, s.d), "norm": (s.d,)})
    final = tensors["norm"]
    if norm_offset and final is not None:
        final = wide(final) + norm_offset
    return llama_model(st, d=s.d, H=s.H, G=s.G, e=s.e, eps=eps, theta=theta, act=act,
                       embeddings={} if tensors["word"] is None else {"word": tensors["word"]}, final_norm=final,
                       head=lm_head(config, reader, (s.V, s.d), default_tied=default_tied), info=info, window=window,
                       scale=scale, attn_softcap=attn_softcap, rope_base=rope_base)


def reject_gate_bias(reader, s: Sizes) -> None:
    """The SwiGLU FFN of powerlens has no gate bias: a non-zero ``gate_proj.bias`` is an error."""
    for i in range(s.L):
        name = f"layers.{i}.mlp.gate_proj.bias"
        if reader.has(name) and reader.get(name, (s.f,)).any():
            raise CheckpointError(f"{reader.folder}: tensor {name!r} is non-zero; a gate bias "
                                  f"is not supported by the SwiGLU FFN of powerlens")


@register("llama", output_layout=LINEAR)
def convert_llama(config: dict, reader, dtype, name: str) -> Model:
    check_config(config, config_file(reader), "llama", handled=LLAMA_HANDLED, neutral=LLAMA_NEUTRAL,
                 only=LLAMA_ONLY)
    biases = (ATTENTION_BIASES if config.get("attention_bias") else ()) + (
        MLP_BIASES if config.get("mlp_bias") else ())
    return convert_hf_llama(config, reader, dtype, name, family="llama", biases=biases)
