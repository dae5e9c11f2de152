"""Many processes, one sweep: the start-up of JAX's own multi-controller runtime
(``jax.distributed``).

* :func:`initialize` starts this process's part: from an explicit coordinator
  (``--coordinator HOST:PORT --num-processes N --process-id I``) or from what
  ``jax.distributed.initialize`` detects (Slurm, Open MPI, or ``JAX_COORDINATOR_ADDRESS``
  with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``). Cross-process collectives on CPUs use
  gloo (``jax_cpu_collectives_implementation``, the default since jax 0.5.1, set anyway).
  Before JAX starts, the processes meet at the coordinator's address over a plain TCP
  handshake (:func:`rendezvous`): a process missing, another ``--num-processes``, a
  ``--process-id`` given twice or another program on the port, on which JAX's coordination
  service would abort the process, is a ValueError naming the address and what was expected,
  within about ``--init-timeout`` seconds.

``--processes N`` (N local workers) is :func:`powerlens._src.runtime.workers.spawn`. How the work
is divided is the sweep engine's business (:mod:`powerlens._src.sweeps.engine`): chunk j goes to
process j mod N, each process writes its chunks into the shared folder, process 0 merges
after a barrier.
"""
from __future__ import annotations

import errno
import math
import os
import selectors
import socket
import sys
import time
from typing import Optional

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def use_gloo() -> None:
    """Cross-process collectives on CPU devices through gloo (before any backend starts)."""
    import jax
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # pragma: no cover - a jax without the option: gloo is built in
        pass


MAX_INIT_TIMEOUT = 86400.0
"""The longest ``--init-timeout`` accepted, in seconds (a day)."""


def check_init_timeout(seconds) -> float:
    """``--init-timeout``: a number of seconds in (0, :data:`MAX_INIT_TIMEOUT`], returned as a
    float; anything else (0, negative, nan, inf, not a number) is a ValueError naming the option.
    nan and inf would otherwise wait for ever."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = math.nan
    if not 0 < value <= MAX_INIT_TIMEOUT:           # False for nan
        raise ValueError(f"--init-timeout must be positive and at most {MAX_INIT_TIMEOUT:g} seconds, "
                         f"got {seconds}")
    return value


# ------------------------------------------------------------------ the start-up handshake
#
# Before jax.distributed.initialize, whose coordination service aborts the whole process (a
# C++ CHECK, SIGABRT) when the processes do not match, they meet over a plain TCP socket at
# the coordinator's address: process 0 listens there, every other process sends one line
#     powerlens-sweep 1 N I
# and process 0 answers "powerlens-sweep ok", then "powerlens-sweep go" once processes
# 1 .. N-1 have all joined (having closed its listener, so that JAX's coordinator can take the
# port), or "powerlens-sweep error MESSAGE" to every process when one of them does not fit.
# Only then does JAX start, with the time left: the settings it would abort on were checked.

HANDSHAKE = "powerlens-sweep"
PROTOCOL = "1"
LINE_MAX = 1024                                     # bytes in one handshake line, at most


def split_address(address: str):
    """(host, port) of ``HOST:PORT`` (an IPv6 host in brackets); a ValueError naming --coordinator."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {address!r}: expected HOST:PORT, e.g. 10.0.0.1:12345")
    return host.strip("[]"), int(port)


def _family(host: str):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _processes(ids) -> str:
    ids = list(ids)
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(str(i) for i in ids)


def _send(sock: socket.socket, *words) -> None:
    """One handshake line (best effort: a peer that has gone is not an error here); the
    socket's blocking mode is left as it was."""
    before = sock.gettimeout()
    try:
        sock.settimeout(1.0)
        sock.sendall((" ".join((HANDSHAKE,) + tuple(str(w) for w in words)) + "\n").encode())
    except OSError:
        pass
    finally:
        try:
            sock.settimeout(before)
        except OSError:
            pass


def _read_line(sock: socket.socket, deadline: float) -> Optional[str]:
    """The next line from ``sock`` (without its newline; the bytes after it are left unread, for
    the next call): None when nothing came before ``deadline`` (time.monotonic), '' when the
    other side closed first, what came so far when that is longer than :data:`LINE_MAX`."""
    data = b""
    while not data.endswith(b"\n") and len(data) < LINE_MAX:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            ahead = sock.recv(LINE_MAX - len(data), socket.MSG_PEEK)
            end = ahead.find(b"\n") + 1 or len(ahead)
            chunk = sock.recv(end) if ahead else b""
        except socket.timeout:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


def _reply(line: Optional[str]):
    """A handshake reply: ("ok" | "go" | "error", text), or (None, what came instead)."""
    words = (line or "").split(" ", 2)
    if len(words) >= 2 and words[0] == HANDSHAKE and words[1] in ("ok", "go", "error"):
        return words[1], words[2] if len(words) > 2 else ""
    return None, line


