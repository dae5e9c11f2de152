"""Many processes, one sweep: JAX's own multi-controller runtime (``jax.distributed``).

* :func:`initialize` starts this process's part: from an explicit coordinator
  (``--coordinator HOST:PORT --num-processes N --process-id I``) or from what
  ``jax.distributed.initialize`` detects (Slurm, Open MPI, or ``JAX_COORDINATOR_ADDRESS``
  with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``). Cross-process collectives on CPUs use
  gloo (``jax_cpu_collectives_implementation``, the default since jax 0.5.1, set anyway).
  A coordinator that cannot be reached is a ValueError naming its address within
  ``timeout`` seconds (JAX itself would abort the process after its own timeout).
* :func:`spawn` is ``--processes N``: it starts N local workers on 127.0.0.1 itself
  (``python -m powerlens.cli sweep ... --process-id i``), watches them, and stops them all
  when one fails (finished chunks are kept: the same command resumes).

How the work is divided is the engine's business (:mod:`powerlens.sweeps.engine`):
chunk j goes to process j mod N, each process writes its chunks into the shared folder,
process 0 merges after a barrier.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def use_gloo() -> None:
    """Cross-process collectives on CPU devices through gloo (before any backend starts)."""
    import jax
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # pragma: no cover - a jax without the option: gloo is built in
        pass


def split_address(address: str):
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {address!r}: expected HOST:PORT, e.g. 10.0.0.1:12345")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout: float) -> float:
    """Connect to HOST:PORT until it answers; the seconds left of ``timeout``, or a
    ValueError naming the address when it never does."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return max(deadline - time.monotonic(), 1.0)
        except OSError:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the coordinator at {address} within {timeout:g} s "
                                 f"(--init-timeout): is process 0 running there, and is the port open?") from None
            time.sleep(0.1)


def check_bindable(address: str) -> None:
    """Process 0 serves the coordinator at ``address``: it must be this host's, and free."""
    host, port = split_address(address)
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise ValueError(f"--coordinator {address}: process 0 cannot serve it here ({exc.strerror}); "
                         f"give an address of this host and a free port") from None


def from_environment() -> Optional[dict]:
    """The distributed settings the environment gives (None for a single process)."""
    env = os.environ
    if env.get(ENV_ADDRESS):
        count, pid = env.get(ENV_COUNT), env.get(ENV_ID)
        if count is None or pid is None:
            raise ValueError(f"{ENV_ADDRESS} is set: set {ENV_COUNT} and {ENV_ID} too")
        return {"coordinator": env[ENV_ADDRESS], "num_processes": int(count), "process_id": int(pid)}
    for count in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(count, "1") or 1) > 1:
            return {}                           # jax.distributed.initialize detects the rest
    return None


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, timeout: float = 60.0) -> bool:
    """Start this process's part of a multi-process sweep; False if there is only one process."""
    import jax
    explicit = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    given = [k for k, v in explicit.items() if v is not None]
    if given and len(given) < 3:
        missing = [k for k in explicit if k not in given]
        raise ValueError(f"{', '.join(given)} needs {' and '.join(missing)} too")
    settings = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id} \
        if given else from_environment()
    if settings is None:
        return False
    if timeout <= 0:
        raise ValueError(f"--init-timeout must be positive, got {timeout}")
    use_gloo()
    if not settings:                            # Slurm / Open MPI: one process per host sees all its devices
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
        kw = {"local_device_ids": []} if per_node == "1" else {}
        jax.distributed.initialize(initialization_timeout=int(timeout), **kw)
        start_xla()
        return True
    n, i, address = int(settings["num_processes"]), int(settings["process_id"]), settings["coordinator"]
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--process-id {i} must lie in [0, --num-processes {n})")
    if n == 1:
        return False
    if i == 0:
        check_bindable(address)
        left = timeout
    else:
        left = wait_for_coordinator(address, timeout)
    jax.distributed.initialize(address, n, i, initialization_timeout=max(int(left), 1))
    start_xla()                                 # after jax.distributed: one thread when worker_env asked
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false"
"""The XLA_FLAGS that turn off Eigen's intra-op threads: all of XLA's CPU threads in older
jaxlibs, only some in jax 0.10, whose backend sizes its thread pool (XNNPACK's, which runs the
dots) from the process's CPU affinity when it starts: :func:`start_xla` does that part."""

XLA_THREADS = "POWERLENS_XLA_THREADS"
"""The environment variable that asks :func:`start_xla` for one XLA thread ("1")."""


