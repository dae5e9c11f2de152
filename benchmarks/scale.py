"""A model at research scale on this machine: Llama-3-8B's shape in bf16, and a Llama-3.2-1B
shape against transformers.

The checkpoint is random (normal x 0.02, rounded to bf16) with Llama-3-8B's published config:
32 layers, d 4096, 32 query heads over 8 key/value heads of 128, FFN 14336, vocabulary 128256,
untied LM head; about 16 GB of bf16 safetensors in shards with a ``model.safetensors.index.json``.
It is written once, streaming one tensor at a time in blocks (memory stays low), into
``<powerlens cache>/bench/llama3-8b-random`` (``powerlens.io.cache_dir()``; never the
repository), with a word-level ``tokenizer.json`` so that ``powerlens align`` takes text.

Each measured command runs in its own subprocess; its peak RSS is the ``ru_maxrss`` of that
child (``os.wait4``), its wall time the child's whole life (start-up, load and compilation
included):

    load        pl.load(folder): every weight, bf16                          (<= 20 GB)
    spectrum    powerlens spectrum FOLDER: W_v and W_o only, per-layer float64 eig   (<= 3 GB)
    align       powerlens align FOLDER --rule paper, 1 x 32 tokens: no FFN, no LM head (<= 8 GB)
    trace       pl.trace(model, 1 x 32 tokens, rule="full")                  (<= 20 GB)
    generate    pl.generate(model, 1 x 32 tokens, max_new_tokens=16)        (<= 20 GB)

The spectrum's lambda_1 (both orderings) of a few layers is checked against an independent
float64 ``numpy.linalg.eigvals`` formed from the raw bf16 bytes of the file: of the r x r
matrix V_t O_t,g whose eigenvalues are the nonzero ones of F_t = O_t V_t (``--check-full``: of
the d x d F_t itself; the tiny configuration always does).

``--only`` picks cases (``write,spectrum,align,load,trace,generate,vs_transformers``); the
cases that need the whole model (load, trace, generate) are skipped, and say so, unless the
machine has ``--need-gb`` (default 21) GB available when they start.

vs_transformers: a Llama-3.2-1B-shaped random bf16 checkpoint (16 layers, d 2048, 32/8 heads
of 64, FFN 8192, vocabulary 128256, tied embeddings, plain RoPE), the forward (1 x 32 tokens,
logits) and greedy ``generate`` (16 new tokens) of powerlens (bf16 weights, float32 compute)
and of transformers on the same weights upcast to float32 (the same arithmetic), in one
process, timed in turns; the ratio is transformers' time over powerlens' (> 1: powerlens faster).
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchdoc  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=8192, tie_word_embeddings=False)
LLAMA32_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=8192, tie_word_embeddings=True, head_dim=64)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=256, tie_word_embeddings=False)
TARGETS_GB = {"spectrum": 3, "align": 8, "load": 20, "trace": 20, "generate": 20}
WORDS = 2000                      # the word-level tokenizer's vocabulary (ids 0 .. WORDS-1)
PROMPT = " ".join(f"w{(7 * i + 3) % WORDS}" for i in range(32))     # 32 tokens
CASES = ("write", "spectrum", "align", "load", "trace", "generate", "vs_transformers")
WHOLE = ("load", "trace", "generate")


def bench_dir() -> str:
    from powerlens import io
    return os.path.join(io.cache_dir(), "bench")


def tensors_of(cfg: dict):
    """[(name, shape)] of a Llama checkpoint, layer by layer (Hugging Face names)."""
    d, L, H, G = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e = cfg.get("head_dim", d // H)
    f, V = cfg["intermediate_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (V, d))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (H * e, d)),
                (p + "self_attn.k_proj.weight", (G * e, d)), (p + "self_attn.v_proj.weight", (G * e, d)),
                (p + "self_attn.o_proj.weight", (d, H * e)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    out.append(("model.norm.weight", (d,)))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (V, d)))
    return out


def _bf16_bits(rng, n: int, norm: bool) -> np.ndarray:
    """n bf16 values as uint16 bits: 1 + 0.02 N(0,1) for a norm weight, else 0.02 N(0,1)."""
    x = rng.standard_normal(n, dtype=np.float32)
    x *= 0.02
    if norm:
        x += 1.0
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)     # round to nearest even


def write_checkpoint(folder: str, cfg: dict, *, seed: int = 0, shard_bytes: int = 2 << 30, block: int = 1 << 24,
                     progress: bool = True) -> str:
    """A random bf16 Llama checkpoint in ``folder`` (sharded safetensors + index, config.json,
    tokenizer.json), written tensor by tensor in blocks of ``block`` values; a ``.complete``
    marker is written last, and a folder that has it is kept as it is."""
    if os.path.isfile(os.path.join(folder, ".complete")):
        return folder
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, cur, size = [], [], 0
    for name, shape in tensors_of(cfg):
        nbytes = 2 * int(np.prod(shape))
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    shards.append(cur)
    total = sum(2 * int(np.prod(s)) for sh in shards for _, s in sh)
    weight_map, done, t0 = {}, 0, time.perf_counter()
    shown = t0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, shape in shard:
            n = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-(len(raw) + 8) % 8)
        with open(os.path.join(folder, fname + ".partial"), "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shard:
                n = int(np.prod(shape))
                for s0 in range(0, n, block):
                    fh.write(_bf16_bits(rng, min(block, n - s0), name.endswith("norm.weight")).tobytes())
                done += 2 * n
                if progress and (time.perf_counter() - shown > 2 or done == total):
                    shown = time.perf_counter()
                    print(f"\r  writing {folder}: {done / 2**30:.1f} / {total / 2**30:.1f} GiB "
                          f"({time.perf_counter() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
        os.replace(os.path.join(folder, fname + ".partial"), os.path.join(folder, fname))
    if progress:
        print(file=sys.stderr)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(dict(cfg, model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                       torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2), fh, indent=1)
    write_tokenizer(folder)
    open(os.path.join(folder, ".complete"), "w").close()
    return folder


def write_tokenizer(folder: str) -> None:
    """A word-level ``tokenizer.json``: ``w0`` .. ``w1999`` split on whitespace (ids 0 .. 1999)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab["[UNK]"] = WORDS
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))


