"""Figures: each writes a real PNG, and what is drawn matches independently computed numbers."""
import os

import matplotlib.image as mpimg
import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.patches import Circle

from powerlens._src.analysis import plots as P
from powerlens._src.analysis.spectra import layer_spectra

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(path, min_kb=5.0, min_px=200):
    """A complete PNG: signature, size, decodes to an RGB(A) image, no temp file left."""
    assert os.path.exists(path), path
    assert not os.path.exists(path + ".tmp.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    assert os.path.getsize(path) > min_kb * 1024
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    assert img.shape[0] >= min_px and img.shape[1] >= min_px
    assert img[..., :3].std() > 0.01          # not blank
    return img.shape


def by_gid(fig, gid, kind=None):
    out = [a for ax in fig.axes for a in ax.get_children() if a.get_gid() == gid]
    return [a for a in out if kind is None or isinstance(a, kind)]


def line_by_label(ax, label):
    hits = [l for l in ax.get_lines() if l.get_label() == label]
    assert len(hits) == 1, [l.get_label() for l in ax.get_lines()]
    return hits[0]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("plots")


@pytest.fixture(scope="module")
def F_known():
    """Three layers with known spectra (Q D Q^T, so eigenvalues are exactly D):
    layer 0: dominant negative -3 -> plain top -3 (|1+l|=2), shifted top 1.5 (2.5): differ;
    layer 1: top 2.0, same in both orderings; layer 2: a complex pair 0.5 +- 2j on top."""
    rng = np.random.default_rng(1)
    d = 12
    Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    D0 = np.diag([-3.0, 1.5, 0.3, -0.2] + [0.1] * (d - 4))
    D1 = np.diag([2.0, 1.0, -0.5] + [0.05 * i for i in range(d - 3)])
    D2 = np.diag([0.0, 0.0, 0.4, -0.3] + [0.02 * i for i in range(d - 4)])
    D2[0, 1], D2[1, 0] = 2.0, -2.0
    D2[0, 0] = D2[1, 1] = 0.5
    return np.stack([Q @ D @ Q.T for D in (D0, D1, D2)])


def test_eigenvalues_figure_matches_spectra(out, F_known):
    spec = layer_spectra(F_known)
    path = str(out / "eig.png")
    fig = P.plot_eigenvalues(spec, path, title="known", return_fig=True)
    check_png(path, min_kb=20)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title().startswith("layer")]
    assert len(panels) == 3
    for ax, F in zip(panels, F_known):
        ev = np.linalg.eigvals(F)                                   # independent eigenvalues
        sc = [c for c in ax.collections if isinstance(c, PathCollection) and c.get_gid() == "eigenvalues"]
        assert len(sc) == 1
        pts = sc[0].get_offsets()
        assert pts.shape == (12, 2)                                 # one point per eigenvalue
        z = pts[:, 0] + 1j * pts[:, 1]
        np.testing.assert_allclose(np.sort_complex(z), np.sort_complex(ev), atol=1e-8)
        circles = {p.get_gid(): p for p in ax.patches if isinstance(p, Circle)}
        mu = np.sort(np.abs(1 + ev))[::-1]
        assert circles["circle_mu1"].get_radius() == pytest.approx(mu[0], rel=1e-9)
        assert tuple(circles["circle_mu1"].center) == (-1.0, 0.0)
        assert circles["unit_circle"].get_radius() == 1.0
        # mu2: first key outside the top group (a complex pair counts once)
        mu2 = mu[mu < mu[0] * (1 - 1e-6)][0]
        assert circles["circle_mu2"].get_radius() == pytest.approx(mu2, rel=1e-9)
        star = line_by_label(ax, "shifted top (max |1+λ|)")
        top = ev[np.argmax(np.abs(1 + ev))]
        np.testing.assert_allclose(star.get_xdata()[0], top.real, atol=1e-8)
        np.testing.assert_allclose(abs(star.get_ydata()[0]), abs(top.imag), atol=1e-8)
        square = line_by_label(ax, "plain top (max |λ|)")
        ptop = ev[np.argmax(np.abs(ev))]
        np.testing.assert_allclose(square.get_xdata()[0], ptop.real, atol=1e-8)
        # every eigenvalue inside the view (the mu1 circle encloses them all)
        x0, x1 = ax.get_xlim()
        y0, y1 = ax.get_ylim()
        assert (ev.real > x0).all() and (ev.real < x1).all() and (np.abs(ev.imag) < y1).all()
        assert ax.get_aspect() == 1.0
    assert "orderings differ" in panels[0].get_title()        # -3 vs 1.5
    assert "orderings differ" not in panels[1].get_title()    # 2.0 in both
    assert "orderings differ" not in panels[2].get_title()    # 0.5+2j in both (|.|=2.06, |1+.|=2.5)
    assert len(fig.legends) == 1                              # legend once


