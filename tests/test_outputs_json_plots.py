"""What spectrum.json and align.json hold, and the figures drawn from them.

* spectrum.json keeps every eigenvalue of each F_t, the sizes of its eigen-groups (the one group
  rule) and a ``gap`` between groups, so that a dominant complex pair is never a gap of 0; the
  file describes its fields (``layer_fields``).
* align.json keeps each prompt's gamma_t and rho_t; their token-weighted mean is the pooled value,
  a prompt's own value is that of a run on that prompt alone, and the standard error across
  prompts is the closed form for two prompts.
* The figures: the eigenvalue figure's suptitle and panel titles do not overlap; a one-layer
  alignment figure has no "other layer" legend entry; the alignment legends sit outside the
  panels (they covered Gemma 3's layers 16-17); alignment draws error bands; the bipartite
  figure of reproduce draws binomial intervals on a y axis from 0.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import powerlens as pl
from powerlens._src.analysis import plots
from powerlens._src.analysis.experiment import StepMeasures, plot_measures
from powerlens._src.analysis.measures import binomial_interval
from powerlens._src.analysis.spectra import LAYER_FIELDS, layer_spectra, spectra_json
from powerlens.cli import main
from test_spectra_cache import PROMPTS, tiny_decoder


def _block_matrix() -> np.ndarray:
    """F with eigenvalues 2 +- 1j (a rotation-scaling block), 0.5, -0.3 and 0, in a random basis."""
    blocks = np.zeros((5, 5))
    blocks[:2, :2] = [[2.0, -1.0], [1.0, 2.0]]
    blocks[2, 2], blocks[3, 3] = 0.5, -0.3
    Q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(5, 5)))
    return Q @ blocks @ Q.T


# ------------------------------------------------------------------ spectrum.json

def test_a_complex_pair_is_one_group_and_the_gap_is_to_the_next_group():
    (s,) = layer_spectra(_block_matrix())
    (entry,) = spectra_json([s])
    # every eigenvalue, in both orderings
    assert len(entry["eigenvalues_shifted"]) == len(entry["eigenvalues_plain"]) == 5
    # shifted keys |1 + lambda|: sqrt(10) (the pair), 1.5, 1 (lambda = 0), 0.7
    assert entry["groups_shifted"] == [2, 1, 1, 1]
    assert entry["gap"] == pytest.approx(np.sqrt(10) - 1.5, abs=1e-12)
    assert entry["ratio"] == pytest.approx(1.5 / np.sqrt(10), abs=1e-12)
    # plain keys |lambda|: sqrt(5) (the pair), 0.5, 0.3, 0
    assert entry["groups_plain"] == [2, 1, 1, 1]
    assert entry["gap_plain"] == pytest.approx(np.sqrt(5) - 0.5, abs=1e-12)
    # what a reader computes from the file: the key of the first entry of group 1 and group 2
    ev = np.array(entry["eigenvalues_shifted"])
    key = np.abs(1 + ev[:, 0] + 1j * ev[:, 1])
    assert key[0] - key[1] == pytest.approx(0.0, abs=1e-12)           # inside the pair: not a gap
    assert key[0] - key[entry["groups_shifted"][0]] == pytest.approx(entry["gap"], abs=1e-12)
    assert set(entry) <= set(LAYER_FIELDS)


def test_a_repeated_eigenvalue_is_one_group():
    F = np.diag([3.0, 3.0, 3.0 * (1 - 1e-6), 1.0, -0.5])
    (entry,) = spectra_json(layer_spectra(F))
    assert entry["groups_shifted"] == [3, 1, 1] and entry["dim"] == 3
    assert entry["gap"] == pytest.approx(4.0 - 2.0, rel=1e-5)


def test_spectrum_json_of_minilm_has_every_eigenvalue(tmp_path, capsys):
    out = tmp_path / "spec"
    assert main(["spectrum", "minilm", "--out", str(out)]) == 0
    doc = json.loads((out / "spectrum.json").read_text())
    assert set(doc["layer_fields"]) >= {"gap", "gap_plain", "groups_shifted", "eigenvalues_shifted"}
    for entry in doc["layers"]:
        assert len(entry["eigenvalues_shifted"]) == len(entry["eigenvalues_plain"]) == 384
        assert sum(entry["groups_shifted"]) == sum(entry["groups_plain"]) == 384
        assert entry["groups_shifted"][0] == entry["dim"]
        ev = np.array(entry["eigenvalues_shifted"])
        key = np.abs(1 + ev[:, 0] + 1j * ev[:, 1])
        assert np.all(np.diff(key) <= 1e-12)                            # sorted by |1 + lambda|
        assert key[0] - key[entry["dim"]] == pytest.approx(entry["gap"], abs=1e-9)
        assert entry["gap"] > 0
        assert set(entry) <= set(LAYER_FIELDS)


# ------------------------------------------------------------------ align.json per prompt

@pytest.fixture(scope="module")
def aligned():
    model = tiny_decoder(seed=4)
    return model, pl.align_model(model, PROMPTS, dynamics=pl.Dynamics())


def test_per_prompt_values_pool_to_the_reported_ones(aligned):
    model, res = aligned
    doc = res.to_json()
    for order in ("shifted", "plain"):
        pp = doc["orders"][order]["per_prompt"]
        steps = doc["orders"][order]["steps"]
        w = np.array(pp["n_tokens"], float)
        assert pp["n_tokens"] == [4, 3]
        g, r = (np.array([[np.nan if v is None else v for v in row] for row in pp[k]]) for k in ("gamma", "rho"))
        assert g.shape == r.shape == (2, len(steps))
        np.testing.assert_allclose(w @ g / w.sum(), [s["gamma"] for s in steps], rtol=1e-12)
        np.testing.assert_allclose((w @ r[:, 1:]) / w.sum(), [s["rho"] for s in steps[1:]], rtol=1e-12)
        # two prompts: se = 2 w1 w2 |v1 - v2| / W^2 (the cluster standard error, by hand)
        np.testing.assert_allclose(pp["gamma_se"], 2 * w[0] * w[1] * np.abs(g[0] - g[1]) / w.sum() ** 2, atol=1e-15)
        np.testing.assert_allclose(pp["rho_se"][1:], 2 * w[0] * w[1] * np.abs(r[0, 1:] - r[1, 1:]) / w.sum() ** 2,
                                   atol=1e-15)
        assert pp["rho_se"][0] is None
    # a prompt's own values are those of a run on it alone
    alone = pl.align_model(model, PROMPTS[1:], dynamics=pl.Dynamics()).measures["shifted"]
    np.testing.assert_allclose(res.measures["shifted"].prompt_gamma[1], alone.gamma, rtol=1e-5)
    np.testing.assert_allclose(res.measures["shifted"].prompt_rho[1, 1:], alone.rho[1:], rtol=1e-5)
    # read back from the JSON, as reproduce does
    shifted = doc["orders"]["shifted"]
    back = StepMeasures.from_rows(shifted["steps"], res.n_tokens, shifted["per_prompt"])
    np.testing.assert_allclose(back.standard_error("gamma"), res.measures["shifted"].standard_error("gamma"))


def test_trace_keeps_the_prompts_too(aligned):
    model, res = aligned
    tr = pl.trace(model, PROMPTS, dynamics=pl.Dynamics())
    np.testing.assert_allclose(tr.measures.prompt_gamma, res.measures["shifted"].prompt_gamma, rtol=1e-5, atol=1e-7)
    assert tr.measures.prompt_tokens.tolist() == [4, 3]


def test_align_json_of_the_cli_has_the_per_prompt_values(tmp_path, capsys):
    out = tmp_path / "al"
    texts = ["The cat sat on the mat.", "Power iteration finds the dominant eigenvector."]
    assert main(["align", "minilm", "--text", texts[0], "--text", texts[1], "--out", str(out), "--quiet"]) == 0
    doc = json.loads((out / "align.json").read_text())
    pp = doc["orders"]["shifted"]["per_prompt"]
    assert len(pp["gamma"]) == len(pp["rho"]) == len(pp["n_tokens"]) == 2
    assert len(pp["gamma"][0]) == len(doc["orders"]["shifted"]["steps"]) == 7
    assert "layer_fields" in doc


# ------------------------------------------------------------------ figures

def _renderer(fig):
    """An Agg renderer of ``fig`` after a draw (which also applies its layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_eigenvalue_suptitle_and_titles_do_not_overlap(tmp_path):
    rng = np.random.default_rng(1)
    spectra = layer_spectra(rng.normal(size=(12, 16, 16)) * np.linspace(0.3, 4.0, 12)[:, None, None])
    fig = plots.plot_eigenvalues(spectra, tmp_path / "e.png", title="a long title: eigenvalues of F_t = O_t V_t",
                                 return_fig=True)
    r = _renderer(fig)
    sup = fig._suptitle.get_window_extent(r)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title().startswith("layer")]
    titles = [ax.title.get_window_extent(r) for ax in panels]
    assert not any(_overlap(sup, t) for t in titles)
    insets = [c.title.get_window_extent(r) for ax in panels for c in ax.child_axes]
    assert not any(_overlap(i, t) for i in insets for t in titles)
    labels = [ax.xaxis.label.get_window_extent(r) for ax in panels]
    assert not any(_overlap(lab, t) for lab in labels for t in titles)


