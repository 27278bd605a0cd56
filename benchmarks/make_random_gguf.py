"""A GGUF file with a published model's shapes and random weights, for speed figures on a
size other than SmolLM2's: ``bench_gguf.py`` and ``bench_decode_rows.py`` then compare
ortserve with llama.cpp on exactly the same weights.

    uv run python benchmarks/make_random_gguf.py qwen2.5-0.5b OUT.gguf

    uv run python benchmarks/make_random_gguf.py qwen2.5-0.5b OUT.gguf --vocab-from smollm2.gguf

The matrices are random Q4_0 blocks (nibbles uniform, scales giving each weight a standard
deviation of 1/sqrt(inputs)), the tied embedding and head Q8_0 (as ``llama-quantize``
makes a Q4_0 file's), norms near 1, biases near 0. The vocabulary is another GGUF file's
(``--vocab-from``: its tokens, merges, special tokens and chat template, so that text
splits into as many tokens as with that model), else byte-level tokens and a few special
ones; filler tokens make up the shape's size. Its text is meaningless, its cost (the head's
width) the model's own. Written in seconds: no quantization is computed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

SHAPES = {
    # name: (architecture, hidden, layers, heads, kv heads, feed-forward, vocabulary, rope base)
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151936, 1e6),
    "qwen2.5-1.5b": ("qwen2", 1536, 28, 12, 2, 8960, 151936, 1e6),
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, 5e5),
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = chr(extra)
            extra += 1
    return [chars[b] for b in range(256)]


def blocks(rng: np.random.Generator, rows: int, columns: int, qtype: Q) -> np.ndarray:
    """Random ``qtype`` blocks of a ``rows x columns`` matrix, as the file holds them."""
    count = rows * columns // 32
    if qtype == Q.Q4_0:  # fp16 scale, 16 bytes of nibbles; (q - 8) has a deviation of 4.6
        scale = np.float16(1 / (4.6 * np.sqrt(columns)))
        body = rng.integers(0, 256, (count, 16), dtype=np.uint8)
    else:  # Q8_0: fp16 scale, 32 signed bytes; uniform in [-127, 127] has a deviation of 73
        scale = np.float16(1 / (73 * np.sqrt(columns)))
        body = rng.integers(-127, 128, (count, 32), dtype=np.int8).view(np.uint8)
    scales = np.full((count, 1), scale, dtype=np.float16).view(np.uint8).reshape(count, 2)
    return np.concatenate([scales, body], axis=1).reshape(rows, -1)


def tokenizer(vocab_from: Path | None) -> dict[str, Any]:
    """The tokenizer fields of ``vocab_from`` (a GGUF file), else a byte-level one."""
    if vocab_from is None:
        tokens = byte_tokens() + SPECIAL
        types = [1] * 256 + [3] * len(SPECIAL)
        return {
            "pre": "default", "tokens": tokens, "types": types, "merges": ["Ġ t", "h e", "i n"],
            "bos": tokens.index("<|endoftext|>"), "eos": tokens.index("<|im_end|>"), "template": CHAT_TEMPLATE,
        }  # fmt: skip
    fields = gguf.GGUFReader(vocab_from).fields

    def value(key: str) -> Any:
        return fields[key].contents()

    return {
        "pre": value("tokenizer.ggml.pre"), "tokens": value("tokenizer.ggml.tokens"),
        "types": value("tokenizer.ggml.token_type"), "merges": value("tokenizer.ggml.merges"),
        "bos": value("tokenizer.ggml.bos_token_id"), "eos": value("tokenizer.ggml.eos_token_id"),
        "template": value("tokenizer.chat_template") if "tokenizer.chat_template" in fields else CHAT_TEMPLATE,
    }  # fmt: skip


def write(name: str, path: Path, seed: int = 0, vocab_from: Path | None = None) -> Path:
    arch, hidden, layers, heads, kv_heads, ffn, vocab, rope_base = SHAPES[name]
    head = hidden // heads
    rng = np.random.default_rng(seed)
    words = tokenizer(vocab_from)
    tokens, types = list(words["tokens"]), list(words["types"])
    if len(tokens) > vocab:
        raise SystemExit(f"{vocab_from} has {len(tokens)} tokens, more than {name}'s {vocab}")
    tokens += [f"<filler{i}>" for i in range(vocab - len(tokens))]
    types += [1] * (vocab - len(types))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"random-{name}-Q4_0")
    writer.add_block_count(layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(words["pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(words["merges"])
    writer.add_bos_token_id(words["bos"])
    writer.add_eos_token_id(words["eos"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(words["template"])

    def vector(size: int, around: float) -> np.ndarray:
        return (around + 0.05 * rng.standard_normal(size)).astype(np.float32)

    def matrix(tensor: str, rows: int, columns: int, qtype: Q = Q.Q4_0) -> None:
        writer.add_tensor(tensor, blocks(rng, rows, columns, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", vocab, hidden, Q.Q8_0)  # tied: the head too
    for i in range(layers):
        p = f"blk.{i}"
        writer.add_tensor(f"{p}.attn_norm.weight", vector(hidden, 1.0))
        for part, rows in (("attn_q", heads * head), ("attn_k", kv_heads * head), ("attn_v", kv_heads * head)):
            matrix(f"{p}.{part}.weight", rows, hidden)
            if arch == "qwen2":
                writer.add_tensor(f"{p}.{part}.bias", vector(rows, 0.0))
        matrix(f"{p}.attn_output.weight", hidden, heads * head)
        writer.add_tensor(f"{p}.ffn_norm.weight", vector(hidden, 1.0))
        matrix(f"{p}.ffn_gate.weight", ffn, hidden)
        matrix(f"{p}.ffn_up.weight", ffn, hidden)
        matrix(f"{p}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", vector(hidden, 1.0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-from", type=Path, help="a GGUF file whose tokenizer to use")
    args = parser.parse_args()
    print(write(args.shape, args.out, args.seed, args.vocab_from))


if __name__ == "__main__":
    main()
