"""The loaded model: static facts + pytrees of arrays, and the converter registry.

A converter is called as ``convert(config, reader, dtype, name)``: the Hugging Face
``config.json`` dict, a :class:`~powerlens._src.models.reader.TensorReader` on the folder, the
NumPy float dtype to load in, and the name the model was asked for (reports). It returns
a :class:`Model`. It checks ``config.json`` against its allow-list
(:func:`powerlens._src.models.convert.check_config`) and rejects, with a ``CheckpointError``
naming the file and the attribute, anything that would change the maths and that it does
not handle. Registering a converter also declares how its family stores the attention
output projection (:mod:`powerlens._src.models.layout`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import jax
import numpy as np
from ..dynamics import struct

from ..dynamics.params import Layers
from .layout import declare_output_layout


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Static facts about a loaded checkpoint.

    family: ``bert``, ``albert``, ``roberta``, ``distilbert``, ``gpt2``, ``gpt_neo``, ``llama``,
    ``mistral``, ``qwen2``, ``gpt_neox``, ``opt``, ``phi``, ``phi3`` (and the other registered model types).
    source: the path it was read from. tokenizer: a folder with tokenizer files or a
    ``.gguf`` path. max_positions: longest prompt the position embeddings allow
    (None = unbounded, RoPE). decoder: causal LM. hidden_state_steps: the schedule
    step indices (1-based counts of steps done) after which Hugging Face records
    ``hidden_states[1:]`` (ALBERT with inner groups records after each outer layer).
    final_norm_in_hidden_states: HF applies the final norm to the last hidden state
    (GPT-2, GPT-Neo, Llama, Mistral, Qwen2). pad_token_id, bos_token_id: for embedding.
    position_offset: RoBERTa's positions start at padding_idx + 1 (OPT: 2, from the same mask cumsum).
    inner_group_num: ALBERT's layers per group (unique layer u is in group u // inner_group_num).
    embed_scale: the word embeddings are multiplied by it, in the model's dtype (Gemma: sqrt(d));
    None = 1.
    final_logit_softcap: logits z become c tanh(z / c) (Gemma 2's ``final_logit_softcapping``);
    None = off.
    parts: what ``load(..., parts=)`` read: ``all``, ``attention`` (no FFN, no LM head) or
    ``spectrum`` (W_v and W_o alone). unread_head: the name, in ``source``, of the untied LM
    head such a load left unread (token directions read its rows from there); None otherwise.
    """

    family: str
    source: str
    tokenizer: Optional[str] = None
    max_positions: Optional[int] = None
    decoder: bool = False
    hidden_state_steps: Optional[Tuple[int, ...]] = None
    final_norm_in_hidden_states: bool = False
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    position_offset: int = 0
    name: str = ""
    inner_group_num: int = 1          # ALBERT: unique layer u belongs to group u // inner_group_num
    embed_scale: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    parts: str = "all"                # what the load read (powerlens._src.models.convert.PARTS)
    unread_head: Optional[str] = None  # the checkpoint tensor of an untied LM head left unread


@struct.dataclass
class Model:
    """A checkpoint as pytrees.

    layers: the stacked unique attention layers (ALBERT: its groups, with the group
      schedule in ``layers.config.schedule``) including FFN parameters for rule ``full``.
    embeddings: dict of arrays, family-specific names::

        word (V, E), position (P, E), token_type (T, E), norm_scale/norm_bias (E,),
        project_W (d, E), project_b (d,)   (ALBERT embedding -> hidden mapping)

    final_norm_scale / final_norm_bias: (d,) or None.
    lm_head: (V, d) or None (tied to ``embeddings['word']`` for decoders).
    lm_head_bias: (V,) or None: added to the logits (Phi's ``lm_head.bias``).
    """

    layers: Layers
    embeddings: Dict[str, jax.Array]
    final_norm_scale: Optional[jax.Array] = None
    final_norm_bias: Optional[jax.Array] = None
    lm_head: Optional[jax.Array] = None
    lm_head_bias: Optional[jax.Array] = None
    info: ModelInfo = struct.field(pytree_node=False, default=None)

    @property
    def config(self):
        return self.layers.config


Converter = Callable[[dict, "TensorReader", np.dtype, str], Model]
CONVERTERS: Dict[str, Converter] = {}


def register(*model_types: str, output_layout: str):
    """Register a converter for Hugging Face ``model_type`` values (also the family names).

    ``output_layout``: how these checkpoints store W_o, ``layout.LINEAR`` (d, H e) or
    ``layout.CONV1D`` (H e, d); see :func:`powerlens._src.models.layout.checkpoint_delta`.
    """
    declare_output_layout(output_layout, *model_types)

    def deco(fn):
        for t in model_types:
            CONVERTERS[t] = fn
        return fn
    return deco
