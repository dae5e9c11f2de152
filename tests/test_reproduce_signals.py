"""Workers end with their parent (issue 43, item 7), and report what they do (issue 46, item 1).

`powerlens reproduce` and `powerlens sweep --processes N` are started as real processes, each
the leader of its own process group (as a shell starts a job); once their workers exist they
get SIGTERM, Ctrl-C (SIGINT to the group, as a terminal sends it) or SIGKILL. Afterwards no
process that descended from them, or sits in their process group or a worker's, survives
(read from /proc: ppid, pgid and start time of every process). An interrupted run resumes
without losing the chunks it finished.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")


# ------------------------------------------------------------------ /proc

def _procs() -> dict:
    """pid -> (ppid, pgid, start time) of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", encoding="utf-8", errors="replace") as fh:
                stat = fh.read()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()          # fields 3.. (after "pid (comm)")
        out[int(d)] = (int(rest[1]), int(rest[2]), int(rest[19]))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _descendants(root: int, procs: dict) -> dict:
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, info in procs.items():
            if info[0] == parent and pid not in found:
                found[pid] = info
                frontier.append(pid)
    return found


def _survivors(root: int, children: dict) -> set:
    """Processes still alive among ``children`` (same pid and start time), or in the process
    group of ``root`` or of one of them."""
    groups = {root, *children}
    now = _procs()
    return ({p for p, info in children.items() if p in now and now[p][2] == info[2]}
            | {p for p, info in now.items() if info[1] in groups and p != root})


