"""report.html renders in headless Chromium and every embedded figure loads.

A small report is built with ``render_html`` from fake sections whose figures are tiny PNGs
made with matplotlib, then loaded by ``tools/render_report.py`` in headless Chromium.  The
browser's ``naturalWidth``/``naturalHeight`` of each image must equal the pixel size Pillow
reads from the PNG file (an independent decoder).  A deliberately corrupt PNG and a figure
whose file does not exist must be reported as not loaded / missing, so the check is not
vacuous.

Skipped, with the reason, when no Chromium is found (``make test`` installs the system package
``chromium`` with apt-get when it runs as root; ``make test HTML_TEST=no`` skips this instead,
which sets ``POWERLENS_HTML_TEST=no``).
"""
import importlib.util
import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("render_report", os.path.join(ROOT, "tools", "render_report.py"))
render_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_report)


def skip_reason():
    """Why the headless-browser check cannot run here, or None when it can."""
    if os.environ.get("POWERLENS_HTML_TEST", "").lower() == "no":
        return ("skipped on request (make test HTML_TEST=no, i.e. POWERLENS_HTML_TEST=no): "
                "the headless-browser check of report.html needs chromium")
    if render_report.find_chromium() is None:
        return ("no chromium on PATH (nor named by $CHROMIUM): the headless-browser check of report.html "
                "needs one; install it (apt-get install chromium) or set CHROMIUM to a Chrome/Chromium binary")
    return None


needs_browser = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def test_skip_reason_says_why_and_how(monkeypatch):
    """The browser tests are skipped on request or without a browser, each time saying why and
    what to do; with a browser found they run."""
    monkeypatch.setenv("POWERLENS_HTML_TEST", "no")
    assert "HTML_TEST=no" in skip_reason()
    monkeypatch.delenv("POWERLENS_HTML_TEST")
    monkeypatch.setattr(render_report, "find_chromium", lambda explicit=None: None)
    assert "apt-get install chromium" in skip_reason() and "CHROMIUM" in skip_reason()
    monkeypatch.setattr(render_report, "find_chromium", lambda explicit=None: "/usr/bin/chromium")
    assert skip_reason() is None

# name -> (width inches, height inches, dpi): pixel sizes 150x100, 80x80 and 800x320.
FIGS = {"line.png": (3.0, 2.0, 50), "square.png": (2.0, 2.0, 40), "wide.png": (10.0, 4.0, 80)}


