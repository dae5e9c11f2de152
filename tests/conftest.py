"""Test-session settings.

Two pytest-xdist workers share the two cores; each keeps NumPy's BLAS to one thread so
that dense eigen-decompositions do not oversubscribe the machine (8x slower otherwise).
The Makefile also sets these before Python starts, which is what actually takes effect
when NumPy was imported by a plugin first.
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# One persistent XLA compilation cache per test process (and the subprocesses it starts), never
# the user's shared one: an entry read while another process wrote it crashed a worker inside
# jax's cache read (a segmentation fault in compilation_cache.get_executable_and_time).
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import tempfile as _tempfile
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _tempfile.mkdtemp(prefix="powerlens-test-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def x64():
    """float64 for one test module (``pytestmark = pytest.mark.usefixtures("x64")``), restored after."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    """The environment for the tests' subprocesses: one persistent compilation cache per test
    worker, so a program that several processes run (a killed run, its resumption, a fresh
    run; one process against several) compiles once."""
    cache = tmp_path_factory.getbasetemp() / "jax-cache"
    cache.mkdir(exist_ok=True)
    return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1")
