"""Build the system and initial tokens a ``simulate``/``spectrum`` command asks for."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..dynamics.params import Layers, check_steps
from ..dynamics.synthetic import parse_spectrum, sphere_tokens, synthetic_system
from ..models.npz import load_weights_npz


def build_system(args) -> Layers:
    """A ``Layers`` from ``--weights`` or from a named synthetic spectrum, with the schedule set."""
    dtype = np.float64 if getattr(args, "x64", False) else np.float32
    attention = getattr(args, "attention", None)
    norm = getattr(args, "norm", None) or ("l2" if getattr(args, "rule", "paper") == "paper" else "layernorm")
    if getattr(args, "weights", None):
        layers = load_weights_npz(args.weights, attention=attention, norm=norm, dtype=dtype)
    elif getattr(args, "spectrum", None):
        try:
            eigenvalues = parse_spectrum(args.spectrum)
        except ValueError as exc:
            raise ValueError(f"--spectrum: {exc}") from None
        layers = synthetic_system(eigenvalues, kind=args.kind, heads=args.heads, beta=args.beta,
                                  d=args.dim, seed=args.seed, dtype=dtype)
        layers = layers.replace(config=dataclasses.replace(layers.config, norm=norm))
    else:
        raise ValueError("give either --weights system.npz or --spectrum (a synthetic system)")
    steps = getattr(args, "steps", None)
    if steps is not None:
        check_steps(steps)
        if layers.n_unique > 1 and getattr(args, "shared_layer", None) is None:
            raise ValueError(f"--steps iterates one layer as a shared-weight system, but the weights have "
                             f"{layers.n_unique} layers: also give --shared-layer L")
        layers = layers.shared(getattr(args, "shared_layer", None) or 0, steps)
    return layers


def _open_init(path: str, d: int, *, mmap: bool) -> np.ndarray:
    """``--init x0.npy`` validated ((n, d) or (B, n, d)); with ``mmap`` only its header is read."""
    if not os.path.isfile(path):
        raise ValueError(f"--init file {path!r} does not exist")
    try:
        x = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--init {path}: not a readable .npy file ({exc})") from exc
    if x.ndim not in (2, 3) or x.shape[-1] != d:
        raise ValueError(f"--init {path}: expected shape (n, {d}) or (B, n, {d}), got {x.shape}")
    return x


def token_shape(args, d: int):
    """(B, n) of the initial tokens a command will use, before any of them is drawn or read."""
    if getattr(args, "init", None):
        shape = _open_init(args.init, d, mmap=True).shape
        return (shape[0] if len(shape) == 3 else 1), shape[-2]
    for flag in ("tokens", "batch"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag} must be positive, got {getattr(args, flag)}")
    return args.batch, args.tokens


def initial_tokens(args, d: int):
    """x0 from ``--init x0.npy`` ((n, d) or (B, n, d)) or ``--tokens N`` random unit tokens."""
    if getattr(args, "init", None):
        return np.asarray(_open_init(args.init, d, mmap=False))
    B, n = token_shape(args, d)
    rng = np.random.default_rng(args.seed + 1)
    if B == 1:
        return sphere_tokens(rng, n, d)
    return np.stack([sphere_tokens(rng, n, d) for _ in range(B)])
