"""A tiny llama model in GGUF with random weights, written on the spot with the `gguf` package (for
bench/gpu_check.py: the real model does not travel to a lent GPU machine, and placement and serving
need only a model llama-server loads, not a good one).

    write_tiny_llama(path, TinyShape(layers=4, embd=256, ff=768, heads=4, vocab=1024), seed=0)

The vocabulary is SentencePiece-style (llama.cpp's `llama` tokenizer): `<unk>`, `<s>`, `</s>`, the
256 byte tokens every input falls back to, then short pieces; a ChatML template, so the chat endpoint
formats messages. Matrices are F16, norms F32; the same arguments write the same bytes. The defaults
give about 8 MB. The output layer never favours a control or byte token, so answers are pieces of
letters up to their max_tokens, never cut short by end-of-text.
"""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass
from pathlib import Path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# llama.cpp's token types (gguf.TokenType): NORMAL 1, UNKNOWN 2, CONTROL 3, BYTE 6.
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class TinyShape:
    layers: int = 4
    embd: int = 256
    ff: int = 768
    heads: int = 4
    kv_heads: int = 4
    vocab: int = 1024
    context: int = 4096

    def __post_init__(self) -> None:
        if self.embd % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"embd {self.embd} must divide by heads {self.heads}, heads by kv_heads {self.kv_heads}")
        if self.vocab < 3 + 256 + 1:
            raise ValueError(f"vocab {self.vocab}: at least 260 (3 control, 256 byte tokens, one piece)")

    def parameters(self) -> int:
        head = self.embd // self.heads
        attn = 2 * self.embd * self.embd + 2 * self.embd * head * self.kv_heads
        return 2 * self.vocab * self.embd + self.layers * (attn + 3 * self.embd * self.ff + 2 * self.embd) + self.embd


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types: 3 control tokens, the 256 byte tokens, then pieces (`▁a`, `a`, `▁ab`, ...)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    letters = string.ascii_lowercase
    pieces = (p for n in itertools.count(1) for t in itertools.product(letters, repeat=n)
              for p in ("\u2581" + "".join(t), "".join(t)))
    while len(tokens) < size:
        tokens.append(next(pieces))
        types.append(NORMAL)
    scores = [0.0] * 259 + [-float(i) for i in range(size - 259)]
    return tokens, scores, types


def write_tiny_llama(path: Path, shape: TinyShape = TinyShape(), seed: int = 0) -> Path:
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    head = shape.embd // shape.heads

    def mat(rows: int, cols: int) -> "np.ndarray":  # numpy (rows, cols) is ggml's [cols, rows]
        return (rng.standard_normal((rows, cols)) * (1.0 / cols ** 0.5)).astype(np.float16)

    def norm() -> "np.ndarray":
        return np.ones(shape.embd, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.embd)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = vocabulary(shape.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", mat(shape.vocab, shape.embd))
    for i in range(shape.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", norm())
        w.add_tensor(b + "attn_q.weight", mat(shape.embd, shape.embd))
        w.add_tensor(b + "attn_k.weight", mat(head * shape.kv_heads, shape.embd))
        w.add_tensor(b + "attn_v.weight", mat(head * shape.kv_heads, shape.embd))
        w.add_tensor(b + "attn_output.weight", mat(shape.embd, shape.embd))
        w.add_tensor(b + "ffn_norm.weight", norm())
        w.add_tensor(b + "ffn_gate.weight", mat(shape.ff, shape.embd))
        w.add_tensor(b + "ffn_up.weight", mat(shape.ff, shape.embd))
        w.add_tensor(b + "ffn_down.weight", mat(shape.embd, shape.ff))
    w.add_tensor("output_norm.weight", norm())
    # Logits of about 5 standard deviations for the pieces and exactly 0 for the control and byte
    # tokens: top-k sampling (and greedy) never picks end-of-text or a lone byte, so every answer runs
    # to max_tokens in valid UTF-8 and a streamed one has text in its chunks.
    out = mat(shape.vocab, shape.embd) * np.float16(5)
    out[:259] = 0
    w.add_tensor("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