# ------------------------------------------------------------------ the measured children

CHILD = {
    "load": """
import powerlens as pl, time
t = time.perf_counter(); m = pl.load(FOLDER)
print("RESULT", {"seconds_load": time.perf_counter() - t, "dtype": str(m.layers.W_v.dtype)})
""",
    "trace": """
import powerlens as pl, numpy as np, time
t = time.perf_counter(); m = pl.load(FOLDER); tl = time.perf_counter() - t
ids = [[(7 * i + 3) % 2000 for i in range(32)]]
from powerlens.analysis.alignment import model_spectra
t = time.perf_counter(); tr = pl.trace(m, ids, rule="full", spectra=model_spectra(m)); lg = np.asarray(tr.logits)
print("RESULT", {"seconds_load": tl, "seconds_call": time.perf_counter() - t, "finite": bool(np.isfinite(lg).all()),
                 "logits_shape": list(lg.shape)})
""",
    "generate": """
import powerlens as pl, numpy as np, time
t = time.perf_counter(); m = pl.load(FOLDER); tl = time.perf_counter() - t
ids = [[(7 * i + 3) % 2000 for i in range(32)]]
t = time.perf_counter(); g = pl.generate(m, ids, max_new_tokens=16)
print("RESULT", {"seconds_load": tl, "seconds_call": time.perf_counter() - t,
                 "new_tokens": int(np.asarray(g.new_ids).shape[-1])})
""",
}


