"""Token ids back to text: :func:`decode`, and the most probable next tokens, :func:`top_tokens`.

Both use the checkpoint's own tokenizer (:func:`powerlens._src.models.embed.tokenizer`: a Hugging
Face folder's ``tokenizer.json``, or the one a GGUF file describes) and its ``decode``, so the
text is the one transformers' tokenizer of the same checkpoint gives::

    ids = tokenize(model, ["The capital of France is"])[0]
    decode(model, ids)                         # "The capital of France is"
    top_tokens(model, logits(model, hs[-1])[0, -1], k=3)
    # [TopToken(id=7042, text=' Paris', prob=0.31), ...]
"""
from __future__ import annotations

import functools
from typing import List, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from .base import Model
from .embed import tokenizer


class TopToken(NamedTuple):
    """One of the most probable next tokens: its id, its text (:func:`decode` of that one id)
    and its probability (softmax of the logits over the whole vocabulary)."""

    id: int
    text: str
    prob: float


def _check_model(model, what: str) -> None:
    if not isinstance(model, Model):
        raise ValueError(f"{what}: model must be a powerlens Model (powerlens.load(...)), got {type(model).__name__}")


def vocabulary_size(model: Model) -> int:
    """V, the rows of the model's word embeddings (the ids :func:`decode` accepts)."""
    _check_model(model, "vocabulary_size")
    return int(model.embeddings["word"].shape[0])


def _decoder(model: Model):
    """The model's tokenizer: ``decode(ids, skip_special_tokens=...)`` turns ids into text."""
    return tokenizer(model)


def _check_ids(model: Model, ids: np.ndarray, what: str) -> None:
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what}: token ids must be integers, got dtype {ids.dtype}")
    V = vocabulary_size(model)
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"{what}: token id {bad} is outside the model's vocabulary [0, {V})")


def decode(model: Model, ids, *, valid=None, skip_special_tokens: bool = False) -> Union[str, List[str]]:
    """Text of token ids, with the model's own tokenizer.

    Args:
      ids: one prompt, "int[n]" (a list of ints or a 1-D array) -> one string; several,
        "int[B n]" (a list of lists or a 2-D array) -> a list of B strings; one id -> the
        text of that token.
      valid: "bool[n]" or "bool[B n]" (the mask of :func:`~powerlens._src.models.embed.embed`):
        only these positions are decoded, so the padding of a batch is left out.
      skip_special_tokens: leave out special tokens (BOS, EOS, [CLS], ...); default False:
        the text of every id.

    ``decode(model, tokenize(model, text)[0]) == text`` for tokenizers that add no special
    token and do not normalise the text (byte-level BPE: GPT-2, Llama 3, SmolLM2, ...).
    """
    _check_model(model, "decode")
    if isinstance(ids, (int, np.integer)):
        ids = [int(ids)]
    if _is_nested(ids):                                  # prompts of any lengths
        rows, single = [np.asarray(r) for r in ids], False
    else:
        arr = np.asarray(ids)
        if arr.ndim > 2:
            raise ValueError(f"decode: ids must be one prompt int[n] or several int[B n], got shape {arr.shape}")
        single = arr.ndim < 2
        rows = [arr.reshape(-1)] if single else list(arr)
    masks = [None] * len(rows) if valid is None else [valid] if single else list(valid)
    if len(masks) != len(rows):
        raise ValueError(f"decode: valid has {len(masks)} rows for {len(rows)} prompts of ids")
    dec, texts = _decoder(model), []
    for b, (r, m) in enumerate(zip(rows, masks)):
        what = "decode" if single else f"decode (prompt {b})"
        if r.ndim != 1:
            raise ValueError(f"{what}: ids of shape {r.shape}, expected a 1-D list of ids")
        if m is not None:
            r = r[_mask(m, r.shape, what)]
        _check_ids(model, r, what)
        texts.append(dec.decode([int(i) for i in r], skip_special_tokens=skip_special_tokens))
    return texts[0] if single else texts


def _is_nested(ids) -> bool:
    """A list/tuple of sequences (prompts of possibly different lengths)."""
    return isinstance(ids, (list, tuple)) and len(ids) > 0 and all(
        isinstance(r, (list, tuple, np.ndarray, jax.Array)) for r in ids)


def _mask(valid, shape, what: str) -> np.ndarray:
    """The mask "bool[n]" of one prompt's ids of shape (n,)."""
    m = np.asarray(valid)
    if not (m.dtype == bool or (np.issubdtype(m.dtype, np.integer) and np.isin(m, (0, 1)).all())):
        raise ValueError(f"{what}: valid must be a mask of booleans (True on the tokens to decode), got dtype {m.dtype}")
    m = m.astype(bool)
    if m.shape != shape:
        raise ValueError(f"{what}: valid has shape {m.shape}, the ids {shape}")
    return m


def token_texts(model: Model, ids: Sequence[int]) -> List[str]:
    """The text of each token of ``ids`` on its own (special tokens by their names)."""
    _check_model(model, "token_texts")
    ids = np.asarray(ids).reshape(-1)
    _check_ids(model, ids, "token_texts")
    dec = _decoder(model)
    unique, inverse = np.unique(ids, return_inverse=True)
    texts = [dec.decode([int(i)], skip_special_tokens=False) for i in unique]
    return [texts[j] for j in inverse.reshape(-1)]


def _real_array(logits, V: int) -> np.ndarray:
    """``logits`` as a NumPy array, or one ValueError naming the argument (text, None, ragged lists)."""
    try:
        return np.asarray(logits)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"top_tokens: logits must be an array of numbers float[... {V}] "
                         f"({' '.join(str(exc).split())[:120]})") from None


@functools.partial(jax.jit, static_argnames="k")
def _top_probs(logits, *, k: int):
    """The k largest probabilities "float[... k]" of softmax(logits) (float32) and their ids."""
    return jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), k)


def top_tokens(model: Model, logits, k: int = 5):
    """The k most probable next tokens of logits "float[V]": a list of k :class:`TopToken`
    (id, text, probability), most probable first. Logits "float[... V]" (e.g. "float[B n V]" of
    :func:`~powerlens._src.models.forward.logits`) give nested lists, one level per leading axis.

    Probabilities are the softmax over the whole vocabulary, in float32."""
    _check_model(model, "top_tokens")
    V = vocabulary_size(model)
    z = logits if isinstance(logits, jax.Array) else _real_array(logits, V)
    if not (jnp.issubdtype(z.dtype, jnp.floating) or jnp.issubdtype(z.dtype, jnp.integer)):
        raise ValueError(f"top_tokens: logits must be real numbers float[... {V}], got dtype {z.dtype}")
    z = jnp.asarray(z)
    if z.ndim == 0 or z.shape[-1] != V:
        raise ValueError(f"top_tokens: logits of shape {tuple(z.shape)}; expected float[... {V}], the model's "
                         f"vocabulary on the last axis (pl.logits(model, h))")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= V:
        raise ValueError(f"top_tokens: k must be an integer in [1, {V}], got {k!r}")
    probs, ids = (np.asarray(a) for a in _top_probs(z, k=int(k)))
    if not np.isfinite(probs).all():
        raise ValueError("top_tokens: the logits contain NaN or +inf, so their probabilities are undefined")
    texts = np.asarray(token_texts(model, ids.reshape(-1)), object).reshape(ids.shape)

    def nest(p, i, t):
        if p.ndim == 1:
            return [TopToken(int(a), str(b), float(c)) for a, b, c in zip(i, t, p)]
        return [nest(*row) for row in zip(p, i, t)]

    return nest(probs, ids, texts)
