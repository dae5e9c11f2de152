"""What every converter shares: config checks, activations, tokenizer files, stacked reads.

A converter (``@register`` in :mod:`powerlens._src.models.base`) turns a Hugging Face
``config.json`` dict and a :class:`~powerlens._src.models.reader.TensorReader` into a
:class:`~powerlens._src.models.base.Model`. The helpers here do the parts that do not depend
on the family:

* :func:`check_config`: the allow-list (as Penzai does). Every attribute of
  ``config.json`` is either handled by the converter, or known to leave the maths
  unchanged (:data:`NEUTRAL`, plus the family's own list), or accepted only at a value
  that leaves the maths unchanged (:data:`NEUTRAL_VALUES`, plus the family's own). Anything
  else is one :class:`CheckpointError` that names every offending attribute and the file.
* :func:`require`, :func:`activation`, :func:`head_size`: one validated attribute each,
  with an error naming the file and the attribute.
* :func:`check_layer_count`: the declared number of layers against the layer indices of
  the tensors actually in the file, before anything per layer is built.
* :class:`Stack`: per-layer tensors read into stacked (L, ...) arrays, each held once.
* :func:`to_device`, :func:`read_tensors`, :func:`lm_head`, :func:`tokenizer_folder`.

What a load reads (``pl.load(..., parts=...)``, :data:`PARTS`): ``all``; ``attention``
(no FFN, no LM head: the paper and faithful rules); ``spectrum`` (W_v and W_o alone: F_t).
:func:`reading` sets it while a converter runs; :class:`Stack` never reads or allocates a
skipped key, and :func:`read_tensors` / :func:`lm_head` skip what the parts leave out. A
Stack refuses, before any tensor is read, stacked arrays that cannot fit in memory.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import re
import warnings
from typing import Collection, Dict, Iterable, Mapping, Optional, Tuple

import jax
import numpy as np

from .reader import CheckpointError, TensorReader, aligned_empty, check_allocation

# ---------------------------------------------------------------------- what a load reads
FFN_KEYS = frozenset({"W_in", "b_in", "W_gate", "W_out", "b_out", "ffn_norm_scale", "ffn_norm_bias",
                      "post_ffn_norm_scale"})
"""Stacked keys of the FFN sub-layer (rule ``full`` alone reads them)."""
PARTS = ("all", "attention", "spectrum")
_PARTS: contextvars.ContextVar = contextvars.ContextVar("powerlens_load_parts", default="all")
_UNREAD: contextvars.ContextVar = contextvars.ContextVar("powerlens_load_unread", default=None)


def check_parts(parts: str) -> str:
    if parts not in PARTS:
        raise ValueError(f"parts={parts!r} is not one of {PARTS} (all: every weight; attention: no FFN and no LM "
                         f"head, for the paper and faithful rules; spectrum: W_v and W_o alone)")
    return parts


@contextlib.contextmanager
def reading(parts: str):
    """The converters called inside read only ``parts`` (:data:`PARTS`). Yields a dict that
    :func:`left_out` fills: what the converters left unread (``"lm_head"``: the checkpoint name
    of an untied LM head that was not read)."""
    token = _PARTS.set(check_parts(parts))
    unread: dict = {}
    token2 = _UNREAD.set(unread)
    try:
        yield unread
    finally:
        _PARTS.reset(token)
        _UNREAD.reset(token2)


def left_out(what: str, tensor: str) -> None:
    """Record that ``what`` (e.g. ``"lm_head"``), the checkpoint tensor ``tensor``, was not read."""
    unread = _UNREAD.get()
    if unread is not None:
        unread[what] = tensor


def current_parts() -> str:
    return _PARTS.get()


def wanted(key: str, parts: Optional[str] = None) -> bool:
    """Whether a load of ``parts`` (default: the current one) reads the stacked array or
    model tensor ``key`` (stacked keys, and ``word``, ``lm_head``, ``final_norm``, ``embeddings``)."""
    parts = current_parts() if parts is None else parts
    if parts == "all":
        return True
    if parts == "attention":
        return key not in FFN_KEYS and key != "lm_head"
    return key in ("W_v", "W_o")


class _Sink:
    """What a skipped key's slot is: writes vanish, reads are refused."""

    def __setitem__(self, index, value):
        pass

    def __getitem__(self, index):
        return self

    def reshape(self, *shape):
        return self

