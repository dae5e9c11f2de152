"""How each family stores what steering changes, so that steering never reads a checkpoint.

Output projection. powerlens keeps every layer's W_o as (d, H e) (column vectors,
``y = W_o m`` for the concatenated heads m). Checkpoints store it in one of two layouts::

    linear   nn.Linear / GGUF  weight (out, in) = (d, H e) = W_o      (BERT, ..., GPT-Neo, Llama)
    conv1d   GPT-2 Conv1D      weight (in, out) = (H e, d) = W_o^T    (y = m @ weight)

Each family module declares its layout when it registers its converter
(``@register("gpt2", output_layout=CONV1D)`` in :mod:`powerlens._src.models.base`);
:func:`checkpoint_delta` turns a change ΔO (d, H e) of W_o into the change of the stored
weight, so that ``stored + checkpoint_delta(...)`` is the steered checkpoint.

Read-out. :func:`unembedding_matrix` gives the token read-out rows in the residual space
(the LM head, or the tied word embeddings mapped through ALBERT's embedding projection).
"""
from __future__ import annotations

from typing import Dict, Union

import numpy as np

LINEAR = "linear"
CONV1D = "conv1d"
LAYOUTS = (LINEAR, CONV1D)

# family -> layout of its stored output projection; the families register themselves.
# ``synthetic`` (synthetic systems and .npz weight files) stores W_o as powerlens does.
OUTPUT_LAYOUTS: Dict[str, str] = {"synthetic": LINEAR}


def declare_output_layout(layout: str, *families: str) -> None:
    """Record that ``families`` store their output projection in ``layout`` (LINEAR or CONV1D)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown output-projection layout {layout!r}; expected one of {LAYOUTS}")
    for family in families:
        OUTPUT_LAYOUTS[family] = layout


def family_of(source) -> str:
    """The family name of a family string, a :class:`ModelInfo` or a :class:`Model`."""
    if isinstance(source, str):
        return source
    info = getattr(source, "info", source)          # a Model carries its ModelInfo
    family = getattr(info, "family", None)
    if not isinstance(family, str):
        raise ValueError(f"expected a family name, a ModelInfo or a Model, got {type(source).__name__}")
    return family


def output_layout(source) -> str:
    """LINEAR or CONV1D: how ``source``'s family (see :func:`family_of`) stores W_o."""
    from . import families  # noqa: F401  (each family module declares its layout)
    family = family_of(source)
    if family not in OUTPUT_LAYOUTS:
        raise ValueError(f"unknown storage layout for family {family!r}; known: {sorted(OUTPUT_LAYOUTS)}")
    return OUTPUT_LAYOUTS[family]


def checkpoint_delta(source: Union[str, object], delta_O) -> np.ndarray:
    """ΔO (d, H e) as the change of the family's stored output-projection weight.

    ``source``: a family name, a ModelInfo or a Model. Returns ΔO itself for LINEAR
    (weight (d, H e)) and ΔO^T (H e, d) for CONV1D; for a rank-1 ΔO = α u wᵀ the latter
    is α w uᵀ.
    """
    d = np.asarray(delta_O)
    if d.ndim != 2:
        raise ValueError(f"delta_O must be a matrix (d, H*d_head), got shape {d.shape}")
    return d.T if output_layout(source) == CONV1D else d


def vocabulary_rows(model) -> int:
    """V, the number of rows of :func:`unembedding_matrix`, without forming it."""
    info = getattr(model, "info", None)
    if model.lm_head is None and getattr(info, "unread_head", None):
        return int(unread_head_rows(info, None, shape_only=True)[0])
    return int((model.lm_head if model.lm_head is not None else model.embeddings["word"]).shape[0])


def unread_head_rows(info, rows=None, *, shape_only: bool = False):
    """Rows ``rows`` "int[K]" (None: all) of the LM head a ``parts`` load left unread, read from
    the checkpoint ``info.source`` now: a safetensors folder reads each row by its offset
    (:meth:`~powerlens._src.models.reader.TensorReader.rows`); a GGUF file dequantises the tensor.
    ``shape_only``: its stored shape (V, d), nothing read."""
    name, source = info.unread_head, info.source
    if str(source).endswith(".gguf"):
        from .gguf_file import GGUFFile
        f = GGUFFile(source)
        t = f.tensors[name]
        shape = tuple(int(s) for s in reversed(list(t.shape)))
        if shape_only:
            return shape
        W = f.get(name, shape)
        return W if rows is None else W[np.asarray(rows, np.int64)]
    from .reader import TensorReader
    reader = TensorReader(source, dtype=np.float32)
    if shape_only:
        return reader.check(name)
    return reader.get(name) if rows is None else reader.rows(name, rows)


def unembedding_matrix(model, rows=None) -> np.ndarray:
    """The token read-out matrix in the residual space: (V, d), float64; with ``rows`` (ids,
    shape (K,)) only those rows, (K, d), without converting the other V - K.

    ``lm_head`` when present, otherwise the (tied) word embeddings; for ALBERT-like models
    whose embedding width E differs from d, the word rows (V, E) are mapped through the
    embedding projection ``project_W`` (d, E).
    """
    from ..dynamics.execution import host_array       # a head split over other hosts' devices: gathered
    d = model.layers.config.d_model
    pick = (lambda a: a) if rows is None else (lambda a: a[np.asarray(rows, np.int64)])
    info = getattr(model, "info", None)
    if model.lm_head is None and getattr(info, "unread_head", None):     # a load without the LM head
        return np.asarray(unread_head_rows(info, rows), np.float64)
    if model.lm_head is not None:
        return np.asarray(pick(host_array(model.lm_head)), np.float64)
    W = np.asarray(pick(host_array(model.embeddings["word"])), np.float64)
    if W.shape[1] != d:
        if "project_W" not in model.embeddings:
            raise ValueError(f"word embeddings have width {W.shape[1]} != d={d} and there is no projection")
        W = W @ np.asarray(model.embeddings["project_W"], np.float64).T
    return W
