"""Text -> initial tokens x0, exactly as the model embeds them.

    x0 = word[ids] (+ position[pos]) (+ token_type[0]) -> (embedding LayerNorm) -> (projection)

which covers BERT/RoBERTa/DistilBERT/ALBERT (LayerNorm; ALBERT's E -> d projection),
GPT-2/GPT-Neo (word + position), Llama (word only) and Gemma (word * sqrt(d), the factor
``info.embed_scale`` rounded to float32 and then cast to the model's dtype, as
transformers' ``ScaledWordEmbedding`` does). Prompts are right-padded;
``valid`` is False on padding. A prompt longer than the model's position table is an
error (never silently truncated); an empty prompt is an error.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.norms import layer_norm
from jaxtyping import Array, ArrayLike, Float, Int
from .base import Model
from .reader import CheckpointError, one_line
from .folder_tokenizer import FolderTokenizer, folder_tokenizer, tokenizer_json_error  # noqa: F401  (re-exported)


@functools.lru_cache(maxsize=8)
def _tokenizer_for(path: str):
    """The tokenizer of a GGUF file, or of a folder: its ``tokenizer.json`` through
    ``tokenizers`` (:func:`folder_tokenizer`), else transformers' ``AutoTokenizer``."""
    if path.endswith(".gguf"):
        from .gguf_tokenizer import gguf_tokenizer
        return gguf_tokenizer(path)
    tok = folder_tokenizer(path)
    if tok is not None:
        return tok
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: transformers cannot read the tokenizer files of this folder "
                              f"({one_line(exc)})") from None


def tokenizer(model: Model):
    """The checkpoint's own tokenizer: a folder's ``tokenizer.json`` run by ``tokenizers``
    (:class:`FolderTokenizer`; transformers' ``AutoTokenizer`` for a folder without one),
    or the GGUF file's. ``tok(text)["input_ids"]`` and ``tok.decode(ids)`` on each."""
    if model.info is None or model.info.tokenizer is None:
        raise CheckpointError(f"model {getattr(model.info, 'name', '?')!r} has no tokenizer, so text prompts cannot be "
                              f"embedded: pass token ids (powerlens.embed_ids), or point MODEL at a folder with "
                              f"tokenizer files (tokenizer.json, vocab.txt, ...) or a GGUF file with a vocabulary")
    return _tokenizer_for(model.info.tokenizer)


def tokenize(model: Model, texts: Sequence[str]) -> List[List[int]]:
    """One list of token ids (int) per text, with the special tokens the model's tokenizer
    adds ([CLS] ... [SEP] for BERT, BOS for Llama); never truncated, never padded."""
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise ValueError("no prompts given")
    tok = tokenizer(model)
    out = []
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"prompt {i} is empty")
        out.append(list(tok(t)["input_ids"]))
    return out


def pad_ids(ids: Sequence[Sequence[int]], pad_id: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Right-pad token id lists: ids (B, n) int32, valid (B, n) bool."""
    if not len(ids):
        raise ValueError("no prompts given")
    for i, row in enumerate(ids):
        if len(row) == 0:
            raise ValueError(f"prompt {i} is empty (no tokens)")
    n = max(len(r) for r in ids)
    arr = np.full((len(ids), n), pad_id, np.int32)
    valid = np.zeros((len(ids), n), bool)
    for i, row in enumerate(ids):
        arr[i, : len(row)] = row
        valid[i, : len(row)] = True
    return arr, valid


def embed_ids(model: Model, ids, valid=None):
    """x0 (B, n, d) for token ids (B, n) (right-padded; ``valid`` (B, n) bool)."""
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if valid is None:
        valid = np.ones(ids.shape, bool)
    valid = np.asarray(valid, bool).reshape(ids.shape)
    E = model.embeddings
    vocab = E["word"].shape[0]
    if ids.size == 0 or ids.shape[1] == 0:
        raise ValueError("empty prompt: no tokens to embed")
    bad = ids[valid]
    if bad.size and (bad.min() < 0 or bad.max() >= vocab):
        raise ValueError(f"token id out of range [0, {vocab}) in the prompt")
    info = model.info
    n = ids.shape[1]
    if info is not None and info.max_positions is not None and n + info.position_offset > info.max_positions:
        raise ValueError(
            f"prompt of {n} tokens is longer than the model's {info.max_positions - info.position_offset} "
            f"positions ({info.family}); shorten it (powerlens does not truncate silently)")
    pos = None
    if "position" in E:
        if info is not None and info.position_offset:
            # RoBERTa: positions count valid tokens from padding_idx + 1
            pos = np.cumsum(valid, axis=1) * valid + (info.position_offset - 1)
        else:
            pos = np.broadcast_to(np.arange(n), ids.shape)
        pos = np.asarray(pos, np.int32)
    scale = None if info is None or info.embed_scale is None else np.float32(info.embed_scale)
    x = embed_arrays({k: jnp.asarray(v) for k, v in E.items()}, np.asarray(np.where(valid, ids, 0), np.int32), pos,
                      scale, eps=float(model.layers.config.norm_eps), dtype=np.dtype(model.layers.dtype).name)
    return x, jax.device_put(np.array(valid))     # a copy, and no copy program (jnp.asarray compiles one)


@functools.partial(jax.jit, static_argnames=("eps", "dtype"))
def embed_arrays(E: dict, ids: Int[ArrayLike, "B n"], pos: Int[ArrayLike, "B n"] | None,
                 scale: Float[ArrayLike, ""] | None, *, eps: float,
                 dtype: Optional[str] = None) -> Float[Array, "B n d"]:
    """x0 "float[B n d]": word (times ``scale``) + position + token type embeddings, then the
    embedding LayerNorm and projection where the model has them; one compiled program. The
    word rows are taken in the model's compute ``dtype`` (bf16 weights: only the B n rows upcast;
    None: the stored dtype)."""
    x = E["word"][ids] if dtype is None else E["word"][ids].astype(dtype)
    if scale is not None:
        x = x * scale.astype(x.dtype)
    if pos is not None:
        x = x + E["position"][pos]
    if "token_type" in E:
        x = x + E["token_type"][0]
    if "norm_scale" in E:
        x = layer_norm(x, E["norm_scale"], E.get("norm_bias"), eps)
    if "project_W" in E:
        x = x @ E["project_W"].T + E["project_b"]
    return x


def prompt_ids(model: Model, texts_or_ids) -> List[List[int]]:
    """Token id lists of texts (tokenized) or of token ids (as they are; an array is one prompt per row)."""
    if isinstance(texts_or_ids, str) or (len(texts_or_ids) and isinstance(texts_or_ids[0], str)):
        return [list(r) for r in tokenize(model, texts_or_ids)]
    rows = np.atleast_2d(texts_or_ids) if isinstance(texts_or_ids, np.ndarray) else texts_or_ids
    return [list(np.asarray(r).reshape(-1)) for r in rows]


def padded_ids(model: Model, ids: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`pad_ids` with the model's own pad token (0 when it has none)."""
    pad = model.info.pad_token_id if model.info is not None and model.info.pad_token_id is not None else 0
    return pad_ids(ids, pad)


def embed(model: Model, texts_or_ids: Union[str, Sequence[str], Sequence[Sequence[int]], np.ndarray]):
    """x0 (B, n, d) and the padding mask ``valid`` (B, n) for texts or token ids."""
    return embed_ids(model, *padded_ids(model, prompt_ids(model, texts_or_ids)))
