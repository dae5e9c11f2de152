"""Several hosts: the start-up of a user's own multi-host script (public, like ``jax.distributed``).

A model over the devices of several hosts is one program run by every host (JAX's
multi-controller SPMD). Each process calls :func:`initialize` before anything else touches
JAX, then builds the same mesh (``pl.model_mesh``) and loads the same checkpoint::

    import powerlens.distributed
    powerlens.distributed.initialize()      # Slurm, Open MPI or JAX_COORDINATOR_ADDRESS / ...
    import powerlens as pl
    ...
    z = pl.host_array(pl.logits(model, hs[-1]))   # gathered on every process

Importing this module imports no numerical library.
"""
from __future__ import annotations

from ._src.runtime.distributed import initialize

__all__ = ["initialize"]
