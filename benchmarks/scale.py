"""A model at research scale on this machine: Llama-3-8B's shape in bf16, and a Llama-3.2-1B
shape against transformers.

The checkpoint is random (normal x 0.02, rounded to bf16) with Llama-3-8B's published config:
32 layers, d 4096, 32 query heads over 8 key/value heads of 128, FFN 14336, vocabulary 128256,
untied LM head; about 16 GB of bf16 safetensors in shards with a ``model.safetensors.index.json``.
It is written once, streaming one tensor at a time in blocks (memory stays low), into
``<powerlens cache>/bench/llama3-8b-random`` (``powerlens._src.io.cache_dir()``; never the
repository), with a word-level ``tokenizer.json`` so that ``powerlens align`` takes text.

Each measured command runs in its own subprocess; its peak RSS is the ``ru_maxrss`` of that
child (``os.wait4``), its wall time the child's whole life (start-up, load and compilation
included):

    load        pl.load(folder): every weight, bf16                          (<= 20 GB)
    spectrum    powerlens spectrum FOLDER: W_v and W_o only, per-layer float64 eig   (<= 3 GB)
    align       powerlens align FOLDER --rule paper, 1 x 32 tokens: no FFN, no LM head (<= 8 GB)
    trace       pl.run_states (rule full) and pl.logits, then pl.trace(rule="full"), 1 x 32 tokens (<= 20 GB)
    generate    pl.generate(model, 1 x 32 tokens, max_new_tokens=16), greedy  (<= 20 GB)
    independent after trace or generate: a float32 forward pass in NumPy of the prompt and the
                generated tokens from the raw bf16 bytes, one layer at a time
                (:func:`reference_forward`), against every state and logit of ``trace``'s
                run_states and the tokens of ``generate`` (:func:`independent_check`)

The spectrum's lambda_1 (both orderings) of a few layers is checked against an independent
float64 ``numpy.linalg.eigvals`` formed from the raw bf16 bytes of the file: of the r x r
matrix V_t O_t,g whose eigenvalues are the nonzero ones of F_t = O_t V_t (``--check-full``: of
the d x d F_t itself; the tiny configuration always does).

``--only`` picks cases (``write,spectrum,align,load,trace,generate,vs_transformers``); the
cases that need the whole model (load, trace, generate) are skipped, and say so, unless the
machine has ``--need-gb`` (default 21 at 8b) GB available when they start. The results file
keeps the rows and tables of the cases a run does not measure again (from the file it
replaces, with that run's command line), so that ``--only load,trace,generate`` adds to the
spectrum and align results instead of dropping them. ``--size 1b`` measures the same cases on
the Llama-3.2-1B shape below, ``--size tiny`` on 2 layers (neither writes the results file
unless given ``--doc``).

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
    from powerlens._src import io
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
import powerlens as pl, jax, time
t = time.perf_counter(); m = pl.load(FOLDER)
print("RESULT", {"seconds_load": time.perf_counter() - t, "dtype": str(m.layers.W_v.dtype),
                 "weights_gib": sum(a.nbytes for a in jax.tree_util.tree_leaves(m)) / 2**30})
""",
    "trace": """
import powerlens as pl, numpy as np, time, os
t = time.perf_counter(); m = pl.load(FOLDER); tl = time.perf_counter() - t
ids = [PROMPT_IDS]
t = time.perf_counter()
x0, valid = pl.embed(m, ids)
states = np.asarray(pl.run_states(m, x0, valid))               # "float32[T+1 1 n d]", rule full
lg = np.asarray(pl.logits(m, states[-1]))                      # "float32[1 n V]"
tf = time.perf_counter() - t
np.save(os.path.join(WORK, "states.npy"), states)
np.save(os.path.join(WORK, "logits.npy"), lg)
from powerlens._src.analysis.alignment import model_spectra
t = time.perf_counter(); tr = pl.trace(m, ids, rule="full", spectra=model_spectra(m)); tt = time.perf_counter() - t
same = lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())
print("RESULT", {"seconds_load": tl, "seconds_forward": tf, "seconds_trace": tt, "finite": bool(np.isfinite(lg).all()),
                 "trace_vs_run_states": max(same(tr.states, states), same(tr.logits, lg))})
""",
    "generate": """
import powerlens as pl, numpy as np, time, os
t = time.perf_counter(); m = pl.load(FOLDER); tl = time.perf_counter() - t
t = time.perf_counter(); g = pl.generate(m, [PROMPT_IDS], max_new_tokens=NEW_TOKENS)
new = np.asarray(g.new_ids[0], np.int64)
np.save(os.path.join(WORK, "new_ids.npy"), new)
print("RESULT", {"seconds_load": tl, "seconds_generate": time.perf_counter() - t, "new_tokens": int(new.size)})
""",
    "independent": """
import sys; sys.path.insert(0, HERE)
import scale
print("RESULT", scale.independent_check(FOLDER, CFG, WORK, PROMPT_IDS, progress=True))
""",
}
PROMPT_IDS = [(7 * i + 3) % WORDS for i in range(32)]     # PROMPT's ids under the word-level tokenizer
NEW_TOKENS = 16


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


