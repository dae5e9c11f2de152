"""Padded batches whose pad token has a zero embedding row (Gemma 2/3 with transformers'
``padding_idx``, and any model trained with one), for the family equivalence tests.

``zero_pad_rows(model, hf)`` zeroes the pad row in both the tiny transformers model (restored
afterwards) and a copy of the powerlens model; ``pad_batch`` pads a random batch with that
token, right or left. In families without learned positions (Llama-style, GPT-NeoX, Phi) the
padded rows of x0 are then exactly zero: powerlens validates only the valid tokens and keeps
the padded ones inert inside the scan, so the valid tokens' states are transformers' own.
"""
from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np
import torch

PAD = 0
"""The token that pads: powerlens's ``embed_ids`` embeds token 0 at every padded position."""


@contextlib.contextmanager
def zero_pad_rows(model, hf, rows=(PAD,)):
    """Within the block, the word-embedding rows ``rows`` are zero in transformers' model ``hf``
    (its weights are restored on leaving) and in the powerlens model the block receives."""
    emb = hf.get_input_embeddings().weight
    saved = emb.detach().clone()
    with torch.no_grad():
        emb[list(rows)] = 0
    words = jnp.asarray(model.embeddings["word"]).at[np.asarray(rows)].set(0)
    try:
        yield model.replace(embeddings=dict(model.embeddings, word=words))
    finally:
        with torch.no_grad():
            emb.copy_(saved)


def pad_batch(ids, mask, *, pad: int = PAD, avoid=(PAD,)):
    """``ids`` (B, n) with token ``pad`` at every padded position (``mask`` 0) and no valid token
    among ``avoid`` (those are moved to the next id not in ``avoid``), so that only padding reads
    the zero row."""
    ids = np.array(ids)
    for a in avoid:
        nxt = a + 1
        while nxt in avoid:
            nxt += 1
        ids[ids == a] = nxt
    return np.where(np.asarray(mask, bool), ids, pad), mask


def paper_uniform_states(model, ids, mask):
    """The states "float64[T+1 B n d]" of rule ``paper`` with uniform attention: a padded query with no
    key (the first token of a left-padded causal prompt) has attention 0 there, so its zero row
    stays zero and N2 of it is 0 / 0, the NaN that a mask lets through (A_ij = 0 times NaN)
    unless the padding is inert."""
    from powerlens._src.models import embed_ids, run_states
    x0, valid = embed_ids(model, ids, np.asarray(mask, bool))
    return np.asarray(run_states(model, x0, valid, rule="paper", attention="uniform"), np.float64)


def check_zero_pad_row(model, hf, ids, mask, errors, tol: float, *, zero_x0: bool = True, pad: int = PAD) -> None:
    """The batch ``ids`` / ``mask`` padded with token ``pad`` (transformers reads it; powerlens
    embeds :data:`PAD` at padded positions), whose embedding row is zero in both models, as is
    :data:`PAD`'s: ``errors(model, hf, ids, mask)`` (the per-state max abs errors at the valid
    tokens) are all <= ``tol``, and every valid state of :func:`paper_uniform_states` is finite.
    ``zero_x0``: also assert that the padded rows of x0 are zero (families without learned
    positions or an embedding LayerNorm), so that the check bites."""
    from powerlens._src.models import embed_ids
    rows = sorted({PAD, pad})
    ids, mask = pad_batch(ids, mask, pad=pad, avoid=rows)
    valid = np.asarray(mask, bool)
    with zero_pad_rows(model, hf, rows) as zero:
        if zero_x0:
            x0, _ = embed_ids(zero, ids, valid)
            assert np.all(np.asarray(x0)[~valid] == 0)
        errs = errors(zero, hf, ids, mask)
        paper = paper_uniform_states(zero, ids, mask)
    assert max(errs) <= tol, f"per-state max abs errors {errs}"
    assert np.all(np.isfinite(paper[:, valid]))
