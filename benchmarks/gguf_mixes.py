"""GGUF files in llama.cpp's quantization mixes, for side-by-side runs against llama.cpp.

No model hub is reachable here, and the built-in SmolLM2 (width 576) cannot hold K-quants
(their blocks are 256 weights of a row). So this writes a random-weight model of a real
shape in float16, SmolLM2's tokenizer and chat template copied from the built-in file,
and has llama.cpp's own quantizer (llama-cpp-python's ``llama_model_quantize``) write the
mixes, with the types it picks per tensor as for any Llama/Qwen3 file:

    PYTHONPATH=$PWD python benchmarks/gguf_mixes.py --out /tmp/gguf-mixes [--arch llama|qwen3] [--layers 12] \\
        [--types Q4_K_M,IQ4_XS,Q3_K_M,Q2_K]

``llama``: width 2048, 32 query / 8 KV heads of 64, FFN 5632 (TinyLlama's widths);
``qwen3``: width 2048, 16 / 8 heads of 128, FFN 6144, per-head q/k norms. Untied LM head
over SmolLM2's 49152 tokens. Weights are N(0, 0.02): the tokens they produce mean
nothing; speed and memory do not depend on them. Writes ``{arch}-{TYPE}.gguf`` and removes
the float16 source. Needs the optional llama-cpp-python (``pip install 'pipeserve[llamacpp]'``).

``--random-blocks`` needs no llama.cpp: each tensor is written as random valid blocks (float16
scales of a trained model's size) of the type ``RANDOM_MIXES`` gives its role, an approximation
of llama.cpp's picks (it varies some roles by layer); the files then hold exactly the mix's
layouts at their bytes, which is what loading, memory and kernel speed depend on:

    PYTHONPATH=$PWD python benchmarks/gguf_mixes.py --out /tmp/gguf-mixes --random-blocks --types Q2_K,Q3_K_M,IQ4_XS
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from tests.checkpoints import random_quant_blocks

SHAPES = {  # hidden, ffn, heads, kv heads, head dim
    "llama": (2048, 5632, 32, 8, 64),
    "qwen3": (2048, 6144, 16, 8, 128),
}
# --random-blocks: per file type, (the default type, {role: type}); the head is Q6_K as llama.cpp
# writes it, the embedding the default type.
RANDOM_MIXES = {
    "Q2_K": ("Q2_K", {"attn_v": "Q3_K", "ffn_down": "Q3_K", "attn_output": "Q4_K", "output": "Q6_K"}),
    "Q3_K_M": ("Q3_K", {"attn_v": "Q4_K", "ffn_down": "Q4_K", "attn_output": "Q4_K", "output": "Q6_K"}),
    "Q3_K_S": ("Q3_K", {"output": "Q6_K"}),
    "IQ4_XS": ("IQ4_XS", {"output": "Q6_K"}),
    "IQ4_NL": ("IQ4_NL", {"output": "Q6_K"}),
    "Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}),
    "Q8_0": ("Q8_0", {}),   # llama.cpp keeps the head in Q8_0 too
}
SKIP_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}


def write_f16(path: Path, arch: str, layers: int, seed: int = 0, mix: str | None = None,
              source: Path | None = None) -> None:
    """The float16 source model, or (``mix``: a key of RANDOM_MIXES) that mix as random blocks.
    ``source``: the GGUF whose tokenizer and settings are copied (default the built-in SmolLM2;
    ``--metadata-only`` writes a small file of them, for a machine without the package)."""
    hidden, ffn, heads, kv_heads, head_dim = SHAPES[arch]
    src = gguf.GGUFReader(str(source or _builtin()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    shape = {"block_count": layers, "embedding_length": hidden, "feed_forward_length": ffn,
             "attention.head_count": heads, "attention.head_count_kv": kv_heads,
             "rope.dimension_count": head_dim}
    if arch == "qwen3":
        shape.update({"attention.key_length": head_dim, "attention.value_length": head_dim})
    w = gguf.GGUFWriter(str(path), arch)
    _copy_fields(src, w, arch, shape)    # tokenizer, template, rope base, eps: SmolLM2's
    for key, value in shape.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{mix}" if mix else "MOSTLY_F16"))
    rng = np.random.default_rng(seed)

    def add_matrix(name: str, rows: int, cols: int) -> None:
        if mix is None:
            w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16))
            return
        default, roles = RANDOM_MIXES[mix]
        qtype = gguf.GGMLQuantizationType[roles.get(name.split(".")[-2], default)]
        w.add_tensor(name, random_quant_blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    add_matrix("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    add_matrix("output.weight", vocab, hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        b = f"blk.{i}."
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(b + name + ".weight", np.ones(hidden, np.float32))
        if arch == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(b + name + ".weight", np.ones(head_dim, np.float32))
        for name, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, q), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                                 ("ffn_down", hidden, ffn)):
            add_matrix(b + name + ".weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _builtin() -> Path:
    from pipeserve.model.loader import resolve_model
    return resolve_model("smollm2-135m-instruct").path


def _copy_fields(src: gguf.GGUFReader, w: gguf.GGUFWriter, arch: str, shape: dict) -> None:
    """src's key/values into w but SKIP_KEYS, its ``llama.`` keys renamed for ``arch``, those
    ``shape`` sets left for it."""
    for key, field in src.fields.items():
        if key in SKIP_KEYS:
            continue
        if key.startswith("llama."):
            key = arch + key[len("llama"):]
            if key[len(arch) + 1:] in shape:
                continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])


def write_metadata(path: Path) -> None:
    """The built-in file's key/values (tokenizer, template, settings) and no tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    _copy_fields(gguf.GGUFReader(str(_builtin())), w, "llama", {})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, dst: Path, file_type: str, threads: int) -> None:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src} to {file_type}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arch", choices=sorted(SHAPES), default="llama")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--types", default="Q4_K_M,IQ4_XS,Q3_K_M,Q2_K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--random-blocks", action="store_true",
                    help="write each mix as random blocks of RANDOM_MIXES' types (no llama.cpp needed)")
    ap.add_argument("--source", type=Path, help="copy the tokenizer and settings from this GGUF "
                    "(default: the built-in SmolLM2)")
    ap.add_argument("--metadata-only", action="store_true",
                    help="write OUT/smollm2-meta.gguf: the built-in file's key/values without its tensors")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.metadata_only:
        write_metadata(args.out / "smollm2-meta.gguf")
        print(args.out / "smollm2-meta.gguf")
        return
    if args.random_blocks:
        for file_type in args.types.split(","):
            if file_type not in RANDOM_MIXES:
                raise SystemExit(f"--random-blocks knows the mixes {', '.join(RANDOM_MIXES)}, not {file_type}")
            write_f16(args.out / f"{args.arch}-{file_type}.gguf", args.arch, args.layers, mix=file_type,
                      source=args.source)
            print(args.out / f"{args.arch}-{file_type}.gguf")
        return
    src = args.out / f"{args.arch}-F16.gguf"
    write_f16(src, args.arch, args.layers, source=args.source)
    try:
        for file_type in args.types.split(","):
            quantize(src, args.out / f"{args.arch}-{file_type}.gguf", file_type, args.threads)
            print(args.out / f"{args.arch}-{file_type}.gguf")
    finally:
        src.unlink()


if __name__ == "__main__":
    main()
