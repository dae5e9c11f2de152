"""One synthetic-system builder: ``synthetic_system`` is ``synthetic`` compiled and brought to
the host; its head split W_o V_cat = F holds for H e = d and H e > d and H e < d is refused;
its facts' eigenvalues are F's."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerlens._src.dynamics.schedule import Schedule
from powerlens._src.dynamics.synthetic import (SyntheticConfig, synthetic, synthetic_inputs,
                                          synthetic_system)

SPECTRUM = [2.0, 0.5 + 1.0j, 0.3]
SHAPE = dict(kind="normal", heads=2, d=8)        # most tests share this shape: one compiled builder per dtype


def _leaves(layers, facts):
    arrays = {k: getattr(layers, k) for k in ("W_q", "W_k", "W_v", "W_o", "scale", "window")}
    return {**arrays, **{k: v for k, v in facts.items() if v is not None}}


def _split_error(layers, F):
    """max |W_o V_cat - F| / max |F|."""
    V = np.asarray(layers.W_v[0], np.float64)
    H, e, d = V.shape
    return np.abs(np.asarray(layers.W_o[0], np.float64) @ V.reshape(H * e, d) - F).max() / np.abs(F).max()


def _assert_same_spectrum(got, want, tol):
    """Every eigenvalue of ``want`` matched to a distinct nearest one of ``got`` (a pair's
    two members have equal real parts, so a plain sort would not pair them up)."""
    got, used = np.asarray(got, complex), np.zeros(len(got), bool)
    assert len(got) == len(want)
    for z in want:
        dist = np.where(used, np.inf, np.abs(got - z))
        j = int(np.argmin(dist))
        assert dist[j] <= tol, (z, got)
        used[j] = True


def _eigenvalues(facts):
    return facts["eigenvalues"][:, 0] + 1j * facts["eigenvalues"][:, 1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_synthetic_system_is_the_compiled_builder_bitwise(dtype):
    """The wrapper's layers and facts are, bit for bit, jax.jit(synthetic) of the same seed,
    values and config."""
    seed, values, cfg = synthetic_inputs(SPECTRUM, **SHAPE, seed=3, beta=1.5, dtype=dtype)
    with jax.enable_x64(cfg.x64):
        layers, facts = synthetic_system(SPECTRUM, **SHAPE, seed=3, beta=1.5, dtype=dtype, facts=True)
        want = jax.device_get(jax.jit(synthetic, static_argnames="cfg")(seed, values, cfg))
    assert layers.W_v.dtype == dtype and facts["F"].dtype == dtype
    got, want = _leaves(layers, facts), _leaves(*want)
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert layers.scale[0] == pytest.approx(1.5 / np.sqrt(4))


def test_float64_is_enabled_for_the_build_only():
    """dtype float64 without float64 enabled: the build runs in float64 (the facts keep it),
    the caller's setting is unchanged, and the layers are jnp arrays in its precision."""
    assert not jax.config.jax_enable_x64
    layers, facts = synthetic_system(SPECTRUM, **SHAPE, seed=3, dtype=np.float64, facts=True)
    assert not jax.config.jax_enable_x64
    assert facts["F"].dtype == np.float64 and layers.W_o.dtype == np.float32
    with jax.enable_x64(True):
        want = synthetic_system(SPECTRUM, **SHAPE, seed=3, dtype=np.float64)
    np.testing.assert_array_equal(layers.W_o, np.asarray(want.W_o, np.float32))


def test_a_spectrum_list_is_the_sweeps_spectrum_text():
    """A spectrum list (a dynamic value: one program for every spectrum of a shape) builds the
    system the sweeps' static spectrum text builds from the same seed."""
    seed, values, cfg = synthetic_inputs(SPECTRUM, **SHAPE, seed=1)
    build = jax.jit(synthetic, static_argnames="cfg")
    a = _leaves(*jax.device_get(build(seed, values, cfg)))
    b = _leaves(*jax.device_get(build(seed, values, dataclasses.replace(cfg, spectrum="2,0.5+1j,0.3"))))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("d_head", [None, 5])      # H e = 8 = d (e = ceil(d / H)) and H e = 10 > d
def test_head_split_carries_F_and_the_facts_are_its_spectrum(d_head, dtype, tol):
    """W_o V_cat = F (H e = d: the exact inverse; H e > d: the least-squares split) and the
    facts' eigenvalues are np.linalg.eigvals(F)."""
    with jax.enable_x64(dtype == np.float64):
        layers, facts = synthetic_system(SPECTRUM, **SHAPE, d_head=d_head, seed=0, dtype=dtype, facts=True)
    e = d_head or 4
    assert layers.W_v.shape == (1, 2, e, 8) and layers.W_o.shape == (1, 8, 2 * e)
    F = np.asarray(facts["F"], np.float64)
    assert _split_error(layers, F) < tol
    _assert_same_spectrum(np.linalg.eigvals(F), _eigenvalues(facts), 1e3 * tol)
    _assert_same_spectrum(_eigenvalues(facts), [2.0, 0.5 + 1j, 0.5 - 1j, 0.3, 0, 0, 0, 0], np.finfo(dtype).eps)