def test_eigenvalues_single_many_and_inset(out):
    rng = np.random.default_rng(0)
    spec = layer_spectra(rng.standard_normal((20, 6, 6)) / 3)
    fig = P.plot_eigenvalues(spec, str(out / "many.png"), max_panels=8, return_fig=True)
    check_png(str(out / "many.png"))
    shown = [ax for ax in fig.axes if ax.get_visible() and ax.get_title().startswith("layer")]
    assert len(shown) == 8
    assert [int(ax.get_title().split()[1]) for ax in shown][0::7] == [0, 19]   # first and last kept
    assert "8 of 20" in fig.get_suptitle()
    # one layer with a steered outlier (|1 + l1| ~ 31): a zoom inset shows -1 and the bulk
    u = rng.standard_normal(16)
    u /= np.linalg.norm(u)
    F = rng.standard_normal((16, 16)) / 10 + 30 * np.outer(u, u)
    path = P.plot_eigenvalues(layer_spectra(F)[0], str(out / "one.png"))
    assert path == str(out / "one.png")
    check_png(path)
    fig = P.plot_eigenvalues(layer_spectra(F), str(out / "one.png"), return_fig=True)
    insets = [c for ax in fig.axes for c in ax.child_axes if c.get_title() == "zoom on −1"]
    assert len(insets) == 1
    lo, hi = insets[0].get_xlim()
    assert lo < -2 and hi > 0 and hi - lo < 10


def test_alignment_figure(out):
    L = 7
    x = np.arange(L)
    rng = np.random.default_rng(2)
    g = {"shifted": rng.uniform(0.1, 0.3, L), "plain": rng.uniform(0.05, 0.2, L)}
    r = rng.uniform(0.4, 0.8, L)
    r[3] = np.nan                                   # undefined: a gap, not an error
    chance = np.sqrt(2 / (np.pi * 64))
    path = str(out / "align.png")
    fig = P.plot_alignment(x, g, r, path, chance=chance, chance_band=0.01,
                           gamma_controls={"random subspace": np.full(L, chance)},
                           rho_controls={"random subspace": np.full(L, 0.5), "other layer": np.full(L, 0.45)},
                           return_fig=True)
    check_png(path, min_kb=20)
    ax1, ax2 = fig.axes
    np.testing.assert_array_equal(line_by_label(ax1, "γ_t shifted").get_ydata(), g["shifted"])
    np.testing.assert_array_equal(line_by_label(ax1, "γ_t plain").get_ydata(), g["plain"])
    np.testing.assert_allclose(line_by_label(ax1, "chance (random direction)").get_ydata(), chance)
    band = ax1.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == pytest.approx(chance - 0.01) and band.max() == pytest.approx(chance + 0.01)
    np.testing.assert_array_equal(line_by_label(ax2, "ρ_t").get_ydata(), r)
    assert line_by_label(ax2, "0.5 (no preference)").get_ydata()[0] == 0.5
    assert {"random subspace", "other layer"} <= {l.get_label() for l in ax2.get_lines()}
    assert ax2.get_xlabel() == "layer t"
    with pytest.raises(ValueError, match="rho has length 5, expected 7"):
        P.plot_alignment(x, g, r[:5], str(out / "bad.png"), chance=chance)
    with pytest.raises(ValueError, match="chance must be a number or have length 7"):
        P.plot_alignment(x, g, r, str(out / "bad.png"), chance=[0.1, 0.2])
    assert not os.path.exists(out / "bad.png")


def test_consensus_figure_predicted_line(out):
    T = 40
    t = np.arange(T + 1)
    rate, C = 0.7, 0.9
    cons = C * rate ** t
    cons[-3:] = 0.0                                     # exact consensus: gaps on the log axis
    path = str(out / "cons.png")
    fig = P.plot_consensus(cons, path, rank_collapse=0.5 * cons, pairwise_cos=1 - cons,
                           predicted_rate={"|μ2/μ1|": 0.8}, fit_start=10, return_fig=True)
    check_png(path, min_kb=20)
    ax, ax2 = fig.axes
    assert ax.get_yscale() == "log" and ax2.get_yscale() == "linear"
    pred = [l for l in ax.get_lines() if l.get_label().startswith("|μ2/μ1|")][0]
    np.testing.assert_allclose(pred.get_xdata(), t[10:])
    np.testing.assert_allclose(pred.get_ydata(), cons[10] * 0.8 ** (t[10:] - 10), rtol=1e-12)
    mu = [l for l in ax.get_lines() if l.get_label().startswith("μ(X_t)")][0].get_ydata()
    assert np.isnan(mu[-3:]).all() and np.allclose(mu[:-3], cons[:-3])
    y0, y1 = ax.get_ylim()
    assert y0 <= cons[T - 3] and y1 >= cons[0]
    # a bare call: one panel, a plain rate
    fig = P.plot_consensus(C * rate ** t, str(out / "cons1.png"), predicted_rate=rate, return_fig=True)
    assert len(fig.axes) == 1
    line = line_by_label(fig.axes[0], f"predicted: C·r^t, r = {rate:.4g}")
    np.testing.assert_allclose(line.get_ydata(), C * rate ** t, rtol=1e-12)  # through t=0, slope = data
    with pytest.raises(ValueError, match="predicted_rate 'predicted' must be a positive"):
        P.plot_consensus(cons, str(out / "bad.png"), predicted_rate=-0.5)
    with pytest.raises(ValueError, match="rank_collapse has length 3"):
        P.plot_consensus(cons, str(out / "bad.png"), rank_collapse=[1, 2, 3])