def _measures(L: int, B: int, seed: int = 0) -> StepMeasures:
    rng = np.random.default_rng(seed)
    T1 = L + 1
    g = rng.uniform(0.05, 0.3, size=(B, T1))
    rho = np.concatenate([np.full((B, 1), np.nan), rng.uniform(0.3, 0.9, size=(B, L))], axis=1)
    n = np.full(B, 5)
    nan_other = np.full(T1, np.nan) if L == 1 else rng.uniform(0.3, 0.6, T1)
    return StepMeasures(t=np.arange(T1), layer=np.arange(-1, L), gamma=g.mean(0), rho=rho.mean(0),
                        rotation=np.full(T1, np.nan), gamma_random=np.full(T1, 0.05), rho_random=np.full(T1, 0.5),
                        gamma_other_layer=nan_other, rho_other_layer=nan_other, rho_pvalue=np.full(T1, 0.5),
                        consensus=np.ones(T1), rank_collapse=np.ones(T1), pairwise_cos=np.zeros(T1),
                        chance_gamma=np.full(T1, 0.05), chance_band=np.full(T1, 0.01), n_tokens=int(n.sum()),
                        prompt_gamma=g, prompt_rho=rho, prompt_tokens=n)


def test_one_layer_alignment_has_no_other_layer_entry(tmp_path):
    m = _measures(1, 1)
    fig = plot_measures({"shifted": m, "plain": m}, str(tmp_path / "a.png"), over="layers", return_fig=True)
    labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert "other layer" not in labels and "random subspace" in labels
    assert not any("s.e." in lab for lab in labels)                     # one prompt: no band


