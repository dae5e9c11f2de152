"""Issue "The first hour with traces and steering", the steering parts: edits as files, progress
on stderr, summaries that say what happened.

- The round trip steer -> edit.npz -> pl.load_edit -> pl.apply_edit -> the model's own forward
  pass and pl.generate reproduces steer.json's target probability (1e-4) and continuation, for
  the learned dO and the activation-addition vector; ``steer MODEL --apply edit.npz`` reports
  the same numbers; a model whose edited layer differs is refused in one line.
- A non-quiet ``steer --objective token`` prints progress on stderr (a line per stage and one at
  least every 4 s), counted here; the numbers are bitwise those of a run without progress.
- Every method that misses its target says "not reached"; control KLs are >= 0 (float64);
  frontier.png leaves failed points off its axes; a direction edit reports the signed cosine.

The model is a tiny random Llama folder (tests/hf_tiny_decoders.py) with a word-level tokenizer,
the setting of tests/test_steer_token_cli_outputs.py.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
import hf_tiny_decoders as T  # noqa: E402
from test_steer_token_cli_outputs import CONTROLS, PROMPTS, _write_tokenizer  # noqa: E402

import powerlens as pl  # noqa: E402
from next_token import last_token_probs  # noqa: E402
from powerlens.cli import main  # noqa: E402

TARGET_PROB, MAX_KL, LAYER = 0.5, 0.5, 1


def _cli(argv):
    printed, errors = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(argv)
    return code, printed.getvalue(), errors.getvalue(), time.monotonic() - t0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("edits")
    folder = root / "tiny"
    T.build("llama", str(folder), seed=1, head=True, vocab_size=61, num_hidden_layers=3)
    _write_tokenizer(folder)
    (root / "controls.txt").write_text("\n".join(CONTROLS) + "\n")
    out = root / "out"
    argv = ["steer", str(folder), "--direction", "token:London", "--optimize", "--objective", "token",
            "--target-prob", str(TARGET_PROB), "--max-kl", str(MAX_KL), "--steps", "30", "--layer", str(LAYER),
            "--controls", str(root / "controls.txt"), "--out", str(out)]
    for p in PROMPTS:
        argv += ["--text", p]
    code, printed, errors, wall = _cli(argv)
    assert code == 0, errors
    return dict(root=root, folder=folder, out=out, printed=printed, errors=errors, wall=wall,
                doc=json.loads((out / "steer.json").read_text()), model=pl.load(str(folder)))


# ------------------------------------------------------------------ edits as files

def test_round_trip_reproduces_steer_json(run):
    doc, model = run["doc"], run["model"]
    tid = doc["effects"]["target_id"]
    cond = doc["effects"]["conditions"]
    edit = pl.load_edit(run["out"] / "edit.npz")
    assert (edit.kind, edit.layer, edit.rank) == ("delta_O", LAYER, 1)
    assert edit.target["token_id"] == tid and edit.target["target_prob"] == TARGET_PROB
    assert edit.norm == pytest.approx(cond["gradient"]["delta_norm"], rel=1e-6)
    np.testing.assert_array_equal(edit.delta_O, np.load(run["out"] / "delta_O.npy"))   # the same edit
    steered = pl.apply_edit(model, edit)
    p = last_token_probs(steered, PROMPTS)[:, tid]
    np.testing.assert_allclose(p, cond["gradient"]["target_prob"], atol=1e-4)
    assert np.all(p >= TARGET_PROB - 1e-4)
    assert pl.generate(steered, PROMPTS, max_new_tokens=12).text == cond["gradient"]["continuation"]
    # the path works too, and the activation-addition vector round-trips the same way
    act = pl.load_edit(run["out"] / "edit_activation_addition.npz")
    assert act.kind == "activation" and act.vector.shape == (model.layers.config.d_model,)
    p_act = last_token_probs(pl.apply_edit(model, str(run["out"] / "edit_activation_addition.npz")), PROMPTS)[:, tid]
    np.testing.assert_allclose(p_act, cond["activation_addition"]["target_prob"], atol=1e-4)


def test_apply_option_reports_the_same_numbers(run, tmp_path):
    code, printed, errors, _ = _cli(["steer", str(run["folder"]), "--apply", str(run["out"] / "edit.npz"),
                                     *sum((["--text", p] for p in PROMPTS), []), "--out", str(tmp_path / "a")])
    assert code == 0, errors
    got = json.loads((tmp_path / "a" / "steer.json").read_text())["effects"]["conditions"]
    want = run["doc"]["effects"]["conditions"]
    np.testing.assert_allclose(got["edit"]["target_prob"], want["gradient"]["target_prob"], atol=1e-6)
    assert got["edit"]["control_kl_mean"] == pytest.approx(want["gradient"]["control_kl_mean"], abs=1e-6)
    assert "applied" in printed and "p(" in printed


def test_apply_edit_refuses_another_model(run, tmp_path):
    edit = pl.load_edit(run["out"] / "edit.npz")
    edited = pl.apply_edit(run["model"], edit)
    with pytest.raises(ValueError, match="whose layer 1 has sha256") as info:
        pl.apply_edit(edited, edit)                        # the same model, already edited there
    assert "\n" not in str(info.value) and "already edited" in str(info.value)
    other = tmp_path / "other"
    T.build("llama", str(other), seed=2, head=True, vocab_size=61, num_hidden_layers=3)
    _write_tokenizer(other)
    with pytest.raises(ValueError, match="sha256"):
        pl.apply_edit(pl.load(str(other)), edit)
    code, _, errors, _ = _cli(["steer", str(other), "--apply", str(run["out"] / "edit.npz"), "--text", "Hi",
                               "--out", str(tmp_path / "x")])
    assert code == 2 and "sha256" in errors and len(errors.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_edit_file_format(run, tmp_path):
    """Every kind saves and loads unchanged (arrays bitwise, metadata); bad files are one line."""
    model = run["model"]
    d, He = model.layers.config.d_model, model.layers.W_o.shape[-1]
    rng = np.random.default_rng(0)
    u, w = rng.normal(size=d), rng.normal(size=He)
    edits = {"r1": pl.make_edit(model, "rank1", -1, delta_O=2.0 * np.outer(u, w), u=u, w=w, alpha=2.0),
             "dO": pl.make_edit(model, "delta_O", 0, delta_O=rng.normal(size=(d, He)).astype(np.float32)),
             "v": pl.make_edit(model, "activation", 2, vector=rng.normal(size=d))}
    for name, e in edits.items():
        pl.save_edit(tmp_path / f"{name}.npz", e)
        back = pl.load_edit(tmp_path / f"{name}.npz")
        assert back.kind == e.kind and back.layer == e.layer and back.alpha == e.alpha
        assert back.model == e.model and back.metadata() == e.metadata()
        for k, a in e.arrays.items():
            assert back.arrays[k].dtype == a.dtype and np.array_equal(back.arrays[k], a)
    assert edits["r1"].rank == 1 and edits["r1"].layer == 2 and edits["dO"].rank == min(d, He)
    meta = edits["r1"].metadata()
    assert meta["format"] == "powerlens-edit" and meta["version"] == 1 and meta["dtype"] == "float32"
    assert meta["norm"] == pytest.approx(2.0 * np.linalg.norm(u) * np.linalg.norm(w))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="is not a powerlens edit"):
        pl.load_edit(tmp_path / "junk.npz")
    np.savez(tmp_path / "plain.npz", delta_O=np.zeros((d, He)))
    with pytest.raises(ValueError, match="has no powerlens metadata"):
        pl.load_edit(tmp_path / "plain.npz")
    newer = dict(meta, version=2)
    np.savez(tmp_path / "newer.npz", metadata=np.asarray(json.dumps(newer)), **edits["r1"].arrays)
    with pytest.raises(ValueError, match="newer than this powerlens reads"):
        pl.load_edit(tmp_path / "newer.npz")


# ------------------------------------------------------------------ progress

def test_progress_lines_on_stderr(run):
    """One line per stage (start and end) and one at least every 4 s while a stage runs: the
    count is at least the wall time over 5 s and at least the 2 x 5 stage lines."""
    lines = [ln for ln in run["errors"].splitlines() if ln.startswith("steer: ")]
    assert len(lines) >= max(10, run["wall"] / 5), (run["wall"], lines)
    text = "\n".join(lines)
    assert "gradient dO (rank <= 1): 30 Adam steps at levels 0.1/0.3/0.5/0.9" in text
    assert "activation addition: 30 Adam steps" in text
    assert "Adam step 30/30" in text or "gradient dO (rank <= 1): done" in text
    assert "p min " in text and ", KL " in text
    # the printed plan says what runs
    assert "4 methods" in run["printed"] and "30 Adam steps at the levels 0.1/0.3/0.5/0.9" in run["printed"]


def test_progress_is_bitwise_neutral_and_quiet_is_silent():
    from test_steer_token import tiny_decoder
    from powerlens._src.steering.progress import SteerProgress
    model = tiny_decoder(1, vocab=5)
    x0 = np.random.default_rng(0).normal(size=(2, 3, 6)).astype(np.float32)
    kw = dict(objective="token", target_prob=[0.3, 0.9], max_kl=5.0, controls=[[1, 2], [3]], steps=20)
    for param in ("lowrank", "activation"):
        a = pl.optimize_steering(model, x0, [0, 0], param=param, **kw)
        stream = io.StringIO()
        with SteerProgress(True, stream=stream, interval=0.01) as progress:
            progress.stage("test", total=20, levels=[0.3, 0.9])
            b = pl.optimize_steering(model, x0, [0, 0], param=param, progress=True, **kw)
        assert "Adam step 20/20" in stream.getvalue() or "test: done" in stream.getvalue()
        for f in ("factor_P", "factor_Q", "norm", "target_prob", "control_kl", "shrink", "history_norm"):
            assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f
    # the alignment objective (steer --optimize) reports through the same loop
    u = np.random.default_rng(1).normal(size=6)
    a = pl.optimize_steering(model.layers, x0, u, target=0.9, steps=20)
    stream = io.StringIO()
    with SteerProgress(True, stream=stream, interval=0.01) as progress:
        progress.stage("align", total=20, levels=[0.9], value="worst alignment")
        b = pl.optimize_steering(model.layers, x0, u, target=0.9, steps=20, progress=True)
    for f in ("factor_P", "factor_Q", "norm", "alignment", "history_alignment"):
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f
    stream = io.StringIO()
    with SteerProgress(False, stream=stream) as progress:
        progress.stage("quiet", total=3)
        pl.optimize_steering(model, x0, [0, 0], param="activation", progress=True, **kw)
    assert stream.getvalue() == ""


def test_help_says_what_runs(capsys):
    with pytest.raises(SystemExit):
        main(["steer", "--help"])
    out = capsys.readouterr().out
    assert "0.1/0.3/0.5/0.9" in out and "activation addition" in out and "Adam steps" in out
    assert "--apply" in out and "--quiet" in out


# ------------------------------------------------------------------ summaries

def test_missed_targets_say_not_reached(run):
    conds = run["doc"]["effects"]["conditions"]
    lines = {ln.split()[0]: ln for ln in run["printed"].splitlines() if ln.startswith("  ") and ln.split()}
    for name in ("closed_form_paper_alpha", "closed_form_token_alpha", "gradient", "activation_addition"):
        c = conds[name]
        ok = min(c["target_prob"]) >= TARGET_PROB - 1e-5 and c["control_kl_mean"] <= MAX_KL + 1e-5
        assert c["reaches_target"] == ok
        assert ("not reached" in lines[name]) == (not ok), lines[name]
    assert conds["gradient"]["reaches_target"]
    assert any(not conds[n]["reaches_target"] for n in conds if n != "before")      # this run has a miss


def test_kl_is_never_negative(run):
    from powerlens._src.steering.compare import kl_rows
    conds = run["doc"]["effects"]["conditions"]
    assert conds["before"]["control_kl_mean"] == 0.0                  # the unedited model: exactly 0
    assert all(c["control_kl_mean"] >= 0.0 for c in conds.values())
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 50)) * 30
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    assert np.array_equal(kl_rows(logp, logp), np.zeros(3))
    q = logp + 1e-9 * rng.normal(size=logp.shape)                      # rounding-size differences
    assert np.all(kl_rows(logp, q) >= 0.0)


def test_frontier_leaves_failed_points_off_the_axes(monkeypatch, tmp_path):
    import powerlens._src.analysis.plots as plots
    from powerlens._src.steering.compare import plot_frontier
    seen = {}
    real = plots.save_figure

    def keep(fig, path, **kw):
        seen["fig"] = fig
        return real(fig, path, **kw)

    monkeypatch.setattr(plots, "save_figure", keep)
    curves = {"good": [(10.0, 0.3, True), (20.0, 0.6, True)], "failed": [(1e-5, 0.001, False), (30.0, 0.9, True)]}
    plot_frontier(curves, tmp_path / "f.png", levels=[0.5])
    ax = seen["fig"].axes[0]
    lo, hi = ax.get_xlim()
    assert lo > 1e-3 and hi < 1e3                            # the failure at beta 1e-5 does not stretch it
    notes = " ".join(t.get_text() for t in seen["fig"].texts)
    assert "not reached" in notes and "failed: 1 of 2" in notes
    assert (tmp_path / "f.png").stat().st_size > 5000


def test_direction_summary_reports_signed_cosine(tmp_path):
    """A random system on which no alpha gives every token cos(x, u) >= 0.9 with w = value (a
    token has s = w.m < 0): the default (signed) target falls back to the sign-free alpha and
    says "not reached"; --sign-free reaches its own target."""
    rng = np.random.default_rng(2)
    D, H, e = 8, 2, 3
    np.savez(tmp_path / "sys.npz", W_q=rng.normal(size=(H, e, D)), W_k=rng.normal(size=(H, e, D)),
             W_v=rng.normal(size=(H, e, D)) / np.sqrt(D), W_o=rng.normal(size=(D, H * e)) / np.sqrt(H * e))
    np.save(tmp_path / "x0.npy", rng.normal(size=(2, 5, D)))
    np.save(tmp_path / "u.npy", rng.normal(size=D))
    base = ["steer", "--weights", str(tmp_path / "sys.npz"), "--init", str(tmp_path / "x0.npy"),
            "--direction", str(tmp_path / "u.npy"), "--target-alignment", "0.9"]
    code, printed, errors, _ = _cli(base + ["--out", str(tmp_path / "s")])
    assert code == 0, errors
    a = json.loads((tmp_path / "s" / "steer.json").read_text())
    al = a["alignment"]
    if "signed_target_unreachable" in a:
        assert not a["reaches_target"] and "not reached" in printed
        assert "signed cos(x, u) mean" in printed
    else:
        assert al["signed"] and al["signed_min_after"] >= 0.9 - 2e-5 and "reached" in printed
    assert al["signed_mean_after"] == pytest.approx(np.mean(al["after"] if al["signed"] else
                                                            al["signed_mean_after"]), abs=1e-12)
    code, printed, errors, _ = _cli(base + ["--sign-free", "--out", str(tmp_path / "f")])
    assert code == 0, errors
    f = json.loads((tmp_path / "f" / "steer.json").read_text())
    assert not f["alignment"]["signed"] and f["alignment"]["min_after"] >= 0.9 - 2e-5
    assert f["reaches_target"] == (f["alignment"]["signed_mean_after"] >= 0)