def test_trajectories_projection(out):
    rng = np.random.default_rng(3)
    T, n, d = 20, 50, 6
    Qb, _ = np.linalg.qr(rng.standard_normal((d, d)))
    e1, e2, rest = Qb[:, 0], Qb[:, 1], Qb[:, 2:]
    # rotating tokens that tilt into the plane: coordinates known in closed form
    theta = rng.uniform(0, 2 * np.pi, n)[None] + 0.3 * np.arange(T + 1)[:, None]          # (T+1, n)
    r_in = np.linspace(0.2, 1.0, T + 1)[:, None] * np.ones((1, n))
    ortho = rng.standard_normal((n, d - 2))
    ortho /= np.linalg.norm(ortho, axis=1, keepdims=True)
    states = 3.0 * (r_in[..., None] * (np.cos(theta)[..., None] * e1 + np.sin(theta)[..., None] * e2)
                    + np.sqrt(1 - r_in ** 2)[..., None] * (ortho @ rest.T)[None])
    path = str(out / "traj.png")
    fig = P.plot_trajectories(states, np.stack([e1, e2], 1), path, max_tokens=10, return_fig=True)
    check_png(path, min_kb=15)
    ax = fig.axes[0]
    paths = [l for l in ax.get_lines() if l.get_label().startswith("_")]
    paths = [l for l in paths if len(l.get_xdata()) == T + 1]
    assert len(paths) == 10
    idx = np.unique(np.linspace(0, n - 1, 10).round().astype(int))
    for l, j in zip(paths, idx):
        np.testing.assert_allclose(l.get_xdata(), r_in[:, j] * np.cos(theta[:, j]), atol=1e-12)
        np.testing.assert_allclose(l.get_ydata(), r_in[:, j] * np.sin(theta[:, j]), atol=1e-12)
    ends = ax.collections[-1].get_offsets()
    np.testing.assert_allclose(np.hypot(ends[:, 0], ends[:, 1]), 1.0, atol=1e-12)   # last step in the plane
    assert ax.get_aspect() == 1.0
    # batch (T+1, B, n, d) and a 1-D subspace (coordinate against the step)
    fig = P.plot_trajectories(states.reshape(T + 1, 5, 10, d), e1[:, None], str(out / "traj1.png"), return_fig=True)
    check_png(str(out / "traj1.png"))
    assert fig.axes[0].get_xlabel() == "step t"
    with pytest.raises(ValueError, match=r"basis must have shape \(d, 2\) or \(d, 1\) with d=6"):
        P.plot_trajectories(states, np.ones((5, 2)), str(out / "bad.png"))


