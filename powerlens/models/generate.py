"""Greedy decoding on the model's own forward pass (rule ``full``).

Each prompt b of L_b tokens sits, right-padded, in one fixed token buffer of
N = max_b L_b + ``max_new_tokens`` positions; its valid prefix grows by one token a step::

    step k = 0 .. K-1:   valid[b, i] = i < L_b + k
                         h = run(layers, x0, valid, rule="full")[b, L_b + k - 1]   (residual stream)
                         t_bk = argmax_v logits(h)[v]      (final norm, LM head, soft-cap: once)
                         ids[b, L_b + k] = t_bk,  x0[b, L_b + k] = embedding of t_bk at position L_b + k

so every prompt's tokens, old and new, keep positions 0 .. L_b + k - 1 and no valid token
ever attends to padding: the same computation as transformers' ``generate(do_sample=False)``
on the left-padded batch with its attention mask (which counts positions from each prompt's
first token), without a KV cache. The buffer has one shape, so the whole loop is one
compiled program (a ``lax.while_loop``; each step one :func:`powerlens.dynamics.run` per
prompt, vmapped) whatever the prompts.

    out = generate(model, ["The capital of France is"], max_new_tokens=12)
    out.new_ids[0]      # 12 token ids
    out.text[0]         # their text, by the model's own tokenizer
"""
from __future__ import annotations

import functools
import json
import os
from typing import List, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.observers import final
from ..dynamics.projections import prepared_projections
from ..dynamics.run import map_prompts, platform_of, prompt_chunk, run
from .base import Model
from .embed import _embed_arrays, embed_ids, prompt_ids, tokenizer
from .forward import logits


class Generation(NamedTuple):
    """Greedy continuations, one per prompt.

    prompt_ids: each prompt's token ids (as tokenized, special tokens included).
    new_ids: each prompt's new token ids, ``max_new_tokens`` of them (fewer with
      ``stop_at_eos``: up to and including the first end-of-sequence token).
    text: the text of each prompt's new tokens (the model's tokenizer, special tokens kept),
      or None for a model without a tokenizer.
    """

    prompt_ids: List[List[int]]
    new_ids: List[List[int]]
    text: Optional[List[str]]


def generate(model: Model, prompts_or_ids: Union[str, Sequence[str], Sequence[Sequence[int]], np.ndarray], *,
             max_new_tokens: int = 12, stop_at_eos: bool = False,
             eos_token_id: Union[None, int, Sequence[int]] = None) -> Generation:
    """The greedy continuation of each prompt: ``max_new_tokens`` times, the most probable
    next token under the model's own forward pass (rule ``full``), appended.

    Args:
      model: a causal decoder (GPT-2, Llama, Gemma, ... : ``model.info.decoder``).
      prompts_or_ids: a text, texts (tokenized with the model's tokenizer, its special
        tokens added), or token ids: one list of ints per prompt (lengths may differ), or an
        "int[B n]" array (one prompt per row, every id valid).
      max_new_tokens: K >= 1, the tokens generated per prompt.
      stop_at_eos: stop a prompt at its first end-of-sequence token (kept in ``new_ids``),
        and the loop once every prompt has stopped. Off by default: every prompt then gets
        exactly K tokens, transformers' ``generate`` with ``eos_token_id=None``.
      eos_token_id: the end-of-sequence id(s) for ``stop_at_eos``; default the checkpoint's
        own (its tokenizer's ``eos_token_id``, else ``eos_token_id`` in the folder's
        ``generation_config.json`` or ``config.json``).

    Returns:
      a :class:`Generation`: prompt ids, new ids and their text, per prompt.

    Ties between logits go to the lowest token id (``argmax``), as in transformers. Raises a
    one-line ValueError for a model that is not a causal decoder, a bad ``max_new_tokens``,
    an empty prompt, an id outside the vocabulary, or prompts that with the new tokens need
    more positions than the model has.
    """
    _check_decoder(model)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    K = int(max_new_tokens)
    rows = [_token_ids(r, b) for b, r in enumerate(prompt_ids(model, prompts_or_ids))]
    if not rows:
        raise ValueError("generate: no prompts given")
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"generate: prompt {b} is empty (no tokens)")
    lengths = np.asarray([len(r) for r in rows], np.int32)
    N = int(lengths.max()) + K
    info = model.info
    if info.max_positions is not None and N + info.position_offset > info.max_positions:
        raise ValueError(f"generate: the longest prompt ({int(lengths.max())} tokens) plus max_new_tokens={K} needs "
                         f"{N} positions; the model ({info.family}) has {info.max_positions - info.position_offset}")
    eos = _eos_ids(model, eos_token_id) if stop_at_eos else np.zeros((0,), np.int32)
    pad = info.pad_token_id if info.pad_token_id is not None else 0
    buf = np.full((len(rows), N), pad, np.int32)
    for b, r in enumerate(rows):
        buf[b, : len(r)] = r
    x0, _ = embed_ids(model, buf, np.arange(N)[None, :] < lengths[:, None])     # checks the ids, too
    layers = model.layers
    chunk = prompt_chunk(len(rows), N, platform_of(layers.W_v))
    new, count = _greedy(model, x0, jnp.asarray(lengths), jnp.asarray(eos, jnp.int32),
                         prepared_projections(layers, "softmax"), n_new=K, pad=int(pad), chunk=chunk)
    new, count = np.asarray(new), np.asarray(count)
    new_ids = [[int(t) for t in new[b, : count[b]]] for b in range(len(rows))]
    text = None
    if info.tokenizer is not None:
        from .tokens import decode
        text = [decode(model, r) if r else "" for r in new_ids]
    return Generation(prompt_ids=rows, new_ids=new_ids, text=text)


