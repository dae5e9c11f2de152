"""GGUF tokenizer build time: powerlens (``tokenizers`` from the file's metadata) against
transformers' own GGUF path (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``, which
needs torch), on SmolLM2's file, each in a fresh process so that imports are counted once.

    python benchmarks/tokenizer.py

Prints, for powerlens, the metadata read from the already parsed file, the build, and the
first build including the one-time import of transformers; then the transformers path.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchdoc  # noqa: E402

OURS = r"""
import json, time
from powerlens._src.models.gguf_llama import GGUFFile
from powerlens._src.models.load import resolve
f = GGUFFile(resolve("smollm2"))                    # parsed once, for the weights anyway
t0 = time.perf_counter()
from powerlens._src.models.gguf_tokenizer import build_tokenizer, tokenizer_spec
spec = tokenizer_spec(f)
t1 = time.perf_counter()
tok = build_tokenizer(spec)                          # includes importing transformers/tokenizers
t2 = time.perf_counter()
build_tokenizer(spec)
t3 = time.perf_counter()
print(json.dumps({"spec": t1 - t0, "first_build": t2 - t1, "build": t3 - t2}))
"""

THEIRS = r"""
import json, os, time
from powerlens._src.models.load import resolve
p = resolve("smollm2")
t0 = time.perf_counter()
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p), local_files_only=True)
print(json.dumps({"transformers": time.perf_counter() - t0}))
"""


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchdoc.add_doc_option(ap, "tokenizer")
    args = ap.parse_args(argv)
    with benchdoc.Capture() as printed:
        ours, theirs = run(OURS), run(THEIRS)
        total = ours["spec"] + ours["first_build"]
        print(f"powerlens: metadata {ours['spec']:.3f} s + build {ours['build']:.3f} s "
              f"(first build, with the transformers import: {ours['first_build']:.3f} s; total {total:.3f} s)")
        print(f"transformers' GGUF tokenizer (needs torch): {theirs['transformers']:.3f} s "
              f"-> {theirs['transformers'] / total:.1f}x slower")
    table = benchdoc.markdown_table(
        ("path", "time", "over powerlens's first build"),
        [["powerlens: the file's metadata, then the first build", f"{total:.3f} s", "1.0×"],
         ["powerlens: a second build", f"{ours['build']:.3f} s", f"{ours['build'] / total:.2f}×"],
         ["transformers' GGUF path (needs torch)", f"{theirs['transformers']:.3f} s",
          f"{theirs['transformers'] / total:.1f}×"]])
    benchdoc.write_if_asked(args, "tokenizer", argv, [table], printed.text,
                            packages=("tokenizers", "transformers", "torch", "gguf"),
                            summary="Building SmolLM2's tokenizer from its GGUF file, each path in a fresh process.")
    return {"powerlens": ours, "transformers": theirs}


if __name__ == "__main__":
    main()
