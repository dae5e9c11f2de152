"""Llama-block GGUF files (llama.cpp format: ``llama``, ``qwen2``, ``qwen3``, ``gemma3``, ``phi3``),
read with the ``gguf`` package.

The per-architecture facts (metadata key prefix, which Q/K rows are RoPE-permuted, which
bias tensors exist) live in one table, :data:`ARCHITECTURES`; the tensor names in
:data:`TENSORS`. Any other ``general.architecture`` is rejected by name.

    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = gguf_tokenizer(path); tok("text")["input_ids"]; tok.decode(ids)

Layout. GGUF lists dimensions innermost first, so a tensor with GGUF shape ``[d_in, d_out]``
is the NumPy array (d_out, d_in) — the ``nn.Linear`` (out, in) layout — after
``gguf.quants.dequantize``. Tensor names::

    token_embd (V, d)            blk.N.attn_norm (d,)     blk.N.ffn_norm (d,)
    blk.N.attn_q (H*e, d)        blk.N.attn_k (G*e, d)    blk.N.attn_v (G*e, d)
    blk.N.attn_output (d, H*e)   blk.N.ffn_gate, ffn_up (f, d)   blk.N.ffn_down (d, f)
    blk.N.attn_q.bias (H*e,)     blk.N.attn_k.bias, attn_v.bias (G*e,)   (qwen2; optional in llama)
    output_norm (d,)             output (V, d)  (absent when tied to token_embd)
    blk.N.attn_q_norm, attn_k_norm (e,)                     (qwen3, gemma3: per-head q/k RMSNorm)
    blk.N.post_attention_norm, post_ffw_norm (d,)           (gemma3: sandwich norms; ffn_norm is
                                                             then the pre-FFN norm)

Gemma 3 (``gemma3``). llama.cpp's ``Gemma3Model`` converter stores every ``*norm.weight``
as 1 + w (its ``norm_shift``: Gemma3RMSNorm multiplies by 1 + w), which is the scale the plain
RMSNorm of powerlens needs, so the file's norms are used as they are (transformers' GGUF
loader subtracts the 1 again, ``Gemma2TensorProcessor``). The file does not carry, and
powerlens takes from llama.cpp's loader (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``), which
agrees with transformers' ``Gemma3TextConfig`` defaults:

* the local/global pattern: every 6th layer global (``set_swa_pattern(6)``; transformers'
  ``sliding_window_pattern`` 6: layers 5, 11, 17, ... are ``full_attention``), the others
  local with window ``gemma3.attention.sliding_window``;
* the RoPE base of the local layers, 1e4 (``rope_freq_base_train_swa``;
  ``default_theta["local"]``); ``gemma3.rope.freq_base`` (1e6) is the global layers';
* the sqrt(d) scale of the embeddings (llama.cpp scales ``inpL`` by sqrt(n_embd));
* the softmax scale: ``key_length ** -0.5``, llama.cpp's for every size but 27B (whose
  query_pre_attn_scalar is d / H; 270M: 256 ** -0.5 either way);
* the GELU-tanh gated FFN; ``gemma3.final_logit_softcapping`` is read when present.

Qwen3 (``qwen3``): llama.cpp's ``Qwen3Model`` writes the HF rows unpermuted, no biases,
``attn_q_norm`` / ``attn_k_norm`` as stored (Qwen3's RMSNorm multiplies by w), and
``key_length`` (the explicit head_dim).

Phi-3 (``phi3``): llama.cpp's ``Phi3MiniModel`` keeps HF's fused projections, unpermuted,
under ``blk.N.attn_qkv`` (H e + 2 G e, d), rows [q | k | v], and ``blk.N.ffn_up`` (2 f, d),
rows [gate | up] (:data:`FUSED`; there is no ``ffn_gate``); it writes no ``key_length``
(e = d / H). ``phi3.attention.sliding_window`` is NOT applied: llama.cpp's loader switches Phi
SWA off (``LLM_ARCH_PHI3``: ``swa_type = NONE``) and transformers' GGUF loader does not map the
key (``GGUF_CONFIG_MAPPING['phi3']``, so ``Phi3Config.sliding_window`` stays None) — both run
every layer globally, and so does powerlens (an HF folder of Phi-3-mini-4k, by contrast, gets
its window 2047, as ``Phi3ForCausalLM`` applies it). Longrope files (``rope_factors_long``,
the 128k models) and partial RoPE (``phi3.rope.dimension_count`` < e) are rejected.

RoPE permutation. llama.cpp's converter rewrites the rows of W_q and W_k so that its
interleaved RoPE (pairs (2i, 2i+1)) equals Hugging Face's ``rotate_half`` RoPE (pairs
(i, i + e/2))::

    permute(w)   = w.reshape(n, 2, e/2, d_in).swapaxes(1, 2).reshape(n*e, d_in)
    unpermute(w) = w.reshape(n, e/2, 2, d_in).swapaxes(1, 2).reshape(n*e, d_in)

with n = H for W_q and n = G for W_k (and the same on their biases). ``load_gguf`` un-permutes,
so the layers use the HF convention of :mod:`powerlens._src.dynamics.attention`. Only ``llama``
is permuted: llama.cpp's ``Qwen2Model`` writes the HF rows as they are (and transformers'
GGUF loader un-permutes ``llama`` alone, ``TENSOR_PROCESSORS`` in
``modeling_gguf_pytorch_utils.py``).

Memory. Every tensor is dequantised alone and copied into a preallocated stacked array
(L, ...); each stacked array is handed to JAX and its NumPy copy dropped before the next.
Peak memory is therefore about the float32 model plus one stacked array plus the mapped
file — far above the file size for a 4-bit file (see :func:`load_gguf`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from .base import Model
from ..dynamics.params import wide
from .convert import WINDOW_MAX, Stack, check_layer_count, left_out, short_repr, to_device, wanted
from .llama import QK_NORMS, SANDWICH_NORMS, Sizes, check_rope_head_size, llama_info, llama_model, llama_shapes
from .gguf_tokenizer import gguf_tokenizer, remember_tokenizer  # noqa: F401  (gguf_tokenizer re-exported)
from .reader import CheckpointError
from .gguf_file import GGUFFile  # noqa: F401  (re-exported: the file reader)


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of W_q / W_k: (n*e, d_in) -> (n*e, d_in)."""
    rows, d_in = w.shape
    e = rows // n_heads
    return w.reshape(n_heads, e // 2, 2, d_in).swapaxes(1, 2).reshape(rows, d_in)


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """What differs between the llama.cpp architectures powerlens reads.

    The metadata keys are ``{general.architecture}.…`` (``llama.block_count``,
    ``qwen2.rope.freq_base``); the tensor names are :data:`TENSORS` for all of them.

    family: the powerlens family (``ModelInfo.family``, output layout).
    permuted_qk: llama.cpp's converter permuted the rows of W_q / W_k (and of their biases)
      for its interleaved RoPE (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``);
      undone on reading. transformers' GGUF loader un-permutes for ``llama`` only.
    biases: stacked bias key -> required (True: every block has it; False: read when the
      file has it, as llama.cpp's loader treats it as optional).
    norms: the extra per-layer norm keys every block has (``q_norm_scale`` ..., see
      :data:`~powerlens._src.models.llama.QK_NORMS`, :data:`~powerlens._src.dynamics.params.SANDWICH_NORMS`).
    act: the FFN (``silu_glu``; Gemma's ``gelu_glu``).
    swa_pattern: 0, or n: every n-th layer (n-1, 2n-1, ...) global, the others local with the
      window ``{arch}.attention.sliding_window`` (llama.cpp's ``set_swa_pattern``).
    local_rope_base: RoPE base of the local layers (None: ``rope.freq_base`` everywhere).
    embed_scale: the embeddings are multiplied by sqrt(d) (Gemma).
    fused: the fused tensors of :data:`FUSED` the blocks store instead of their parts (Phi-3).
    """

    family: str
    permuted_qk: bool
    biases: Mapping[str, bool]
    norms: Tuple[str, ...] = ()
    act: str = "silu_glu"
    swa_pattern: int = 0
    local_rope_base: Optional[float] = None
    embed_scale: bool = False
    fused: Tuple[str, ...] = ()


# The one table of the GGUF architectures powerlens reads.
ARCHITECTURES: Mapping[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", permuted_qk=True,
                              biases={"b_q": False, "b_k": False, "b_v": False, "b_o": False}),
    # Qwen2Model(TextModel) in convert_hf_to_gguf.py: no permutation; q/k/v biases always there
    "qwen2": GGUFArchitecture("qwen2", permuted_qk=False, biases={"b_q": True, "b_k": True, "b_v": True}),
    # Qwen3Model(Qwen2Model): no permutation, no biases, q/k norms
    "qwen3": GGUFArchitecture("qwen3", permuted_qk=False, biases={}, norms=QK_NORMS),
    # Gemma3Model(TextModel): no permutation, norms stored as 1 + w; pattern, local base and
    # embedding scale from llama.cpp's loader (module docstring)
    "gemma3": GGUFArchitecture("gemma3", permuted_qk=False, biases={}, norms=QK_NORMS + SANDWICH_NORMS,
                               act="gelu_glu", swa_pattern=6, local_rope_base=10000.0, embed_scale=True),
    # Phi3MiniModel(TextModel): HF's fused qkv_proj / gate_up_proj kept as attn_qkv / ffn_up, no
    # permutation, no biases; phi3.attention.sliding_window is not applied (module docstring)
    "phi3": GGUFArchitecture("phi3", permuted_qk=False, biases={}, fused=("attn_qkv.weight", "ffn_up.weight")),
}

