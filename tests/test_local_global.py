"""Local against global attention layers (section 5 on Gemma 3): the exact permutation test
across the layers, the per-model comparison and the shading of the global layers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from powerlens._src.analysis.measures import group_difference
from powerlens._src.analysis.plots import plot_alignment
from powerlens._src.reproduce.real_models import local_global


def test_three_largest_of_eighteen_has_the_exact_permutation_pvalue():
    """The 3 global layers hold the 3 largest of 18 distinct values: of the C(18, 3) = 816
    splits only that one and the 3 smallest give |difference| >= the observed 9."""
    v = np.arange(18.0)
    glob = np.zeros(18, bool)
    glob[-3:] = True
    diff, p = group_difference(v, glob)
    assert diff == pytest.approx(16.0 - 7.0)                    # mean of 15..17 minus mean of 0..14
    assert p == pytest.approx(2 / math.comb(18, 3))


def test_identical_groups_give_p_one_and_monte_carlo_agrees_with_exact():
    v = np.array([1.0, 2.0, 1.0, 2.0, 1.5, 1.5])
    assert group_difference(v, np.array([1, 1, 0, 0, 0, 0], bool)) == (0.0, 1.0)
    rng = np.random.default_rng(3)
    v = rng.standard_normal(14)
    g = np.zeros(14, bool)
    g[[1, 5, 9]] = True
    d0, p0 = group_difference(v, g)
    d1, p1 = group_difference(v, g, max_exact=0, samples=40_000, seed=1)
    assert d0 == d1
    assert abs(p0 - p1) < 4 * math.sqrt(p0 * (1 - p0) / 40_000) + 1e-4


def test_nan_layers_are_dropped_and_one_sided_groups_are_undefined():
    v = np.array([np.nan, 1.0, 2.0, 3.0])
    d, p = group_difference(v, np.array([True, False, False, True]))
    assert d == pytest.approx(3.0 - 1.5) and 0 < p <= 1
    assert all(math.isnan(x) for x in group_difference(np.ones(4), np.zeros(4, bool)))


def _entry(gamma, rho, kinds, window=512, longest=20):
    steps = [{"gamma": 0.1, "rho": None}] + [{"gamma": g, "rho": r} for g, r in zip(gamma, rho)]
    e = {"rule": "paper", "kinds": kinds, "windows": [window if k == "local" else 0 for k in kinds],
         "longest_prompt": longest, "shifted": {"steps": steps}}
    return {"paper": e, "faithful": dict(e, rule="pre_ln")}


def test_local_global_reports_the_difference_and_its_test_per_model():
    kinds = (["local"] * 5 + ["global"]) * 3
    gamma = [0.1] * 18
    for t in (5, 11, 17):
        gamma[t] = 0.4                                              # global layers align more
    rho = list(np.linspace(0.4, 0.6, 18))
    rows, text = local_global({"gemma3": _entry(gamma, rho, kinds), "minilm": _entry([0.2] * 6, [0.5] * 6,
                                                                                     ["global"] * 6)})
    assert [r["model"] for r in rows] == ["gemma3", "gemma3"]           # minilm has no local layers
    r = rows[0]
    assert (r["n_local"], r["n_global"], r["window"]) == (15, 3, 512)
    assert r["gamma_diff"] == pytest.approx(0.1 - 0.4)
    # ties: any split whose 3 layers are the 3 globals is as extreme; only that one (p = 1/816)
    assert r["gamma_p"] == pytest.approx(1 / 816) and r["differ"]
    assert "15 local (window 512) and 3 global" in text and "differ between" in text
    assert "fits in the window" in text


def test_global_layers_are_shaded_on_both_panels(tmp_path):
    x = np.arange(1, 19)
    fig = plot_alignment(x, np.full(18, 0.2), np.full(18, 0.5), tmp_path / "a.png", chance=0.05,
                         marks={"global attention": [6, 12, 18]}, return_fig=True)
    for ax in fig.axes:
        spans = [p for p in ax.patches if p.get_zorder() == 0]
        assert len(spans) == 3
        xs = sorted(round(float(p.get_x()), 6) for p in spans)
        assert xs == [5.5, 11.5, 17.5]
    assert "global attention" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
