"""The sweep's plan is plain Python, and rebuilding rows reuses one compiled builder.

* ``powerlens._src.sweeps.plan`` (the memory of a chunk, chunk sizes, the refusals) and
  ``powerlens._src.sweeps.schema`` import and run in a process where JAX cannot be imported
  (``sys.modules["jax"] = None``); the numbers are checked against a derivation by hand.
* ``pl.sweep_system`` and ``Engine.systems_of`` share one compiled builder per static shape:
  a second call with the same shapes does not trace it again.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

NO_JAX = """
import sys, types
sys.modules["jax"] = None                     # `import jax` raises ImportError from here on
sys.path.insert(0, {root!r})
import powerlens
# powerlens._src.analysis/__init__ imports the spectra (JAX); the plan needs only its budget module,
# which must itself be free of JAX: load the package without running its __init__
pkg = types.ModuleType("powerlens._src.analysis")
pkg.__path__ = [{root!r} + "/powerlens/_src/analysis"]
sys.modules["powerlens._src.analysis"] = pkg
"""


def _run(code: str) -> dict:
    """Run ``code`` with JAX blocked; it prints one JSON object."""
    script = NO_JAX.format(root=str(ROOT)) + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


PLAN = """
import json, types
from powerlens._src.sweeps import plan as P

# one group of G = 100 synthetic systems: T = 99 steps, n = 4 tokens, d = 4, one head of e = 4,
# float32; one CPU device, micro-batches of 8
st = types.SimpleNamespace(steps=99, x64=False, series=())
shapes = {"d": 4, "tokens": 4, "heads": 1, "d_head": 4}
group = types.SimpleNamespace(index=0, n_systems=100, replicates=1,
                              static={"d": 4, "tokens": 4, "heads": 1, "steps": 99, "rule": "paper"})
spec = types.SimpleNamespace(source="s.toml", grid={"beta": [1.0]}, run={"steps": 99, "chunk_size": 0,
                             "micro_batch": "auto"}, model=None)
pad = lambda s, n, m: (-(-(-(-s // n)) // m) * m if m else -(-s // n)) * n     # equal shares of whole micro-batches

def planner(host):
    return P.Planner(spec, [group], [st], [shapes], device_built=True, host=host, width=20, pad=pad,
                     devices=P.Devices(count=1, micro=8, platform="cpu", memory=None))

out = {"estimate": P.chunk_estimate(st, shapes, 10, 3).parts}
plan = planner(662821).plan()
out["sizes"], out["chunks"] = list(plan.sizes), [[c.start, c.stop, c.size] for c in plan]
out["estimate_24"] = plan.estimates[0].total
try:
    planner(1000.0).plan()
except ValueError as exc:
    out["refusal"] = str(exc)
out["jax"] = sys.modules["jax"] is None and not any(m.startswith(("jax.", "jaxlib")) for m in sys.modules)
print(json.dumps(out))
"""


def test_the_plan_runs_without_jax_and_gives_the_sizes_derived_by_hand():
    out = _run(PLAN)
    assert out["jax"]                                             # nothing of JAX was imported
    # S systems, A at once (s = 4 bytes, T + 1 = 100 steps kept, m = 3 references, no series):
    #   initial tokens  S n d (8 + s)           = 192 S
    #   per-step        (T+1) S (4 m + 5) s     = 6800 S
    #   attention       A (3 H n² + 2 n (H + 2G) e + 4 n d) s = A (48 + 96 + 64) 4 = 832 A
    #   systems         S (12 d² + 4 n d + 16 d) s = 1280 S
    #   host copies     S (T+1) (4 m + 5) 8     = 13600 S
    S, A = 10, 3
    assert out["estimate"] == {"initial tokens": 192 * S, "per-step measures": 6800 * S, "attention": 832 * A,
                               "systems": 1280 * S, "host copies": 13600 * S}
    # 21872 bytes a system, 832 x 8 = 6656 for the micro-batch's attention; a host of
    # 6656 + 30 x 21872 + 5 bytes fits 30 systems; balanced over 100 systems: 4 chunks of 25;
    # rounded up to 32 (does not fit), so down to 24 = 3 micro-batches: 5 chunks, the last of 4
    assert out["sizes"] == [24]
    assert out["chunks"] == [[0, 24, 24], [24, 48, 24], [48, 72, 24], [72, 96, 24], [96, 100, 24]]
    assert out["estimate_24"] == 21872 * 24 + 6656
    # 1000 bytes: even one micro-batch of 8 (8 x 21872 + 6656 = 181632 bytes) does not fit; the
    # largest part is the host copies (8 x 13600 = 108800 = 106.25 KiB), which grow with steps
    assert out["refusal"] == (
        "s.toml: [run] steps: one chunk of 8 systems (group 0: d=4, tokens=4, heads=1, steps=99, rule=paper) "
        "needs about 177.4 KiB (host copies 106.2 KiB, per-step measures 53.1 KiB, systems 10.0 KiB, "
        "attention 6.5 KiB, initial tokens 1.5 KiB), more than the 1000 B available; use fewer steps")


def test_the_schema_runs_without_jax():
    out = _run("""
    import json
    from powerlens._src.sweeps import schema
    try:
        schema.count(1, 1, maximum=10).check(11, "s.toml: [run] steps")
    except ValueError as exc:
        msg = str(exc)
    print(json.dumps({"msg": msg, "diff": schema.differing_keys({"run": {"steps": 1}}, {"run": {"steps": 2}}),
                      "numpy": "numpy" in sys.modules}))
    """)
    assert out == {"msg": "s.toml: [run] steps: 11 is too large: must be an integer <= 10", "diff": ["run.steps"],
                   "numpy": False}


def test_sweep_system_and_the_engine_share_one_compiled_builder(monkeypatch):
    """The builder is traced once per shape: two rows rebuilt by pl.sweep_system and one by
    Engine.systems_of (one system each) trace it once, and give the same arrays."""
    import powerlens as pl
    from powerlens._src.sweeps import engine, load_spec, systems
    spec = {"name": "cached", "seed": 2, "grid": {"beta": [0.5, 1.0]},
            "system": {"d": 4, "tokens": 3, "heads": 2, "replicates": 2}, "run": {"steps": 5}}
    df = pl.sweep(spec, progress=False)
    traces = []
    real = systems.build_synthetic

    def counted(*args):
        traces.append(args[2])                   # runs once per trace, never when the program runs
        return real(*args)

    monkeypatch.setattr(systems, "build_synthetic", counted)
    systems.synthetic_builder.cache_clear()
    a = pl.sweep_system(spec, df.iloc[1])
    b = pl.sweep_system(spec, df.iloc[2])
    assert len(traces) == 1
    eng = engine.Engine(load_spec(spec), progress=False)
    one = eng.systems_of([1])
    assert len(traces) == 1                      # the engine's rebuild is the same program
    np.testing.assert_array_equal(np.asarray(a.layers.W_o), np.asarray(one.layers.W_o)[0])
    np.testing.assert_array_equal(a.x0, np.asarray(one.x0)[0])
    assert not np.array_equal(a.x0, b.x0)
    eng.systems_of([0, 1])
    eng.systems_of([2, 3])
    assert len(traces) == 2                      # a batch of two: one more shape, traced once
