"""The benchmark scripts run in their tiny configurations: in benchmarks/vs_torch.py powerlens and
the torch code agree (the numbers it times are the same computation), and each script's results
file (benchmarks/benchdoc.py) holds what the run printed. No timing is asserted."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.mark.slow
def test_tiny_configuration_agrees_with_torch(capsys, tmp_path):
    import benchdoc
    import vs_torch
    doc = tmp_path / "vs_torch.md"
    lines = vs_torch.main(["--tiny", "--repeat", "1", "--doc", str(doc)])
    # the results file: its command, workload A's table (MiniLM at 1 x 16 and 2 x 8), then B-E's
    text = doc.read_text()
    assert f"- command: `python benchmarks/vs_torch.py --tiny --repeat 1 --doc {benchdoc.scrub(str(doc))}`" in text
    assert [row.split(" | ")[:2] for row in benchdoc.first_table(text)[2:]] == [["| MiniLM", "1 × 16"],
                                                                             ["| MiniLM", "2 × 8"]]
    assert "| B | minilm layer 3 1x32 T=20 |" in text and "| E | minilm last layer 8 dirs api 20 Adam steps |" in text
    assert {x["workload"] for x in lines} == {"A", "B", "C", "D", "E"}
    for x in lines:
        if "rel_err" in x:
            assert x["rel_err"] < 1e-5, x
        if "abs_err" in x and x["workload"] != "D":      # D: per system, below
            assert x["abs_err"] < 1e-3, x
        if "ratio" in x:
            assert x["ratio"] > 0
    out = capsys.readouterr().out
    assert "matmul 2048^3" in out
    rates = [ln for ln in out.splitlines() if ln.endswith("% of the large matmul")]
    assert len(rates) == 2 and all(ln.startswith("A minilm ") for ln in rates)     # 1x16 and 2x8
    # E: the steering optimiser, the solve alone and end to end, each with a printed ratio
    e = {x["what"].split()[0]: x for x in lines if x["workload"] == "E"}
    assert set(e) == {"solve", "api"}
    assert [ln for ln in out.splitlines() if ln.startswith("E ") and "ratio=" in ln and "solve" in ln]
    assert [ln for ln in out.splitlines() if ln.startswith("E ") and "ratio=" in ln and "api" in ln]
    for x in e.values():
        k = int(x["size"].split()[0])
        assert x["feasible"] == f"{k}/{k}/{k}", x          # every direction feasible on both sides
        assert x["closed_rel_max"] < 1e-4, x               # the bisection for the closed form
        # float32, 20 Adam steps: ~1e-5 on the shared problem; end to end the entering states
        # differ at float32 rounding and Adam's early sign-like steps amplify it: measured
        # 3e-4 on one CPU and 5.6e-3 (one direction of 8, its ||dO|| within 1.8e-3) on another
        assert x["norm_rel_median"] < 1e-2, x
        assert x["align_abs_max"] < (1e-3 if x["what"].startswith("solve") else 2e-2), x
    # the same maths: float64 on both sides agrees to rounding over every step
    assert e["solve"]["f64_hist_rel_max"] < 1e-9, e["solve"]
    assert e["solve"]["norm_rel_max"] < 1e-3, e["solve"]
    # D: the sweep's final tokens (8 systems, 10 steps). In float32 a random system may amplify
    # rounding (one of the 8 ends 3.9e-3 apart); the typical one stays at rounding, at most one is
    # apart, and in float64 on both sides (every step here) all agree to rounding: the same maths
    (dline,) = [x for x in lines if x["workload"] == "D"]
    assert dline["f64_steps"] == 10 and dline["f64_abs_err"] < 1e-10, dline
    assert dline["abs_err_median"] < 1e-5, dline
    assert int(dline["apart"].split("/")[0]) <= 1, dline


def test_paper_flops_counts_the_four_matmuls():
    """The FLOPs behind the printed matmul rate, against the count by hand: MiniLM at 8 x 128
    (6 layers of 12 heads of 32, d = 384) 8.46 GFLOP; SmolLM2 (30 layers, d = 576, 9 query
    heads over 3 key/value heads of 64) 63.4 GFLOP."""
    import vs_torch
    from powerlens._src.dynamics.params import LayerConfig
    minilm = LayerConfig(d_model=384, n_heads=12, d_head=32)
    qkv, scores_and_mix, out = 2 * 128 * 384 * 1152, 2 * 2 * 12 * 128 * 128 * 32, 2 * 128 * 384 * 384
    assert vs_torch.paper_flops(minilm, 6, 8, 128) == 6 * 8 * (qkv + scores_and_mix + out) == 8_455_716_864
    smollm2 = LayerConfig(d_model=576, n_heads=9, n_kv_heads=3, d_head=64)
    assert vs_torch.paper_flops(smollm2, 30, 8, 128) == 63_417_876_480


@pytest.mark.slow
def test_gpu_script_runs_on_cpu(tmp_path):
    """benchmarks/gpu.py (workloads A-E, powerlens only) runs on whatever device JAX sees and
    writes a JSON of timings: every workload present, every time positive; the cuDNN entries
    (GPU only) say why they were skipped."""
    import json

    import gpu
    out = tmp_path / "t.json"
    doc = gpu.main(["--tiny", "--repeat", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert {r["workload"] for r in doc["results"]} == {"A", "B", "C", "D", "E"}
    skipped = [r for r in doc["results"] if "skipped" in r]
    assert all(r["seconds"] > 0 for r in doc["results"] if r not in skipped)
    assert doc["platform"] == "cpu"
    assert len(skipped) == 2 and all(r["what"] == "states bfloat16 cudnn" and "needs an NVIDIA GPU" in r["skipped"]
                                     for r in skipped)


@pytest.mark.slow
def test_sweep_script_tiny(tmp_path):
    """benchmarks/sweep.py on a tiny workload: each variant ran in its own process(es) with the
    device and process counts it names, swept every system, and resuming from a finished folder
    computed nothing (the "computed fraction" of the half-present run is what was removed)."""
    import sweep
    one, many, two = sweep.main(["--systems", "64", "--steps", "4", "--kernel-systems", "16", "--tmp", str(tmp_path),
                                 "--no-doc"])
    assert (one["devices"], one["processes"]) == (1, 1)
    assert (many["devices"], many["processes"]) == (os.cpu_count() or 1, 1)
    assert (two["devices"], two["processes"]) == (2, 2)
    assert one["systems"] == many["systems"] == two["systems"] == 64
    assert 0 < one["resume_computed_fraction"] <= 1 and many["kernel_systems"] == 16


def test_memory_script_quick(tmp_path, capsys):
    """benchmarks/memory.py --quick: every case ran in its own process and reported its peaks; the
    JSON holds what was printed. Sanity only (no memory bound is asserted here)."""
    import json

    import memory
    out = tmp_path / "m.json"
    doc = memory.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    text = capsys.readouterr().out
    assert "bound: parameters + 4 x activations" in text and "load: peak RSS" in text
    run = doc["run"]
    assert "error" not in run, run
    assert run["finite"] and run["n"] == 32 and run["steps"] == 6
    assert run["param_bytes"] > 0 and run["layer_activation_bytes"] > 0
    assert 0 < run["baseline_rss"] <= run["before"] <= run["first_peak"]
    # the second call's peak is read after a reset of the high-water mark: the allocator may have
    # returned pages since before_steady was read, so only sanity is asserted between the two
    assert run["peak"] > 0 and run["before_steady"] > 0
    assert set(run["activation_floats"]) == {"tokens_in", "qkv", "scores", "head_out", "tokens_out"}
    steps = doc["steps"]
    assert [(r["T"], r["save_states"]) for r in steps] == [(2, False), (4, False), (4, True)]
    assert all("error" not in r and r["steps"] == r["T"] and r["peak"] > 0 for r in steps), steps
    assert set(doc["steps_growth"]) >= {"first_increment_growth", "peak_growth", "states_bytes_expected"}
    (load,) = doc["load"]
    assert load["model"] == "minilm" and "error" not in load, load
    assert load["peak"] >= load["baseline_rss"] > 0 and load["param_bytes"] > 0
    assert load["bound"] == 1.5 * load["param_bytes"]


def test_results_file_header_tables_and_output(tmp_path):
    """benchmarks/benchdoc.py: a results file holds the command, the date, the CPU and the
    versions, then the tables, then the printed output with this machine's folders written as
    <repo>, <tmp> and ~; a second run replaces it whole."""
    import tempfile
    import time

    import benchdoc
    table = benchdoc.markdown_table(("case", "time"), [["one", "1.00 s"], ["two", None]])
    assert table == ["| case | time |", "|---|---|", "| one | 1.00 s |", "| two | – |"]
    printed = f"loaded {benchdoc.ROOT}/docs/x.png and {tempfile.gettempdir()}/scratch/y\nsecond line\n"
    path = tmp_path / "demo.md"
    assert benchdoc.write("demo", ["--fast", "2"], [table], printed, path=str(path), summary="What it does.") == str(path)
    text = path.read_text()
    lines = text.splitlines()
    assert lines[:4] == ["# benchmarks/demo.py", "", "What it does.", ""]
    assert "- command: `python benchmarks/demo.py --fast 2`" in lines
    assert f"- date: {time.strftime('%Y-%m-%d')}" in lines
    assert f"- CPU: {benchdoc.cpu_name()}, {os.cpu_count()} cores" in lines
    (versions,) = [ln for ln in lines if ln.startswith("- versions: Python ")]
    assert " jax " in versions and " numpy " in versions and " powerlens " in versions
    assert benchdoc.first_table(text) == table
    assert "loaded <repo>/docs/x.png and <tmp>/scratch/y" in text and "second line" in text
    assert benchdoc.ROOT not in text and tempfile.gettempdir() + "/" not in text
    benchdoc.write("demo", [], [["| a |", "|---|", "| 1 |"]], "other\n", path=str(path))
    text = path.read_text()
    assert benchdoc.first_table(text) == ["| a |", "|---|", "| 1 |"] and "second line" not in text
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        benchdoc.markdown_table(("a",), [[1, 2]])


def test_readme_tables_follow_their_results_files(tmp_path):
    """The table after a ``<!-- table from docs/benchmarks/NAME.md -->`` marker is replaced by
    NAME.md's table, and only that one; a file written elsewhere (``--doc``) leaves the README alone."""
    import benchdoc
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- table from docs/benchmarks/demo.md -->\n| old |\n|---|\n| 0 |\n\ntext\n"
                      "<!-- table from docs/benchmarks/other.md -->\n| keep |\n|---|\n")
    new = ["| new | col |", "|---|---|", "| 1 | 2 |"]
    assert benchdoc.sync_readme("docs/benchmarks/demo.md", new, str(readme))
    assert readme.read_text() == ("intro\n<!-- table from docs/benchmarks/demo.md -->\n| new | col |\n|---|---|\n"
                                  "| 1 | 2 |\n\ntext\n<!-- table from docs/benchmarks/other.md -->\n| keep |\n|---|\n")
    assert not benchdoc.sync_readme("docs/benchmarks/demo.md", new, str(readme))     # nothing to change
    before = readme.read_text()
    benchdoc.write("demo", [], [["| x |", "|---|"]], "", path=str(tmp_path / "demo.md"), readme=str(readme))
    assert readme.read_text() == before