def test_too_few_head_dimensions_are_one_line_errors():
    """H e < d cannot carry a rank-d F: refused by the wrapper and by the config."""
    for call in (lambda: synthetic_system([1.0, 0.5], d=8, heads=2, d_head=3),
                 lambda: synthetic_system(None, F=np.eye(5), heads=2, d_head=2),
                 lambda: SyntheticConfig(d=8, tokens=2, heads=3, d_head=2)):
        with pytest.raises(ValueError, match=r"cannot carry a rank-\d F \(need H\*d_head >= d\)") as err:
            call()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("call,match", [
    (lambda: synthetic_system([1.0], heads=0), "heads must be positive"),
    (lambda: synthetic_system([1.0], beta=float("nan")), "beta must be finite"),
    (lambda: synthetic_system([1.0, 1 + 1j], d=2), r"spectrum needs dimension >= 3"),
    (lambda: synthetic_system([1 + 1j], d=4), "'symmetric' needs a real spectrum"),
    (lambda: synthetic_system([1.0], kind="hermitian"), "unknown kind 'hermitian'"),
    (lambda: synthetic_system(None), "give a spectrum"),
    (lambda: synthetic_system(None, F=np.ones((3, 4))), r"F must be a square \(d, d\) matrix"),
    (lambda: synthetic_system(None, F=np.full((2, 2), np.inf)), "F contains non-finite values"),
    (lambda: synthetic_system([1.0], dtype=np.float16), "dtype must be float32 or float64"),
    (lambda: synthetic_system([1.0], seed=-1), r"seed must be an integer in 0 \.\. 2147483647"),
    (lambda: synthetic_system([1.0], steps=0), "steps must be a positive integer"),
])
def test_bad_arguments_are_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_given_F_is_carried_and_its_spectral_facts_are_nan():
    """With F given the heads carry it; its spectrum is not known without an eig, so the
    spectral facts are NaN and the dims 0 (never a wrong number)."""
    F = synthetic_system(SPECTRUM, **SHAPE, seed=2, dtype=np.float64, facts=True)[1]["F"]
    with jax.enable_x64(True):
        layers, facts = synthetic_system(None, F=F, heads=2, seed=4, dtype=np.float64, facts=True)
    assert _split_error(layers, F) < 1e-12
    np.testing.assert_array_equal(facts["F"], F)
    for k in ("eigenvalues", "lam", "lam_plain", "direction", "principal", "top2", "v1"):
        assert np.all(np.isnan(facts[k])), k
    assert int(facts["dim"]) == int(facts["dim_plain"]) == int(facts["principal_dim"]) == 0
    np.testing.assert_allclose(np.linalg.norm(facts["x0"], axis=1), 1.0)


def test_steps_set_the_schedule_without_a_new_build():
    """steps=T repeats the one layer T times; steps=None leaves the schedule unset (one step);
    both are the same arrays."""
    a = synthetic_system(SPECTRUM, **SHAPE, seed=7)
    b = synthetic_system(SPECTRUM, **SHAPE, seed=7, steps=5)
    assert a.config.schedule is None and b.config.schedule == Schedule.repeat(0, 5)
    assert list(b.schedule) == [0] * 5
    np.testing.assert_array_equal(a.W_o, b.W_o)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.integers(2, 6), heads=st.integers(1, 3), extra=st.integers(0, 1),
       kind=st.sampled_from(["symmetric", "normal", "nonnormal"]), seed=st.integers(0, 2 ** 20))
def test_head_split_property(d, heads, extra, kind, seed):
    """For any width, heads, head size e = ceil(d / H) + extra (H e >= d) and kind, the heads
    carry F (float64, 1e-12) and F has the facts' eigenvalues."""
    eigs = [1.3, -0.2 + 0.4j] if kind != "symmetric" and d >= 3 else [1.3, -0.2][:d]
    with jax.enable_x64(True):
        layers, facts = synthetic_system(eigs, kind=kind, heads=heads, d=d, d_head=-(-d // heads) + extra,
                                         seed=seed, nonnormality=0.5, dtype=np.float64, facts=True)
    F = facts["F"]
    assert _split_error(layers, F) < 1e-12
    _assert_same_spectrum(np.linalg.eigvals(F), _eigenvalues(facts), 1e-7)
