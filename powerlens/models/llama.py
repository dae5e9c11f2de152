"""Llama converter, Hugging Face format (``model_type`` ``llama``); shared with the GGUF reader.

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
"""
from __future__ import annotations

from ..dynamics.params import LayerConfig, make_layers
from .base import Model, ModelInfo, register
from .convert import (Stack, activation, check_config, check_layer_count, config_file, lm_head, read_tensors,
                      require, require_all, tokenizer_folder)
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


def llama_shapes(d: int, H: int, G: int, e: int, f: int, *, attention_bias=False, mlp_bias=False):
    """Per-layer shapes of the stacked arrays of a Llama block."""
    shapes = {"W_q": (H, e, d), "W_k": (G, e, d), "W_v": (G, e, d), "W_o": (d, H * e),
              "norm_scale": (d,), "ffn_norm_scale": (d,), "W_gate": (f, d), "W_in": (f, d), "W_out": (d, f)}
    if attention_bias:
        shapes.update(b_q=(H, e), b_k=(G, e), b_v=(G, e), b_o=(d,))
    if mlp_bias:
        shapes.update(b_in=(f,), b_out=(d,))
    return shapes


def llama_model(stack: Stack, *, d, H, G, e, eps, theta, act, embeddings, final_norm, head,
                info: ModelInfo, family: str = "llama") -> Model:
    """Assemble a :class:`Model` from filled Llama stacked arrays (HF or GGUF source).

    ``mlp_bias`` biases are stored as ``b_in`` (up_proj) and ``b_out`` (down_proj); the
    FFN of powerlens has no gate bias, so a non-zero ``gate_proj.bias`` is rejected.
    """
    cfg = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G, d_head=e, causal=True, norm="rmsnorm", norm_eps=eps,
                      norm_placement="pre", rope_theta=float(theta), rope_dim=None, ffn_activation=act,
                      family=family)
    arrays = stack.finish()
    layers = make_layers(arrays.pop("W_v"), arrays.pop("W_o"), W_q=arrays.pop("W_q"), W_k=arrays.pop("W_k"),
                         scale=e ** -0.5, window=0, config=cfg, **arrays)
    return Model(layers=layers, embeddings=embeddings, final_norm_scale=final_norm, final_norm_bias=None,
                 lm_head=head, info=info)


def rope_theta(config: dict, source: str) -> float:
    """RoPE base from ``rope_parameters`` (transformers >= 5) or ``rope_theta``; rejects scaled RoPE."""
    params = config.get("rope_parameters") or {}
    for key, spec in (("rope_scaling", config.get("rope_scaling")), ("rope_parameters", params)):
        if spec:
            kind = spec.get("rope_type", spec.get("type", "default"))
            if kind not in (None, "default"):
                raise CheckpointError(
                    f"{source}: {key} with rope_type={kind!r} is not supported (only plain RoPE, "
                    f"rope_type 'default'); {key}={spec!r}")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def check_rope_head_size(e: int, source: str, key: str) -> None:
    """RoPE rotates pairs of coordinates: the head size must be even."""
    if e % 2:
        raise CheckpointError(f"{source}: {key} gives an odd head size {e}; RoPE needs an even one")


def llama_info(*, source, tokenizer, max_positions, pad, bos, name) -> ModelInfo:
    return ModelInfo(family="llama", source=source, tokenizer=tokenizer, max_positions=max_positions, decoder=True,
                     final_norm_in_hidden_states=True, pad_token_id=pad, bos_token_id=bos, name=name)


@register("llama", output_layout=LINEAR)
def convert_llama(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "llama", handled=LLAMA_HANDLED, neutral=LLAMA_NEUTRAL, only=LLAMA_ONLY)
    d, H, L, f, V = require_all(config, src, d="hidden_size", H="num_attention_heads", L="num_hidden_layers",
                                f="intermediate_size", V="vocab_size")
    G = require(config, "num_key_value_heads", src, default=H)
    e = require(config, "head_dim", src, default=d // H)
    if H % G:
        raise CheckpointError(f"{src}: num_attention_heads={H} is not a multiple of num_key_value_heads={G}")
    check_rope_head_size(e, src, "head_dim (or hidden_size / num_attention_heads)")
    act = activation(config, "hidden_act", src, "silu", GLU_ACTIVATIONS)
    theta = rope_theta(config, src)
    eps = require(config, "rms_norm_eps", src, kind=float, default=1e-6)
    ab, mb = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))

    check_layer_count(L, "num_hidden_layers", reader.names(), "layers.", src)
    st = Stack(L, dtype, llama_shapes(d, H, G, e, f, attention_bias=ab, mlp_bias=mb), reader.folder)
    for i in range(L):
        p, a, m = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        st["W_q"][i] = reader.get(a + "q_proj.weight", (H * e, d)).reshape(H, e, d)
        st["W_k"][i] = reader.get(a + "k_proj.weight", (G * e, d)).reshape(G, e, d)
        st["W_v"][i] = reader.get(a + "v_proj.weight", (G * e, d)).reshape(G, e, d)
        st["W_o"][i] = reader.get(a + "o_proj.weight", (d, H * e))
        if ab:
            st["b_q"][i] = reader.get(a + "q_proj.bias", (H * e,)).reshape(H, e)
            st["b_k"][i] = reader.get(a + "k_proj.bias", (G * e,)).reshape(G, e)
            st["b_v"][i] = reader.get(a + "v_proj.bias", (G * e,)).reshape(G, e)
            st["b_o"][i] = reader.get(a + "o_proj.bias", (d,))
        st["norm_scale"][i] = reader.get(p + "input_layernorm.weight", (d,))
        st["ffn_norm_scale"][i] = reader.get(p + "post_attention_layernorm.weight", (d,))
        st["W_gate"][i] = reader.get(m + "gate_proj.weight", (f, d))
        st["W_in"][i] = reader.get(m + "up_proj.weight", (f, d))
        st["W_out"][i] = reader.get(m + "down_proj.weight", (d, f))
        if mb:
            if reader.has(m + "gate_proj.bias"):
                g = reader.get(m + "gate_proj.bias", (f,))
                if g.any():
                    raise CheckpointError(f"{reader.folder}: tensor {m + 'gate_proj.bias'!r} is non-zero; a gate bias "
                                          f"is not supported by the SwiGLU FFN of powerlens")
            st["b_in"][i] = reader.get(m + "up_proj.bias", (f,))
            st["b_out"][i] = reader.get(m + "down_proj.bias", (d,))
    folder = reader.folder
    info = llama_info(source=folder, tokenizer=tokenizer_folder(folder),
                      max_positions=require(config, "max_position_embeddings", src, default=None),
                      pad=config.get("pad_token_id"), bos=config.get("bos_token_id"), name=name)
    tensors = read_tensors(reader, {"word": "embed_tokens.weight", "norm": "norm.weight"}, {"word": (V, d), "norm": (d,)})
    return llama_model(st, d=d, H=H, G=G, e=e, eps=eps, theta=theta, act=act, embeddings={"word": tensors["word"]},
                       final_norm=tensors["norm"], head=lm_head(config, reader, (V, d), default_tied=False),
                       info=info)
