"""Test-session settings.

Two pytest-xdist workers share the two cores; each keeps NumPy's BLAS to one thread so
that dense eigen-decompositions do not oversubscribe the machine (8x slower otherwise).
The Makefile also sets these before Python starts, which is what actually takes effect
when NumPy was imported by a plugin first.
"""
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