def _make_fig(path, w, h, dpi, seed):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(w, h), dpi=dpi)
    ax.plot(np.random.default_rng(seed).standard_normal(20), label="x")
    ax.set_xlabel("step")
    ax.legend()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two reports in one folder: ``good.html`` (3 real figures) and ``bad.html`` (the same,
    plus a corrupt PNG and a figure whose file is missing)."""
    from PIL import Image
    from powerlens._src.reproduce.report import render_html
    from powerlens._src.reproduce.section import SectionResult, Table

    out = tmp_path_factory.mktemp("report")
    os.makedirs(out / "figures")
    sizes = {}
    for i, (name, (w, h, dpi)) in enumerate(FIGS.items()):
        path = out / "figures" / name
        _make_fig(path, w, h, dpi, i)
        with Image.open(path) as im:            # independent decoder: the pixel size on disk
            sizes[name] = im.size
    # bytes that start like a PNG but are garbage after the signature: base64 is valid, the
    # image is not decodable, so the browser must report naturalWidth == 0.
    (out / "figures" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"this is not image data" * 20)

    def sections(bad):
        s1 = SectionResult("one", "1. First claim", "A claim.", "supported", "All good.",
                           numbers={"checks": {"rate within 5%": True}},
                           figures=["figures/line.png", "figures/square.png"],
                           tables=[Table("numbers", ["a", "b"], [[1.0, 2.5], [float("nan"), None]])])
        s2 = SectionResult("two", "2. Second claim", "Another claim.", "partly supported", "Mixed.",
                           numbers={"checks": {"x": True, "y": False}},
                           figures=["figures/wide.png"] + (["figures/broken.png"] if bad else []))
        s3 = SectionResult("three", "3. Third claim", "A third.", "not supported", "No.",
                           figures=["figures/nowhere.png"] if bad else [])
        return [s1, s2, s3]

    settings = {"quick": True, "seed": 0, "versions": {"python": "3"}}
    paths = {}
    for kind in ("good", "bad"):
        p = out / f"{kind}.html"
        p.write_text(render_html(sections(kind == "bad"), settings, str(out)), encoding="utf-8")
        paths[kind] = str(p)
    return paths, sizes


@pytest.fixture(scope="module")
def checked(reports):
    paths, _ = reports
    return {k: render_report.check_images(p, timeout=90) for k, p in paths.items()}


@needs_browser
def test_every_figure_loads_with_its_true_pixel_size(reports, checked):
    _, sizes = reports
    res = checked["good"]
    assert res["title"] == "powerlens reproduce"
    assert res["images"] == 3 and res["loaded"] == 3
    assert res["missing"] == 0 and res["ok"] is True
    got = {d["alt"]: (d["width"], d["height"]) for d in res["details"]}
    assert got == sizes == {"line.png": (150, 100), "square.png": (80, 80), "wide.png": (800, 320)}
    assert all(d["complete"] for d in res["details"])
    # 3 sections + "Contents" + "Settings and versions"; one badge per section in the
    # table of contents and one in each section heading.
    assert res["headings"] == 5
    assert res["badges"] == 6


@needs_browser
def test_broken_and_missing_figures_are_detected(checked):
    res = checked["bad"]
    assert res["images"] == 4
    assert res["loaded"] == 3
    not_loaded = [d for d in res["details"] if not (d["complete"] and d["width"] > 0)]
    assert [d["alt"] for d in not_loaded] == ["broken.png"]
    assert not_loaded[0]["width"] == 0 and not_loaded[0]["height"] == 0
    assert res["missing"] == 1 and "figures/nowhere.png" in res["missing_text"][0]
    assert res["ok"] is False


@needs_browser
def test_wide_figures_get_a_full_row(reports):
    """Landscape figures (w >= 1.2 h, wider than 700 px) are marked ``wide``; the rest are not."""
    paths, _ = reports
    src = open(paths["good"], encoding="utf-8").read()
    classes = dict((alt, cls) for cls, alt in re.findall(r'<figure( class="wide")?><img alt="([^"]+)"', src))
    assert classes == {"line.png": "", "square.png": "", "wide.png": ' class="wide"'}


@needs_browser
def test_command_line_exit_codes_and_screenshot(reports, tmp_path, capsys):
    from PIL import Image
    paths, _ = reports
    assert render_report.main([paths["bad"]]) == 1
    out = capsys.readouterr().out
    assert "3/4 figures loaded, 1 missing" in out and "NOT LOADED: broken.png" in out
    shot = tmp_path / "shot.png"
    assert render_report.main([paths["good"], "--screenshot", str(shot), "--window-size", "640,480"]) == 0
    with Image.open(shot) as im:
        assert im.size == (640, 480)
        px = np.asarray(im.convert("L"), dtype=float)
    # the page is drawn: mostly white background with dark text (not a blank frame)
    assert px.mean() > 200 and px.min() < 80
    assert render_report.main([str(tmp_path / "absent.html")]) == 2


@needs_browser
def test_sweep_report_from_the_same_renderer_loads_its_figures(reports):
    """A sweep's report.html (the same renderer as reproduce's): its figures load at their true
    pixel size, and a figure whose file is missing is named on the page, not an error."""
    import types
    import pandas as pd
    from powerlens._src.sweeps.report import render_html
    paths, sizes = reports
    out = os.path.dirname(paths["good"])
    spec = types.SimpleNamespace(name="tiny", grid={"beta": [1.0, 2.0]}, model=None, replicates=2)
    df = pd.DataFrame({"beta": [1.0, 1.0, 2.0, 2.0], "final_gamma": [0.5, 0.7, float("nan"), 0.9]})
    page = os.path.join(out, "sweep.html")
    with open(page, "w", encoding="utf-8") as fh:
        fh.write(render_html(out, df, spec, {"spec": {"name": "tiny"}},
                             ["figures/line.png", "figures/wide.png", "figures/nowhere.png"]))
    res = render_report.check_images(page, timeout=90)
    assert res["title"] == "powerlens sweep: tiny"
    assert res["images"] == 2 and res["loaded"] == 2
    got = {d["alt"]: (d["width"], d["height"]) for d in res["details"]}
    assert got == {k: sizes[k] for k in ("line.png", "wide.png")}
    assert res["missing"] == 1 and "figures/nowhere.png" in res["missing_text"][0]