def test_results_file_only_from_a_real_configuration():
    """A tiny/quick run writes no results file unless given --doc; --no-doc writes none; a full run
    writes docs/benchmarks/NAME.md. Stdout is still printed while it is kept."""
    import argparse

    import benchdoc
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    benchdoc.add_doc_option(ap, "demo")
    target = lambda *a: benchdoc.doc_target(ap.parse_args(list(a)), "demo")
    assert target() == os.path.join(benchdoc.ROOT, "docs", "benchmarks", "demo.md")
    assert target("--tiny") is None and target("--no-doc") is None
    assert target("--tiny", "--doc", "x.md") == "x.md"
    import io
    import contextlib
    outer = io.StringIO()
    with contextlib.redirect_stdout(outer):
        with benchdoc.Capture() as printed:
            print("a line")
    assert printed.text == "a line\n" == outer.getvalue()


def test_vs_torch_tables():
    """vs_torch.py's results tables from reported lines: workload A one row per model and size
    (times to 3 significant digits, ms below a second; a missing cell is "–"), B-E one row each
    with its agreement fields."""
    import vs_torch
    A = dict(workload="A", model="minilm", size="8x128")
    lines = [dict(A, rule="paper", what="states", powerlens_s=0.0593, torch_s=0.06126, ratio=1.033, rel_err=6.6e-7),
             dict(A, rule="paper", what="measures", powerlens_s=0.06292, torch_s=0.07211, ratio=1.146,
                  measures_over_states=1.061),
             dict(A, rule="full", what="states", powerlens_s=0.1486, torch_s=0.1498, ratio=1.008, rel_err=8.3e-7),
             dict(workload="A", model="smollm2", size="32x128", rule="paper", what="states", powerlens_s=1.869,
                  torch_s=2.033, ratio=1.088, rel_err=6.3e-6),
             dict(workload="A", model="minilm", size="8x128", rule="paper", what="torch.compile", torch_s=0.0616),
             dict(workload="B", model="minilm layer 3", size="1x32", rule="paper", what="T=1000", powerlens_s=0.4179,
                  torch_s=0.4804, ratio=1.149, abs_err=2.31e-7),
             dict(workload="D", model="256 synthetic systems", size="256x32", rule="paper", what="T=200",
                  powerlens_s=0.7866, torch_s=1.852, ratio=2.354, abs_err=0.7462, abs_err_median=2.636e-7,
                  f64_abs_err=4.992e-12)]
    assert vs_torch.workload_a_table(lines) == [
        "| " + " | ".join(vs_torch.A_COLUMNS) + " |", "|---|---|---|---|---|---|---|",
        "| MiniLM | 8 × 128 | 59.3 ms / 61.3 ms | 1.03× | 1.15× (1.06) | 149 ms / 150 ms | 1.01× |",
        "| SmolLM2 | 32 × 128 | 1.87 s / 2.03 s | 1.09× | – | – | – |"]
    assert vs_torch.bcde_table(lines)[2:] == [
        "| B | minilm layer 3 1x32 T=1000 | 418 ms | 480 ms | 1.15× | abs_err 2.3e-07 |",
        "| D | 256 synthetic systems 256x32 T=200 | 787 ms | 1.85 s | 2.35× | abs_err_median 2.6e-07, f64_abs_err 5e-12 |"]