def python_child(code: str, folder: str, work: str = "", cfg: dict = None):
    for key, value in (("FOLDER", folder), ("WORK", work), ("HERE", HERE), ("CFG", cfg), ("PROMPT_IDS", PROMPT_IDS),
                       ("NEW_TOKENS", NEW_TOKENS)):
        code = code.replace(key, repr(value))
    return run_child([sys.executable, "-c", code])


def cli_child(args):
    exe = os.path.join(os.path.dirname(sys.executable), "powerlens")
    return run_child([exe, *args, "--quiet"] if args[0] == "align" else [exe, *args])


def result_of(out: str) -> dict:
    import ast
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return ast.literal_eval(lines[-1][7:]) if lines else {}


def available_gb() -> float:
    from powerlens._src.models.reader import available_memory
    a = available_memory()
    return float("inf") if a is None else a / 2 ** 30


# ------------------------------------------------------------------ the independent spectrum check

def raw_bf16(folder: str, name: str, rows=None, dtype=np.float64) -> np.ndarray:
    """Tensor ``name`` of a bf16 safetensors folder as ``dtype`` (float64 or float32: both hold
    every bf16 value exactly), from its bytes (index, header, offsets); ``rows``: a range
    (start, stop) of its first axis, or a list of row indices, read by their offsets alone."""
    with open(os.path.join(folder, "model.safetensors.index.json")) as fh:
        shard = json.load(fh)["weight_map"][name]
    with open(os.path.join(folder, shard), "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        meta = json.loads(fh.read(n))[name]
        assert meta["dtype"] == "BF16", meta
        begin, end = meta["data_offsets"]
        shape = list(meta["shape"])
        width = 2 * int(np.prod(shape[1:]))                    # bytes of one row
        if rows is None:
            idx = [(0, shape[0])]
        elif isinstance(rows, tuple):
            idx = [rows]
        else:
            idx = [(int(r), int(r) + 1) for r in rows]
        parts = []
        for a, b in idx:
            fh.seek(8 + n + begin + a * width)
            parts.append(np.frombuffer(fh.read((b - a) * width), np.uint16))
        bits = np.concatenate(parts) if len(parts) > 1 else parts[0]
    out = (bits.astype(np.uint32) << 16).view(np.float32).reshape([-1] + shape[1:])
    return out if dtype == np.float32 else out.astype(dtype)


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


# ------------------------------------------------------------------ the independent float32 forward

HEAD_ROWS = 16384          # rows of the LM head read (and upcast) at a time


def reference_forward(folder: str, cfg: dict, ids, *, progress: bool = False):
    """Llama's forward pass of one prompt ``ids`` (n tokens) in NumPy float32, from the raw bf16
    bytes of the checkpoint, one layer at a time: (states "float32[L+1 n d]", x_0 the embedding
    rows and x_t the residual stream after layer t; logits "float32[n V]").

    Hugging Face's Llama, written out: RMSNorm r(x) = x / sqrt(mean(x^2) + eps) * w; per layer
    x += W_o concat_h softmax(q_h k_g(h)^T / sqrt(e) + causal mask) v_g(h) on r(x) with RoPE
    (rotate_half, base rope_theta, angles in float64) on q and k, query head h reading
    key/value head h // (H / G); then x += W_down (silu(W_gate r(x)) * W_up r(x)); logits
    W_head r(x) after the last layer (the word embeddings when tied). Only one layer's weights
    are ever held in float32 (about 0.9 GB at Llama-3-8B's shape), the LM head is read
    :data:`HEAD_ROWS` rows at a time, and the embeddings only at the prompt's rows: nothing of
    powerlens is used."""
    d, L, H, G = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e = cfg.get("head_dim", d // H)
    eps, theta, V = np.float32(cfg["rms_norm_eps"]), float(cfg["rope_theta"]), cfg["vocab_size"]
    ids = np.asarray(ids, np.int64)
    n = len(ids)
    read = lambda name, rows=None: raw_bf16(folder, name, rows, dtype=np.float32)

    def rms(x, w):
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w

    ang = np.arange(n, dtype=np.float64)[:, None] / theta ** (np.arange(0, e, 2, dtype=np.float64) / e)[None]
    cos, sin = (np.concatenate([f(ang)] * 2, axis=-1).astype(np.float32) for f in (np.cos, np.sin))   # (n, e)

    def rope(x):                                           # x (heads, n, e)
        half = e // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rot * sin

    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
    x = read("model.embed_tokens.weight", list(ids))                  # (n, d)
    states = np.empty((L + 1, n, d), np.float32)
    states[0] = x
    for i in range(L):
        p = f"model.layers.{i}."
        h = rms(x, read(p + "input_layernorm.weight"))
        q = rope((h @ read(p + "self_attn.q_proj.weight").T).reshape(n, H, e).transpose(1, 0, 2))
        k = rope((h @ read(p + "self_attn.k_proj.weight").T).reshape(n, G, e).transpose(1, 0, 2))
        v = (h @ read(p + "self_attn.v_proj.weight").T).reshape(n, G, e).transpose(1, 0, 2)
        k, v = np.repeat(k, H // G, axis=0), np.repeat(v, H // G, axis=0)      # head h reads h // (H / G)
        s = q @ k.transpose(0, 2, 1) / np.float32(np.sqrt(e)) + mask
        a = np.exp(s - s.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        x = x + (a @ v).transpose(1, 0, 2).reshape(n, H * e) @ read(p + "self_attn.o_proj.weight").T
        h = rms(x, read(p + "post_attention_layernorm.weight"))
        g = h @ read(p + "mlp.gate_proj.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ read(p + "mlp.up_proj.weight").T)) @ read(p + "mlp.down_proj.weight").T
        states[i + 1] = x
        if progress:
            print(f"\r  independent forward: layer {i + 1} / {L}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    h = rms(x, read("model.norm.weight"))
    head = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    logits = np.empty((n, V), np.float32)
    for a in range(0, V, HEAD_ROWS):
        b = min(V, a + HEAD_ROWS)
        logits[:, a:b] = h @ read(head, (a, b)).T
    return states, logits


def independent_check(folder: str, cfg: dict, work: str, prompt_ids, *, progress: bool = False) -> dict:
    """The powerlens outputs saved in ``work`` by the trace and generate children against
    :func:`reference_forward` of the prompt followed by the generated tokens (one pass: causal
    attention leaves the prompt's states as they are):

    * states: max over steps t of max |x_t - x_t ref| (absolute, and over max |x_t ref|);
    * logits at the prompt's tokens: max |z - z ref| (absolute, and over max |z ref|);
    * generated tokens: greedy decoding of the reference gives the same ids iff at every
      position n - 1 + j the reference's argmax is new token j (given the same prefix, by
      induction); ``min_margin`` is the smallest gap between the reference's two largest
      logits there, to set against the logits' difference."""
    path = lambda name: os.path.join(work, name)
    new = np.load(path("new_ids.npy")).reshape(-1) if os.path.isfile(path("new_ids.npy")) else np.zeros(0, np.int64)
    n = len(prompt_ids)
    full = np.concatenate([np.asarray(prompt_ids, np.int64), new.astype(np.int64)])
    t = time.perf_counter()
    states, logits = reference_forward(folder, cfg, full, progress=progress)
    out = {"seconds_reference": time.perf_counter() - t, "tokens": int(len(full))}
    if os.path.isfile(path("states.npy")):
        got = np.load(path("states.npy"))[:, 0]                       # "float32[T+1 n d]"
        ref = states[:, :n]
        diff = np.abs(got.astype(np.float64) - ref).reshape(len(ref), -1).max(axis=1)
        out["states_max_abs_diff"] = float(diff.max())
        out["states_max_rel_diff"] = float((diff / np.abs(ref).reshape(len(ref), -1).max(axis=1)).max())
        z = np.load(path("logits.npy"))[0]                            # "float32[n V]"
        dz = np.abs(z.astype(np.float64) - logits[:n])
        out["logits_max_abs_diff"] = float(dz.max())
        out["logits_max_rel_diff"] = float(dz.max() / np.abs(logits[:n]).max())
    if len(new):
        at = logits[n - 1: n - 1 + len(new)]
        top2 = np.sort(at, axis=-1)[:, -2:]
        out["tokens_equal"] = bool((np.argmax(at, axis=-1) == new).all())
        out["min_margin"] = float((top2[:, 1] - top2[:, 0]).min())
        out["new_tokens"] = int(len(new))
    return out


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


SIZES = {   # --size: (config, folder name, seed, default --need-gb)
    "8b": (LLAMA3_8B, "llama3-8b-random", 0, 21.0),
    "1b": (LLAMA32_1B, "llama3.2-1b-random", 1, 6.0),
    "tiny": (TINY, "llama-tiny-random", 0, 0.0),
}
FACTS = ("states_max_rel_diff", "logits_max_rel_diff", "tokens_equal")
EQUAL_REL = 1e-4            # states and logits "equal" the independent forward within this of their scale


def earlier_results(path: str, rerun) -> dict:
    """What the results file at ``path`` holds for the cases this run does not measure again
    (a run of some cases keeps the others' rows): {"rows": [first-table rows of those cases],
    "tables": [its other tables kept], "command": its command line, "date": its date}."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return {"rows": [], "tables": [], "cases": set(), "notes": []}
    lines = text.splitlines()
    field = lambda key: next((ln.split(": ", 1)[1].strip("`") for ln in lines if ln.startswith(f"- {key}: ")), "?")
    tables, cur = [], []
    for ln in lines + [""]:
        if ln.startswith("|"):
            cur.append(ln)
        elif cur:
            tables.append(cur)
            cur = []
    if not tables:
        return {"rows": [], "tables": [], "cases": set(), "notes": []}
    cells = lambda row: [c.strip() for c in row.strip("|").split("|")]
    rows = [cells(r) for r in tables[0][2:] if cells(r)[0] in CASES + ("independent",) and cells(r)[0] not in rerun]
    owner = {"λ1": "spectrum", "Llama-3.2-1B": "vs_transformers", "independent float32 forward": "independent"}
    kept = [t for t in tables[1:] if any(k in t[0] and v not in rerun for k, v in owner.items())]
    cases = {r[0] for r in rows} | {v for t in kept for k, v in owner.items() if k in t[0]}
    notes = [ln for ln in lines if ln.startswith("1B check:")] if "vs_transformers" in cases else []
    lam = next((t for t in kept if "λ1" in t[0]), None)
    for r in rows:
        if r[0] == "spectrum" and len(r) < 6 and lam:        # a file written before the last column
            r.append(f"λ1 within {max(float(cells(x)[-1]) for x in lam[2:]):.0e} of numpy's float64 eig")
    return {"rows": rows, "tables": kept, "cases": cases, "notes": notes, "command": field("command"),
            "date": field("date")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases of {CASES}")
    ap.add_argument("--size", choices=tuple(SIZES), default="8b",
                    help="the measured checkpoint: Llama-3-8B's shape (default), Llama-3.2-1B's (the same "
                         "stages at 1/6 of the memory) or a 2-layer one (a test); only 8b writes the results "
                         "file unless --doc is given")
    ap.add_argument("--tiny", action="store_true", help="the same as --size tiny")
    ap.add_argument("--folder", default=None, help="where the checkpoints go (default <powerlens cache>/bench)")
    ap.add_argument("--need-gb", type=float, default=None,
                    help="GB that must be available before a whole-model case (load, trace, generate) starts "
                         "(default 21 at 8b, 6 at 1b)")
    ap.add_argument("--check-layers", default=None, help="layers whose lambda_1 is checked against numpy "
                                                         "(default 0,15,31 at 8b)")
    ap.add_argument("--check-full", action="store_true",
                    help="check against numpy's eig of the d x d F itself (8B: ~15-30 min a layer on 2 busy cores)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats of the 1B comparison (best of)")
    benchdoc.add_doc_option(ap, "scale")
    args = ap.parse_args(argv)
    if args.tiny:
        args.size = "tiny"
    args.tiny = args.size == "tiny"                        # benchdoc: a tiny run writes no file unless --doc
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    bad = [c for c in only if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; expected some of {CASES}")
    if args.size != "8b" and args.doc is None:       # the results file holds the 8B measurements alone
        args.no_doc = True
    root = args.folder or bench_dir()
    big_cfg, name, seed, need = SIZES[args.size]
    need_gb = need if args.need_gb is None else args.need_gb
    small_cfg = dict(TINY, tie_word_embeddings=True) if args.tiny else LLAMA32_1B
    big = os.path.join(root, name)
    small = os.path.join(root, "llama-tiny-tied-random" if args.tiny else "llama3.2-1b-random")
    L = big_cfg["num_hidden_layers"]
    check_layers = [int(x) for x in (args.check_layers or ",".join(str(i) for i in sorted({0, L // 2 - 1, L - 1}))
                                     ).split(",")]
    targets = TARGETS_GB if args.size == "8b" else {}
    rows, checks, skipped, vs = [], [], [], None
    results = {}
    with benchdoc.Capture() as printed:
        t = time.perf_counter()
        write_checkpoint(big, big_cfg, seed=seed)
        shards = [f for f in os.listdir(big) if f.endswith(".safetensors")]
        size = sum(os.path.getsize(os.path.join(big, f)) for f in shards)
        print(f"checkpoint: {big} ({size / 2**30:.1f} GiB of bf16 safetensors, {len(shards)} shards; "
              f"{time.perf_counter() - t:.0f} s)")

        def row(case, sec, peak, rc):
            target = targets.get(case)
            within = None if target is None else ("yes" if rc == 0 and peak <= target * 2**30 else "no")
            rows.append([case, f"{sec:.1f}", gb(peak), None if target is None else f"≤ {target}", within])

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
                    print(f"vs_transformers: rc={rc} {sec:.1f} s peak {gb(peak)} GiB {_short(vs or {})}")
                    if rc:
                        print(out[-3000:])
                    continue
                if case in WHOLE and available_gb() < need_gb:
                    msg = f"{case}: skipped, {available_gb():.1f} GB available < --need-gb {need_gb}"
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
                    sec, peak, rc, out = python_child(CHILD[case], big, tmp, big_cfg)
                res = result_of(out)
                results[case] = res
                print(f"{case}: rc={rc} wall {sec:.1f} s, peak RSS {gb(peak)} GiB {_short(res)}")
                if rc:
                    print(out[-3000:])
                row(case, sec, peak, rc)
                if case == "spectrum" and rc == 0:
                    checks = check_spectrum(big, big_cfg, os.path.join(out_dir, "spectrum.json"), check_layers,
                                            full=args.check_full or args.tiny)
                    for r in checks:
                        print(f"  layer {r[0]} {r[1]}: lambda_1 {r[2]:.6g} vs numpy float64 eig {r[3]:.6g}: "
                              f"rel diff {r[4]:.2e}")
            if any(os.path.isfile(os.path.join(tmp, f)) for f in ("states.npy", "new_ids.npy")):
                # the independent float32 forward (NumPy, one layer at a time) of what trace and generate gave
                sec, peak, rc, out = python_child(CHILD["independent"], big, tmp, big_cfg)
                res = result_of(out)
                results["independent"] = res
                print(f"independent: rc={rc} wall {sec:.1f} s, peak RSS {gb(peak)} GiB {_short(res)}")
                if rc:
                    print(out[-3000:])
                row("independent", sec, peak, rc)
    facts = facts_of(results, rows)
    for line in facts["lines"]:
        print(line)
    doc = benchdoc.doc_target(args, "scale")
    kept = earlier_results(doc, set(only) | ({"independent"} if "independent" in results else set())) \
        if doc else {"rows": [], "tables": [], "cases": set(), "notes": []}
    order = list(CASES[:CASES.index("generate") + 1]) + ["independent"]
    for r in rows:
        r.append(independent_cell(r[0], results.get("independent") or {}, checks))
    all_rows = sorted(rows + [[c if c != "–" else None for c in r] + [None] * (6 - len(r)) for r in kept["rows"]],
                      key=lambda r: order.index(r[0]) if r[0] in order else len(order))
    tables = [benchdoc.markdown_table(["command", "wall s", "peak RSS GiB", "target GiB", "within",
                                       "against an independent computation"], all_rows)]
    if facts["table"]:
        tables.append(facts["table"])
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
    tables += kept["tables"]
    notes = []
    if vs:
        notes.append(f"1B check: logits agree to {vs['logits_rel_err']:.1e} of their scale; greedy tokens "
                     f"{'identical' if vs['same_tokens'] else 'DIFFER'}.")
    notes += kept["notes"]
    if kept["cases"]:
        notes.append(f"Kept from the earlier run `{kept['command']}` ({kept['date']}), not run again here: "
                     f"{', '.join(c for c in CASES + ('independent',) if c in kept['cases'])}.")
    measured = set(results) | ({"vs_transformers"} if vs else set()) | kept["cases"]
    not_asked = [c for c in CASES if c not in measured and c not in skipped and c != "write"]
    if not_asked:
        notes.append(f"Not measured (`--only`): {', '.join(not_asked)}.")
    if skipped:
        notes.append(f"Not run here (too little memory available when they would have started): "
                     f"{', '.join(skipped)}; run them with `python benchmarks/scale.py --only {','.join(skipped)}`.")
    shape = {"8b": "Llama-3-8B-shaped", "1b": "Llama-3.2-1B-shaped", "tiny": "2-layer"}[args.size]
    benchdoc.write_if_asked(args, "scale", argv, tables, printed.text,
                            summary=f"{shape} random bf16 checkpoint (sharded safetensors): wall time and peak RSS "
                                    f"of each command in its own process, its states, logits and generated tokens "
                                    f"against an independent float32 forward of the bf16 weights; a Llama-3.2-1B "
                                    f"shape against transformers.", packages=("torch", "transformers"), notes=notes)
    return {"rows": rows, "checks": checks, "vs": vs, "skipped": skipped, "results": results, "facts": facts}


def independent_cell(case: str, ref: dict, checks) -> str:
    """The first table's last cell: how a case's numbers compare with an independent computation
    (the NumPy float32 forward; NumPy's float64 eig for the spectrum)."""
    if case == "spectrum" and checks:
        return f"λ1 within {max(r[4] for r in checks):.0e} of numpy's float64 eig"
    if case == "trace" and "states_max_rel_diff" in ref:
        return (f"states within {ref['states_max_rel_diff']:.0e}, logits within {ref['logits_max_rel_diff']:.0e} "
                f"of their scale")
    if case == "generate" and "tokens_equal" in ref:
        return f"{ref['new_tokens']} of {ref['new_tokens']} tokens equal" if ref["tokens_equal"] else "tokens DIFFER"
    return None


def facts_of(results: dict, rows) -> dict:
    """The done-when of the whole-model cases, from their results: peak RSS of each, states and
    logits against the independent forward, the generated tokens equal. {"lines": printed,
    "table": a Markdown table or [], "ok": all within EQUAL_REL and equal}."""
    ref = results.get("independent") or {}
    if not ref:
        return {"lines": [], "table": [], "ok": None}
    peak = {r[0]: r[2] for r in rows}
    out, ok = [], True
    if "states_max_rel_diff" in ref:
        for key, what in (("states", "every state x_0 .. x_L (run_states, rule full)"),
                          ("logits", "logits of x_L at every prompt token")):
            rel, ab = ref[f"{key}_max_rel_diff"], ref[f"{key}_max_abs_diff"]
            ok &= rel <= EQUAL_REL
            out.append([what, f"max abs {ab:.2e}, max / scale {rel:.1e}", "yes" if rel <= EQUAL_REL else "NO"])
    if "tokens_equal" in ref:
        ok &= ref["tokens_equal"]
        out.append([f"{ref['new_tokens']} greedy tokens (generate, KV cache)",
                    f"reference argmax at each position (smallest top-2 gap {ref['min_margin']:.3g})",
                    "yes" if ref["tokens_equal"] else "NO"])
    lines = [f"independent float32 forward: {w}: {v} -> {'equal' if e == 'yes' else 'DIFFERENT'}" for w, v, e in out]
    lines.append("peak RSS per stage: " + ", ".join(f"{c} {peak[c]} GiB" for c in WHOLE + ("independent",)
                                                    if c in peak))
    table = benchdoc.markdown_table(["independent float32 forward (NumPy, one layer at a time)", "difference",
                                     f"equal (≤ {EQUAL_REL:g} of scale)"], out)
    return {"lines": lines, "table": table, "ok": ok}


if __name__ == "__main__":
    main()
