"""Reference subspaces that the alignment observer measures the tokens against.

For every unique layer u there are m named references (design.md §3)::

    principal     S_u, the principal invariant subspace of F_u (in the chosen ordering)
    random        a uniformly random subspace of the same dimension      (control)
    other_layer   the principal subspace of another layer                 (control)

Each is an orthonormal basis zero-padded to a common width k; ``dim`` holds the true
dimension (0 = undefined: every measure against it is NaN). References are read by
name, never by position: ``subspaces.index("random")``.

Computing them needs the spectra (host-side, :func:`powerlens._src.analysis.spectra.reference_subspaces`);
this module only holds the container, so the scan does not depend on the analysis layer.
"""
from __future__ import annotations

import functools
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp
from . import struct

REFERENCES = ("principal", "random", "other_layer")


def reference_index(names: Tuple[str, ...], name: str) -> int:
    """Position of reference ``name`` in ``names`` (a clear error for an unknown one)."""
    if name not in names:
        raise KeyError(f"no reference subspace named {name!r}; these are {names}")
    return names.index(name)


@struct.dataclass
class Subspaces:
    """m named reference subspaces for each of U unique layers.

    Attributes:
      basis: "float[U m d k]" orthonormal columns, zero-padded to k.
      dim: "int[U m]" the true dimension of each basis (0 = undefined).
      names: static tuple of the m reference names (default :data:`REFERENCES`).
    """

    basis: jax.Array
    dim: jax.Array
    names: Tuple[str, ...] = struct.field(pytree_node=False, default=REFERENCES)

    def index(self, name: str) -> int:
        """Position of reference ``name`` on the m axis."""
        return reference_index(self.names, name)


def null_subspaces(layers) -> Subspaces:
    """One undefined reference (dim 0) per unique layer of ``layers`` (or a Model).

    Runs that only need states do not need this: give :func:`powerlens._src.dynamics.run` the
    ``states()`` or ``final()`` observer and no alignment is computed at all.
    """
    layers = getattr(layers, "layers", layers)
    U, d = layers.n_unique, layers.config.d_model
    return Subspaces(basis=jnp.zeros((U, 1, d, 1), layers.W_v.dtype), dim=jnp.zeros((U, 1), jnp.int32),
                     names=("none",))


def stack_subspaces(subs: Sequence[Subspaces]) -> Subspaces:
    """Stack the references of S systems along a new leading axis, padding k to the widest."""
    names = {s.names for s in subs}
    if len(names) != 1:
        raise ValueError(f"stack_subspaces needs subspaces with the same reference names, got {sorted(names)}")
    k = max(int(s.basis.shape[-1]) for s in subs)
    basis, dim = _stack_padded(tuple(s.basis for s in subs), tuple(s.dim for s in subs), k=k)
    return Subspaces(basis=basis, dim=dim, names=names.pop())


@functools.partial(jax.jit, static_argnames=("k",))
def _stack_padded(bases, dims, *, k: int):
    pad = lambda b: jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, k - b.shape[-1])])
    return jnp.stack([pad(b) for b in bases]), jnp.stack(dims)
