"""The benchmark scripts run in their tiny configurations: in benchmarks/vs_torch.py powerlens and
the torch code agree (the numbers it times are the same computation). No timing is asserted."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.mark.slow
def test_tiny_configuration_agrees_with_torch(capsys):
    import vs_torch
    lines = vs_torch.main(["--tiny", "--repeat", "1"])
    assert {x["workload"] for x in lines} == {"A", "B", "C", "D", "E"}
    for x in lines:
        if "rel_err" in x:
            assert x["rel_err"] < 1e-5, x
        if "abs_err" in x:
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
    # D: the sweep's final tokens (8 systems, 10 steps). In float32 one system amplifies
    # rounding to 2.2e-4 (checked above, < 1e-3); the typical one stays at rounding, and in
    # float64 on both sides (every step here) all agree to rounding
    (dline,) = [x for x in lines if x["workload"] == "D"]
    assert dline["f64_steps"] == 10 and dline["f64_abs_err"] < 1e-10, dline
    assert dline["abs_err_median"] < 1e-5, dline


def test_paper_flops_counts_the_four_matmuls():
    """The FLOPs behind the printed matmul rate, against the count by hand: MiniLM at 8 x 128
    (6 layers of 12 heads of 32, d = 384) 8.46 GFLOP; SmolLM2 (30 layers, d = 576, 9 query
    heads over 3 key/value heads of 64) 63.4 GFLOP."""
    import vs_torch
    from powerlens.dynamics.params import LayerConfig
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


def _saved_run(path, commit, matmul, a, measures, rates, bcde):
    """A file in vs_torch.py's output format with the given numbers (B-E only when ``a`` is empty)."""
    lines = [f"# python benchmarks/vs_torch.py at {commit}, test"] if commit else []
    lines.append(f"matmul 2048^3 float32: jax {matmul[0]} GFLOP/s, torch {matmul[1]} GFLOP/s (torch threads 2)")
    for key, ratio in a.items():
        model, size, rule = key.split()
        lines.append(f"A {model} {size} {rule} states    powerlens_s=0.1 torch_s=0.1 ratio={ratio} rel_err=1e-07")
        if key in measures:
            lines.append(f"A {model} {size} {rule} measures    powerlens_s=0.1 torch_s=0.1 ratio=1.0 "
                         f"measures_over_states={measures[key]}")
    if a:
        lines.append("matmul 2048^3 float32 after A: jax 180 GFLOP/s; the rates below are against 180")
    for key, pct in rates.items():
        lines.append(f"A {key} paper states: 120 GFLOP/s, {pct} % of the large matmul")
    names = {"B": "B minilm layer 3 1x32 paper T=1000", "C": "C minilm 4x32 paper grad W_o",
             "D": "D 256 synthetic systems 256x32 paper T=200",
             "E_solve": "E minilm last layer 64 dirs paper solve 200 Adam steps",
             "E_api": "E minilm last layer 64 dirs paper api 200 Adam steps"}
    for key, ratio in bcde.items():
        lines.append(f"{names[key]}    powerlens_s=0.1 torch_s=0.1 ratio={ratio} abs_err=1e-07")
        if key == "C":      # the whole-scan gradient is not the C target's row
            lines.append(f"C minilm 4x32 paper grad W_o whole scan    powerlens_s=0.3 torch_s=0.1 ratio=0.33")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_vs_torch_runs_reads_every_run_against_the_targets(tmp_path, capsys):
    """benchmarks/vs_torch_runs.py on three made-up runs: run 1 and run 2 (whose B-E come from an
    ``--only B,C,D,E`` file) are counted, the throttled run 3 is shown but left out. Each number
    is what the files say, and the medians and counts are worked out by hand below."""
    import vs_torch_runs as VR
    a1 = {"minilm 1x16 paper": 1.4, "minilm 8x128 paper": 0.9, "smollm2 8x128 paper": 1.1}
    a2 = {"minilm 1x16 paper": 1.2, "minilm 8x128 paper": 1.0, "smollm2 8x128 paper": 1.3}
    files = [
        _saved_run(tmp_path / "vs_torch_2core_cpu.txt", "abc1234", (190, 170), a1,
                   {"minilm 8x128 paper": 1.20}, {"minilm 8x128": 81, "smollm2 8x128": 60},
                   {"B": 1.31, "C": 1.1, "D": 2.9, "E_solve": 30, "E_api": 14}),
        _saved_run(tmp_path / "vs_torch_2core_cpu_run2.txt", "", (150, 160), a2,
                   {"minilm 8x128 paper": 1.05}, {"minilm 8x128": 70, "smollm2 8x128": 62},
                   {"B": 0.5, "C": 0.5, "D": 0.5, "E_solve": 1, "E_api": 1}),
        _saved_run(tmp_path / "vs_torch_2core_cpu_run2_BCDE.txt", "def5678", (150, 160), {}, {}, {},
                   {"B": 1.25, "C": 1.3, "D": 2.4, "E_solve": 40, "E_api": 16}),
        _saved_run(tmp_path / "vs_torch_2core_cpu_run3_throttled.txt", "0123abc", (70, 70),
                   {"minilm 1x16 paper": 0.1}, {}, {}, {"B": 9.0}),
    ]
    out = VR.main(files)
    assert out == capsys.readouterr().out.splitlines()
    runs = VR.collect(files)
    assert [(r.number, r.note, r.counted) for r in runs] == [(1, "", True), (2, "", True), (3, "throttled", False)]
    r1, r2, r3 = runs
    assert r1.commit == "abc1234" and r2.commit == "" and r1.matmul_before == (190, 170)
    # run 1: lowest 0.9, median of (1.4, 0.9, 1.1) = 1.1; run 2's B-E are the BCDE file's, C is
    # never the whole-scan row
    assert (r1.value("a_min"), r1.value("a_median"), r1.value("measures_worst")) == (0.9, 1.1, 1.2)
    assert (r2.value("a_min"), r2.value("a_median")) == (1.0, 1.2)
    assert r2.bcde == {"B": 1.25, "C": 1.3, "D": 2.4, "E_solve": 40, "E_api": 16}
    assert r2.bcde_from == "vs_torch_2core_cpu_run2_BCDE.txt" and r1.bcde["C"] == 1.1
    rows = {line.split(" | ")[0]: line for line in out if line.startswith("| ")}
    assert rows["| 1"] == ("| 1 | abc1234 | 190 / 170 | 0.90× | 1.10× | 1.20 | 81 / 60 % | 1.31× | 1.10× | 2.90× "
                           "| 30× / 14× |")
    assert rows["| 2"] == "| 2 | – | 150 / 160 | 1.00× | 1.20× | 1.05 | 70 / 62 % | 1.25× | 1.30× | 2.40× | 40× / 16× |"
    assert rows["| 3, throttled"].startswith("| 3, throttled | 0123abc | 70 / 70 | 0.10× |")
    # over runs 1 and 2 only: medians of two are their means; A lowest met by run 2 (1.0 >= 1.0),
    # A median by run 2 (1.2), measures by run 2 (1.05 <= 1.15), MiniLM's rate by run 1, SmolLM2's
    # by none, B by run 1 (1.31), C by run 2 (1.3), D by run 1 (2.9), E by both
    assert rows["| median over the runs"] == ("| median over the runs | | | 0.95× | 1.15× | 1.12 | 76 / 61 % | 1.28× "
                                              "| 1.20× | 2.65× | 35× / 15× |")
    assert rows["| runs meeting the target"] == ("| runs meeting the target | | | 1/2 | 1/2 | 1/2 | 1/2, 0/2 | 1/2 | 1/2 "
                                                 "| 1/2 | 2/2, 2/2 |")
    assert "Left out of the medians and counts: run 3, throttled." in out
    # a B-E file whose run has no workload A anywhere is an error naming the file
    orphan = _saved_run(tmp_path / "vs_torch_2core_cpu_run7_BCDE.txt", "", (1, 1), {}, {}, {}, {"B": 1.0})
    with pytest.raises(SystemExit):
        VR.main(files + [orphan])
    assert "vs_torch_2core_cpu_run7_BCDE.txt: B-E of run 7" in capsys.readouterr().err


