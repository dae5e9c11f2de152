"""BLAS and XLA threads, and the CPU affinity XLA's thread pool is sized from.

* :func:`limit_blas_threads`: one OpenBLAS thread unless the user chose (every command).
* :func:`same_numbers_xla`: XLA without Eigen's intra-op threads, so that a sweep's numbers do
  not depend on how many processes computed them (``powerlens sweep``, ``reproduce``).
* :func:`single_threaded_main` and :func:`start_xla`: this process's XLA on one thread
  (``reproduce``'s main process, workers that fill the cores).
* :func:`worker_env`: the environment of N worker processes on one host.
"""
from __future__ import annotations

import os
import sys
from typing import List, Mapping, Optional

SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"
"""The XLA_FLAGS that turn off Eigen's intra-op threads: all of XLA's CPU threads in older
jaxlibs, only some in jax 0.10, whose backend sizes its thread pool (XNNPACK's, which runs the
dots) from the process's CPU affinity when it starts: :func:`start_xla` does that part."""

XLA_THREADS = "POWERLENS_XLA_THREADS"
"""The environment variable that asks :func:`start_xla` for one XLA thread ("1")."""

BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
"""The environment variables that set the BLAS threads (the user's choice wins)."""


def limit_blas_threads() -> None:
    """One BLAS thread unless the user chose otherwise (one of :data:`BLAS_THREADS` set).

    The dense eigen-decompositions run between XLA computations; OpenBLAS worker threads
    that keep spinning after a call then compete with XLA's own threads for the cores
    (measured here: 8x slower spectra on a busy 2-core machine). SciPy ships its own OpenBLAS,
    loaded only when scipy.linalg is first imported, after this runs: the environment
    variable reaches it (and the worker processes), ``threadpool_limits`` the libraries
    already loaded. (With the limit on NumPy's OpenBLAS only, SciPy's kept two spinning
    threads: ``reproduce --quick`` used 178 s of CPU in 100 s, against 158 s in 89 s.)
    The command line loads no BLAS before this runs, so there the variable is enough and
    threadpoolctl (its import and its scan of the loaded libraries) is left out.
    """
    if any(os.environ.get(name) for name in BLAS_THREADS):
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    if "numpy" not in sys.modules and "scipy" not in sys.modules:
        return
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=1, user_api="blas")
    except Exception:  # pragma: no cover - best effort
        pass


def chooses_threads(flags: str, env: Optional[Mapping] = None) -> bool:
    """Whether XLA_FLAGS ``flags``, or :data:`XLA_THREADS` in ``env``, already set XLA's CPU
    threads (the user's choice wins)."""
    return "multi_thread_eigen" in flags or XLA_THREADS in (env or {})


def same_numbers_xla(env: dict) -> bool:
    """Turn Eigen's intra-op threads off in the environment ``env`` (a dict, changed in place:
    :data:`SINGLE_THREAD_XLA` added to its XLA_FLAGS, read when a backend starts) unless the
    user's XLA_FLAGS or :data:`XLA_THREADS` chose XLA's threads already; whether it did. Only
    the command line applies it to ``os.environ`` (before the backend starts,
    :func:`~powerlens._src.dynamics.execution.backends_initialized`).

    ``powerlens sweep`` applies it in every process, one or many, so that a sweep's numbers do
    not depend on how many processes, and so how many threads each, computed them: with
    Eigen's threads on, XLA's CPU results changed in the last bits with the thread count
    (seen on an AMD EPYC family 25 machine with jax 0.10.2: 2 threads against 1 moved
    final_gamma by 2.4e-7, and mean_rho, a share of steps decided by near-ties, by 0.48);
    with them off, one process (two cores for the dots, which XNNPACK runs) and two
    single-threaded workers gave the same results.parquet, byte for byte. The ops that moved
    are the small batched dots (e.g. "f32[8 4 4]") that XLA runs through Eigen, not XNNPACK.
    The cost, one process on 2 cores, alternating runs: the test suite's 128-system sweep ran
    at 98-105 systems/s against 88 with Eigen's threads, a 256-system d = 64 sweep at 56-77
    against 61-81 (this machine's noise is as wide). From Python (``pl.sweep``), set
    ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` before JAX starts for the same guarantee."""
    flags = env.get("XLA_FLAGS", "")
    if chooses_threads(flags, env):
        return False
    env["XLA_FLAGS"] = (flags + " " + SINGLE_THREAD_XLA).strip()
    return True


