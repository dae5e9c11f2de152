"""Test-session settings.

Two pytest-xdist workers share the two cores; each keeps NumPy's BLAS to one thread so
that dense eigen-decompositions do not oversubscribe the machine (8x slower otherwise).
The Makefile also sets these before Python starts, which is what actually takes effect
when NumPy was imported by a plugin first.
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# JAX's persistent compilation cache: one folder for the whole test session, shared by the
# xdist workers' subprocesses (the commands a test starts: a killed run and its resumption, the
# processes of one sweep), never the user's. Its size is bounded, so JAX locks it around every
# read and write. The test processes themselves do not use it (see below): a process reuses its
# own programs in memory anyway, and serialising each one costs memory mappings too (a worker
# that died inside executable.serialize() had run out of them: see "live compiled programs").
_OWNER = "POWERLENS_TEST_XLA_CACHE"
_FAULTS = "POWERLENS_TEST_FAULTS"     # each xdist worker's faulthandler log (see the crash hook below)
if not os.environ.get(_OWNER) or os.environ.get(_OWNER) != os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import atexit as _atexit
    import shutil as _shutil
    import tempfile as _tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_OWNER] = _folder = _tempfile.mkdtemp(
        prefix="powerlens-test-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    from powerlens._src.runtime.cache import MAX_BYTES as _MAX_BYTES     # light: imports no JAX
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(_MAX_BYTES)  # with a size, JAX locks the folder
    _atexit.register(_shutil.rmtree, _folder, ignore_errors=True)   # by the process that made it
    os.environ[_FAULTS] = _tempfile.mkdtemp(prefix="powerlens-test-faults-")
    _atexit.register(_shutil.rmtree, os.environ[_FAULTS], ignore_errors=True)

# XLA compiles without LLVM's optimisation passes in the test processes and their subprocesses.
# XLA's own HLO passes (fusion, layout, buffer assignment) run as usual and matmuls call the same
# library kernels; what changes is the machine code of the fused loops, and compiling takes about
# half as long (a token-steering CLI run on a tiny Llama: 52 s of compiling -> 26 s), which is
# most of what the suite spends. The benchmarks and every command a user runs keep XLA's default.
_O0 = "--xla_backend_optimization_level=0"
if _O0 not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _O0).strip()

# --- typecheck: the public functions' jaxtyping annotations, checked under beartype ---------------
# Every function of powerlens._EXPORTS is wrapped with jaxtyping.jaxtyped(typechecker=beartype)
# for the whole session (tests/typecheck.py); POWERLENS_TYPECHECK=0 turns it off.
import typecheck as _typecheck  # noqa: E402

if _typecheck.enabled(os.environ):
    _typecheck.install()
# --- end typecheck ---------------------------------------------------------------------------------


import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)     # this process: no persistent cache (above)


# --- live compiled programs ------------------------------------------------------------------------
# Each live XLA:CPU executable holds about three memory mappings of its compiled code, and the jit
# caches keep every program a process compiled alive. An xdist worker that runs ~900 tests reached
# 23,000 mappings; at the kernel's vm.max_map_count (65,530 by default) a new mapping fails inside
# XLA's compiler and the process dies of a segmentation fault. After each module, a process past a
# third of that limit drops its compiled programs (jax.clear_caches(); the next use recompiles).
def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:                 # not Linux: no such limit to watch
        return 0


def _mapping_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _few_enough_compiled_programs():
    yield
    if _mappings() > _mapping_limit() // 3:
        import gc
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="module")
def x64():
    """float64 for one test module (``pytestmark = pytest.mark.usefixtures("x64")``), restored after."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


@pytest.fixture(scope="session")
def cache_env():
    """The environment for the tests' subprocesses: the session's persistent compilation cache
    (above), so that a program that several processes run (a killed run, its resumption, a
    fresh run; one process against several) compiles once."""
    return dict(os.environ, JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONUNBUFFERED="1",
                OPENBLAS_NUM_THREADS="1")


# --- a worker that dies --------------------------------------------------------------------------
# The known cause of a dying worker, too many live compiled programs, is bounded above
# (_few_enough_compiled_programs: at the mapping limit LLVM reports "Cannot allocate memory" and the
# process dies of a segmentation fault inside backend_compile_and_load). Should a worker die anyway,
# the test it was running runs once more, in the fresh worker xdist starts, and the crash is printed
# with the dead worker's Python stack; a second crash of the same test fails it.
_CRASHES: dict = {}


def _fault_log(worker):
    return os.path.join(os.environ.get(_FAULTS, ""), f"{worker}.txt")


@pytest.hookimpl(trylast=True)      # after pytest's own faulthandler plugin, which writes to stderr
def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and os.environ.get(_FAULTS) and os.path.isdir(os.environ[_FAULTS]):
        import faulthandler
        log = open(_fault_log(worker), "a")            # kept open for the life of the worker
        log.write(f"--- worker {worker}, pid {os.getpid()}\n")
        log.flush()
        config._powerlens_fault_log = log
        faulthandler.enable(file=log, all_threads=True)


@pytest.hookimpl(optionalhook=True)      # xdist's hook: unknown where xdist is not loaded
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist's hook for a test whose worker died: schedule it again once, and say why."""
    worker = getattr(getattr(report.node, "gateway", None), "id", "?")
    try:
        with open(_fault_log(worker)) as f:
            log = f.read().split(f"--- worker {worker},")[-1].splitlines()
        noise = ("/pluggy/", "/_pytest/", "/execnet/", "/xdist/", "<string>", "Extension modules")
        stack = [line for line in log if line.strip() and not any(n in line for n in noise)][-30:]
    except OSError:
        stack = ["(no fault log)"]
    import sys
    runs = _CRASHES[crashitem] = _CRASHES.get(crashitem, 0) + 1
    verdict = "running it once more in a fresh worker" if runs == 1 else "a second crash: failed"
    print(f"\nworker {worker} died while running {crashitem}; {verdict}. Its last fault log:\n  "
          + "\n  ".join(stack), file=sys.stderr, flush=True)
    if runs == 1:
        sched.mark_test_pending(crashitem)
        report.outcome = "rerun"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
