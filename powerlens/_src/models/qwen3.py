"""Qwen3 converter, Hugging Face format (``model_type`` ``qwen3``).

Qwen3 is the Llama block of :mod:`powerlens._src.models.llama` (pre-norm RMSNorm, RoPE with
``rotate_half``, grouped-query attention, SwiGLU FFN) read by the same
:func:`~powerlens._src.models.llama.convert_hf_llama`, plus:

* **per-head q/k RMSNorm** (``self_attn.q_norm``, ``self_attn.k_norm``, weights (e,),
  eps ``rms_norm_eps``) applied to each head of q and k after the projection and before RoPE
  (``q_norm_scale``, ``k_norm_scale`` of :class:`~powerlens._src.dynamics.params.Layers`); they
  only shape A, so F_t = W_o V_cat as for Llama;
* an explicit ``head_dim`` (default 128, Qwen3Config's, not d / H);
* ``attention_bias``: biases on q, k, v **and** o when true (none by default);
* sliding windows exactly as Qwen2 (:func:`~powerlens._src.models.mistral_qwen.qwen2_windows`):
  ``layer_types`` when present, otherwise ``sliding_attention`` on layers >=
  ``max_window_layers`` when ``use_sliding_window`` is true; the window only when
  ``use_sliding_window`` is true;
* RoPE: ``rope_theta`` (older configs) or ``rope_parameters`` (transformers 5); any
  ``rope_type`` other than ``default`` is rejected by name.
"""
from __future__ import annotations

from .base import Model, register
from .convert import check_config, config_file, require, short_repr
from .layout import LINEAR
from .llama import ATTENTION_BIASES, QK_NORMS, convert_hf_llama
from .mistral_qwen import COMMON_NEUTRAL, QWEN2_HANDLED, qwen2_windows
from .reader import CheckpointError

QWEN3_HEAD_DIM = 128
QWEN3_HANDLED = QWEN2_HANDLED | {"attention_bias"}
QWEN3_NEUTRAL = COMMON_NEUTRAL


@register("qwen3", output_layout=LINEAR)
def convert_qwen3(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "qwen3", handled=QWEN3_HANDLED, neutral=QWEN3_NEUTRAL)
    bias = config.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise CheckpointError(f"{src}: attention_bias={short_repr(bias)} must be true or false")
    window = qwen2_windows(config, require(config, "num_hidden_layers", src), src)
    return convert_hf_llama(config, reader, dtype, name, family="qwen3", biases=ATTENTION_BIASES if bias else (),
                            window=window, norms=QK_NORMS, head_dim_default=QWEN3_HEAD_DIM)