def test_gpu_script_fused_attention_entries(monkeypatch):
    """benchmarks/gpu.py's GPU-only entries, with cuDNN's call made through XLA and its GPU check
    passed: the bfloat16 states with and without Dynamics(attention_block='cudnn') are timed and agree; a
    failing cuDNN call becomes an entry with its error."""
    import functools

    import gpu
    import powerlens as pl
    from powerlens._src.dynamics import attention
    monkeypatch.setattr(attention, "check_fused_attention", lambda lp, dtype: None)
    monkeypatch.setattr(attention, "fused_attention_mix",
                        functools.partial(attention.fused_attention_mix, implementation="xla"))
    model = pl.load("minilm")
    x0, valid = gpu.tokens(model, 2, 8)
    entries = []
    gpu.fused_attention_entries("minilm", model, 2, 8, x0, valid, lambda **e: entries.append(e), 1)
    assert [e["what"] for e in entries] == ["states bfloat16 xla", "states bfloat16 cudnn"]
    assert all(e["seconds"] > 0 for e in entries)
    assert entries[1]["max_abs_diff_from_xla"] < 0.05            # bfloat16 unit tokens, two orders of sums
    assert gpu.in_bfloat16(model).layers.W_q.dtype == gpu.jnp.bfloat16
    # a failing cuDNN call (another prompt shape, so the program is traced again) is recorded, not raised

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no cuDNN kernel for these shapes\nsecond line")
    monkeypatch.setattr(attention, "fused_attention_mix", no_kernel)
    x0, valid = gpu.tokens(model, 1, 6)
    gpu.fused_attention_entries("minilm", model, 1, 6, x0, valid, lambda **e: entries.append(e), 1)
    assert entries[-1]["what"] == "states bfloat16 cudnn"
    assert entries[-1]["error"] == "RuntimeError: no cuDNN kernel for these shapes"


