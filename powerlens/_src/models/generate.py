"""Decoding with a key/value cache: greedy, or sampled with an explicit PRNG key.

The prompts are prefilled once (:mod:`powerlens._src.models.kv_cache`), then each step embeds
one new token per prompt at its position and runs it through the model against the cache::

    prompt b: tokens 0 .. L_b - 1 (right-padded), cache of N = max_b L_b + K - 1 indices
    step k = 0 .. K-1:   logits_bk = logits(h_bk), h_bk the state of the token at position L_b + k - 1
                         t_bk = argmax_v logits_bk[v]                        (greedy, ties to the lowest id)
                              or a draw from softmax(logits_bk / T), restricted to the top_k most
                              probable tokens, then to the smallest set of most probable tokens
                              whose probability reaches top_p, renormalised          (sampling)
                         token t_bk enters at position L_b + k (its key and value written there)

so every prompt's tokens, old and new, keep positions 0 .. L_b + k - 1: the computation of
transformers' ``generate`` on the left-padded batch with its attention mask, which counts
positions from each prompt's first token, and each prompt's tokens are those it gets alone.
Prefill and the first token are one compiled program; the K - 1 steps after it are one
``lax.while_loop`` (with ``progress``, a few such loops of the same compiled program, a
progress bar on stderr between them).

Sampling: prompt b at step k draws with the key ``fold_in(fold_in(key, b), k)`` (Gumbel-max,
``jax.random.categorical``), so a given key gives the same tokens on every call, and prompt 0
of a batch gets the tokens it gets alone with the same key.

    out = generate(model, ["The capital of France is"], max_new_tokens=12)
    out.new_ids[0]      # 12 token ids
    out.text[0]         # their text, by the model's own tokenizer
    generate(model, prompts, max_new_tokens=64, key=jax.random.key(0), temperature=0.8, top_p=0.95)
    generate(model, prompts, add=v, add_layer=20)    # activation addition: v "float[d]" added to the
                                                     # output of layer 20 at every token
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import List, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.projections import prepared_projections
from ..dynamics.run import platform_of, prompt_chunk
from .base import Model
from jaxtyping import Array, ArrayLike, Float, Int, Real
from .embed import embed_arrays, embed_ids, prompt_ids, tokenizer
from .forward import logits
from .kv_cache import UNROLL_MIN_TOKENS, decode_layers, decode_step, prefill


class Generation(NamedTuple):
    """Continuations, one per prompt.

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
             eos_token_id: Union[None, int, Sequence[int]] = None, key: Optional[jax.Array] = None,
             temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
             add: Optional[Real[ArrayLike, "d"]] = None, add_layer: int = -1, progress: bool = False,
             unroll: Optional[bool] = None) -> Generation:
    """The continuation of each prompt: ``max_new_tokens`` times, the next token under the
    model's own forward pass (rule ``full``), with a key/value cache, appended.

    Args:
      model: a causal decoder (GPT-2, Llama, Gemma, ... : ``model.info.decoder``), as loaded
        or edited (``steered_model``: the edited weights are used as they are).
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
      key: a JAX PRNG key (``jax.random.key(seed)`` or ``jax.random.PRNGKey(seed)``): sample
        instead of the greedy argmax (module docstring). None (default): greedy.
      temperature: T > 0, the logits are divided by it before sampling (default 1).
      top_k: sample among the k most probable tokens only (k >= 1; 1 is greedy).
      top_p: 0 < p <= 1, sample among the smallest set of most probable tokens (after
        ``top_k``) whose probability reaches p (nucleus sampling).
      add: activation addition, a vector "float[d]" added to every token of the output of
        unique layer ``add_layer`` (its last application), in the prompt and the new tokens.
      add_layer: the layer of ``add`` (negative counts from the last; default the last).
      progress: a progress bar on stderr over the new tokens (off by default).
      unroll: write the decoding step out layer by layer, each layer's weights in buffers of
        their own (:func:`~powerlens._src.models.kv_cache.decode_layers`: faster steps on a CPU, a
        slower compile, a second copy of the layers' weights), instead of one scan over the
        stacked layers. None (default): on a CPU, for at least
        :data:`~powerlens._src.models.kv_cache.UNROLL_MIN_TOKENS` new tokens, weights held in their
        compute dtype and at most :data:`~powerlens._src.models.kv_cache.UNROLL_BYTES` of them.
        The tokens are the same either way.

    Returns:
      a :class:`Generation`: prompt ids, new ids and their text, per prompt.

    Ties between logits go to the lowest token id (``argmax``), as in transformers. Raises a
    one-line ValueError for a model that is not a causal decoder, a bad ``max_new_tokens``,
    an empty prompt, an id outside the vocabulary, prompts that with the new tokens need
    more positions than the model has, a sampling option without ``key`` or out of its range,
    and an ``add`` of the wrong shape or a layer the model does not have.
    """
    _check_decoder(model)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    K = int(max_new_tokens)
    sampling = _sampling(key, temperature, top_k, top_p)
    if unroll is not None and not isinstance(unroll, (bool, np.bool_)):
        raise ValueError(f"generate: unroll must be True, False or None, got {unroll!r}")
    add, add_step = _addition(model, add, add_layer)
    rows = [_token_ids(r, b) for b, r in enumerate(prompt_ids(model, prompts_or_ids))]
    if not rows:
        raise ValueError("generate: no prompts given")
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"generate: prompt {b} is empty (no tokens)")
    lengths = np.asarray([len(r) for r in rows], np.int32)
    n = int(lengths.max())
    info = model.info
    if info.max_positions is not None and n + K + info.position_offset > info.max_positions:
        raise ValueError(f"generate: the longest prompt ({n} tokens) plus max_new_tokens={K} needs "
                         f"{n + K} positions; the model ({info.family}) has {info.max_positions - info.position_offset}")
    eos = _eos_ids(model, eos_token_id) if stop_at_eos else np.zeros((0,), np.int32)
    pad = info.pad_token_id if info.pad_token_id is not None else 0
    buf = np.full((len(rows), n), pad, np.int32)
    for b, r in enumerate(rows):
        buf[b, : len(r)] = r
    x0, valid = embed_ids(model, buf, np.arange(n)[None, :] < lengths[:, None])     # checks the ids, too
    layers = model.layers
    # weights stored in another dtype than the compute dtype are cast a layer at a time: no copies
    projections = prepared_projections(layers, "softmax") if layers.dtype == layers.storage_dtype else None
    statics = dict(pad=int(pad), top_k=sampling.pop("top_k"))
    args = (jnp.asarray(lengths), jnp.asarray(eos, jnp.int32), projections, sampling, add, add_step)
    state = _start(model, x0, valid, *args, size=n + K - 1, n_new=K,
                   chunk=prompt_chunk(len(rows), n, platform_of(layers.W_v)), **statics)
    unrolled = None
    if unroll or (unroll is None and K >= UNROLL_MIN_TOKENS):
        unrolled = decode_layers(model, projections, force=bool(unroll))
    state = _run_steps(model, state, args + (unrolled,), statics, K, progress)
    new, count = np.asarray(state[3]), np.asarray(state[5])
    new_ids = [[int(t) for t in new[b, : count[b]]] for b in range(len(rows))]
    text = None
    if info.tokenizer is not None:
        from .tokens import decode as decode_ids
        text = [decode_ids(model, r) if r else "" for r in new_ids]
    return Generation(prompt_ids=rows, new_ids=new_ids, text=text)


