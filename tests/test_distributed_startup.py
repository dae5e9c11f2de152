"""`powerlens sweep --coordinator ...` start-up: every mismatch between the processes is one
line naming the coordinator's address and what was expected, exit status 2, within about
--init-timeout (JAX's coordination service would abort the process, or wait for ever).

Every process runs on 127.0.0.1, is started by the test and killed by it if still running;
every wait is bounded."""
from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from powerlens.cli import main
from powerlens._src.runtime import distributed

pytestmark = pytest.mark.slow

SPEC = """
name = "startup"
seed = 0
[grid]
beta = [1.0]
[system]
d = 4
tokens = 4
replicates = 2
[run]
steps = 5
"""
WAIT = 90                                   # seconds a test waits for its processes, at most


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "spec.toml"
    path.write_text(SPEC)
    return str(path)


def _sweep(spec, out, address, n, i, timeout):
    cmd = [sys.executable, "-m", "powerlens.cli", "sweep", spec, "--out", str(out), "--quiet",
           "--coordinator", address, "--num-processes", str(n), "--process-id", str(i), "--init-timeout", str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1"))


@contextlib.contextmanager
def _started():
    """A list for the processes a test starts; those still running at the end are killed."""
    procs = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


def _outcome(proc, deadline):
    """(exit status, stderr lines) of ``proc``; status None if it still ran at ``deadline``."""
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None, [f"still running after {WAIT} s"]
    return proc.returncode, proc.stderr.read().strip().splitlines()


def _wait_until_listening(address, proc):
    """Until something accepts at ``address`` (this probe is dropped by a handshake), or ``proc`` ends."""
    host, port = distributed.split_address(address)
    for _ in range(WAIT * 10):
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                return
            threading.Event().wait(0.1)


def _address():
    return f"127.0.0.1:{distributed.free_port()}"


class _Listener:
    """Another program on the coordinator's port: it accepts, then says ``says`` (or nothing)
    and keeps the connection open until it is closed."""

    def __init__(self, says: bytes):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.says, self.conns = says, []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            while True:
                conn, _ = self.server.accept()
                self.conns.append(conn)
                if self.says:
                    conn.sendall(self.says)
        except OSError:                     # closed
            pass

    def close(self):
        try:
            self.server.shutdown(socket.SHUT_RDWR)          # wakes the accept (close alone does not)
        except OSError:
            pass
        for s in (self.server, *self.conns):
            s.close()
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def startups(spec, tmp_path_factory):
    """The start-ups the tests below check, all at once (each waits for its own processes,
    WAIT s at most): name -> (coordinator address, [(exit status, stderr lines) per process])."""
    tmp = tmp_path_factory.mktemp("startups")
    silent = _Listener(b"")
    plans = {"twice": (_address(), [(2, 0, 60)]),                     # a second process 0 joins below
             "alone": (_address(), [(2, 0, 1.5)]),
             "count": (_address(), [(3, 0, 60), (2, 1, 60)]),
             "foreign": (silent.address, [(2, 1, 1.5)])}
    try:
        with _started() as procs:
            runs = {}
            for name, (address, settings) in plans.items():
                runs[name] = [_sweep(spec, tmp / name, address, *s) for s in settings]
                procs.extend(runs[name])
            address, (first,) = plans["twice"][0], runs["twice"]
            _wait_until_listening(address, first)
            runs["twice"].append(_sweep(spec, tmp / "twice", address, 2, 0, 60))
            procs.append(runs["twice"][-1])
            deadline = time.monotonic() + WAIT
            return {name: (plans[name][0], [_outcome(p, deadline) for p in ps]) for name, ps in runs.items()}
    finally:
        silent.close()


def _one_error(outcome, *parts):
    code, lines = outcome
    assert code == 2 and len(lines) == 1, outcome
    assert lines[0].startswith("powerlens sweep: error: "), lines
    for part in parts:
        assert part in lines[0], (part, lines[0])


def test_process_0_alone_gives_up_after_the_timeout(startups):
    address, (alone,) = startups["alone"]
    _one_error(alone, f"--coordinator {address}: process 0 waited 1.5 s (--init-timeout) for process 1 "
                      "(--num-processes 2); process 1 did not join")


def test_another_process_count_stops_both(startups):
    address, outcomes = startups["count"]
    for outcome in outcomes:                # both told, long before their timeout
        _one_error(outcome, f"--coordinator {address}: process 1 was started with --num-processes 2, "
                            "process 0 with 3: expected the same --num-processes on every process")


def test_process_id_0_twice_stops_both(startups):
    address, (served, refused) = startups["twice"]
    _one_error(served, f"--coordinator {address}: two processes were started with --process-id 0: "
                       "expected each of 0 .. 1 on one process only")
    _one_error(refused, f"--coordinator {address}: another process 0 already serves it there: "
                        "expected --process-id 0 on one process only")


def test_process_1_against_another_program_on_the_port(startups):
    address, (outcome,) = startups["foreign"]
    _one_error(outcome, f"--coordinator {address}: what listens there did not answer within 1.5 s "
                        "(--init-timeout); expected a powerlens sweep's process 0")
    talking = _Listener(b"SSH-2.0-OpenSSH_9.6\r\n")                 # one that answers: refused at once
    try:
        with pytest.raises(ValueError, match=f"--coordinator {talking.address}: what listens there answered "
                                             "'SSH-2.0-OpenSSH_9.6'; expected a powerlens sweep's process 0"):
            distributed.rendezvous(talking.address, 2, 1, 20.0)
    finally:
        talking.close()


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_and_inf_timeouts_are_refused_not_waited_on(value):
    """Process 1 with nothing at the coordinator retries until its deadline: nan or inf never
    comes (run in a thread, so that a wait for ever fails this test after 10 s)."""
    failure = []

    def start():
        try:
            distributed.initialize(_address(), 2, 1, timeout=value)
        except ValueError as exc:
            failure.append(str(exc))

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and failure == [
        f"--init-timeout must be positive and at most 86400 seconds, got {value}"], failure


@pytest.mark.parametrize("value", ["0", "-2", "1e9", "nan", "inf", "-inf", "ten"])
def test_bad_timeouts_are_one_line_before_anything_starts(spec, tmp_path, capsys, value):
    with pytest.raises(ValueError, match=f"--init-timeout must be positive and at most 86400 seconds, got {value}"):
        distributed.check_init_timeout(value)
    if value == "ten":                      # argparse's own error (type=float)
        return
    assert main(["sweep", spec, "--out", str(tmp_path / "o"), f"--init-timeout={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"powerlens sweep: error: --init-timeout must be positive and at most 86400 seconds, got {float(value)}"
    assert not (tmp_path / "o").exists()
    assert distributed.check_init_timeout("2.5") == 2.5 and distributed.check_init_timeout(86400) == 86400.0


def test_the_handshake_drops_strangers_and_frees_the_place_of_a_process_that_left():
    """Process 0 (a thread here) takes in 1 and 2 although a port scanner and a process 1
    that disconnected came first; everyone returns the time left."""
    address, n = _address(), 3
    host, port = distributed.split_address(address)
    left = {}
    threads = [threading.Thread(target=lambda i=i: left.__setitem__(i, distributed.rendezvous(address, n, i, 20.0)),
                                daemon=True) for i in range(n)]
    threads[0].start()
    _wait_until_listening(address, None)
    scanner = socket.create_connection((host, port), timeout=5)
    scanner.sendall(b"GET / HTTP/1.0\r\n\r\n")
    assert scanner.recv(1024).startswith(b"powerlens-sweep error ")     # answered, then dropped
    scanner.close()
    with socket.create_connection((host, port), timeout=5) as quitter:
        quitter.sendall(b"powerlens-sweep 1 3 1\n")
        assert quitter.recv(1024) == b"powerlens-sweep ok\n"            # joined as 1, then leaves
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert sorted(left) == [0, 1, 2] and all(0 < s < 20 for s in left.values()), left


def test_a_process_id_given_twice_stops_process_0_and_both_others():
    address, n = _address(), 3
    host, port = distributed.split_address(address)
    failures = []

    def serve():
        try:
            distributed.rendezvous(address, n, 0, 20.0)
        except ValueError as exc:
            failures.append(str(exc))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    _wait_until_listening(address, None)
    replies = []
    with socket.create_connection((host, port), timeout=5) as one, \
            socket.create_connection((host, port), timeout=5) as again:
        one.sendall(b"powerlens-sweep 1 3 1\n")
        assert one.recv(1024) == b"powerlens-sweep ok\n"
        again.sendall(b"powerlens-sweep 1 3 1\n")
        for s in (one, again):
            replies.append(distributed._read_line(s, time.monotonic() + 5))
    thread.join(timeout=WAIT)
    message = (f"--coordinator {address}: two processes were started with --process-id 1: "
               "expected each of 0 .. 2 on one process only")
    assert failures == [message] and replies == [f"powerlens-sweep error {message}"] * 2, (failures, replies)


def test_a_process_that_fails_after_the_start_ends_at_once(spec, tmp_path):
    """A process of a started run that fails (here process 1, whose spec differs from the one
    process 0 marked the folder with) prints its one-line error and exits 2 at once: it does not
    run jax.distributed's exit handler, which would wait for process 0 for ever (the launcher
    of --processes then stops the others)."""
    other = tmp_path / "other.toml"
    other.write_text(SPEC.replace("steps = 5", "steps = 6"))
    address = _address()
    out = tmp_path / "out"
    with _started() as procs:
        procs.append(_sweep(spec, out, address, 2, 0, 30))
        procs.append(_sweep(str(other), out, address, 2, 1, 30))
        code, err = _outcome(procs[1], time.monotonic() + WAIT)
    assert code == 2, err
    assert len(err) == 1 and "different spec" in err[0] and "steps" in err[0], err


def test_leave_on_failure_does_nothing_in_a_single_process():
    distributed.leave_on_failure(3)           # no jax.distributed here: it returns
    assert main(["sweep", "/nonexistent/spec.toml", "--out", "/tmp/x"]) == 2
