"""Steering edits as files: one small, versioned format to save, load and apply an edit.

An edit changes unique layer l of a loaded model in one of three ways::

    "delta_O"     W_o[l] += delta_O "float[d H e]"   a learned change of rank r (optax)
    "rank1"       W_o[l] += delta_O = alpha u w^T    the closed form (u "float[d]" and
                                                     w "float[H e]" are kept beside delta_O)
    "activation"  h += v "float[d]" at every token of the output of the last step that applies
                  l (activation addition), applied as a change of that layer's FFN output bias
                  (:func:`~.compare.activation_model`, exact for pre-norm blocks)

:func:`apply_edit` applies a weight edit with :func:`~.effects.steered_model` (W_o[l] +
delta_O cast to W_o's dtype, exactly as ``steer`` measured it), so the probabilities it
gives are the ones ``steer.json`` reports.

The file is one ``.npz`` (NumPy's zip of ``.npy`` arrays; nothing is pickled) holding the
edit's arrays in the dtype they were applied from and ``metadata``, a JSON text::

    format "powerlens-edit", version 1
    kind, layer (unique, counted from 0), rank, norm (||delta_O||_F or ||v||), dtype (W_o's)
    model   {family, name, source, d_model, n_unique, layer_sha256}: the identity
    target  what the edit was made for (objective, token or direction, levels reached)
    options how it was made (method, rank, steps, seed, w, ...)
    alpha   the closed form's alpha ("rank1" only)

The model's identity is ``layer_sha256``: the sha256 of the edited layer's arrays as held in
memory (each array's name, dtype, shape and bytes, in the layer's field order). An edit
applied to a model whose edited layer differs (another checkpoint, another dtype, or a model
already edited there) is refused in one line. Files are written atomically
(:func:`powerlens._src.io.write_bytes`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io as _bytes_io
import json
import os
import zipfile
from typing import Any, Mapping, Optional

import numpy as np

FORMAT = "powerlens-edit"
VERSION = 1
KINDS = ("delta_O", "rank1", "activation")


def layer_sha256(model, layer: int) -> str:
    """sha256 (hex) of unique layer ``layer``'s arrays as held in memory: for each array of the
    layer (field order), its name, dtype, shape and bytes."""
    from .rank1 import layer_index
    layers = getattr(model, "layers", model)
    one = layers.layer(layer_index(layers, layer))
    h = hashlib.sha256()
    for name, leaf in one.arrays().items():          # flat names, powerlens._src.dynamics.params.FIELDS order
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f".{name}|{a.dtype.name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def model_identity(model, layer: int) -> dict:
    """The ``model`` entry of an edit's metadata (module docstring); the family is the model's
    ``info.family`` ("" for a model without a ModelInfo)."""
    from .rank1 import layer_index
    layers = model.layers
    info = getattr(model, "info", None)
    return {"family": getattr(info, "family", "") or "", "name": getattr(info, "name", "") or "",
            "source": getattr(info, "source", "") or "", "d_model": int(layers.config.d_model),
            "n_unique": int(layers.n_unique), "layer_sha256": layer_sha256(model, layer_index(layers, layer))}


@dataclasses.dataclass(frozen=True)
class Edit:
    """One edit of unique layer ``layer`` (module docstring). ``arrays``: ``delta_O`` (kinds
    "delta_O", "rank1"; with ``u``, ``w`` for "rank1") or ``vector`` ("activation")."""

    kind: str
    layer: int
    arrays: Mapping[str, np.ndarray]
    model: Mapping[str, Any]
    target: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    alpha: Optional[float] = None
    dtype: str = "float32"

    @property
    def delta_O(self) -> np.ndarray:
        """The weight change "float[d H e]" (error for an activation addition)."""
        if self.kind == "activation":
            raise ValueError("an activation-addition edit has no delta_O; its edit is .vector")
        return self.arrays["delta_O"]

    @property
    def vector(self) -> np.ndarray:
        """The added vector "float[d]" (activation addition only)."""
        if self.kind != "activation":
            raise ValueError(f"a {self.kind!r} edit is a weight change; use .delta_O")
        return self.arrays["vector"]

    @property
    def norm(self) -> float:
        """||delta_O||_F or ||v|| (float64)."""
        return float(np.linalg.norm(np.asarray(self.arrays["vector" if self.kind == "activation" else "delta_O"],
                                               np.float64)))

    @property
    def rank(self) -> int:
        """Numerical rank of delta_O (its singular values above the rounding of its dtype); 1 for
        a nonzero vector."""
        if self.kind == "activation":
            return int(self.norm > 0)
        from .rank1 import rank_tolerance
        a = np.asarray(self.delta_O)
        sv = np.linalg.svd(a.astype(np.float64), compute_uv=False)
        return int(np.sum(sv > rank_tolerance(sv, a.shape, a.dtype))) if sv.size and sv[0] > 0 else 0

    def metadata(self) -> dict:
        """The JSON metadata written beside the arrays."""
        return {"format": FORMAT, "version": VERSION, "kind": self.kind, "layer": int(self.layer),
                "rank": self.rank, "norm": self.norm, "dtype": self.dtype, "alpha": self.alpha,
                "model": dict(self.model), "target": dict(self.target), "options": dict(self.options),
                "arrays": {k: {"shape": list(np.shape(v)), "dtype": np.asarray(v).dtype.name}
                           for k, v in self.arrays.items()}}

    def to_edit(self) -> dict:
        """The edit as :func:`~.compare.edit_effects` takes it: {"delta_O": ...} or {"vector": ...}."""
        return {"vector": self.vector} if self.kind == "activation" else {"delta_O": self.delta_O}


def make_edit(model, kind: str, layer: int, *, delta_O=None, vector=None, u=None, w=None, alpha=None,
              target: Optional[Mapping] = None, options: Optional[Mapping] = None) -> Edit:
    """An :class:`Edit` of ``model`` (its identity taken now, before the edit is applied).
    ``delta_O`` "float[d H e]" for kinds "delta_O" and "rank1" (with ``u``, ``w``, ``alpha``),
    ``vector`` "float[d]" for "activation"; the arrays keep their dtype."""
    from .rank1 import layer_index
    if kind not in KINDS:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {KINDS}")
    layers = model.layers
    l = layer_index(layers, layer)
    d, He = int(layers.config.d_model), int(layers.W_o.shape[-1])
    if kind == "activation":
        arrays = {"vector": np.asarray(vector)}
        shapes = {"vector": (d,)}
    else:
        arrays = {"delta_O": np.asarray(delta_O)}
        shapes = {"delta_O": (d, He)}
        if kind == "rank1":
            if alpha is None or u is None or w is None:
                raise ValueError("a 'rank1' edit needs u, w and alpha beside delta_O")
            arrays.update(u=np.asarray(u), w=np.asarray(w))
            shapes.update(u=(d,), w=(He,))
    _check_arrays(arrays, shapes, "edit")
    return Edit(kind=kind, layer=l, arrays=arrays, model=model_identity(model, l), target=dict(target or {}),
                options=dict(options or {}), alpha=None if alpha is None else float(alpha),
                dtype=np.dtype(layers.W_o.dtype).name)


def _check_arrays(arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple], where: str) -> None:
    for name, shape in shapes.items():
        if name not in arrays:
            raise ValueError(f"{where}: the array {name!r} is missing")
        a = arrays[name]
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{where}: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        if not np.issubdtype(a.dtype, np.floating) or not np.all(np.isfinite(a.astype(np.float64))):
            raise ValueError(f"{where}: {name} must hold finite real numbers")


def save_edit(path, edit: Edit) -> str:
    """Write ``edit`` to ``path`` (an ``.npz``; module docstring), atomically. Returns the path."""
    from .. import io
    if not isinstance(edit, Edit):
        raise ValueError(f"save_edit needs an Edit (powerlens.make_edit, or the one steer wrote), got "
                         f"{type(edit).__name__}")
    buf = _bytes_io.BytesIO()
    meta = np.asarray(json.dumps(io.to_jsonable(edit.metadata()), allow_nan=False))
    np.savez(buf, metadata=meta, **{k: np.asarray(v) for k, v in edit.arrays.items()})
    return io.write_bytes(os.fspath(path), buf.getvalue())


def load_edit(path) -> Edit:
    """Read an edit written by :func:`save_edit`; every problem is one ValueError naming the file."""
    path = os.fspath(path)
    where = f"edit file {path!r}"
    if not os.path.isfile(path):
        raise ValueError(f"{where} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            files = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{where} is not a powerlens edit (an .npz written by save_edit or steer): "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if "metadata" not in files or files["metadata"].dtype.kind != "U" or files["metadata"].ndim != 0:
        raise ValueError(f"{where} has no powerlens metadata (not written by save_edit or steer)")
    try:
        meta = json.loads(str(files.pop("metadata")))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: its metadata is not valid JSON ({exc.msg})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{where} is not a powerlens edit (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    version = meta.get("version")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"{where}: bad format version {version!r}")
    if version > VERSION:
        raise ValueError(f"{where} has format version {version}, newer than this powerlens reads ({VERSION}); "
                         f"upgrade powerlens")
    kind = meta.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: unknown edit kind {kind!r}; expected one of {KINDS}")
    model = meta.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("layer_sha256"), str):
        raise ValueError(f"{where}: its metadata has no model identity (model.layer_sha256)")
    layer = meta.get("layer")
    if not isinstance(layer, int) or layer < 0:
        raise ValueError(f"{where}: bad layer {layer!r}")
    d = model.get("d_model")
    names = {"activation": ("vector",), "delta_O": ("delta_O",), "rank1": ("delta_O", "u", "w")}[kind]
    shapes = {}
    for name in names:
        if name not in files:
            raise ValueError(f"{where}: the array {name!r} is missing")
        shapes[name] = files[name].shape
    if kind != "activation" and (files["delta_O"].ndim != 2 or files["delta_O"].shape[0] != d):
        raise ValueError(f"{where}: delta_O has shape {files['delta_O'].shape}, expected ({d}, H*d_head)")
    if kind == "activation" and files["vector"].shape != (d,):
        raise ValueError(f"{where}: vector has shape {files['vector'].shape}, expected ({d},)")
    _check_arrays(files, shapes, where)
    return Edit(kind=kind, layer=layer, arrays={n: files[n] for n in names}, model=model,
                target=meta.get("target") or {}, options=meta.get("options") or {}, alpha=meta.get("alpha"),
                dtype=str(meta.get("dtype", "float32")))


def check_identity(model, edit: Edit, where: str = "the edit") -> None:
    """Refuse (one ValueError) a model whose edited layer is not the one the edit was made for."""
    layers = model.layers
    want = edit.model
    d, U = int(layers.config.d_model), int(layers.n_unique)
    made_for = want.get("name") or want.get("source") or want.get("family") or "another model"
    if want.get("d_model") != d or want.get("n_unique") != U or not 0 <= edit.layer < U:
        raise ValueError(f"{where} was made for {made_for} (d={want.get('d_model')}, {want.get('n_unique')} layers), "
                         f"not this model (d={d}, {U} layers)")
    have = layer_sha256(model, edit.layer)
    if have != want["layer_sha256"]:
        raise ValueError(f"{where} was made for {made_for}, whose layer {edit.layer} has sha256 "
                         f"{want['layer_sha256'][:12]}..., but this model's layer {edit.layer} has {have[:12]}... "
                         f"(another checkpoint or dtype, or a model already edited there)")


def apply_edit(model, edit):
    """The model with ``edit`` (an :class:`Edit` or the path of an edit file) applied: W_o[l] +=
    delta_O (:func:`~.effects.steered_model`) or the activation vector as a bias change
    (:func:`~.compare.activation_model`). Refuses a model whose identity differs."""
    where = "the edit"
    if isinstance(edit, (str, os.PathLike)):
        where = f"edit file {os.fspath(edit)!r}"
        edit = load_edit(edit)
    if not isinstance(edit, Edit):
        raise ValueError(f"apply_edit needs an Edit or the path of an edit file, got {type(edit).__name__}")
    check_identity(model, edit, where)
    if edit.kind == "activation":
        from .compare import activation_model
        return activation_model(model, edit.vector, edit.layer)
    from .effects import steered_model
    return steered_model(model, edit.delta_O, edit.layer)