PROGRESS_STEPS = 16
"""New tokens per compiled loop between two updates of the progress bar (``progress=True``)."""


def _run_steps(model, state, args, statics, K: int, progress: bool):
    """Steps 1 .. K-1 of the decoding loop from ``state``: one compiled loop, or, with
    ``progress``, loops of :data:`PROGRESS_STEPS` tokens of the same compiled program with a
    tqdm bar on stderr between them."""
    if not progress:
        return _steps(model, state, jnp.int32(K), *args, **statics)
    from tqdm.auto import tqdm
    with tqdm(total=K, initial=1, desc="generate", unit=" tokens", file=sys.stderr) as bar:
        done = 1
        while done < K:
            stop = min(K, done + PROGRESS_STEPS)
            state = _steps(model, state, jnp.int32(stop), *args, **statics)
            bar.update(stop - done)
            done = stop
            if bool(np.all(np.asarray(state[4]))):                     # every prompt stopped at EOS
                break
    return state


def _sampling(key, temperature, top_k, top_p) -> dict:
    """The sampling options checked: {"key", "temperature", "top_p"} (arrays or None) and
    "top_k" (an int or None, static). Any option without ``key`` is an error."""
    if key is None:
        given = [name for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                 if v is not None]
        if given:
            raise ValueError(f"generate: {', '.join(given)} shape sampling, which needs a PRNG key: pass "
                             f"key=jax.random.key(seed) (without a key, decoding is greedy)")
        return dict(key=None, temperature=None, top_p=None, top_k=None)
    if not isinstance(key, jax.Array) or not (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
                                              or key.dtype == jnp.uint32 and key.shape == (2,)):
        raise ValueError(f"generate: key must be one JAX PRNG key (jax.random.key(seed) or "
                         f"jax.random.PRNGKey(seed)), got {type(key).__name__} "
                         f"{getattr(key, 'dtype', '')} {tuple(getattr(key, 'shape', ()))}")
    number = lambda v: isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
    if temperature is not None and not (number(temperature) and 0 < temperature < np.inf):
        raise ValueError(f"generate: temperature must be a number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"generate: top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and not (number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be a number in (0, 1], got {top_p!r}")
    return dict(key=key, temperature=jnp.float32(1.0 if temperature is None else temperature),
                top_p=None if top_p is None else jnp.float32(top_p), top_k=None if top_k is None else int(top_k))


def _addition(model: Model, add, layer):
    """(the activation-addition vector "float[d]" or None, the schedule step it is added at or None)."""
    if add is None:
        return None, None
    layers = model.layers
    d, U = layers.config.d_model, layers.n_unique
    v = np.asarray(add)
    if v.shape != (d,) or not np.issubdtype(v.dtype, np.floating) and not np.issubdtype(v.dtype, np.integer) \
            or np.issubdtype(v.dtype, np.bool_):
        raise ValueError(f"generate: add must be a real vector of shape ({d},), got {v.dtype} {v.shape}")
    if not np.all(np.isfinite(v)):
        raise ValueError("generate: add contains non-finite values (NaN or inf)")
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not -U <= layer < U:
        raise ValueError(f"generate: add_layer must be an integer in [-{U}, {U}), got {layer!r}")
    steps = layers.schedule.steps_of(int(layer) % U)
    if not steps:
        raise ValueError(f"generate: add_layer {layer} is never applied by the schedule")
    return jnp.asarray(v, layers.dtype), jnp.int32(steps[-1])


def _pick(lg: Float[ArrayLike, "B V"], k, sampling: dict, top_k: Optional[int]) -> Int[Array, "B"]:
    """The next token of each row: the argmax of the logits, or a draw (module docstring)."""
    if sampling["key"] is None:
        return jnp.argmax(lg, axis=-1).astype(jnp.int32)
    z = lg.astype(jnp.float32) / sampling["temperature"]
    B = z.shape[0]
    rows = jnp.arange(B)[:, None]
    if top_k is not None and top_k < z.shape[-1]:
        vals, idx = jax.lax.top_k(z, top_k)                        # ties: the lower id first, as argmax
        z = jnp.full_like(z, -jnp.inf).at[rows, idx].set(vals)
    if sampling["top_p"] is not None:
        order = jnp.argsort(-z, axis=-1, stable=True)
        p = jax.nn.softmax(jnp.take_along_axis(z, order, axis=-1), axis=-1)
        keep = (jnp.cumsum(p, axis=-1) - p) < sampling["top_p"]    # the mass before each token < p
        keep = jnp.zeros(z.shape, bool).at[rows, order].set(keep)
        z = jnp.where(keep, z, -jnp.inf)
    keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(sampling["key"], b), k))(jnp.arange(B))
    return jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("size", "n_new", "chunk", "pad", "top_k"))