# ---------------------------------------------------------------------- the allow-list
# Attributes any Hugging Face config may carry (PretrainedConfig defaults of transformers
# 4.x and 5.x, hub metadata, training-only settings, generation settings that older
# versions saved in config.json) that do not change the forward pass powerlens computes.
NEUTRAL = frozenset({
    # bookkeeping and hub metadata
    "architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path", "_commit_hash",
    "dtype", "torch_dtype", "use_bfloat16", "torchscript", "tf_legacy_loss", "xla_device",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "_experts_implementation",
    "experts_implementation", "tokenizer_class", "prefix", "finetuning_task", "task_specific_params",
    "transformers.js_config",
    # task heads powerlens does not run (classification / QA labels)
    "id2label", "label2id", "num_labels", "problem_type",
    # what the forward pass returns, not what it computes
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "use_cache",
    # training only: dropout is off in evaluation, initialisation is overwritten by the weights
    "initializer_range", "gradient_checkpointing", "chunk_size_feed_forward",
    # special token ids (the converter reads pad/bos where it needs them)
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    # generation settings (transformers < 4.41 saved them in config.json)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "encoder_repetition_penalty", "epsilon_cutoff", "eta_cutoff",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind",
})

# Attributes accepted only at the value(s) that leave the maths unchanged (``None`` = the
# default, always accepted): encoder-decoder wiring, causal BERT, pruned heads.
NEUTRAL_VALUES: Mapping[str, Tuple[object, ...]] = {
    "is_decoder": (False,),
    "add_cross_attention": (False,),
    "is_encoder_decoder": (False,),
    "tie_encoder_decoder": (False,),
    "cross_attention_hidden_size": (None,),
    "pruned_heads": ({},),
}


def config_file(reader: TensorReader) -> str:
    """The ``config.json`` path of the reader's folder (what config errors name)."""
    return os.path.join(reader.folder, "config.json")


def _same(value, ok) -> bool:
    """``value == ok`` without ``True == 1``."""
    return value == ok and isinstance(value, bool) == isinstance(ok, bool)


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (for messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_config(config: Mapping, source: str, family: str, *, handled: Collection[str],
                 neutral: Collection[str] = (), only: Optional[Mapping[str, Tuple[object, ...]]] = None) -> None:
    """Reject every ``config.json`` attribute the ``family`` converter does not understand.

    Args:
      config: the parsed ``config.json``.
      source: the file, for the message (:func:`config_file`).
      family: the converter's name, for the message.
      handled: attributes the converter reads (it validates their values itself).
      neutral: family-specific attributes known to leave the maths unchanged (added to
        :data:`NEUTRAL`).
      only: family-specific ``attribute -> accepted values`` (added to
        :data:`NEUTRAL_VALUES`); ``None`` is always accepted.

    Raises one CheckpointError naming the file and all offending attributes: the unknown
    ones, and the known ones whose value changes the maths.
    """
    allowed = dict(NEUTRAL_VALUES, **(only or {}))
    known = NEUTRAL | frozenset(handled) | frozenset(neutral)
    problems = []
    for key in sorted(config):
        value = config[key]
        if key in allowed:
            if value is not None and not any(_same(value, ok) for ok in allowed[key]):
                accepted = " or ".join(repr(v) for v in allowed[key])
                problems.append(f"{key}={short_repr(value)} is not supported (only {accepted})")
        elif key not in known:
            problems.append(f"{key}={short_repr(value)} is unknown")
    if problems:
        raise CheckpointError(
            f"{source}: the {family} converter does not handle {len(problems)} config attribute(s), "
            f"which may change the model's maths: {'; '.join(problems)}")


# ---------------------------------------------------------------------- single attributes
_REQUIRED = object()


WINDOW_MAX = 2 ** 31 - 1
"""The largest local attention window (``sliding_window``, ``window_size``): windows are int32."""


def require(config: Mapping, key: str, source: str, *aliases: str, kind=int, default=_REQUIRED,
            maximum: Optional[int] = None):
    """``config[key]`` (or the first alias present) as a positive ``kind`` (int or float; a float
    must be finite), at most ``maximum`` when given (e.g. :data:`WINDOW_MAX`).

    ``default``: returned when neither ``key`` nor an alias is set (absent or null);
    without it that is a CheckpointError naming the key. A value that is not a positive
    ``kind`` (``true`` is not a number) is a CheckpointError naming the key and the value.
    """
    for k in (key,) + aliases:
        if config.get(k) is not None:
            key, value = k, config[k]
            break
    else:
        if default is not _REQUIRED:
            return default
        also = f" (nor {', '.join(repr(a) for a in aliases)})" if aliases else ""
        raise CheckpointError(f"{source}: required attribute {key!r}{also} is missing")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{source}: {key}={short_repr(value)} must be a positive integer")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
            raise CheckpointError(f"{source}: {key}={short_repr(value)} must be a positive finite number")
        value = float(value)
    if maximum is not None and value > maximum:
        raise CheckpointError(f"{source}: {key}={value!r} is too large (at most {maximum})")
    return value


def given_key(config: Mapping, key: str, *aliases: str) -> str:
    """The first of ``key`` and its ``aliases`` that ``config`` sets (``key`` when none is set)."""
    return next((k for k in (key,) + aliases if config.get(k) is not None), key)


def layer_indices(names: Iterable[str], prefix: str):
    """The sorted distinct N of the tensor names ``{prefix}N.…`` (e.g. ``h.`` -> ``h.3.attn...``)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for m in map(pattern.match, names) if m})


def check_layer_count(declared: int, key: str, names: Iterable[str], prefix: str, source: str) -> None:
    """CheckpointError naming ``source`` and ``key`` unless the tensors ``names`` hold exactly the
    layers ``{prefix}0.`` … ``{prefix}{declared-1}.``: checked before anything per layer is
    allocated, so a config that claims 10^9 layers costs nothing, and a config with fewer
    layers than the file is an error rather than a silent truncation."""
    found = layer_indices(names, prefix)
    if len(found) == declared and (not found or found[-1] == declared - 1):
        return
    span = (f"N = 0..{found[-1]}" if found and found[-1] == len(found) - 1
            else f"N in {found[:8]}{'...' if len(found) > 8 else ''}")
    what = f"{len(found)} layer{'' if len(found) == 1 else 's'} ({prefix}N.*, {span})" if found else "no layers"
    raise CheckpointError(f"{source}: {key}={declared}, but the checkpoint's tensors are for {what}")


def require_all(config: Mapping, source: str, **keys) -> Tuple[int, ...]:
    """Several required positive integers, in the order given: ``name="key"`` or
    ``name=("key", "alias", ...)``, each read with :func:`require`."""
    keys = {n: (k,) if isinstance(k, str) else tuple(k) for n, k in keys.items()}
    return tuple(require(config, k[0], source, *k[1:]) for k in keys.values())


# Hugging Face ``hidden_act`` / ``activation_function`` -> powerlens ``ffn_activation``.
# ``gelu_pytorch_tanh`` is the same tanh approximation as ``gelu_new``.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu"}


def activation(config: Mapping, key: str, source: str, default: str, table: Mapping[str, str] = ACTIVATIONS) -> str:
    """Map the checkpoint's activation name ``config[key]`` through ``table``, or reject it by name."""
    name = config.get(key)
    name = default if name is None else name
    if not isinstance(name, str) or name not in table:
        raise CheckpointError(f"{source}: unsupported activation {key}={name!r} "
                              f"(supported: {', '.join(sorted(table))})")
    return table[name]


def head_size(d: int, H: int, source: str, *, d_key: str = "hidden_size", h_key: str = "num_attention_heads") -> int:
    """e = d / H, or a CheckpointError naming both attributes when H does not divide d."""
    if d % H:
        raise CheckpointError(f"{source}: {d_key}={d} is not a multiple of {h_key}={H}")
    return d // H


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model")


def tokenizer_folder(folder: str) -> Optional[str]:
    """The folder itself when it ships tokenizer files, else None. A ``tokenizer.json`` is
    run by ``tokenizers`` directly (:func:`powerlens._src.models.embed.folder_tokenizer`); the
    other files are read by transformers' ``AutoTokenizer``."""
    return folder if any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES) else None