# fused tensor (after ``blk.N.``) -> the stacked keys whose TENSORS rows it holds, in row order:
# attn_qkv (H e + 2 G e, d) = [W_q | W_k | W_v]; ffn_up (2 f, d) = [W_gate | W_in] (HF chunk(2))
FUSED = {"attn_qkv.weight": ("W_q", "W_k", "W_v"), "ffn_up.weight": ("W_gate", "W_in")}


def fused_part(spec: "GGUFArchitecture", key: str, s: Sizes):
    """(fused tensor suffix, its stored shape, first row of ``key``) when ``spec`` stores ``key``
    inside one of its :data:`FUSED` tensors, else None."""
    for name in spec.fused:
        parts = FUSED[name]
        if key in parts:
            rows = [TENSORS[p][1](s) for p in parts]
            start = sum(r[0] for r in rows[:parts.index(key)])
            return name, (sum(r[0] for r in rows),) + rows[0][1:], start
    return None

# stacked key -> (tensor name after ``blk.N.``, stored NumPy shape, heads its rows hold when
# RoPE-permuted: "H" (query), "G" (key) or None)
TENSORS = {
    "W_q": ("attn_q.weight", lambda s: (s.H * s.e, s.d), "H"),
    "W_k": ("attn_k.weight", lambda s: (s.G * s.e, s.d), "G"),
    "W_v": ("attn_v.weight", lambda s: (s.G * s.e, s.d), None),
    "W_o": ("attn_output.weight", lambda s: (s.d, s.H * s.e), None),
    "b_q": ("attn_q.bias", lambda s: (s.H * s.e,), "H"),
    "b_k": ("attn_k.bias", lambda s: (s.G * s.e,), "G"),
    "b_v": ("attn_v.bias", lambda s: (s.G * s.e,), None),
    "b_o": ("attn_output.bias", lambda s: (s.d,), None),
    "norm_scale": ("attn_norm.weight", lambda s: (s.d,), None),
    "ffn_norm_scale": ("ffn_norm.weight", lambda s: (s.d,), None),
    "W_gate": ("ffn_gate.weight", lambda s: (s.f, s.d), None),
    "W_in": ("ffn_up.weight", lambda s: (s.f, s.d), None),
    "W_out": ("ffn_down.weight", lambda s: (s.d, s.f), None),
    "q_norm_scale": ("attn_q_norm.weight", lambda s: (s.e,), None),
    "k_norm_scale": ("attn_k_norm.weight", lambda s: (s.e,), None),
    "post_attn_norm_scale": ("post_attention_norm.weight", lambda s: (s.d,), None),
    "post_ffn_norm_scale": ("post_ffw_norm.weight", lambda s: (s.d,), None),
}