def test_histogram_bars_curve_scatter(out):
    rng = np.random.default_rng(4)
    before, after = rng.beta(2, 20, 500), rng.beta(20, 2, 300)
    path = str(out / "hist.png")
    fig = P.plot_histogram_before_after(before, after, path, bins=20, return_fig=True)
    check_png(path)
    ax = fig.axes[0]
    heights = {g: np.array([p.get_height() for p in ax.patches if p.get_gid() == g]) for g in ("before", "after")}
    edges = np.linspace(0, 1, 21)
    np.testing.assert_array_equal(heights["before"], np.histogram(before, edges)[0])
    np.testing.assert_array_equal(heights["after"], np.histogram(after, edges)[0])
    assert heights["before"].sum() == 500 and heights["after"].sum() == 300

    x = np.logspace(-1, 2, 12)
    path = str(out / "curve.png")
    fig = P.plot_curve(x, {"a": x / (1 + x), "b": 1 / (1 + x)}, path, xlabel="α", ylabel="γ", logx=True,
                       hlines={"chance": 0.1}, return_fig=True)
    check_png(path)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "α"
    np.testing.assert_allclose(line_by_label(ax, "a").get_ydata(), x / (1 + x))
    np.testing.assert_allclose(line_by_label(ax, "chance").get_ydata(), 0.1)
    with pytest.raises(ValueError, match="logx=True needs positive x"):
        P.plot_curve(x - 1, x, str(out / "bad.png"), xlabel="x", ylabel="y", logx=True)

    labels = [" the", "\n", "$x", "Paris", "a"]
    pb, pa = np.array([0.4, 0.3, 0.15, 0.1, 0.05]), np.array([0.05, 0.1, 0.2, 0.6, 0.05])
    path = str(out / "bars.png")
    fig = P.plot_bars(labels, pb, pa, path, return_fig=True)
    check_png(path)
    ax = fig.axes[0]
    np.testing.assert_allclose([p.get_height() for p in ax.patches if p.get_gid() == "before"], pb)
    np.testing.assert_allclose([p.get_height() for p in ax.patches if p.get_gid() == "after"], pa)
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["' the'", "'\\n'", r"\$x", "Paris", "a"]     # whitespace visible, no mathtext
    with pytest.raises(ValueError, match="values_after has length 2, expected 5"):
        P.plot_bars(labels, pb, pa[:2], str(out / "bad.png"))

    pred = rng.uniform(0.1, 0.9, 60)
    meas = pred + 0.01 * rng.standard_normal(60)
    path = str(out / "scatter.png")
    fig = P.plot_scatter_predicted(pred, meas, path, xlabel="predicted |μ2/μ1|", ylabel="measured rate",
                                   return_fig=True)
    check_png(path)
    ax = fig.axes[0]
    diag = by_gid(fig, "diagonal")[0]
    np.testing.assert_array_equal(diag.get_xdata(), diag.get_ydata())
    assert diag.get_xdata()[0] <= min(pred.min(), meas.min()) and diag.get_xdata()[1] >= max(pred.max(), meas.max())
    np.testing.assert_allclose(by_gid(fig, "points")[0].get_offsets(), np.stack([pred, meas], 1))
    assert ax.get_xlim() == ax.get_ylim()



def test_scatter_of_angles_draws_each_measured_value_on_the_branch_of_its_prediction(out):
    """Rotations predicted at pi - 0.01 and measured at -pi + 0.01 (the same angle, on the
    other side of the cut) are 0.02 off: with ``angles`` the point is drawn at pi + 0.01 and
    the legend's median error is 0.02, not 2 pi - 0.02 (what plain values give)."""
    pred = np.array([np.pi - 0.01, 0.5, -np.pi + 0.03])
    meas = np.array([-np.pi + 0.01, 0.52, np.pi - 0.01])
    fig = P.plot_scatter_predicted(pred, meas, str(out / "angles.png"), xlabel="p", ylabel="m",
                                   angles=True, return_fig=True)
    check_png(str(out / "angles.png"))
    pts = by_gid(fig, "points")[0]
    np.testing.assert_allclose(pts.get_offsets(), [[np.pi - 0.01, np.pi + 0.01], [0.5, 0.52],
                                                   [-np.pi + 0.03, -np.pi - 0.01]], atol=1e-12)
    assert "median |meas − pred| = 0.02" in pts.get_label()
    plain = P.plot_scatter_predicted(pred, meas, str(out / "plain.png"), xlabel="p", ylabel="m", return_fig=True)
    assert "median |meas − pred| = 6.2" in by_gid(plain, "points")[0].get_label()

def test_save_is_atomic_and_checked(out):
    with pytest.raises(ValueError, match="must end in .png"):
        P.plot_curve([0, 1], [0, 1], str(out / "x.pdf"), xlabel="x", ylabel="y")
    # overwriting an existing figure replaces it whole, and creates missing folders
    path = str(out / "sub" / "dir" / "c.png")
    P.plot_curve([0, 1, 2], [0, 1, 4], path, xlabel="x", ylabel="y")
    size1 = os.path.getsize(path)
    P.plot_curve(np.arange(30), np.arange(30) ** 2, path, xlabel="x", ylabel="y", title="again")
    check_png(path)
    assert os.path.getsize(path) != size1
    assert sorted(os.listdir(out / "sub" / "dir")) == ["c.png"]


def test_group_bars_heights(tmp_path):
    from powerlens._src.analysis.plots import plot_group_bars
    series = {"before": [0.01, 0.02], "rank-1": [0.3, 0.1], "act. add.": [0.6, 0.05]}
    fig = plot_group_bars(["closed", "gradient"], series, str(tmp_path / "g.png"), ylabel="P", logy=True,
                          return_fig=True)
    ax = fig.axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == sorted([0.01, 0.02, 0.3, 0.1, 0.6, 0.05])
    assert ax.get_yscale() == "log" and (tmp_path / "g.png").stat().st_size > 5000