@functools.partial(jax.jit, static_argnames=("n_new", "pad", "chunk"))
def _greedy(model: Model, x0: "float[B N d]", lengths: "int[B]", eos: "int[E]", projections, *, n_new: int,
            pad: int, chunk: Optional[int]):
    """The decoding loop: (new ids "int[B K]", their count per prompt "int[B]").

    x0 holds the prompts' embeddings (right-padded, L_b valid tokens); each step runs rule
    ``full`` on the whole buffer under the grown mask, reads the logits at each prompt's last
    valid token and writes the argmax, and its embedding, into the next position. A prompt that
    has emitted an id of ``eos`` gets ``pad`` from then on; the loop ends after ``n_new`` steps
    or once every prompt has stopped."""
    B, N, _ = x0.shape
    rows = jnp.arange(B)
    positions = jnp.arange(N)
    info = model.info
    E = model.embeddings
    scale = None if info.embed_scale is None else np.float32(info.embed_scale)
    eps = float(model.layers.config.norm_eps)

    def forward(x, valid):
        one = lambda xb, vb: run(model.layers, xb, vb, rule="full", attention="softmax", projections=projections,
                                 observers={"final": final()})["final"]
        return map_prompts(one, x, valid, chunk)

    def step(carry):
        k, x, new, done, count = carry
        last = lengths + k - 1                                        # each prompt's last valid token
        h = forward(x, positions[None, :] < (last + 1)[:, None])
        token = jnp.argmax(logits(model, h[rows, last]), axis=-1).astype(jnp.int32)
        token = jnp.where(done, pad, token)
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(token, eos)
        at = jnp.minimum(last + 1, N - 1)                             # the last step writes past no buffer
        pos = None if "position" not in E else (at + info.position_offset)[:, None]
        row = _embed_arrays(E, token[:, None], pos, scale, eps=eps)[:, 0]
        x = x.at[rows, at].set(row.astype(x.dtype))
        return k + 1, x, new.at[:, k].set(token), done, count

    def more(carry):
        k, _, _, done, _ = carry
        return (k < n_new) & ~jnp.all(done)

    init = (jnp.zeros((), jnp.int32), x0, jnp.full((B, n_new), pad, jnp.int32), jnp.zeros((B,), bool),
            jnp.zeros((B,), jnp.int32))
    _, _, new, _, count = jax.lax.while_loop(more, step, init)
    return new, count


def _check_decoder(model: Model) -> None:
    info = model.info
    if info is None or not info.decoder or not model.config.causal:
        name = getattr(info, "name", "") or getattr(info, "family", "?")
        raise ValueError(f"generate: model {name!r} is not a causal decoder (family {getattr(info, 'family', '?')}); "
                         f"greedy decoding needs a causal language model (GPT-2, Llama, Gemma, ...)")


def _token_ids(row, b: int) -> List[int]:
    """Prompt b's token ids as ints; a float or bool id is an error, never cast."""
    arr = np.asarray(row)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"generate: prompt {b}'s token ids must be integers, got dtype {arr.dtype}")
    return [int(t) for t in arr.reshape(-1)]


def _eos_ids(model: Model, eos_token_id) -> np.ndarray:
    """The end-of-sequence ids "int[E]": ``eos_token_id`` as given, else the checkpoint's own."""
    V = int(model.embeddings["word"].shape[0])
    given = eos_token_id is not None
    ids = eos_token_id if given else _checkpoint_eos(model)
    if ids is None:
        raise ValueError(f"generate: stop_at_eos needs an end-of-sequence id and the checkpoint "
                         f"{model.info.source!r} names none: pass eos_token_id")
    ids = [ids] if isinstance(ids, (int, np.integer)) else list(ids)
    if not ids or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < V for i in ids):
        raise ValueError(f"generate: eos_token_id must be token ids in [0, {V}), got {eos_token_id!r}")
    return np.asarray(ids, np.int32)


def _checkpoint_eos(model: Model):
    """The checkpoint's end-of-sequence id(s): its tokenizer's, else a folder's
    ``generation_config.json`` / ``config.json`` ``eos_token_id``; None when none says."""
    if model.info.tokenizer is not None:
        eos = getattr(tokenizer(model), "eos_token_id", None)
        if eos is not None:
            return eos
    source = model.info.source
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(source, name) if source and os.path.isdir(source) else None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                eos = json.load(fh).get("eos_token_id")
            if eos is not None:
                return eos
    return None