@pytest.mark.slow
def test_steering_token_tiny_agrees_with_torch(tmp_path, capsys):
    """benchmarks/steering.py --tiny: the token objective's Adam loop in powerlens and in batched
    torch, from the same start, agree over the first 3 steps to float32 precision (the script
    raises otherwise), while the steps do change the edit; powerlens's composed loop is the
    public optimize_steering's; the results file holds the table and the printed ratio."""
    import benchdoc
    import steering
    doc = tmp_path / "steering.md"
    out = steering.main(["--tiny", "--no-profile", "--doc", str(doc)])
    tok = out["token"]
    assert tok["targets"] == 2 and tok["steps"] == 3
    for name, v in tok["agree"].items():
        assert v < 1e-4, (name, v)
    for name, v in tok["later_steps"].items():          # on this tiny problem no coordinate's
        assert v < 1e-4, (name, v)                       # gradient sits at rounding: steps 1-3 agree too
    assert tok["moved"] > 1e-3                           # the 3 steps are not a fixed point
    assert tok["api_rel"] < 1e-4
    assert tok["powerlens_s"] > 0 and tok["torch_s"] > 0 and tok["ratio"] > 0
    text = doc.read_text()
    table = benchdoc.first_table(text)
    assert table[0].startswith("| problem | Adam steps | powerlens per step | torch per step | torch / powerlens")
    assert len(table) == 3 and " 3 | " in table[2]
    printed = capsys.readouterr().out
    assert "ratio torch/powerlens" in printed and "-> agree" in printed