def chooses_threads(flags: str, env: Optional[dict] = None) -> bool:
    """Whether XLA_FLAGS ``flags``, or :data:`XLA_THREADS` in ``env``, already set XLA's CPU
    threads (the user's choice wins)."""
    return "multi_thread_eigen" in flags or XLA_THREADS in (env or {})


def worker_env(n: int, cores: Optional[int] = None, base: Optional[dict] = None) -> dict:
    """The environment of N local workers on one CPU host: with N >= the cores, each worker's
    XLA runs single-threaded (:data:`SINGLE_THREAD_XLA` and :data:`XLA_THREADS` = 1, which
    :func:`start_xla` reads), else every worker's thread pool would span all the cores and N
    workers would only share them (measured with jax 0.4: 2 workers on 2 cores were no faster
    than one process; single-threaded, 1.77x). The user's XLA_FLAGS thread choice, or their
    own :data:`XLA_THREADS`, win. ``base``: the environment to start from (default
    ``os.environ``). That the numbers do not change with the process count is
    :func:`same_numbers_xla`'s work, which every ``powerlens sweep`` process calls."""
    env = dict(os.environ if base is None else base)
    cores = cores or os.cpu_count() or 1
    if n >= cores and same_numbers_xla(env):                # SINGLE_THREAD_XLA, unless the user chose
        env[XLA_THREADS] = "1"
    return env


def same_numbers_xla(env: Optional[dict] = None) -> bool:
    """Turn Eigen's intra-op threads off (:data:`SINGLE_THREAD_XLA` added to ``env``'s
    XLA_FLAGS, default ``os.environ``, read when the backend starts) unless the user's XLA_FLAGS
    or :data:`XLA_THREADS` chose XLA's threads already, or (``env`` None) this process's
    backend has started; whether it did.

    ``powerlens sweep`` calls it in every process, one or many, so that a sweep's numbers do
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
    if env is None:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():       # too late for this process: left as it is
            return False
        env = os.environ
    flags = env.get("XLA_FLAGS", "")
    if chooses_threads(flags, env):
        return False
    env["XLA_FLAGS"] = (flags + " " + SINGLE_THREAD_XLA).strip()
    return True


def start_xla(env: Optional[dict] = None) -> bool:
    """When ``env`` (default ``os.environ``) has :data:`XLA_THREADS` = 1, start this process's
    JAX backend now, on one CPU thread. jax 0.10's CPU backend sizes its thread pool from the
    CPU affinity at the moment it starts, and ignores the XLA flags that used to set it; so the
    process is held to one core while the backend starts, then every thread of it is given all
    of its cores back (a thread keeps the affinity it was born with): the one XLA thread then
    runs wherever the OS puts it. Measured on this project's 2-core machine, a 2048^3 matmul:
    CPU time / wall time 1.00 after this, 1.95 with ``--xla_cpu_multi_thread_eigen=false``.

    Returns True when XLA now runs one thread by this call; False when not asked, when a
    backend had already started (it keeps its threads), or where the OS has no CPU affinity
    (macOS, Windows: XLA keeps its threads there)."""
    env = os.environ if env is None else env
    if env.get(XLA_THREADS) != "1" or not hasattr(os, "sched_setaffinity"):
        return False
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
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


def spawn(argv: Sequence[str], n: int, *, quiet_others: bool = True) -> int:
    """``--processes N``: run ``powerlens sweep ARGV`` as N local workers; their exit status.

    Worker 0 serves the coordinator on a free 127.0.0.1 port. When a worker fails the
    others are stopped and the first failure's status returned.
    """
    port = free_port()
    procs: List[subprocess.Popen] = []
    env = worker_env(n)
    for i in range(n):
        cmd = [sys.executable, "-m", "powerlens.cli", "sweep", *argv, "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(n), "--process-id", str(i)]
        if quiet_others and i > 0:
            cmd.append("--quiet")
        procs.append(subprocess.Popen(cmd, env=env))
    print(f"powerlens sweep: {n} workers on 127.0.0.1:{port}, pids {' '.join(str(p.pid) for p in procs)}",
          flush=True)
    failed = None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            time.sleep(0.1)
        failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), failed)
    except KeyboardInterrupt:
        failed = -1
    if failed is not None:
        _stop(procs)
        if failed >= 0:
            code = procs[failed].returncode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            print(f"powerlens sweep: worker {failed} {how}; the others were stopped. Finished chunks are kept: "
                  f"run the same command again to resume", file=sys.stderr, flush=True)
            return code if code > 0 else 1
        return 130
    return 0


def _stop(procs: List[subprocess.Popen]) -> None:
    """Stop the workers still running (by pid, the ones this launcher started)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
