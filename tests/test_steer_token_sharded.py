"""objective="token" runs its K targets through the one execution helper (map_systems): on
two CPU host devices, K = 3 targets (padded to 4, two per device) give the same edits as on
one device, and the program's outputs are split over both devices."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow         # two fresh processes (start and compilation: ~6 s each)

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[2])
import powerlens as pl
from powerlens._src.steering import token as T
from test_steer_token import tiny_decoder
model = tiny_decoder(2, vocab=3)
ids = np.array([[1, 0, 2], [2, 1, 0]])
x0, valid = pl.embed_ids(model, ids, np.array([[True, True, True], [True, True, False]]))
res = pl.optimize_steering(model, x0, [1, 2, 1], objective="token", valid=valid, target_prob=[0.6, 0.6, 0.5],
                           max_kl=5.0, controls=[[1, 2, 0]], rank=2, steps=30, lr=1e-2)
# the sharded program itself: its outputs live on every device
pre = {"X": jnp.zeros((2, 3, 6), jnp.float32)}
from powerlens._src.steering.lagrangian import map_targets
out = map_targets(lambda pre, t: {"y": pre["X"].sum() + t}, 1, (pre,), (jnp.arange(3.0),), {})
np.savez(sys.argv[1], delta_O=res.delta_O, norm=res.norm, target_prob=res.target_prob, feasible=res.feasible,
         closed_norm=res.closed_norm, history_norm=res.history_norm, devices=jax.device_count(),
         spread=out["y"].sharding.num_devices)
"""


def _run(tmp_path, env, devices: int) -> dict:
    path = tmp_path / f"devices{devices}.npz"
    env = dict(env, XLA_FLAGS=env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), HERE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(np.load(path))


def test_token_targets_sharded_over_two_devices_equal_one_device(tmp_path, cache_env):
    one, two = _run(tmp_path, cache_env, 1), _run(tmp_path, cache_env, 2)
    assert int(one["devices"]) == 1 and int(two["devices"]) == 2
    assert int(two["spread"]) == 2                       # the targets' outputs are split over both devices
    assert one["feasible"].all() and (two["feasible"] == one["feasible"]).all()
    assert one["delta_O"].shape == (3, 6, 6) and np.linalg.norm(one["delta_O"][0]) > 0
    # float32: the two programs vmap different widths (2 per device against 3), so their
    # roundings differ; 30 Adam steps carry them to ~1e-5 of each edit's size
    rel = np.linalg.norm(two["delta_O"] - one["delta_O"], axis=(1, 2)) / np.linalg.norm(one["delta_O"], axis=(1, 2))
    assert rel.max() < 1e-4, rel
    for key in ("norm", "target_prob", "closed_norm", "history_norm"):
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, err_msg=key)
