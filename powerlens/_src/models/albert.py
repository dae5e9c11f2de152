"""ALBERT checkpoints -> :class:`~powerlens._src.models.base.Model`, weights shared, never tiled.

ALBERT has G = ``num_hidden_groups`` layer groups of I = ``inner_group_num`` post-LN
layers each, so U = G*I unique layers: group g, inner layer j is unique index g*I + j.
The L = ``num_hidden_layers`` outer layers apply group ``g(i) = int(i / (L / G))``
(Hugging Face's formula), each running its I inner layers in order, so the static
schedule is::

    schedule = concat_{i < L} (g(i)*I + 0, ..., g(i)*I + I - 1)        (L*I steps)

Embeddings live in a smaller width E (``embedding_size``) and are mapped to d by
``encoder.embedding_hidden_mapping_in``: ``x0 = W_p LN_emb(word + position + type0) + b_p``
(stored as ``project_W`` (d, E), ``project_b`` (d,)).

Hidden states: transformers < 5 records one state per outer layer (after steps
I, 2I, ..., L*I); transformers >= 5 records one after every inner layer (every step).
``info.hidden_state_steps`` follows the installed transformers so that
:func:`powerlens._src.models.forward.hidden_states` equals its ``hidden_states``; with
I = 1 both conventions agree.

Tensor names (``albert.`` stripped)::

    encoder.albert_layer_groups.{g}.albert_layers.{j}.attention.{query,key,value,dense,LayerNorm}
    encoder.albert_layer_groups.{g}.albert_layers.{j}.{ffn,ffn_output,full_layer_layer_norm}
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..dynamics.params import LayerConfig
from .base import Model, ModelInfo, register
from .bert import EMBEDDING_NAMES, ENCODER_HANDLED, ENCODER_NEUTRAL, ENCODER_ONLY, encoder_sizes, read_layers
from .convert import activation, check_config, check_layer_count, config_file, read_tensors, require, tokenizer_folder
from .layout import LINEAR
from .reader import CheckpointError, TensorReader

ALBERT_HANDLED = ENCODER_HANDLED | {"embedding_size", "num_hidden_groups", "inner_group_num"}
ALBERT_NEUTRAL = ENCODER_NEUTRAL | {"classifier_dropout_prob"}
# keys of the original ALBERT configs that Hugging Face never implemented: accepted at their defaults only
ALBERT_ONLY = dict(ENCODER_ONLY, down_scale_factor=(1,), gap_size=(0,), net_structure_type=(0,),
                   num_memory_blocks=(0,))

# the longest schedule an ALBERT config may declare (real ones have 12-24 steps); a longer run
# of the shared layers is ``simulate``'s business, not a checkpoint's
ALBERT_MAX_SCHEDULE = 1 << 16

_P = "encoder.albert_layer_groups.{g}.albert_layers.{j}."
ALBERT_NAMES = {
    "W_q": _P + "attention.query.weight",
    "b_q": _P + "attention.query.bias",
    "W_k": _P + "attention.key.weight",
    "b_k": _P + "attention.key.bias",
    "W_v": _P + "attention.value.weight",
    "b_v": _P + "attention.value.bias",
    "W_o": _P + "attention.dense.weight",
    "b_o": _P + "attention.dense.bias",
    "norm_scale": _P + "attention.LayerNorm.weight",
    "norm_bias": _P + "attention.LayerNorm.bias",
    "W_in": _P + "ffn.weight",
    "b_in": _P + "ffn.bias",
    "W_out": _P + "ffn_output.weight",
    "b_out": _P + "ffn_output.bias",
    "ffn_norm_scale": _P + "full_layer_layer_norm.weight",
    "ffn_norm_bias": _P + "full_layer_layer_norm.bias",
}


def check_albert_layers(L: int, G: int, I: int, names, src: str) -> None:
    """The schedule length L*I is bounded, and G groups of I inner layers are what the file holds."""
    if L * I > ALBERT_MAX_SCHEDULE:
        raise CheckpointError(f"{src}: num_hidden_layers={L} x inner_group_num={I} = {L * I} steps exceeds the "
                              f"{ALBERT_MAX_SCHEDULE} steps an ALBERT schedule may have")
    if G > L:
        raise CheckpointError(f"{src}: num_hidden_groups={G} exceeds num_hidden_layers={L}")
    check_layer_count(G, "num_hidden_groups", names, "encoder.albert_layer_groups.", src)
    check_layer_count(I, "inner_group_num", names, "encoder.albert_layer_groups.0.albert_layers.", src)


def albert_schedule(n_layers: int, n_groups: int, inner: int) -> Tuple[int, ...]:
    """Unique-layer index of every step: outer layer i runs group int(i / (L / G))."""
    sched = []
    for i in range(n_layers):
        g = int(i / (n_layers / n_groups))
        sched.extend(g * inner + j for j in range(inner))
    return tuple(sched)


def records_every_inner_layer() -> bool:
    """True when the installed transformers records ALBERT hidden states per inner layer (>= 5)."""
    try:
        import transformers
        return int(transformers.__version__.split(".")[0]) >= 5
    except Exception:  # pragma: no cover - transformers is a dependency
        return True


def hidden_state_steps(n_layers: int, inner: int, every_inner: Optional[bool] = None) -> Tuple[int, ...]:
    """1-based step counts after which Hugging Face records ``hidden_states[1:]``."""
    if every_inner is None:
        every_inner = records_every_inner_layer()
    if every_inner:
        return tuple(range(1, n_layers * inner + 1))
    return tuple(inner * (i + 1) for i in range(n_layers))


@register("albert", output_layout=LINEAR)
def convert_albert(config: dict, reader: TensorReader, dtype, name: str = "") -> Model:
    """ALBERT -> Model with U = G*I unique layers and the outer-layer schedule."""
    src = config_file(reader)
    check_config(config, src, "albert", handled=ALBERT_HANDLED, neutral=ALBERT_NEUTRAL, only=ALBERT_ONLY)
    d, H, e, L, f, V, P, T, eps = encoder_sizes(config, src)
    E = require(config, "embedding_size", src)
    G = require(config, "num_hidden_groups", src, default=1)
    I = require(config, "inner_group_num", src, default=1)
    check_albert_layers(L, G, I, reader.names(), src)
    act = activation(config, "hidden_act", src, "gelu_new")
    emb = read_tensors(reader, EMBEDDING_NAMES, {"word": (V, E), "position": (P, E), "token_type": (T, E),
                                                 "norm_scale": (E,), "norm_bias": (E,)}, dtype)
    emb.update(read_tensors(
        reader, {"project_W": "encoder.embedding_hidden_mapping_in.weight",
                 "project_b": "encoder.embedding_hidden_mapping_in.bias"},
        {"project_W": (d, E), "project_b": (d,)}, dtype))
    schedule = albert_schedule(L, G, I)
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=False, norm="layernorm", norm_eps=eps,
                      norm_placement="post", ffn_activation=act, schedule=schedule)
    indices = [dict(g=g, j=j) for g in range(G) for j in range(I)]
    layers = read_layers(reader, ALBERT_NAMES, indices, cfg, f, dtype)
    info = ModelInfo(family="albert", source=reader.folder, tokenizer=tokenizer_folder(reader.folder),
                     max_positions=P, pad_token_id=config.get("pad_token_id", 0),
                     bos_token_id=config.get("bos_token_id"), hidden_state_steps=hidden_state_steps(L, I),
                     name=name, inner_group_num=I)
    return Model(layers=layers, embeddings=emb, info=info)
