"""What the compiled program measures for one system: one call of :func:`powerlens.run`.

``measure(systems, static)`` runs the system's schedule from x0 with the one bundle of a
measured run, :func:`~powerlens._src.dynamics.observers.run_observers` (``alignment``, ``consensus``,
``finite``, ``final``), and the tangent observers ``mean_tangent`` and ``plane_angle`` as its
extras, and returns the raw per-system outputs that :mod:`powerlens._src.sweeps.columns` reduces to
one row (T steps, n tokens, d width)::

    consensus      "float[T+1]"   mu(X_t)
    finite         "bool[T+1]"    every valid token of X_t finite and non-zero (the scan's own
                                  ``finite`` observer): a row measured on a non-finite state
                                  reports no numbers
    gamma, rho     "float[T]"     against the principal reference
    rotation       "float[T]"     angle step in the principal plane (NaN unless a complex pair)
    direction_tan  "float[T+1]"   tan of the angle between the token mean and the shifted
                                  principal subspace
    top2_tan       "float[T+1]"   the same for the principal + next eigenvalue group (if given)
    final          "float[n d]"   x_T
    exact_step     "float[n d]"   one step from the exact bipartite start (if given)
    plane_angle    "float[T+1 n]" each token's angle in the principal plane (series only)
"""
from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp

from ..dynamics.observers import final, mean_tangent, plane_angle, run_observers
from ..dynamics.options import Dynamics
from ..dynamics.run import run
from .systems import Static, Systems


def measure(sy: Systems, st: Static) -> Dict[str, jax.Array]:
    """The raw outputs of one system (module docstring); the spectral facts of ``sy`` that
    are set (lam, dim, v1) pass through."""
    dynamics = Dynamics(st.rule, st.attention, st.keep_bias or None)
    extras = {"direction_tan": mean_tangent(sy.direction)}
    if sy.top2 is not None:
        extras["top2_tan"] = mean_tangent(sy.top2)
    principal = sy.subspaces.index("principal")
    if "plane_angle" in st.series and sy.subspaces.basis.shape[-1] >= 2:
        extras["plane_angle"] = plane_angle(sy.subspaces.basis[0, principal])
    out = run(sy.layers, sy.x0, sy.valid, dynamics=dynamics,
              observers=run_observers(sy.subspaces, extras=extras))
    a = out.pop("alignment")
    raw = {"consensus": out.pop("consensus").consensus, "gamma": a.gamma[:, principal],
           "rho": a.rho[:, principal], "rotation": a.rotation, **out, "valid": sy.valid}
    if sy.x0_exact is not None:
        one = run(sy.layers, sy.x0_exact, sy.valid, dynamics=dynamics,
                  observers={"final": final()}, schedule=jnp.zeros((1,), jnp.int32))
        raw["exact_step"] = one["final"]
    for name in ("lam", "dim", "v1"):
        if getattr(sy, name) is not None:
            raw[name] = getattr(sy, name)
    return raw
