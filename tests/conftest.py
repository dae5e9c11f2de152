"""Test-session settings.

Two pytest-xdist workers share the two cores; each keeps NumPy's BLAS to one thread so
that dense eigen-decompositions do not oversubscribe the machine (8x slower otherwise).
The Makefile also sets these before Python starts, which is what actually takes effect
when NumPy was imported by a plugin first.
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def x64():
    """float64 for one test module (``pytestmark = pytest.mark.usefixtures("x64")``), restored after."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)
