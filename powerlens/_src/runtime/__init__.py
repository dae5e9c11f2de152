"""Process concerns, kept out of the library: what a ``powerlens`` process sets up about
itself before and while it computes.

    threads      BLAS and XLA threads, the CPU affinity XLA's thread pool is sized from,
                 the environment of worker processes
    cache        JAX's persistent compilation cache
    distributed  ``jax.distributed`` start-up and the TCP handshake before it
    workers      worker processes that end with their parent (process groups, signals,
                 PR_SET_PDEATHSIG), ``sweep --processes``, and workers' progress messages

Only the entry points import this package: :mod:`powerlens.cli`, :mod:`powerlens._src.commands`
and the worker entry point of ``reproduce`` (:mod:`powerlens._src.reproduce.workers`);
``tests/test_runtime_package.py`` checks it, and that no affinity, thread-count, compilation
cache or ``jax.distributed`` call sits anywhere else in the package. Importing a module here
imports no numerical library (each imports JAX where it needs it).
"""
