"""Mistral and Qwen2 converters, Hugging Face format (``model_type`` ``mistral``, ``qwen2``).

Both are the Llama block of :mod:`powerlens._src.models.llama` (pre-norm RMSNorm, RoPE with
``rotate_half``, grouped-query attention, SwiGLU FFN, explicit ``head_dim``), read by the
same :func:`~powerlens._src.models.llama.convert_hf_llama`. What differs:

* **Qwen2** has biases on q, k and v (``q_proj.bias`` ...), none on o_proj or the FFN.
* **Sliding windows**, exactly where transformers 5 applies them (token i sees key j when
  ``i - window < j <= i``, the ``window`` of :class:`~powerlens._src.dynamics.params.Layers`):

  - Mistral: ``sliding_window`` on every layer; null = none. ``MistralForCausalLM`` ignores
    ``layer_types``, so a ``layer_types`` that would say otherwise is rejected.
  - Qwen2: ``layer_types`` when the config has it (transformers 5 writes it), otherwise
    derived as transformers does: ``sliding_attention`` on layers >= ``max_window_layers``
    when ``use_sliding_window`` is true, ``full_attention`` everywhere else. The window is
    ``sliding_window``, and only when ``use_sliding_window`` is true (Qwen2-0.5B ships
    ``use_sliding_window: false`` with ``sliding_window: 131072``: no window).

* RoPE: ``rope_theta`` (older configs) or ``rope_parameters`` (transformers 5); any
  ``rope_type`` other than ``default`` is rejected by name.
"""
from __future__ import annotations

from typing import List

from .base import Model, register
from .convert import WINDOW_MAX, check_config, config_file, require, short_repr
from .layout import LINEAR
from .llama import LLAMA_HANDLED, convert_hf_llama
from .reader import CheckpointError

# what both read: Llama's set without its bias switches (their biases are fixed), plus the windows;
# attention dropout is off in evaluation
COMMON_HANDLED = (LLAMA_HANDLED - {"attention_bias", "mlp_bias"}) | {"sliding_window", "layer_types"}
COMMON_NEUTRAL = frozenset({"attention_dropout"})
MISTRAL_HANDLED = COMMON_HANDLED
QWEN2_HANDLED = COMMON_HANDLED | {"use_sliding_window", "max_window_layers"}
# multimodal RoPE sections (Qwen2-VL); published Qwen2.5 configs carry ``use_mrope: false``
QWEN2_ONLY = {"use_mrope": (False,)}

LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_types(config: dict, L: int, src: str):
    """``config['layer_types']`` checked (L entries, each in :data:`LAYER_TYPES`), or None when absent."""
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != L or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"{src}: layer_types={short_repr(types)} must list {L} entries (num_hidden_layers), "
                              f"each one of {', '.join(LAYER_TYPES)}")
    return list(types)


def sliding_window(config: dict, src: str):
    """``sliding_window`` as a positive int that fits a window (:data:`~powerlens._src.models.convert.WINDOW_MAX`),
    or None when null."""
    return require(config, "sliding_window", src, default=None, maximum=WINDOW_MAX)


def windows_from_types(types: List[str], window, src: str) -> List[int]:
    """Per-layer windows: ``window`` on the ``sliding_attention`` layers, 0 on the others."""
    if window is None and "sliding_attention" in types:
        raise CheckpointError(f"{src}: layer_types has sliding_attention layers but no sliding window is set "
                              f"(sliding_window null, or use_sliding_window false)")
    return [window if t == "sliding_attention" else 0 for t in types]


def mistral_windows(config: dict, L: int, src: str) -> List[int]:
    window = sliding_window(config, src)
    applied = ["sliding_attention" if window is not None else "full_attention"] * L
    types = layer_types(config, L, src)
    if types is not None and types != applied:
        raise CheckpointError(
            f"{src}: layer_types={short_repr(types)} differs from what MistralForCausalLM applies "
            f"(sliding_window={window!r} on every layer; it ignores layer_types); not supported")
    return windows_from_types(applied, window, src)


def qwen2_windows(config: dict, L: int, src: str) -> List[int]:
    use = config.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise CheckpointError(f"{src}: use_sliding_window={short_repr(use)} must be true or false")
    window = sliding_window(config, src) if use else None
    types = layer_types(config, L, src)
    if types is None:
        first = config.get("max_window_layers")
        first = 28 if first is None else first          # the Qwen2Config default
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise CheckpointError(f"{src}: max_window_layers={short_repr(first)} must be an integer >= 0")
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(L)]
    return windows_from_types(types, window, src)


@register("mistral", output_layout=LINEAR)
def convert_mistral(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "mistral", handled=MISTRAL_HANDLED, neutral=COMMON_NEUTRAL)
    window = mistral_windows(config, require(config, "num_hidden_layers", src), src)
    return convert_hf_llama(config, reader, dtype, name, family="mistral", window=window)


@register("qwen2", output_layout=LINEAR)
def convert_qwen2(config: dict, reader, dtype, name: str) -> Model:
    src = config_file(reader)
    check_config(config, src, "qwen2", handled=QWEN2_HANDLED, neutral=COMMON_NEUTRAL, only=QWEN2_ONLY)
    window = qwen2_windows(config, require(config, "num_hidden_layers", src), src)
    return convert_hf_llama(config, reader, dtype, name, family="qwen2", biases=("b_q", "b_k", "b_v"),
                            window=window)