def _hello(line: str):
    """(N, I) from a joining process's line, or None when it is not one."""
    words = line.split()
    if len(words) == 4 and words[:2] == [HANDSHAKE, PROTOCOL] and all(w.isdigit() for w in words[2:]):
        return int(words[2]), int(words[3])
    return None


def _not_process_0(address: str, what: str) -> ValueError:
    return ValueError(f"--coordinator {address}: {what}; expected a powerlens sweep's process 0 waiting for its "
                      f"processes (another program on that port, or a sweep there that has started already?)")


def _join(address: str, n: int, i: int, timeout: float, deadline: float) -> None:
    """Process ``i`` > 0: connect to process 0 at ``address`` (retrying until it listens) and
    wait for its go; a ValueError naming the address when it never answers, answers as no
    powerlens process 0 would, or finds the processes' settings do not fit."""
    host, port = split_address(address)
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise ValueError(f"cannot reach the coordinator at {address} within {timeout:g} s "
                                 f"(--init-timeout): is process 0 running there, and is the port open?") from None
            time.sleep(0.1)
    with sock:
        _send(sock, PROTOCOL, n, i)
        line = _read_line(sock, deadline)
        kind, text = _reply(line)
        if kind is None:
            what = (f"what listens there did not answer within {timeout:g} s (--init-timeout)" if line is None else
                    "what listens there closed the connection without answering" if not line else
                    f"what listens there answered {line[:60]!r}")
            raise _not_process_0(address, what)
        if kind == "ok":
            line = _read_line(sock, deadline)
            kind, text = _reply(line)
            if line is None:
                raise ValueError(f"--coordinator {address}: process 0 answered, but not all of the {n} processes "
                                 f"(--num-processes) joined within {timeout:g} s (--init-timeout)")
            if kind is None:
                raise ValueError(f"--coordinator {address}: process 0 closed the connection before the "
                                 f"{n} processes (--num-processes) had all joined; see its output")
        if kind == "error":
            raise ValueError(text)
        if kind != "go":
            raise _not_process_0(address, f"what listens there answered {line[:60]!r}")


def _listen_everywhere(port: int, backlog: int) -> socket.socket:
    """A socket listening on ``port`` of every interface, IPv6 and IPv4 where the host has both."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=backlog)
        except OSError as exc:                      # IPv6 turned off at run time: IPv4 only
            if exc.errno == errno.EADDRINUSE:
                raise
    return socket.create_server(("", port), backlog=backlog)


def _listen(address: str, n: int) -> socket.socket:
    """Process 0's handshake listener on ``address``'s port, on every interface (where JAX's
    coordinator binds next: ``[::]:PORT``); a ValueError when this host cannot serve it (not
    its address, or the port taken: by another process 0 too, which is then told)."""
    host, port = split_address(address)

    def cannot(why):
        return ValueError(f"--coordinator {address}: process 0 cannot serve it here ({why}); "
                          f"give an address of this host and a free port")

    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as own:
            own.bind((host, 0))                     # an address of this host (any port)
    except OSError as exc:
        raise cannot(exc.strerror) from None
    try:
        return _listen_everywhere(port, backlog=max(n, 16))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise cannot(exc.strerror) from None
    # the port is taken: by a powerlens process 0 (then --process-id 0 was given twice) or another program
    line = None
    try:
        with socket.create_connection((host, port), timeout=2.0) as probe:
            _send(probe, PROTOCOL, n, 0)
            line = _read_line(probe, time.monotonic() + 2.0)
    except OSError:
        pass
    if _reply(line)[0] is not None:
        raise ValueError(f"--coordinator {address}: another process 0 already serves it there: "
                         f"expected --process-id 0 on one process only")
    raise cannot("the port is taken by another program")


def _serve(address: str, n: int, timeout: float, deadline: float) -> None:
    """Process 0: take in processes 1 .. ``n``-1 at ``address``, then tell them all to go. A
    ValueError naming the address (and told to every process that joined) when one of them
    was given another --num-processes or a --process-id already taken, or when some have not
    joined by ``deadline``. A connection that does not speak the handshake is answered and
    dropped; a process that disconnects before the go leaves its place free."""
    listener = _listen(address, n)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    joined = {}                                     # process id -> its socket
    pending = {}                                    # socket -> the bytes of its line so far

    def drop(sock):
        selector.unregister(sock)
        pending.pop(sock, None)
        for pid in [p for p, s in joined.items() if s is sock]:
            del joined[pid]
        sock.close()

    def fail(message, *others):
        for sock in (*joined.values(), *others):
            _send(sock, "error", message)
        for sock in others:
            sock.close()
        raise ValueError(message)

    try:
        while len(joined) < n - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [p for p in range(1, n) if p not in joined]
                fail(f"--coordinator {address}: process 0 waited {timeout:g} s (--init-timeout) for "
                     f"{_processes(range(1, n))} (--num-processes {n}); {_processes(missing)} did not join")
            for key, _ in selector.select(left):
                sock = key.fileobj
                if sock is listener:
                    try:
                        conn, _ = listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    selector.register(conn, selectors.EVENT_READ)
                    pending[conn] = b""
                    continue
                try:
                    chunk = sock.recv(LINE_MAX)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if sock not in pending:             # a joined process: it may only leave
                    if not chunk:
                        drop(sock)
                    continue
                data = pending[sock] + chunk
                if chunk and b"\n" not in data and len(data) <= LINE_MAX:
                    pending[sock] = data
                    continue
                hello = _hello(data.split(b"\n", 1)[0].decode("utf-8", "replace"))
                if hello is None:                   # not a powerlens process: answered and dropped
                    _send(sock, "error", f"--coordinator {address}: expected the line "
                                         f"'{HANDSHAKE} {PROTOCOL} N I' of a powerlens sweep's process")
                    drop(sock)
                    continue
                del pending[sock]
                m, pid = hello
                if m != n:
                    fail(f"--coordinator {address}: process {pid} was started with --num-processes {m}, "
                         f"process 0 with {n}: expected the same --num-processes on every process", sock)
                if pid >= n:                        # not from a powerlens process, which checks its own
                    fail(f"--coordinator {address}: a process was started with --process-id {pid}: "
                         f"expected one of 0 .. {n - 1} (--num-processes {n})", sock)
                if pid == 0 or pid in joined:
                    fail(f"--coordinator {address}: two processes were started with --process-id {pid}: "
                         f"expected each of 0 .. {n - 1} on one process only", sock)
                joined[pid] = sock
                _send(sock, "ok")
        listener.close()                            # JAX's coordinator takes the port next
        for sock in joined.values():
            _send(sock, "go")
    finally:
        selector.close()
        for sock in (listener, *pending, *joined.values()):
            sock.close()


def rendezvous(address: str, n: int, i: int, timeout: float) -> float:
    """Meet the other ``n``-1 processes at ``address`` before JAX's distributed runtime starts
    (the handshake above); the seconds left of ``timeout``. Every mismatch JAX would abort on
    (a process missing, another --num-processes, a --process-id given twice, something else
    listening at the address) is instead a one-line ValueError naming the address and what was
    expected, within about ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    if i == 0:
        _serve(address, n, timeout, deadline)
    else:
        _join(address, n, i, timeout, deadline)
    return deadline - time.monotonic()


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