def run_child(argv, env=None):
    """(seconds, peak RSS in bytes, returncode, output) of a subprocess."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out_chunks = []
    import threading
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    reader.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, proc.returncode, "".join(out_chunks)


def python_child(code: str, folder: str):
    return run_child([sys.executable, "-c", code.replace("FOLDER", repr(folder))])


def cli_child(args):
    exe = os.path.join(os.path.dirname(sys.executable), "powerlens")
    return run_child([exe, *args, "--quiet"] if args[0] == "align" else [exe, *args])


def result_of(out: str) -> dict:
    import ast
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return ast.literal_eval(lines[-1][7:]) if lines else {}


def available_gb() -> float:
    from powerlens.models.reader import available_memory
    a = available_memory()
    return float("inf") if a is None else a / 2 ** 30


# ------------------------------------------------------------------ the independent spectrum check

def raw_bf16(folder: str, name: str) -> np.ndarray:
    """Tensor ``name`` of a bf16 safetensors folder as float64, from its bytes (index, header, offsets)."""
    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        shard = json.load(fh)["weight_map"][name]
    with open(os.path.join(folder, shard), "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        meta = json.loads(fh.read(n))[name]
        begin, end = meta["data_offsets"]
        fh.seek(8 + n + begin)
        bits = np.frombuffer(fh.read(end - begin), np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(meta["shape"])


def check_spectrum(folder: str, cfg: dict, spectrum_json: str, layers, *, full: bool = False) -> list:
    """[(layer, order, lambda_1 of spectrum.json, lambda_1 of numpy's float64 eigvals, |diff| / |lambda_1|)]:
    with ``full``, of F = O V_cat "[d d]" itself; otherwise of the r x r matrix V O_g (O_g: the
    columns of the query heads that share a key/value head summed; r = G e), whose eigenvalues
    are F's nonzero ones (det(lambda - A B) = lambda^(d-r) det(lambda - B A)): the same numbers
    for 1/64 of the cost at Llama-3-8B's d = 4096, r = 1024, formed here from the raw bytes."""
    with open(spectrum_json) as fh:
        doc = json.load(fh)
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e = cfg.get("head_dim", cfg["hidden_size"] // H)
    rows = []
    for i in layers:
        O = raw_bf16(folder, f"model.layers.{i}.self_attn.o_proj.weight")
        V = raw_bf16(folder, f"model.layers.{i}.self_attn.v_proj.weight").reshape(G, e, -1)
        if full:                       # F = O V_cat itself, "float64[d d]"
            w = np.linalg.eigvals(O @ np.repeat(V, H // G, axis=0).reshape(H * e, -1))
        else:                          # the nonzero eigenvalues of O V_cat are those of V_cat O = V O_g,
            Og = O.reshape(O.shape[0], G, H // G, e).sum(axis=2).reshape(O.shape[0], G * e)   # "[r r]"
            w = np.linalg.eigvals(V.reshape(G * e, -1) @ Og)
            w = np.concatenate([w, np.zeros(O.shape[0] - G * e)])     # F's d - r zero eigenvalues
        entry = next(x for x in doc["layers"] if x["layer"] == i)
        for order, key in (("shifted", np.abs(1 + w)), ("plain", np.abs(w))):
            ref = w[np.argmax(key)]
            got = top_of(entry, order)
            # a complex pair: compare the member with Im >= 0
            ref = complex(ref.real, abs(ref.imag))
            rows.append((i, order, got, ref, abs(got - ref) / abs(ref)))
    return rows


def top_of(entry: dict, order: str) -> complex:
    """lambda_1 of one layer of spectrum.json in ``order`` (Im >= 0 for a complex pair)."""
    re, im = entry[f"eigenvalues_{order}"][0]
    return complex(re, abs(im))


# ------------------------------------------------------------------ 1B against transformers

VS_CHILD = """
import time, numpy as np, torch, powerlens as pl, jax
from transformers import LlamaForCausalLM
torch.set_num_threads(THREADS)
folder, ids = FOLDER, [[(7 * i + 3) % 2000 for i in range(32)]]
m = pl.load(folder)
hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
x = torch.tensor(ids)
def pl_forward():
    x0, valid = pl.embed(m, ids); h = pl.hidden_states(m, x0, valid); return np.asarray(pl.logits(m, h))
def hf_forward():
    with torch.no_grad(): return hf(x).logits.numpy()
def pl_gen():
    return np.asarray(pl.generate(m, ids, max_new_tokens=16).new_ids)
def hf_gen():
    with torch.no_grad(): return hf.generate(x, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                             pad_token_id=0)[:, 32:].numpy()
a, b = pl_forward(), hf_forward()
err = float(np.abs(a - b).max() / np.abs(b).max())
same = bool((pl_gen() == hf_gen()).all())
def best(fn, k=REPEAT):
    ts = []
    for _ in range(k):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts)
times = {}
for _ in range(1):
    times["pl_forward"], times["hf_forward"] = best(pl_forward), best(hf_forward)
    times["pl_generate"], times["hf_generate"] = best(pl_gen), best(hf_gen)
print("RESULT", dict(times, logits_rel_err=err, same_tokens=same))
"""


# ------------------------------------------------------------------ main

def gb(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _short(d):
    """A result dict for printing, floats to 4 significant digits."""
    return {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in d.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases of {CASES}")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the 8B and 1B shapes (a test)")
    ap.add_argument("--folder", default=None, help="where the checkpoints go (default <powerlens cache>/bench)")
    ap.add_argument("--need-gb", type=float, default=21.0,
                    help="GB that must be available before a whole-model case (load, trace, generate) starts")
    ap.add_argument("--check-layers", default="0,15,31", help="layers whose lambda_1 is checked against numpy (8B)")
    ap.add_argument("--check-full", action="store_true",
                    help="check against numpy's eig of the d x d F itself (8B: ~15-30 min a layer on 2 busy cores)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats of the 1B comparison (best of)")
    benchdoc.add_doc_option(ap, "scale")
    args = ap.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    bad = [c for c in only if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; expected some of {CASES}")
    root = args.folder or bench_dir()
    big_cfg, small_cfg = (TINY, dict(TINY, tie_word_embeddings=True)) if args.tiny else (LLAMA3_8B, LLAMA32_1B)
    big = os.path.join(root, "llama-tiny-random" if args.tiny else "llama3-8b-random")
    small = os.path.join(root, "llama-tiny-tied-random" if args.tiny else "llama3.2-1b-random")
    check_layers = [0, 1] if args.tiny else [int(x) for x in args.check_layers.split(",")]
    rows, checks, skipped, vs = [], [], [], None
    results = {}
    with benchdoc.Capture() as printed:
        t = time.perf_counter()
        write_checkpoint(big, big_cfg)
        size = sum(os.path.getsize(os.path.join(big, f)) for f in os.listdir(big) if f.endswith(".safetensors"))
        print(f"checkpoint: {big} ({size / 2**30:.1f} GiB of bf16 safetensors, "
              f"{len([f for f in os.listdir(big) if f.endswith('.safetensors')])} shards; {time.perf_counter() - t:.0f} s)")
        with tempfile.TemporaryDirectory() as tmp:
            for case in only:
                if case == "write":
                    continue
                if case == "vs_transformers":
                    write_checkpoint(small, small_cfg, seed=1)
                    code = VS_CHILD.replace("FOLDER", repr(small)).replace("THREADS", str(os.cpu_count() or 1)) \
                        .replace("REPEAT", str(args.repeat))
                    sec, peak, rc, out = run_child([sys.executable, "-c", code])
                    vs = result_of(out) if rc == 0 else None
                    print(f"vs_transformers: rc={rc} {sec:.1f} s peak {gb(peak)} GiB {_short(vs)}")
                    if rc:
                        print(out[-3000:])
                    continue
                if case in WHOLE and available_gb() < args.need_gb:
                    msg = f"{case}: skipped, {available_gb():.1f} GB available < --need-gb {args.need_gb}"
                    print(msg)
                    skipped.append(case)
                    continue
                if case == "spectrum":
                    out_dir = os.path.join(tmp, "spectrum")
                    sec, peak, rc, out = cli_child(["spectrum", big, "--out", out_dir])
                elif case == "align":
                    out_dir = os.path.join(tmp, "align")
                    sec, peak, rc, out = cli_child(["align", big, "--text", PROMPT, "--rule", "paper",
                                                    "--out", out_dir])
                else:
                    sec, peak, rc, out = python_child(CHILD[case], big)
                res = result_of(out)
                results[case] = res
                print(f"{case}: rc={rc} wall {sec:.1f} s, peak RSS {gb(peak)} GiB {_short(res)}")
                if rc:
                    print(out[-3000:])
                target = TARGETS_GB[case]
                rows.append([case, f"{sec:.1f}", gb(peak), f"≤ {target}", "yes" if rc == 0 and peak <= target * 2**30 else "no"])
                if case == "spectrum" and rc == 0:
                    checks = check_spectrum(big, big_cfg, os.path.join(out_dir, "spectrum.json"), check_layers,
                                            full=args.check_full or args.tiny)
                    for r in checks:
                        print(f"  layer {r[0]} {r[1]}: lambda_1 {r[2]:.6g} vs numpy float64 eig {r[3]:.6g}: "
                              f"rel diff {r[4]:.2e}")
    tables = [benchdoc.markdown_table(["command", "wall s", "peak RSS GiB", "target GiB", "within"], rows)]
    if checks:
        tables.append(benchdoc.markdown_table(
            ["layer", "order", "λ1 (powerlens spectrum)", "λ1 (numpy float64, raw bytes)", "rel. diff"],
            [[r[0], r[1], f"{r[2]:.6g}", f"{r[3]:.6g}", f"{r[4]:.1e}"] for r in checks]))
    if vs:
        tables.append(benchdoc.markdown_table(
            ["Llama-3.2-1B shape, 1 × 32", "powerlens s", "transformers s", "ratio (transformers / powerlens)"],
            [["forward (logits)", f"{vs['pl_forward']:.3f}", f"{vs['hf_forward']:.3f}",
              f"{vs['hf_forward'] / vs['pl_forward']:.2f}×"],
             ["generate (16 new tokens, greedy)", f"{vs['pl_generate']:.3f}", f"{vs['hf_generate']:.3f}",
              f"{vs['hf_generate'] / vs['pl_generate']:.2f}×"]]))
    notes = []
    if vs:
        notes.append(f"1B check: logits agree to {vs['logits_rel_err']:.1e} of their scale; greedy tokens "
                     f"{'identical' if vs['same_tokens'] else 'DIFFER'}.")
    not_asked = [c for c in CASES if c not in only and c != "write"]
    if not_asked:
        notes.append(f"Not measured (`--only`): {', '.join(not_asked)}.")
    if skipped:
        notes.append(f"Not run here (too little memory available when they would have started): "
                     f"{', '.join(skipped)}; run them with `python benchmarks/scale.py --only {','.join(skipped)}`.")
    benchdoc.write_if_asked(args, "scale", argv, tables, printed.text,
                            summary="Llama-3-8B-shaped random bf16 checkpoint (sharded safetensors): wall time and "
                                    "peak RSS of each command in its own process; a Llama-3.2-1B shape against "
                                    "transformers.", packages=("torch", "transformers"), notes=notes)
    return {"rows": rows, "checks": checks, "vs": vs, "skipped": skipped, "results": results}


if __name__ == "__main__":
    main()