def test_alignment_legends_outside_the_panels_and_error_bands(tmp_path):
    m = _measures(18, 3)
    fig = plot_measures({"shifted": m, "plain": _measures(18, 3, seed=1)}, str(tmp_path / "a.png"), over="layers",
                        marks={"global attention": [5, 11, 17]}, return_fig=True)
    r = _renderer(fig)
    for ax in fig.axes:
        leg = ax.get_legend().get_window_extent(r)
        assert leg.x0 >= ax.get_window_extent(r).x1                      # right of the panel: covers no point
        bands = [c for c in ax.collections if c.get_gid() == "error_band"]
        assert len(bands) == 2                                           # one per ordering
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "±1 s.e. across 3 prompts" in labels
    assert "other layer" in [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    # the band of gamma is pooled gamma -/+ the standard error across prompts
    band = [c for c in fig.axes[0].collections if c.get_gid() == "error_band"][0]
    ys = band.get_paths()[0].vertices[:, 1]
    se = m.standard_error("gamma")[1:]
    for edge in (m.gamma[1:] + se, m.gamma[1:] - se):
        assert all(np.min(np.abs(ys - v)) < 1e-12 for v in edge)


def test_binomial_interval_known_values():
    lo, hi = binomial_interval([0, 5, 10], 10)
    z2 = 1.959963984540054 ** 2
    np.testing.assert_allclose(lo, [0.0, 0.2365931, 10 / (10 + z2)], atol=1e-6)     # Wilson, 95 %
    np.testing.assert_allclose(hi, [z2 / (10 + z2), 0.7634069, 1.0], atol=1e-6)
    assert np.isnan(binomial_interval(0, 0)[0])


def test_bipartite_figure_has_binomial_intervals_and_starts_at_zero(tmp_path, monkeypatch):
    from powerlens._src.reproduce import synthetic
    rows = []
    for p, (H, beta, k) in enumerate([(1, 0.5, 9), (1, 2.0, 7), (4, 0.5, 2), (4, 2.0, 1)]):
        for i in range(10):
            rows.append({"point": p, "heads": H, "beta": beta, "bipartite_final": i < k,
                         "bipartite_drift": 1e-6 if H == 1 else 1e-2})
    monkeypatch.setattr(synthetic, "run_section", lambda ctx, name, desc: (None, pd.DataFrame(rows)))
    seen = {}
    real = plots.plot_curve

    def spy(*args, **kwargs):
        seen["fig"] = real(*args, **kwargs, return_fig=True)
        return args[2]

    monkeypatch.setattr(plots, "plot_curve", spy)

    class Ctx:
        quick = True

        def fig(self, name):
            return str(tmp_path / name)

    synthetic.section_bipartite(Ctx())
    ax = seen["fig"].axes[0]
    assert ax.get_ylim()[0] == 0.0
    bars = {c.get_label(): c for c in ax.containers}
    lo, hi = binomial_interval([9, 7], [10, 10])
    (one,) = [c for lab, c in bars.items() if lab.startswith("1 head")]
    segs = one.lines[2][0].get_segments()
    np.testing.assert_allclose([s[0][1] for s in segs], lo)
    np.testing.assert_allclose([s[1][1] for s in segs], hi)
    assert "95 % binomial interval" in one.get_label()