def test_vs_torch_runs_prints_one_runs_table(tmp_path, capsys):
    """``vs_torch_runs.py --run K``: run K's workload A as the README's table (times to 3
    significant digits, ms below a second), then its B-E lines as printed (those of its
    ``--only B,C,D,E`` file in place of its own) and A's summary; an unknown run is a one-line
    error."""
    import vs_torch_runs as VR
    lines = ["# python benchmarks/vs_torch.py at abc1234, test",
             "A minilm 8x128 paper states       powerlens_s=0.0593 torch_s=0.06126 ratio=1.033 rel_err=6.6e-07",
             "A minilm 8x128 paper measures     powerlens_s=0.06292 torch_s=0.07211 ratio=1.146 measures_over_states=1.061",
             "A minilm 8x128 full states        powerlens_s=0.1486 torch_s=0.1498 ratio=1.008 rel_err=8.3e-07",
             "A smollm2 32x128 paper states     powerlens_s=1.869 torch_s=2.033 ratio=1.088 rel_err=6.3e-06",
             "A minilm 8x128 paper torch.compile            torch_s=0.0616",
             "B minilm layer 3 1x32 paper T=1000    powerlens_s=0.4 torch_s=0.48 ratio=1.2 abs_err=2e-07",
             "A states only: min 1.01x, median 1.03x over 3 (model, size, rule)"]
    (tmp_path / "vs_torch_2core_cpu_run5.txt").write_text("\n".join(lines) + "\n")
    bcde = "B minilm layer 3 1x32 paper T=1000    powerlens_s=0.4 torch_s=0.52 ratio=1.3 abs_err=2e-07"
    (tmp_path / "vs_torch_2core_cpu_run5_BCDE.txt").write_text(bcde + "\n")
    files = [str(tmp_path / "vs_torch_2core_cpu_run5.txt")]
    out = VR.main(files + ["--run", "5"])
    assert out[:2] == [VR.RUN_HEADER, "|---|---|---|---|---|---|---|"]
    assert out[2] == "| MiniLM | 8 × 128 | 59.3 ms / 61.3 ms | 1.03× | 1.15× (1.06) | 149 ms / 150 ms | 1.01× |"
    assert out[3] == "| SmolLM2 | 32 × 128 | 1.87 s / 2.03 s | 1.09× | – | – | – |"
    assert out[4:] == ["", lines[6], lines[7]]
    out = VR.main(files + [str(tmp_path / "vs_torch_2core_cpu_run5_BCDE.txt"), "--run", "5"])
    assert out[4:] == ["", bcde, lines[7]]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        VR.main(files + ["--run", "6"])
    assert capsys.readouterr().err.strip() == "vs_torch_runs: no saved output of run 6"


def test_gpu_script_fused_attention_entries(monkeypatch):
    """benchmarks/gpu.py's GPU-only entries, with cuDNN's call made through XLA and its GPU check
    passed: the bfloat16 states with and without attention_block='cudnn' are timed and agree; a
    failing cuDNN call becomes an entry with its error."""
    import functools

    import gpu
    import powerlens as pl
    from powerlens.dynamics import attention
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
    assert gpu.in_bfloat16(model, "cudnn").layers.W_q.dtype == gpu.jnp.bfloat16
    # a failing cuDNN call (another prompt shape, so the program is traced again) is recorded, not raised

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no cuDNN kernel for these shapes\nsecond line")
    monkeypatch.setattr(attention, "fused_attention_mix", no_kernel)
    x0, valid = gpu.tokens(model, 1, 6)
    gpu.fused_attention_entries("minilm", model, 1, 6, x0, valid, lambda **e: entries.append(e), 1)
    assert entries[-1]["what"] == "states bfloat16 cudnn"
    assert entries[-1]["error"] == "RuntimeError: no cuDNN kernel for these shapes"
