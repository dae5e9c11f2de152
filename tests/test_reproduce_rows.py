"""Every row of reproduce's sweep sections is rebuilt from its seed and grid values alone.

Sections 1-4 are specs of the built-in synthetic builder and section 6 a ``[model]`` spec;
reproduce runs them with the sweep engine. For 20 random rows of each (all, if fewer),
``pl.sweep_system(spec, row)`` with the section's spec, as ``reproduce --quick --seed S``
loads it, gives the row's eigenvalues, and ``pl.run`` its final_gamma and final_consensus,
to 1e-6 (the checks of test_one_definition.py's synthetic and [model] sweep tests).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_one_definition import _check_rows as _check_rows_as_run

SEED = 3                               # not the spec files' 0: the run's --seed reaches every row


def _quick_ctx():
    from powerlens._src.reproduce import Context
    from powerlens._src.sweeps.store import MemoryStore
    return Context(out="", store=MemoryStore(), quick=True, seed=SEED, models=[], show_progress=False)


def _check_rows(spec, df, rows):
    """test_one_definition's row checks, pl.run in the precision the rows ran in (SweepSystem.x64)."""
    import jax
    with jax.enable_x64(spec.value("x64")):
        _check_rows_as_run(spec, df, rows)


def _some(n: int, k: int = 20, seed: int = 0):
    return np.sort(np.random.default_rng(seed).choice(n, min(n, k), replace=False))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dominant_real", "complex_pair", "close_eigenvalues", "bipartite"])
def test_synthetic_section_rows_are_rebuilt_from_their_seed(name):
    """The section's table, as reproduce --quick computes it (run_section into its store), is a
    built-in synthetic sweep: no custom builder, the run's seed, and each row rebuilt by
    pl.sweep_system from the section's spec alone."""
    from powerlens._src.reproduce import synthetic
    spec, df = synthetic.run_section(_quick_ctx(), name, name)
    assert spec.system["builder"] == "synthetic" and spec.seed == SEED
    assert len(df) == spec.n_systems and df["finite"].all()
    _check_rows(synthetic.section_spec(name, seed=SEED, quick=True), df, _some(len(df)))


def test_quick_section_specs_are_small_and_keep_the_laws():
    """--quick changes grid values, replicates and chunking only: section 3 keeps the gaps
    0.2, 0.1, 0.05 of the full spec's spectra; section 4 keeps one head against several;
    the full bipartite sweep has at least 1000 systems."""
    from powerlens._src.reproduce import synthetic
    for name in synthetic.SPEC_NAMES:
        full, quick = (synthetic.section_spec(name, quick=q) for q in (False, True))
        assert quick.n_systems < full.n_systems, name
        for table in ("system", "run", "measure"):
            changed = {k for k in full.to_dict()[table] if getattr(full, table)[k] != getattr(quick, table).get(k)}
            assert changed <= {"replicates", "chunk_size"}, (name, table, changed)
    gaps = [synthetic.spectrum_gap(s) for s in synthetic.section_spec("close_eigenvalues", quick=True).grid["spectrum"]]
    assert gaps == [0.2, 0.1, 0.05]
    assert synthetic.section_spec("bipartite", quick=True).grid["heads"] == [1, 4]
    assert synthetic.section_spec("bipartite").n_systems >= 1000
    with pytest.raises(ValueError, match="unknown section spec 'nope'; expected one of dominant_real"):
        synthetic.section_spec("nope")


def _minilm_or_skip():
    from powerlens._src.models.load import resolve
    try:
        resolve("minilm")
    except ValueError:
        pytest.skip("minilm is not installed")


def test_shared_real_is_a_model_spec_of_every_layer():
    """Section 6's spec is a [model] sweep: the paper rule in float64 on the first prompt of the
    real-model sections, every unique layer for T = 200 (--quick: every max(U // 4, 1)-th
    layer, T = 80), the gamma series kept for the measured rate."""
    _minilm_or_skip()
    from powerlens._src.reproduce import real_models as R
    full, quick = R.shared_real_spec("minilm", seed=SEED), R.shared_real_spec("minilm", seed=SEED, quick=True)
    for spec in (full, quick):
        assert spec.model is not None and spec.model["name"] == "minilm" and spec.seed == SEED
        assert spec.model["prompts"] == R.PROMPTS[:1]
        assert (spec.run["rule"], spec.run["attention"], spec.run["x64"]) == ("paper", "softmax", True)
        assert spec.measure["series"] == ["gamma"]
    assert full.model["layers"] == list(range(6)) and full.grid == {"steps": [200]}
    assert quick.model["layers"] == list(range(6)) and quick.grid == {"steps": [R.QUICK_SHARED_STEPS]}


@pytest.mark.slow
def test_shared_real_rows_are_rebuilt_from_the_real_model(tmp_path):
    """Section 6's spec on MiniLM (its --quick layers, T shortened to 12): every row rebuilt by
    pl.sweep_system has the layer's eigenvalues, and pl.run its final_gamma and final_consensus;
    the section's row reads them off the table, with |1+lambda1| from lambda1."""
    _minilm_or_skip()
    from powerlens._src.reproduce import real_models as R
    from powerlens._src.sweeps.engine import run_sweep
    from powerlens._src.sweeps.spec import load_spec
    from powerlens._src.sweeps.store import MemoryStore
    spec = load_spec(R.shared_real_spec("minilm", seed=SEED, quick=True), overrides={"grid": {"steps": [12]}})
    df = run_sweep(spec, MemoryStore(), progress=False).table
    assert len(df) == 6 and df["layer"].tolist() == list(range(6))
    _check_rows(spec, df, _some(len(df)))
    row = R.shared_real_row("minilm", df.iloc[2][list(R.SHARED_COLUMNS)].to_dict())
    assert row["layer"] == 2 and row["final_gamma"] == df.final_gamma[2] and len(row["gamma_curve"]) == 12
    np.testing.assert_allclose(row["mu1"], np.hypot(1 + df.lambda1_re[2], df.lambda1_im[2]), rtol=1e-15)
    assert row["ratio"] == df.direction_rate_pred[2]