# ---------------------------------------------------------------------- tensors
def to_device(a: np.ndarray) -> jax.Array:
    """``jax.device_put`` and wait for the copy.

    ``device_put`` is asynchronous: without waiting, the NumPy source of every pending
    transfer stays alive and the peak memory doubles. On the CPU an array from
    :func:`~powerlens._src.models.reader.aligned_empty` is aliased, not copied.
    """
    out = jax.device_put(a)
    out.block_until_ready()
    return out


def read_tensors(reader: TensorReader, names: Mapping[str, str], shapes: Mapping[str, Tuple[int, ...]], dtype=None):
    """``{key: tensor names[key] of shape shapes[key]}`` as JAX arrays of ``dtype`` (default: the
    reader's), one at a time; a key the current parts leave out (:func:`wanted`) is None, unread."""
    return {key: to_device(reader.get(name, shapes[key], dtype=dtype)) if wanted(key) else None
            for key, name in names.items()}


class Stack:
    """Stacked arrays (L,) + shape filled one layer at a time, allocated on first use.

    ``shapes``: key -> per-layer shape; ``source``: the file, for errors. ``stack[key]`` is
    the (L, ...) NumPy array (64-byte aligned, so JAX aliases it on the CPU); :meth:`read`
    reads a tensor straight into one layer's slot (its shape checked before the stack is
    allocated); a converter that must transform a tensor (split, transpose) assigns
    ``stack[key][i] = ...``. Each tensor is read once and the checkpoint is never held
    twice: :meth:`done` hands a filled stacked array to JAX and drops it (a converter that
    fills one key after the other keeps one stacked NumPy array alive); :meth:`finish`
    does the same for the rest and returns every key.
    """

    def __init__(self, n_layers: int, dtype, shapes: Mapping[str, Tuple[int, ...]], source: str = "checkpoint",
                 *, extra: Optional[Mapping[str, int]] = None):
        """``dtype``: the stacked arrays' dtype (None: float32 until :meth:`read` sees a stored
        dtype, see :meth:`dtype_of`). Keys the current parts leave out (:func:`wanted`) are
        never read or allocated. The bytes of the kept stacked arrays, plus ``extra`` (name ->
        bytes: the embeddings, say), are checked against the memory available by
        :meth:`check_memory`, before any tensor is read."""
        self.n_layers, self.source = n_layers, source
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.skip = frozenset(k for k in shapes if not wanted(k))
        self.shapes = {k: tuple(s) for k, s in shapes.items()}
        self.arrays: Dict[str, np.ndarray] = {}
        self.device: Dict[str, jax.Array] = {}
        self.dtypes: Dict[str, np.dtype] = {}
        self.extra = dict(extra or {})

    def check_memory(self) -> int:
        """Refuse (CheckpointError, one line) when the kept stacked arrays plus ``extra`` cannot fit
        in the memory available now; called before any tensor is read. Returns the bytes."""
        itemsize = 4 if self.dtype is None else self.dtype.itemsize
        total = sum(int(self.n_layers) * int(np.prod(s, dtype=object)) * itemsize
                    for k, s in self.shapes.items() if k not in self.skip)
        total += sum(int(v) for v in self.extra.values())
        check_allocation(total, f"{self.source}: the model's weights ({self.n_layers} layers"
                                f"{''.join(', ' + k for k in self.extra)}; parts={current_parts()!r})")
        return total

    def wants(self, key: str) -> bool:
        """Whether ``key`` is read (not left out by the parts of this load)."""
        return key not in self.skip

    def dtype_of(self, key: str) -> np.dtype:
        """The dtype of stacked array ``key``: the Stack's, or (dtype None) the dtype the first
        tensor read into it is stored in (float32 for a key filled by assignment)."""
        return self.dtype if self.dtype is not None else self.dtypes.get(key, np.dtype(np.float32))

    def __getitem__(self, key) -> np.ndarray:
        if key in self.skip:
            return _Sink()
        if key in self.device:
            raise KeyError(f"stacked array {key!r} was already handed to JAX")
        if key not in self.arrays:
            shape = self.shapes[key]
            self.arrays[key] = aligned_empty((self.n_layers,) + shape, self.dtype_of(key),
                                             what=f"{self.source}: {key} ({self.n_layers} layers of shape {shape})")
        return self.arrays[key]

    def read(self, key: str, i: int, reader: TensorReader, name: str, stored: Optional[Tuple[int, ...]] = None):
        """Read tensor ``name`` of shape ``stored`` (default: the slot's shape) into slot ``i``
        of ``key`` in place; ``stored`` must have as many elements as the slot (a reshape).
        The tensor's stored shape is checked before the stacked array is allocated; a key the
        parts leave out is not read."""
        if key in self.skip:
            return
        reader.check(name, stored or self.shapes[key])
        if self.dtype is None and key not in self.dtypes and key not in self.arrays:
            self.dtypes[key] = reader.stored_dtype(name) if reader.dtype is None else reader.dtype
        slot = self[key][i]
        reader.get(name, stored or slot.shape, out=slot.reshape(stored) if stored else slot)

    def done(self, key) -> None:
        if key in self.skip:
            return
        self.device[key] = to_device(self.arrays.pop(key))

    def finish(self) -> Dict[str, jax.Array]:
        """Every kept key as a JAX array (the skipped keys are absent)."""
        missing = [k for k in self.shapes if k not in self.arrays and k not in self.device and k not in self.skip]
        if missing:
            raise ValueError(f"stacked arrays never filled: {missing}")
        for k in list(self.arrays):
            self.done(k)
        return dict(self.device)


def lm_head(config: Mapping, reader: TensorReader, shape: Tuple[int, int], default_tied: bool = True):
    """Untied LM head (V, d), or None when ``tie_word_embeddings`` ties it to the word embeddings.

    ``default_tied``: the family's Hugging Face default when the attribute is absent
    (GPT-2 / GPT-Neo tie, Llama does not).
    """
    tied = config.get("tie_word_embeddings")
    if default_tied if tied is None else tied:
        return None
    if reader.has("lm_head.weight") and not wanted("lm_head"):
        left_out("lm_head", "lm_head.weight")            # its rows are read when asked for (layout.py)
        return None
    if reader.has("lm_head.weight"):
        return to_device(reader.get("lm_head.weight", shape))
    warnings.warn(f"{reader.folder}: tie_word_embeddings is false but the checkpoint has no lm_head.weight "
                  f"(a base model without its LM head); logits() will use the word embeddings")
    return None
