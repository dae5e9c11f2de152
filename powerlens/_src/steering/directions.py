"""Steering directions u in the residual space: validation and parsing.

    token:WORD   the unembedding direction of WORD's single token: row of ``lm_head``
                 (or of the tied word embeddings; through ALBERT's projection when the
                 embedding width differs from d), normalised
    FILE.npy     a saved vector of shape (d,)
    random       a seeded Gaussian direction (uniform on the unit sphere of R^d)

Every direction is returned as a unit float64 vector (d,). A complex, bool, zero,
non-finite or wrongly-sized direction, and a WORD that the tokenizer maps to several tokens or to
the unknown token, are ``ValueError``s that name the culprit.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np

from ..models.layout import unembedding_matrix, vocabulary_rows  # noqa: F401  (unembedding_matrix re-exported: the read-out rows (V, d))


@dataclasses.dataclass
class Direction:
    """A unit steering direction and where it came from."""

    vector: np.ndarray            # (d,) float64, unit norm
    kind: str                     # 'token' | 'file' | 'random' | 'array'
    label: str                    # the spec, for reports
    token_id: Optional[int] = None
    token: Optional[str] = None   # the token string that was matched (e.g. ' Paris')

    def to_json(self) -> dict:
        return {"kind": self.kind, "label": self.label, "token_id": self.token_id, "token": self.token}


def as_direction(u, d: Optional[int] = None, *, name: str = "direction") -> np.ndarray:
    """Validate u and return u / ||u|| as float64 (d,).

    Raises ValueError for a non-real dtype (complex, bool, strings: never cast), a
    non-vector, a wrong width, a non-finite entry or a zero vector.
    """
    a = _real_array(u, name)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a vector of shape (d,), got shape {a.shape}")
    if d is not None and a.shape[0] != d:
        raise ValueError(f"{name} has dimension {a.shape[0]} but the model width is d={d}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    n = float(np.linalg.norm(a))
    if n == 0.0 or not np.isfinite(n):
        raise ValueError(f"{name} is the zero vector: it has no direction")
    return a / n


def _real_array(u, name: str) -> np.ndarray:
    """``u`` as float64 when its dtype is real (float or integer); complex, bool, strings and
    objects are refused, never cast (a complex vector would silently lose its imaginary part)."""
    try:
        a = np.asarray(u)
    except (TypeError, ValueError):
        a = None
    if a is None or a.dtype.kind not in "fiu":
        kind = f"dtype {a.dtype}" if a is not None else type(u).__name__
        raise ValueError(f"{name} must be a real vector, got {kind}")
    return a.astype(np.float64)


def random_direction(d: int, seed: int = 0) -> np.ndarray:
    """A unit vector uniform on the sphere of R^d (seeded)."""
    return as_direction(np.random.default_rng(seed).standard_normal(int(d)), name="random direction")


def _encode(tok, text: str):
    try:
        return list(tok.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tok(text, add_special_tokens=False)["input_ids"])


def word_token_id(model, word: str):
    """The single token id of ``word`` for the model's tokenizer: (id, token string).

    Decoder tokenizers (BPE/SentencePiece) mark a leading space, so for a decoder the
    word is tried as ``' WORD'`` first (the form it takes inside a sentence), then as
    written. The word must map to exactly one token that is not the unknown token.
    """
    from ..models.embed import tokenizer
    if not isinstance(word, str) or not word.strip():
        raise ValueError("token:WORD needs a non-empty WORD")
    tok = tokenizer(model)
    decoder = bool(model.info is not None and model.info.decoder)
    candidates = [word]
    if decoder and not word.startswith(" "):
        candidates = [" " + word, word]
    unk = getattr(tok, "unk_token_id", None)
    tried = []
    for text in candidates:
        ids = _encode(tok, text)
        tried.append((text, ids))
        if len(ids) == 1 and (unk is None or ids[0] != unk):
            return int(ids[0]), text
    desc = "; ".join(f"{t!r} -> {ids}{' (unknown token)' if unk is not None and unk in ids else ''}"
                     for t, ids in tried)
    raise ValueError(f"token:{word} does not name a single known token of this tokenizer ({desc}); "
                     f"choose a word that is one token")


def token_direction(model, word: str) -> Direction:
    """Unit unembedding direction of WORD's token (see :func:`word_token_id`)."""
    tid, text = word_token_id(model, word)
    V = vocabulary_rows(model)
    if not 0 <= tid < V:
        raise ValueError(f"token {text!r} has id {tid} outside the read-out matrix of {V} rows")
    row = unembedding_matrix(model, rows=[tid])[0]
    return Direction(as_direction(row, name=f"unembedding row of {text!r}"), "token", f"token:{word}",
                     token_id=tid, token=text)


def parse_direction(spec, *, d: Optional[int] = None, model=None, seed: int = 0) -> Direction:
    """``token:WORD`` | ``FILE.npy`` | ``random`` | an array -> :class:`Direction` (unit, (d,)).

    ``d`` defaults to the model's width. ``token:WORD`` needs ``model`` (with a tokenizer).
    """
    if model is not None:
        dm = model.layers.config.d_model
        if d is not None and d != dm:
            raise ValueError(f"d={d} disagrees with the model width {dm}")
        d = dm
    if not isinstance(spec, str):
        return Direction(as_direction(spec, d), "array", "array")
    if spec.startswith("token:"):
        if model is None:
            raise ValueError(f"direction {spec!r} needs a model with a tokenizer (not a weights file)")
        dirn = token_direction(model, spec[len("token:"):])
        if d is not None:
            as_direction(dirn.vector, d, name=spec)
        return dirn
    if spec == "random":
        if d is None:
            raise ValueError("direction 'random' needs the model width d")
        return Direction(random_direction(d, seed), "random", f"random(seed={seed})")
    if spec.endswith(".npy"):
        if not os.path.exists(spec):
            raise ValueError(f"direction file {spec!r} does not exist")
        try:
            arr = np.load(spec, allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - report any unreadable file the same way
            raise ValueError(f"cannot read direction file {spec!r}: {exc}") from None
        return Direction(as_direction(arr, d, name=f"direction file {spec!r}"), "file", spec)
    raise ValueError(f"unknown direction {spec!r}; expected token:WORD, a .npy file or 'random'")