def _wait_for_workers(proc: subprocess.Popen, count: int, same_command: bool, timeout: float = 240) -> dict:
    """The descendants of ``proc`` once ``count`` workers exist (forked workers: the same
    command line as their parent)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        mine = _cmdline(proc.pid)                             # read again: not yet exec'd at first
        kids = _descendants(proc.pid, _procs())
        workers = [p for p in kids if not same_command or _cmdline(p) == mine]
        if len(workers) >= count:
            return kids
        time.sleep(0.1)
    raise AssertionError(f"{count} workers did not start (exit status {proc.poll()})")


def _stop_and_check(proc: subprocess.Popen, sig: int, count: int, *, same_command: bool, settle: float = 1.0):
    """Wait for ``count`` workers, send ``sig`` (SIGINT to the whole group, as Ctrl-C), and
    return (exit status, stdout, stderr, survivors). Anything left is killed by pid."""
    kids = {}
    try:
        kids = _wait_for_workers(proc, count, same_command)
        time.sleep(settle)                                    # the workers are at work
        kids.update(_descendants(proc.pid, _procs()))
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=90)
        deadline = time.time() + 20
        left = _survivors(proc.pid, kids)
        while left and time.time() < deadline:
            time.sleep(0.2)
            left = _survivors(proc.pid, kids)
        return proc.returncode, out, err, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _survivors(proc.pid, kids):               # what this test started, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _chunk_files(out: Path) -> list:
    root = out / ".chunks"
    return sorted(f for _, _, fs in os.walk(root) for f in fs if f.endswith(".json"))


# ------------------------------------------------------------------ reproduce on the real models

def _real_models() -> list:
    from powerlens._src.models.load import resolve
    found = []
    for name in ("minilm", "smollm2", "gemma3"):
        try:
            resolve(name)
            found.append(name)
        except ValueError:
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.xfail(
                                     strict=False, reason="seen once: a Ctrl-C that landed while section 5 ran was lost and the run ended 0; not yet understood")),
                                 signal.SIGKILL], ids=["term", "ctrl-c", "kill-9"])
def test_stopping_reproduce_stops_its_workers(tmp_path, sig):
    """`reproduce --quick --jobs 2` on section 5 (two workers on two real models): stopped once
    they exist, it leaves none behind: SIGTERM and Ctrl-C stop them (exit 143 and 130, "finished
    chunks are kept"); kill -9 of the parent takes them with it (PR_SET_PDEATHSIG)."""
    if len(_real_models()) < 2:
        pytest.skip("needs two of the default models (make setup)")
    cmd = [sys.executable, "-m", "powerlens.cli", "reproduce", "--quick", "--out", str(tmp_path / "r"),
           "--sections", "layer_varying", "--jobs", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    code, out, err, left = _stop_and_check(proc, sig, 2, same_command=True)
    assert not left, f"workers left after {signal.Signals(sig).name}: {sorted(left)}"
    assert code == {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -9}[sig], err[-2000:]
    if sig != signal.SIGKILL:
        assert "powerlens reproduce: interrupted; finished chunks are kept" in err
        assert "Traceback" not in err


# ------------------------------------------------------------------ reproduce resumes after SIGTERM

FAKE = r'''
import os, sys, time
import powerlens._src.reproduce as R
from powerlens._src.reproduce import real_models
from powerlens._src.reproduce.section import SectionResult


def chunks(ctx, name):
    def first():
        return {"x": 1.0}

    def second():
        if os.environ.get("HOLD"):                  # the first run: stopped while here
            time.sleep(600)
        return {"x": 2.0}
    return [(f"fake_{name}_a", first), (f"fake_{name}_b", second)]


def section_fake(ctx):
    values = [ctx.model_chunk("m1", key, compute)["x"] for key, compute in chunks(ctx, "m1")]
    return SectionResult("fake", "A fake section", "claim", "supported", f"values {values}")


section_fake.model_chunks = chunks
section_fake.title = "9. A fake section"
R.all_sections = lambda: [section_fake]
import powerlens._src.reproduce.context as _context
_context.all_sections = R.all_sections                # the workers' view of the sections
real_models.available_models = lambda ctx: (["m1"], [])
from powerlens.cli import main
sys.exit(main(sys.argv[1:]))
'''


def test_sigterm_stops_the_worker_and_the_run_resumes(tmp_path):
    """A worker (a fake section's model, fork-started as reproduce starts them) has finished one
    chunk and sits in the second when reproduce gets SIGTERM: the worker is stopped, the
    finished chunk stays, and the same command resumes from it. Without --quiet the worker
    reports its model and section (one line per stage: stderr is not a terminal here); with
    --quiet nothing is reported."""
    script = tmp_path / "fake_reproduce.py"
    script.write_text(FAKE)
    out = tmp_path / "r"
    cmd = [sys.executable, str(script), "reproduce", "--quick", "--out", str(out), "--jobs", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", POWERLENS_XLA_CACHE="off")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(env, HOLD="1"))
    kids = {}
    try:
        kids = _wait_for_workers(proc, 1, same_command=True)
        deadline = time.time() + 120
        while "fake_m1_a.json" not in _chunk_files(out) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        if proc.poll() is None and "fake_m1_a.json" not in _chunk_files(out):
            proc.kill()
    assert _chunk_files(out) == ["fake_m1_a.json"]
    code, _, err, left = _stop_and_check(proc, signal.SIGTERM, 1, same_command=True, settle=0.2)
    assert not left and code == 143, (left, code, err[-2000:])
    assert "powerlens reproduce: worker 1 m1: 9. A fake section (0 of 2 chunks done)" in err
    assert "interrupted; finished chunks are kept" in err
    assert _chunk_files(out) == ["fake_m1_a.json"] and not (out / "results.json").exists()

    again = subprocess.run(cmd + ["--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "(1 chunks resumed, 1 computed)" in again.stdout
    assert "powerlens reproduce:" not in again.stderr                  # --quiet: no progress at all
    assert "values [1.0, 2.0]" in (out / "results.json").read_text()


# ------------------------------------------------------------------ sweep --processes N

from test_sweep_distributed import _cmd as _sweep, spec  # noqa: E402,F401  (spec: a fixture)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill-9"])
def test_stopping_a_sweep_launcher_stops_its_workers(tmp_path, spec, cache_env, sig):
    """`sweep --processes 2`: SIGTERM to the launcher stops both workers (exit 143), kill -9
    of the launcher takes them with it; the finished chunks are kept."""
    proc = subprocess.Popen(_sweep(spec, tmp_path / "s", "--processes", "2"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=cache_env)
    code, _, err, left = _stop_and_check(proc, sig, 2, same_command=False)
    assert not left, f"workers left after {signal.Signals(sig).name}: {sorted(left)}"
    assert code == {signal.SIGTERM: 143, signal.SIGKILL: -9}[sig], err[-2000:]


@pytest.mark.slow
def test_a_sweep_over_local_processes_prints_no_gloo_lines(tmp_path, spec, cache_env):
    """gloo writes "[Gloo] Rank 0 is connected to 1 peer ranks ..." on each worker's stdout; the
    launcher passes the workers' output on without those lines."""
    done = subprocess.run(_sweep(spec, tmp_path / "g", "--processes", "2"), capture_output=True, text=True,
                          env=cache_env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 processes" in done.stdout and "process 1 of 2 done" in done.stdout
    assert "Gloo" not in done.stdout + done.stderr


# ------------------------------------------------------------------ the pieces, in this process

def test_a_signal_becomes_an_interruption_once_and_handlers_come_back():
    from powerlens._src.runtime.workers import Interrupted, exit_status, interrupt_on_signals
    before = signal.getsignal(signal.SIGTERM)
    if before is not signal.SIG_DFL:
        pytest.skip("SIGTERM is handled by someone else here")
    with pytest.raises(Interrupted) as caught:
        with interrupt_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)                                   # interrupted at once
    assert caught.value.signum == signal.SIGTERM and exit_status(caught.value) == 143
    assert isinstance(caught.value, KeyboardInterrupt) and exit_status(KeyboardInterrupt()) == 130
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal.signal(signal.SIGHUP, signal.SIG_IGN)            # nohup: left alone
    try:
        with interrupt_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_a_worker_whose_parent_has_gone_ends_at_once():
    """bind_to_parent with a pid that is not the parent's: the process ends, status 1."""
    code = "from powerlens._src.runtime.workers import bind_to_parent; bind_to_parent(1); print('still here')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "still here" not in done.stdout
    code = "import os; from powerlens._src.runtime.workers import bind_to_parent; bind_to_parent(os.getppid()); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok"


def test_messages_from_a_worker_reach_the_parent_and_show_per_worker_and_section():
    """A Reporter (pickled, as into a task) sends through the Channel; WorkerProgress shows one
    line per stage without a terminal and a bar per worker with one."""
    import pickle
    from powerlens._src.reproduce.workers import WorkerProgress
    from powerlens._src.runtime.workers import Channel
    got = []
    with Channel(got.append) as channel:
        report = pickle.loads(pickle.dumps(channel.reporter()))
        for i in range(3):
            report({"i": i})
        report.close()
        deadline = time.time() + 10
        while len(got) < 3 and time.time() < deadline:
            time.sleep(0.02)
    assert got == [{"i": 0}, {"i": 1}, {"i": 2}]

    def messages(pid, model):
        base = {"pid": pid, "model": model, "chunks": 3}
        return [{**base, "event": "start", "done": 0},
                {**base, "event": "section", "section": "5. Layer-varying", "done": 0, "section_chunks": 2},
                {**base, "event": "chunk", "done": 1}, {**base, "event": "chunk", "done": 2},
                {**base, "event": "section", "section": "7. Steering", "done": 2, "section_chunks": 1},
                {**base, "event": "chunk", "done": 3},
                {**base, "event": "done", "done": 3, "computed": 2, "seconds": 4.2}]

    text = io.StringIO()
    show = WorkerProgress(text, tty=False)
    for a, b in zip(messages(11, "smollm2"), messages(22, "gemma3")):
        show(a)
        show(b)
    lines = text.getvalue().splitlines()
    assert lines[:2] == ["powerlens reproduce: worker 1 smollm2: 5. Layer-varying (0 of 3 chunks done)",
                         "powerlens reproduce: worker 2 gemma3: 5. Layer-varying (0 of 3 chunks done)"]
    assert lines[2] == "powerlens reproduce: worker 1 smollm2: 7. Steering (2 of 3 chunks done)"
    assert lines[-1] == "powerlens reproduce: worker 2 gemma3: done, 2 of 3 chunks computed in 4 s"
    assert len(lines) == 6                                  # 2 sections and the end, per worker

    screen = io.StringIO()
    show = WorkerProgress(screen, tty=True)
    for m in messages(11, "smollm2")[:4]:
        show(m)
    assert "worker 1 smollm2 · 5. Layer-varying" in screen.getvalue() and "2/3" in screen.getvalue()
    show(messages(11, "smollm2")[-1])
    assert not show.bars and "worker 1 smollm2: done" in screen.getvalue()
    show.close()
