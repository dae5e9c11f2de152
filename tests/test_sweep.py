"""Sweeps: one jit/vmap call over stacked systems equals system-by-system runs, and the
sharded path (CPU cores as host devices) equals the unsharded one."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import powerlens as pl
from powerlens._src.analysis.spectra import sweep_subspaces
from powerlens._src.dynamics.execution import TUNING, micro_size, padded_size
from powerlens._src.dynamics.sweep import simulate_sweep, stack_systems

SCRIPT = r"""
import numpy as np, jax
import powerlens as pl
from powerlens._src.analysis.spectra import sweep_subspaces
from powerlens._src.dynamics.sweep import stack_systems, simulate_sweep
S = 19      # 10 per device: padded to 16, two micro-batches of 8 each
systems = [pl.synthetic_system([2.0, 0.5 + 0.5j], kind="normal", heads=2, d=6, seed=i, steps=12) for i in range(S)]
_, subs = sweep_subspaces(systems)
X0 = np.stack([pl.sphere_tokens(np.random.default_rng(i), 5, 6) for i in range(S)])
a = simulate_sweep(stack_systems(systems), X0, subs)
b = simulate_sweep(stack_systems(systems), X0, subs, shard=False)
assert jax.device_count() == 2 and a.final.shape[0] == S
for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
print("SHARDED-OK", a.final.sharding.num_devices)
"""


def test_micro_batch_pads_each_device_share_to_whole_micro_batches():
    m = micro_size("auto", "cpu")
    assert m == TUNING.micro_cpu == 8 and micro_size("auto", "gpu") is None
    assert padded_size(256, 2, m) == 256
    assert padded_size(19, 2, m) == 32                           # 10 per device -> 2 micro-batches of 8
    assert padded_size(19, 1, m) == 24
    assert padded_size(5, 2, m) == 16                            # a share of 3: one micro-batch of 8, as in a sweep
    assert padded_size(19, 2, None) == 20


def test_sweep_equals_individual_runs():
    """11 systems on one CPU device: padded to 16, two micro-batches; the padding is dropped."""
    S = 11
    systems = [pl.synthetic_system([1.5 + 0.1 * i, 0.2], kind="symmetric", heads=2, d=4, seed=i, steps=8)
               for i in range(S)]
    spectra, subs = sweep_subspaces(systems)
    X0 = np.stack([pl.sphere_tokens(np.random.default_rng(i), 5, 4) for i in range(S)])
    traj = simulate_sweep(stack_systems(systems), X0, subs, shard=False)
    assert traj.final.shape == (S, 5, 4) and traj.gamma.shape[0] == S
    for i, s in enumerate(systems):
        one = pl.simulate_batch(s, X0[i][None], pl.reference_subspaces(spectra[i], seed=i))
        np.testing.assert_allclose(np.asarray(traj.final[i]), np.asarray(one.final[0]), atol=1e-6)
        np.testing.assert_allclose(np.asarray(traj.consensus[i]), np.asarray(one.consensus[0]), atol=1e-6)


def test_traced_shared_layer_is_read_through_in_out_copies_built_once():
    """A one-layer system whose weights are traced (a sweep's systems, inside its jit) is read
    through (in, out) copies built once before the scan, as the jitted entry points' cached
    copies are: the scan's loop-invariant inputs hold the fused q/k/v weight "float[d 3He]" and
    W_o^T "float[He d]" (d = 8, 2 heads of 5: He = 10), not the rows, and the states are those of
    the concrete path. (Measured: benchmarks/vs_torch.py's sweep D, 0.91-0.92 of the time.)"""
    import jax

    from powerlens._src.dynamics.run import run
    L = pl.synthetic_system([1.4, 0.3], kind="symmetric", heads=2, d=8, d_head=5, seed=1, steps=4)
    x0 = pl.sphere_tokens(np.random.default_rng(0), 5, 8).astype(np.float32)
    states = lambda lay: run(lay, x0, None, rule="paper", attention="softmax", observers={"states": pl.states()})["states"]
    jaxpr = jax.make_jaxpr(states)(L)
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    invariant = [tuple(v.aval.shape) for v in scan.invars[:scan.params["num_consts"]]]
    assert (8, 30) in invariant and (10, 8) in invariant, invariant
    assert (8, 10) not in invariant and (2, 5, 8) not in invariant, invariant     # no rows: W_o, W_q "float[H e d]"
    np.testing.assert_array_equal(np.asarray(jax.jit(states)(L)), np.asarray(pl.run_batch(
        L, x0, observe=("states",))["states"][0]))


def test_sharded_sweep_matches_unsharded():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SHARDED-OK 2" in out.stdout
