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
# read and write. The test processes themselves do not use it (see below): writing an
# executable into it crashed a worker (a segmentation fault inside executable.serialize(),
# jaxlib 0.10.2 on CPU), and a process reuses its own programs in memory anyway.
_OWNER = "POWERLENS_TEST_XLA_CACHE"
if not os.environ.get(_OWNER) or os.environ.get(_OWNER) != os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import atexit as _atexit
    import shutil as _shutil
    import tempfile as _tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_OWNER] = _folder = _tempfile.mkdtemp(
        prefix="powerlens-test-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2 ** 30)     # with a size, JAX locks the folder
    _atexit.register(_shutil.rmtree, _folder, ignore_errors=True)   # by the process that made it

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
