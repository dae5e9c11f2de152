"""The documented weights-file format for explicit systems (``--weights system.npz``).

Keys (H heads, e = d_head, d = width, L layers; the layer axis is optional):

    W_v   (H, e, d)  or (L, H, e, d)      required
    W_o   (d, H*e)   or (L, d, H*e)       required
    W_q   (H, e, d)  or (L, H, e, d)      required for --attention softmax
    W_k   (H, e, d)  or (L, H, e, d)      required for --attention softmax
    b_q   (H, e)     or (L, H, e)         optional
    b_k   (H, e)     or (L, H, e)         optional
    b_v   (H, e)     or (L, H, e)         optional (the constant c = O b_v + b_o)
    b_o   (d,)       or (L, d)            optional
    scale ()         or (L,)              optional softmax scale (default 1/sqrt(e))
    window ()        or (L,)              optional local window (default 0 = global)
    causal ()                             optional bool (default False)

Without a layer axis the file is one layer; ``--steps T`` then iterates it T times
as a shared-weight system. Initial tokens come separately (``--init x0.npy``, (n, d)
or (B, n, d)).
"""
from __future__ import annotations

import os
import zipfile
from typing import Optional

import numpy as np

from ..dynamics.params import LayerConfig, Layers, make_layers

_PER_HEAD = ("W_q", "W_k", "W_v")
_BIASES = ("b_q", "b_k", "b_v")
KNOWN = set(_PER_HEAD + _BIASES + ("W_o", "b_o", "scale", "window", "causal"))


def load_weights_npz(path: str, *, attention: str = "softmax", norm: str = "l2",
                     dtype=np.float32) -> Layers:
    """Read and validate a weights file; errors name the file and the key at fault."""
    if not os.path.isfile(path):
        raise ValueError(f"weights file {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({exc})") from exc
    unknown = sorted(set(data) - KNOWN)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; expected some of {sorted(KNOWN)}")
    for key in ("W_v", "W_o"):
        if key not in data:
            raise ValueError(f"{path}: required key {key!r} is missing")
    if attention == "softmax":
        for key in ("W_q", "W_k"):
            if key not in data:
                raise ValueError(f"{path}: key {key!r} is missing; it is required for --attention softmax "
                                 f"(it may be left out only for uniform or identity attention)")
    W_v = np.asarray(data["W_v"])
    if W_v.ndim not in (3, 4):
        raise ValueError(f"{path}: W_v must have shape (H, d_head, d) or (L, H, d_head, d), got {W_v.shape}")
    stacked = W_v.ndim == 4
    if not stacked:
        W_v = W_v[None]
    L, H, e, d = W_v.shape

    def get(key: str, per_layer_shape: tuple) -> Optional[np.ndarray]:
        if key not in data:
            return None
        a = np.asarray(data[key])
        if not np.issubdtype(a.dtype, np.number):
            raise ValueError(f"{path}: key {key!r} has non-numeric dtype {a.dtype}")
        want = ((L,) + per_layer_shape) if stacked else per_layer_shape
        if key in ("scale", "window") and a.ndim == 0:
            a = np.broadcast_to(a, (L,))
            want = (L,)
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"{path}: key {key!r} has shape {a.shape}, expected {want}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{path}: key {key!r} contains non-finite values (NaN or inf)")
        if not stacked and key not in ("scale", "window"):
            a = a[None]
        return a

    arrays = {
        "W_q": get("W_q", (H, e, d)), "W_k": get("W_k", (H, e, d)), "W_o": get("W_o", (d, H * e)),
        "b_q": get("b_q", (H, e)), "b_k": get("b_k", (H, e)), "b_v": get("b_v", (H, e)), "b_o": get("b_o", (d,)),
    }
    if not np.all(np.isfinite(W_v)):
        raise ValueError(f"{path}: key 'W_v' contains non-finite values (NaN or inf)")
    scale = get("scale", ())
    window = get("window", ())
    causal = bool(np.asarray(data["causal"]).item()) if "causal" in data else False
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=causal, norm=norm)
    cast = lambda a: None if a is None else np.asarray(a, dtype)
    return make_layers(cast(W_v), cast(arrays.pop("W_o")), W_q=cast(arrays.pop("W_q")), W_k=cast(arrays.pop("W_k")),
                       scale=None if scale is None else np.asarray(scale, dtype),
                       window=None if window is None else np.asarray(window, np.int32), config=cfg,
                       **{k: cast(v) for k, v in arrays.items()})


def save_weights_npz(path: str, layers: Layers) -> str:
    """Write ``layers`` in the documented format (with the layer axis)."""
    from ..io import _atomic
    arrays = {k: np.asarray(getattr(layers, k)) for k in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o",
                                                           "scale", "window") if getattr(layers, k) is not None}
    arrays["causal"] = np.asarray(layers.config.causal)
    return _atomic(path, lambda fh: np.savez(fh, **arrays))
