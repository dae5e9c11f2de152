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
    causal ()                             optional bool, or a 0/1 integer (default False)

Types are checked, never cast: the weights are real (float or integer) arrays, ``window``
holds integers in [0, 2**31 - 1]; complex, bool, string and object arrays are refused by name. Every
array's header is read first, and one that declares more than the memory available or
than the file holds is refused before anything is read.

Without a layer axis the file is one layer; ``--steps T`` then iterates it T times
as a shared-weight system. Initial tokens come separately (``--init x0.npy``, (n, d)
or (B, n, d)).
"""
from __future__ import annotations

import os
import zipfile
from typing import Dict, Optional, Tuple

import numpy as np

from ..dynamics.params import LayerConfig, Layers, make_layers
from ..dynamics.parts import Attention
from .convert import WINDOW_MAX
from .reader import CheckpointError, check_allocation, human_bytes, one_line

_PER_HEAD = ("W_q", "W_k", "W_v")
_BIASES = ("b_q", "b_k", "b_v")
KNOWN = set(_PER_HEAD + _BIASES + ("W_o", "b_o", "scale", "window", "causal"))
# dtype kinds each key accepts (f float, i/u integer, b bool); anything else is refused by name,
# never cast: complex would lose its imaginary part, bool and strings are not weights
_KINDS = dict({k: "fiu" for k in KNOWN}, window="iu", causal="biu")
_EXPECTED = {"fiu": "real numbers (float or integer)", "iu": "integers", "biu": "a bool (or a 0/1 integer)"}


def _npy_header(z: zipfile.ZipFile, member: str, path: str, key: str) -> Tuple[Tuple[int, ...], np.dtype, int]:
    """(shape, dtype, bytes of data held) of one ``.npy`` member, from its header alone."""
    fmt = np.lib.format
    try:
        with z.open(member) as fh:
            version = fmt.read_magic(fh)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f".npy format version {version} is not supported")
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(fh)
            held = z.getinfo(member).file_size - fh.tell()
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, RuntimeError) as exc:
        raise CheckpointError(f"{path}: key {key!r} is not a readable .npy array ({one_line(exc)})") from exc
    return tuple(int(n) for n in shape), dtype, held


def _check_header(path: str, key: str, shape, dtype: np.dtype, held: int) -> int:
    """The declared byte size of ``key``, once its dtype is one the key accepts and its size is
    both available in memory and actually held by the file."""
    kinds = _KINDS[key]
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in kinds:
        raise CheckpointError(f"{path}: key {key!r} has dtype {dtype}; expected {_EXPECTED[kinds]} "
                              f"(it is refused, not converted)")
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    check_allocation(nbytes, f"{path}: key {key!r} of shape {shape} {dtype}")
    if nbytes > held:
        raise CheckpointError(f"{path}: key {key!r} declares shape {shape} {dtype} ({human_bytes(nbytes)}) but the "
                              f"file holds only {human_bytes(held)} of it; the file is truncated or corrupt")
    return nbytes


def read_npz(path: str) -> Dict[str, np.ndarray]:
    """The arrays of a weights file. Every member's header is checked (known key, accepted
    dtype, declared size in memory and in the file) before any array is read."""
    if not os.path.isfile(path):
        raise CheckpointError(f"weights file {path!r} does not exist")
    try:
        with zipfile.ZipFile(path) as z:
            members = {(m[:-4] if m.endswith(".npy") else m): m for m in z.namelist()}
            unknown = sorted(set(members) - KNOWN)
            if unknown:
                raise CheckpointError(f"{path}: unknown key(s) {unknown}; expected some of {sorted(KNOWN)}")
            total = sum(_check_header(path, key, *_npy_header(z, m, path, key)) for key, m in members.items())
            check_allocation(total, f"{path}: the arrays of the file")
            return {key: _read_member(z, m, path, key) for key, m in members.items()}
    except (OSError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: not a readable .npz file ({one_line(exc)})") from exc


def _read_member(z: zipfile.ZipFile, member: str, path: str, key: str) -> np.ndarray:
    try:
        with z.open(member) as fh:
            return np.lib.format.read_array(fh, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot read key {key!r} ({one_line(exc)})") from exc


def _causal(path: str, data: Dict[str, np.ndarray]) -> bool:
    """``causal``: a scalar bool, or a 0/1 integer scalar."""
    if "causal" not in data:
        return False
    a = data["causal"]
    if a.shape != ():
        raise CheckpointError(f"{path}: key 'causal' must be a scalar (True/False), got shape {a.shape}")
    if a.dtype.kind != "b" and int(a) not in (0, 1):
        raise CheckpointError(f"{path}: key 'causal' is {int(a)}; expected a bool (or 0/1)")
    return bool(a)


def _check_window(path: str, window: Optional[np.ndarray]) -> None:
    """``window``: integers in [0, :data:`~powerlens._src.models.convert.WINDOW_MAX`] (windows are
    int32: a larger value would wrap around, 2**32 + 3 to 3, never be cast)."""
    if window is None or not window.size:
        return
    if int(window.min()) < 0:
        raise CheckpointError(f"{path}: key 'window' has the value {int(window.min())}; a local window is a "
                              f"number of keys >= 0 (0 = global attention)")
    if int(window.max()) > WINDOW_MAX:
        raise CheckpointError(f"{path}: key 'window' has the value {int(window.max())}, too large for a window "
                              f"(at most {WINDOW_MAX}; 0 = global attention)")


def _as_float(path: str, key: str, a: Optional[np.ndarray], dtype) -> Optional[np.ndarray]:
    """``a`` as ``dtype``; finite values that the cast would overflow to inf are an error."""
    if a is None:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(a, dtype)
    if not np.all(np.isfinite(out)):
        raise CheckpointError(f"{path}: key {key!r} has values up to {float(np.max(np.abs(a))):.3g}, beyond the "
                              f"{np.dtype(dtype)} range; use --x64 (float64) or rescale the weights")
    return out


def load_weights_npz(path: str | os.PathLike, *, attention: Optional[str] = "softmax", norm: str = "l2",
                     dtype=np.float32) -> Layers:
    """Read and validate a weights file; errors name the file and the key at fault.

    Types and values are checked, never cast: complex, bool, string or object arrays,
    a non-scalar or non-bool ``causal``, a negative or non-integer ``window`` are
    CheckpointErrors naming the key, and so is an array whose declared size exceeds the
    memory available or what the file holds (checked before it is read).
    """
    data = read_npz(path)
    for key in ("W_v", "W_o"):
        if key not in data:
            raise CheckpointError(f"{path}: required key {key!r} is missing")
    if attention == "softmax":
        for key in ("W_q", "W_k"):
            if key not in data:
                raise CheckpointError(f"{path}: key {key!r} is missing; it is required for --attention softmax "
                                      f"(it may be left out only for uniform or identity attention)")
    W_v = data["W_v"]
    if W_v.ndim not in (3, 4):
        raise CheckpointError(f"{path}: W_v must have shape (H, d_head, d) or (L, H, d_head, d), got {W_v.shape}")
    stacked = W_v.ndim == 4
    if not stacked:
        W_v = W_v[None]
    L, H, e, d = W_v.shape

    def get(key: str, per_layer_shape: tuple) -> Optional[np.ndarray]:
        if key not in data:
            return None
        a = data[key]
        want = ((L,) + per_layer_shape) if stacked else per_layer_shape
        if key in ("scale", "window") and a.ndim == 0:
            a = np.broadcast_to(a, (L,))
            want = (L,)
        if tuple(a.shape) != tuple(want):
            raise CheckpointError(f"{path}: key {key!r} has shape {a.shape}, expected {want}")
        if not np.all(np.isfinite(a)):
            raise CheckpointError(f"{path}: key {key!r} contains non-finite values (NaN or inf)")
        if not stacked and key not in ("scale", "window"):
            a = a[None]
        return a

    arrays = {
        "W_q": get("W_q", (H, e, d)), "W_k": get("W_k", (H, e, d)), "W_o": get("W_o", (d, H * e)),
        "b_q": get("b_q", (H, e)), "b_k": get("b_k", (H, e)), "b_v": get("b_v", (H, e)), "b_o": get("b_o", (d,)),
        "scale": get("scale", ()),
    }
    if not np.all(np.isfinite(W_v)):
        raise CheckpointError(f"{path}: key 'W_v' contains non-finite values (NaN or inf)")
    window = get("window", ())
    _check_window(path, window)
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=_causal(path, data), norm=norm)
    floats = {k: _as_float(path, k, v, dtype) for k, v in dict(arrays, W_v=W_v).items()}
    attn = Attention(window=None if window is None else np.asarray(window, np.int32), **floats)
    return make_layers(attn=attn, config=cfg)      # the paper's system: attention only, no norms, no FFN


def save_weights_npz(path: str | os.PathLike, layers: Layers) -> str | os.PathLike:
    """Write ``layers`` (its attention part: W_q, W_k, W_v, W_o, b_q, b_k, b_v, b_o, scale,
    window, and ``config.causal``) in the documented format, with the layer axis: the inverse of
    :func:`load_weights_npz` (``--weights``), so ``load_weights_npz(save_weights_npz(p, layers))``
    has the same arrays. Float arrays are written in at least float32 (bf16 and float16 widened,
    exactly); the file replaces ``path`` atomically. Returns ``path``.

    The format holds nothing else, so layers with more are refused, naming what the format
    cannot hold, never written without it: norms or an FFN (write ``layers.replace(norms=Norms(),
    ffn=None)`` for their attention alone), grouped-query attention (fewer key/value heads than
    query heads), RoPE, q/k norms, per-layer RoPE bases, attention soft-capping. The schedule is
    not stored: the file's layers are applied once each, or one layer is iterated with ``--steps``.
    """
    from ..dynamics.params import wide
    from ..io import atomic_write
    cfg = layers.config
    extra = [k for k in ("q_norm_scale", "k_norm_scale", "q_norm_bias", "k_norm_bias", "rope_base")
             if getattr(layers.attn, k) is not None] + sorted(layers.norms.arrays())
    if layers.ffn is not None:
        extra.append("the FFN (" + ", ".join(sorted(layers.ffn.arrays())) + ")")
    if cfg.n_kv_heads != cfg.n_heads:
        extra.append(f"grouped-query attention ({cfg.n_kv_heads} key/value heads for {cfg.n_heads} query heads)")
    if cfg.rope_theta is not None:
        extra.append("RoPE (config.rope_theta)")
    if cfg.attn_softcap is not None:
        extra.append("attention soft-capping (config.attn_softcap)")
    if extra:
        raise ValueError(f"save_weights_npz: {path}: the weights format holds attention layers only "
                         f"(W_q, W_k, W_v, W_o, biases, scale, window, causal); these layers also have "
                         f"{'; '.join(extra)}")
    arrays = {k: np.asarray(a) for k, a in layers.attn.arrays().items()}
    arrays = {k: a if a.dtype.kind in "iu" else a.astype(wide(a.dtype)) for k, a in arrays.items()}
    arrays["causal"] = np.asarray(cfg.causal)
    atomic_write(path, lambda fh: np.savez(fh, **arrays))
    return path