def _start(model: Model, x0, valid, lengths, eos, projections, sampling, add, add_step, *, size: int, n_new: int,
           chunk, pad: int, top_k):
    """Prefill and the first new token: the loop state (k = 1, the new token "int[B]", the
    cache, new ids "int[B K]", done "bool[B]", count "int[B]")."""
    B = x0.shape[0]
    with jax.default_matmul_precision(model.layers.config.precision):
        h, cache = prefill(model, x0, valid, projections, size=size, chunk=chunk, add=add, add_step=add_step)
        token = _pick(logits(model, h), 0, sampling, top_k)
    new = jnp.full((B, n_new), pad, jnp.int32).at[:, 0].set(token)
    return (jnp.ones((), jnp.int32), token, cache, new, jnp.isin(token, eos), jnp.ones((B,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("pad", "top_k"), donate_argnums=(1,))
def _steps(model: Model, state, stop, lengths, eos, projections, sampling, add, add_step, unrolled=None, *, pad: int,
           top_k):
    """Steps k .. stop-1 of the loop (module docstring) from ``state``: each embeds the last
    token at its position, decodes it against the cache and picks the next. A prompt that has
    emitted an id of ``eos`` gets ``pad`` from then on; the loop ends at ``stop`` or once every
    prompt has stopped."""
    info = model.info
    E = model.embeddings
    scale = None if info.embed_scale is None else np.float32(info.embed_scale)
    eps = float(model.layers.config.norm_eps)
    dtype = np.dtype(model.layers.dtype).name

    # the word embeddings ride in the loop's carry behind an optimization barrier: XLA's CPU
    # compiler otherwise rewrites the upcast of the one row a step reads (bf16 weights, float32
    # compute) into an upcast of the whole table, hoisted out of the loop and held while it runs
    words = E["word"]

    def step(carry):
        (k, token, cache, new, done, count), words = carry
        token, words = jax.lax.optimization_barrier((token, words))
        at = lengths + k - 1                                            # the position of `token`
        pos = None if "position" not in E else (at + info.position_offset)[:, None]
        x = embed_arrays(dict(E, word=words), token[:, None], pos, scale, eps=eps, dtype=dtype)[:, 0]
        h, cache = decode_step(model, x, at, cache, projections, add=add, add_step=add_step, unrolled=unrolled)
        nxt = jnp.where(done, pad, _pick(logits(model, h), k, sampling, top_k))
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.isin(nxt, eos)
        return (k + 1, nxt, cache, new.at[:, k].set(nxt), done, count), words

    def more(carry):
        return (carry[0][0] < stop) & ~jnp.all(carry[0][4])

    with jax.default_matmul_precision(model.layers.config.precision):
        return jax.lax.while_loop(more, step, (state, words))[0]


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
