"""`powerlens sweep` over several processes (JAX's multi-controller runtime on 127.0.0.1):
the same results.parquet as one process, after a killed worker too, with a global mesh
too; an unreachable coordinator is a one-line error within --init-timeout."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from powerlens.cli import main
from powerlens._src.runtime import distributed
from test_sweep_engine import KILL

SPEC = KILL                   # the resume test's spec: one compilation (persistent cache) for both files
N_CHUNKS = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "spec.toml"
    path.write_text(SPEC)
    return str(path)


def _cmd(spec, out, *extra):
    return [sys.executable, "-m", "powerlens.cli", "sweep", spec, "--out", str(out), "--quiet", *extra]


def _run(cmd, env):
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory, spec, cache_env):
    """results.parquet of one process."""
    out = tmp_path_factory.mktemp("one") / "out"
    _run(_cmd(spec, out), cache_env)
    return (out / "results.parquet").read_bytes()


def test_two_processes_give_the_table_of_one(tmp_path, spec, cache_env, reference):
    done = _run(_cmd(spec, tmp_path / "two", "--processes", "2"), cache_env)
    assert "2 workers on 127.0.0.1:" in done.stdout and "2 processes" in done.stdout
    assert (tmp_path / "two" / "results.parquet").read_bytes() == reference


def test_a_killed_worker_restarted_gives_the_same_table(tmp_path, spec, cache_env, reference):
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(spec, out, "--processes", "2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cache_env)
    pids = [int(p) for p in re.search(r"pids (\d+) (\d+)", proc.stdout.readline()).groups()]
    chunks = out / ".chunks"
    deadline = time.time() + 120
    odd = lambda: [f for f in (os.listdir(chunks) if chunks.is_dir() else []) if re.search(r"c\d*[13579]\.json$", f)]
    while not odd() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None and odd(), "worker 1 finished before it could be killed"
    os.kill(pids[1], signal.SIGKILL)                  # a worker this test's launcher started
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "worker 1 was killed by signal 9" in err
    n_done = len(os.listdir(chunks))
    assert n_done < N_CHUNKS and not (out / "results.parquet").exists()

    done = _run(_cmd(spec, out, "--processes", "2"), cache_env)
    assert "resumed" in done.stdout and "0 resumed" not in done.stdout
    assert (out / "results.parquet").read_bytes() == reference


SMALL = SPEC.replace("replicates = 32", "replicates = 8").replace("steps = 300", "steps = 40").replace(
    "chunk_size = 16", "chunk_size = 8")
"""A smaller sweep for the global mesh, whose every step waits on both processes' devices
(gloo on a loaded 2-core machine can be slow): 4 chunks of 8 systems, 40 steps."""


def test_a_global_mesh_gives_the_numbers_of_one_process(tmp_path, cache_env):
    """Every chunk sharded over the devices of both processes (jax.make_mesh over all of them)."""
    assert SMALL != SPEC
    spec = tmp_path / "small.toml"
    spec.write_text(SMALL)
    _run(_cmd(str(spec), tmp_path / "one"), cache_env)
    _run(_cmd(str(spec), tmp_path / "global", "--processes", "2", "--global-mesh"), cache_env)
    assert (tmp_path / "global" / "results.parquet").read_bytes() == (tmp_path / "one" / "results.parquet").read_bytes()


def test_an_unreachable_coordinator_fails_within_the_timeout(tmp_path, spec, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                     # nothing listens there once closed
    t0 = time.monotonic()
    code = main(["sweep", spec, "--out", str(tmp_path / "x"), "--coordinator", f"127.0.0.1:{port}",
                 "--num-processes", "2", "--process-id", "1", "--init-timeout", "1.5"])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2 and elapsed < 5, (code, elapsed)
    assert len(err.splitlines()) == 1 and f"cannot reach the coordinator at 127.0.0.1:{port} within 1.5 s" in err


def test_settings_from_the_environment(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.from_environment() is None
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.from_environment() is None                    # one task: a plain single process
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.from_environment() == {}                      # jax.distributed detects the rest
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    with pytest.raises(ValueError, match="set JAX_NUM_PROCESSES and JAX_PROCESS_ID too"):
        distributed.from_environment()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert distributed.from_environment() == {"coordinator": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        distributed.split_address("nohost")


def test_local_workers_get_one_thread_each_when_they_fill_the_cores(monkeypatch):
    from powerlens._src.runtime.threads import XLA_THREADS, worker_env
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv(XLA_THREADS, raising=False)
    env = worker_env(2, cores=2)
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false" and env[XLA_THREADS] == "1"
    env = worker_env(2, cores=8)                                            # fewer workers than cores: untouched
    assert "XLA_FLAGS" not in env and XLA_THREADS not in env
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
    env = worker_env(4, cores=2)
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true" and XLA_THREADS not in env  # the user's choice wins
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv(XLA_THREADS, "0")
    assert worker_env(4, cores=2)[XLA_THREADS] == "0" and "XLA_FLAGS" not in worker_env(4, cores=2)


def test_same_numbers_xla_turns_eigens_threads_off_unless_the_user_chose():
    """`powerlens sweep` runs every process, one or many, without Eigen's intra-op threads:
    with them, XLA's results moved in the last bits with the thread count (one process against
    two single-threaded workers), and the parquet files of the tests above differed."""
    from powerlens._src.runtime.threads import XLA_THREADS, same_numbers_xla
    env = {"XLA_FLAGS": "--xla_dump_hlo_as_text"}
    assert same_numbers_xla(env) and env["XLA_FLAGS"] == "--xla_dump_hlo_as_text --xla_cpu_multi_thread_eigen=false"
    assert not same_numbers_xla(env) and env["XLA_FLAGS"].count("multi_thread_eigen") == 1     # once
    for chosen in ({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true"}, {XLA_THREADS: "0"}):
        before = dict(chosen)
        assert not same_numbers_xla(chosen) and chosen == before
    import jax
    from powerlens._src.dynamics.execution import backends_initialized
    jax.devices()                                   # this process's backend has started: too late, and
    assert backends_initialized()                   # `powerlens sweep` then leaves its environment alone


def test_start_xla_starts_the_backend_on_one_core_then_gives_the_cores_back(monkeypatch):
    """jax 0.10 sizes its CPU thread pool from the affinity when the backend starts: start_xla
    holds the process to one core exactly while jax.devices() starts it, then restores the set;
    it does nothing unless asked, or once a backend has started."""
    import jax
    from jax._src import xla_bridge
    from powerlens._src.runtime import threads
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(("set", set(cpus))))
    monkeypatch.setattr(jax, "devices", lambda: calls.append(("devices",)))
    monkeypatch.setattr(threads, "_threads", lambda: [0])
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert not threads.start_xla({}) and calls == []                          # not asked
    assert not threads.start_xla({threads.XLA_THREADS: "0"}) and calls == []
    assert threads.start_xla({threads.XLA_THREADS: "1"})
    assert calls == [("set", {0}), ("devices",), ("set", {0, 1, 2})]
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not threads.start_xla({threads.XLA_THREADS: "1"})              # too late: threads kept


def test_start_xla_in_a_fresh_process_keeps_every_core_for_the_os():
    """In a real process: the backend has started, and every thread of it (XLA's too) may run on
    all the process's cores."""
    from powerlens._src.runtime.threads import XLA_THREADS
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    code = ("import os; from powerlens._src.runtime.threads import start_xla; from jax._src import xla_bridge; "
            "before = os.sched_getaffinity(0); print(start_xla(), xla_bridge.backends_are_initialized(), "
            "all(os.sched_getaffinity(int(t)) == before for t in os.listdir('/proc/self/task')))")
    env = dict(os.environ, **{XLA_THREADS: "1"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]