def available_cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity`` where the platform has it)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:
        return max(os.cpu_count() or 1, 1)


def worker_env(n: int, cores: Optional[int] = None, base: Optional[Mapping] = None) -> dict:
    """The environment of N local workers on one CPU host: with N >= the cores, each worker's
    XLA runs single-threaded (:data:`SINGLE_THREAD_XLA` and :data:`XLA_THREADS` = 1, which
    :func:`start_xla` reads) and so does its BLAS (:data:`BLAS_THREADS` = 1 unless set), else
    every worker's thread pool would span all the cores and N workers would only share them
    (measured with jax 0.4: 2 workers on 2 cores were no faster than one process;
    single-threaded, 1.77x). The user's XLA_FLAGS thread choice, or their own
    :data:`XLA_THREADS`, win. ``cores``: default :func:`available_cores`. ``base``: the environment to
    start from (default ``os.environ``; it is copied, never changed). That the numbers do not
    change with the process count is :func:`same_numbers_xla`'s work, which every
    ``powerlens sweep`` process applies to its own environment."""
    env = dict(os.environ if base is None else base)
    if n >= (cores or available_cores()) and same_numbers_xla(env):     # SINGLE_THREAD_XLA, unless the user chose
        env[XLA_THREADS] = "1"
        for name in BLAS_THREADS:
            env.setdefault(name, "1")
    return env


def single_threaded_main(env: dict) -> bool:
    """Ask for this process's XLA on one thread before its CPU backend starts, in the
    environment ``env`` (a dict, changed in place; ``powerlens reproduce`` gives its own
    ``os.environ``): ``XLA_FLAGS`` += :data:`SINGLE_THREAD_XLA` and :data:`XLA_THREADS` = 1,
    which :func:`start_xla` acts on once the workers have started. True when that is set (or
    the user's XLA_FLAGS or XLA_THREADS already choose the threads, which then win); False
    when a backend had already started. The caller keeps a copy of the environment from
    before, for its workers (:func:`worker_env`'s ``base``).

    The numbers of reproduce's sections 1-4 depend, in the last bits, on XLA's thread settings
    (the model sections do not), so the same setting everywhere makes results.json the same
    bytes whatever ``--jobs`` and whatever the machine's cores; and while the workers keep the
    cores busy, threads here would only compete with them."""
    from ..dynamics.execution import backends_initialized
    if chooses_threads(env.get("XLA_FLAGS") or "", env):
        return True
    if backends_initialized():
        return False
    same_numbers_xla(env)                            # XLA_FLAGS += SINGLE_THREAD_XLA
    env[XLA_THREADS] = "1"
    return True


def start_xla(env: Optional[Mapping] = None) -> bool:
    """When ``env`` (default ``os.environ``) has :data:`XLA_THREADS` = 1, start this process's
    JAX backend now, on one CPU thread. jax 0.10's CPU backend sizes its thread pool from the
    CPU affinity at the moment it starts, and ignores the XLA flags that used to set it; so the
    process is held to one core while the backend starts, then every thread of it is given all
    of its cores back (a thread keeps the affinity it was born with): the one XLA thread then
    runs wherever the OS puts it. Measured on this project's 2-core machine, a 2048^3 matmul:
    CPU time / wall time 1.00 after this, 1.95 with ``--xla_cpu_multi_thread_eigen=false``.

    Called only by the entry points (``powerlens sweep``, ``powerlens reproduce`` and their
    workers). Returns True when XLA now runs one thread by this call; False when not asked, when a
    backend had already started (it keeps its threads), or where the OS has no CPU affinity
    (macOS, Windows: XLA keeps its threads there)."""
    env = os.environ if env is None else env
    if env.get(XLA_THREADS) != "1" or not hasattr(os, "sched_setaffinity"):
        return False
    from ..dynamics.execution import backends_initialized
    if backends_initialized():
        return False
    import jax
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        jax.devices()
    finally:
        # every thread, not only this one: the backend's threads were born with the one core
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, allowed)
            except OSError:                    # a thread that has ended since
                pass
    return True


def _threads() -> List[int]:
    """This process's thread ids (Linux: /proc/self/task; else this thread only, as 0)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