def architecture(f: GGUFFile) -> str:
    """``general.architecture``, checked to be one of :data:`ARCHITECTURES` (else an error naming it)."""
    arch = f.meta("general.architecture", required=True)
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise CheckpointError(f"{f.path}: unsupported GGUF architecture {short_repr(arch)} "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch


def gguf_sizes(f: GGUFFile, arch: str = "llama"):
    """(Sizes, ctx, eps, theta) of a GGUF of architecture ``arch`` (keys ``{arch}.…``), each
    checked: a missing key, a non-positive count, H not a multiple of G or an odd head size
    is an error naming the key. V is read off ``token_embd``."""
    k = lambda key: f"{arch}.{key}"
    d = f.meta_int(k("embedding_length"))
    L = f.meta_int(k("block_count"))
    H = f.meta_int(k("attention.head_count"))
    G = f.meta_int(k("attention.head_count_kv"), H)
    ff = f.meta_int(k("feed_forward_length"))
    e = f.meta_int(k("attention.key_length"), max(d // H, 1))
    ctx = f.meta_int(k("context_length"), 0, minimum=0) or None
    eps = f.meta_float(k("attention.layer_norm_rms_epsilon"))
    theta = f.meta_float(k("rope.freq_base"), 10000.0)
    if H % G:
        raise CheckpointError(f"{f.path}: {k('attention.head_count')}={H} is not a multiple of "
                              f"{k('attention.head_count_kv')}={G}")
    check_rope_head_size(e, f.path, f"{k('attention.key_length')} (or embedding_length / head_count)")
    tok_embd = f.tensors.get("token_embd.weight")
    if tok_embd is None or len(tok_embd.shape) != 2:
        raise CheckpointError(f"{f.path}: tensor 'token_embd.weight' (2 dimensions [d, V]) is missing from the GGUF file")
    V = int(tok_embd.shape[-1])  # GGUF dims [d, V]
    return Sizes(d=d, H=H, G=G, e=e, L=L, f=ff, V=V), ctx, eps, theta


def check_plain(f: GGUFFile, arch: str, s: Sizes) -> None:
    """Reject what the Llama block of powerlens does not compute: a value size other than the
    key size, partial RoPE, scaled RoPE, mixture of experts (each error names the key)."""
    path = f.path
    if f.meta_int(f"{arch}.attention.value_length", s.e) != s.e:
        raise CheckpointError(f"{path}: {arch}.attention.value_length differs from key_length (not supported)")
    rope_dim = f.meta_int(f"{arch}.rope.dimension_count", s.e)
    if rope_dim != s.e:
        raise CheckpointError(f"{path}: {arch}.rope.dimension_count={rope_dim} differs from the head size {s.e} "
                              f"(partial RoPE is not supported)")
    scaling = f.meta(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{path}: {arch}.rope.scaling.type={short_repr(scaling)} is not supported "
                              f"(plain RoPE only)")
    if f.meta_int(f"{arch}.expert_count", 0, minimum=0) > 0:
        raise CheckpointError(f"{path}: mixture-of-experts GGUF files ({arch}.expert_count > 0) are not supported")
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if f.has(name):       # longrope / su (Phi-3 128k): scaled RoPE
            raise CheckpointError(f"{path}: tensor {name!r} (longrope RoPE scaling) is not supported (plain RoPE only)")


def swa_windows(f: GGUFFile, arch: str, spec: GGUFArchitecture, L: int) -> List[int]:
    """Per-layer windows: with ``spec.swa_pattern`` = n, layer i is global when (i + 1) % n == 0,
    local (window ``{arch}.attention.sliding_window``, required) otherwise; else all global."""
    if not spec.swa_pattern:
        return [0] * L
    window = f.meta_int(f"{arch}.attention.sliding_window", maximum=WINDOW_MAX)
    return [0 if (i + 1) % spec.swa_pattern == 0 else window for i in range(L)]


def load_gguf(path: str, *, dtype=np.float32, name: Optional[str] = None) -> Model:
    """Load a GGUF file of an architecture in :data:`ARCHITECTURES` (``llama``, ``qwen2``,
    ``qwen3``, ``gemma3``, ``phi3``) as a :class:`~powerlens._src.models.base.Model`.

    Quantised weights (Q4_0/Q4_1/Q8_0/K-quants, F16, F32) are dequantised by the
    ``gguf`` package. Rejected with a CheckpointError naming the file: another
    ``general.architecture`` (by name, with the supported ones), mixture-of-experts,
    scaled RoPE, partial RoPE; a truncated or corrupt file, a missing tensor, a wrong
    shape or a NaN name the file and tensor.

    Memory (SmolLM2-135M Q4_1, 98 MB file, 538 MB of float32 parameters): peak RSS
    growth while loading ~750 MB = 1.4x the float32 parameters = 7.6x the file. A 4-bit
    file expands ~5x when dequantised, so "1.5x the file" is not reachable for it;
    the overhead above the float32 model is one stacked array plus the mapped pages.
    Gemma 3 270M Q4_K_M (241 MB file, 1023 MiB of float32 parameters, the 671 MiB embedding
    held once): peak growth 1.16x the float32 parameters (tests/test_gemma3.py), the parsed
    metadata (262k tokens) being read and dropped before any weight.
    """
    dtype = np.dtype(dtype)
    if dtype.name not in ("float32", "float64", "bfloat16", "float16"):
        raise CheckpointError(f"{path}: unsupported dtype {dtype} (float32, float64, bfloat16 or float16)")
    f = GGUFFile(path)
    arch = architecture(f)
    spec = ARCHITECTURES[arch]
    s, ctx, eps, theta = gguf_sizes(f, arch)
    check_layer_count(s.L, f"{arch}.block_count", f.tensors, "blk.", path)
    check_plain(f, arch, s)
    # all metadata first (the tokenizer never parses the file again), then the parsed metadata
    # is dropped: with a 262k-token vocabulary (Gemma 3) it holds ~0.2 GB
    has_tokenizer = remember_tokenizer(f)
    window = swa_windows(f, arch, spec, s.L)
    cap_key = f"{arch}.final_logit_softcapping"
    cap = f.meta_float(cap_key) if f.meta(cap_key) is not None else None
    extra = dict(embed_scale=float(np.float32(s.d ** 0.5)) if spec.embed_scale else None, final_logit_softcap=cap)
    info = llama_info(source=path, tokenizer=path if has_tokenizer else None, max_positions=ctx,
                      pad=f.meta("tokenizer.ggml.padding_token_id"), bos=f.meta("tokenizer.ggml.bos_token_id"),
                      name=name or os.path.basename(path), family=spec.family, **extra)
    f.drop_metadata()

    # the embedding first: its two transient copies (NumPy + JAX) then coexist with nothing else
    word = to_device(f.get("token_embd.weight", (s.V, s.d), dtype=dtype)) if wanted("word") else None
    head = to_device(f.get("output.weight", (s.V, s.d), dtype=dtype)) \
        if f.has("output.weight") and wanted("lm_head") else None
    if head is None and f.has("output.weight"):
        left_out("lm_head", "output.weight")
    f.release_pages()
    biases = [k for k, required in spec.biases.items() if required or f.has(f"blk.0.{TENSORS[k][0]}")]
    # one stacked array at a time, so at most one NumPy stack is alive (see Stack.done)
    st = Stack(s.L, dtype, llama_shapes(s.d, s.H, s.G, s.e, s.f, biases=biases, norms=spec.norms), path)
    for key in st.shapes:
        if not st.wants(key):                        # left out by the parts of this load: never read
            continue
        suffix, stored, heads = TENSORS[key]
        shape = stored(s)
        heads = getattr(s, heads) if heads and spec.permuted_qk else 0
        part = fused_part(spec, key, s)              # Phi-3: rows [start, start + shape[0]) of a fused tensor
        if part is not None:
            suffix = part[0]
        for i in range(s.L):                         # every shape checked before the stack is allocated
            f.check(f"blk.{i}.{suffix}", shape if part is None else part[1])
        arr = st[key]
        for i in range(s.L):
            slot = arr[i].reshape(shape)             # a view of layer i's slot
            if part is not None:                     # dequantise the fused tensor, keep this key's rows
                slot[...] = f.get(f"blk.{i}.{suffix}", part[1])[part[2]:part[2] + shape[0]]
            elif heads:                              # small (q/k): dequantise, then un-permute rows
                w = f.get(f"blk.{i}.{suffix}", shape)
                slot[...] = unpermute(w.reshape(shape[0], -1), heads).reshape(shape)
            else:                                    # straight into the slot, in row chunks
                f.get(f"blk.{i}.{suffix}", shape, slot)
        st.done(key)
        f.release_pages()
    rope_base = None
    if spec.local_rope_base is not None:
        rope_base = [spec.local_rope_base if w else theta for w in window]
    return llama_model(st, d=s.d, H=s.H, G=s.G, e=s.e, eps=eps, theta=theta, act=spec.act,
                       embeddings={} if word is None else {"word": word},
                       final_norm=jnp.asarray(f.get("output_norm.weight", (s.d,)).astype(wide(dtype)))
                       if wanted("final_norm") else None,
                       head=head, info=info, window=window, rope_base=rope_base)