def leave_on_failure(status: int) -> None:
    """End this process now, with ``status``, if it is a started process of a multi-process
    run (``jax.distributed``); otherwise do nothing.

    A process that failed must not run Python's exit handlers: jax.distributed's waits at a
    shutdown barrier for every other process, and they wait for this one at their next
    collective, so the run would hang until killed instead of ending with the failure (the
    launcher of ``--processes`` stops the others when one exits). The standard streams are
    flushed first, so the one-line error is seen."""
    if "jax" not in sys.modules:
        return
    try:
        from jax._src.distributed import global_state
        started = global_state.client is not None
    except Exception:                           # another jax: no way to tell, exit as usual
        return
    if started:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)


JAX_MIN_TIMEOUT = 5
"""The fewest seconds JAX's own start-up gets after the handshake (a slow start is not a
failure: the handshake already found every process there)."""


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, timeout: float = 60.0) -> bool:
    """Start this process's part of a multi-process run (a sweep, or a user's own multi-host
    script: public as ``powerlens.distributed.initialize``); False if there is only one process.
    The command line starts XLA after it, with :func:`powerlens._src.runtime.threads.start_xla`.

    With a coordinator (given, or from ``JAX_COORDINATOR_ADDRESS``), the processes first meet
    at its address (:func:`rendezvous`), so that a mismatch is a ValueError naming the address
    within about ``timeout`` seconds rather than an abort inside JAX."""
    explicit = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    given = [k for k, v in explicit.items() if v is not None]
    if given and len(given) < 3:
        missing = [k for k in explicit if k not in given]
        raise ValueError(f"{', '.join(given)} needs {' and '.join(missing)} too")
    settings = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id} \
        if given else from_environment()
    if settings is None:
        return False
    timeout = check_init_timeout(timeout)
    import jax
    if not settings:                            # Slurm / Open MPI: one process per host sees all its devices
        use_gloo()
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
        kw = {"local_device_ids": []} if per_node == "1" else {}
        jax.distributed.initialize(initialization_timeout=math.ceil(timeout), **kw)
        return True
    n, i, address = int(settings["num_processes"]), int(settings["process_id"]), settings["coordinator"]
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--process-id {i} must lie in [0, --num-processes {n})")
    if n == 1:
        return False
    split_address(address)
    left = rendezvous(address, n, i, timeout)
    use_gloo()
    try:
        jax.distributed.initialize(address, n, i, initialization_timeout=max(math.ceil(left), JAX_MIN_TIMEOUT))
    except Exception as exc:                    # what JAX raises rather than aborts on
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"--coordinator {address}: JAX's distributed runtime did not start "
                         f"(process {i} of --num-processes {n}): {first}") from None
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
