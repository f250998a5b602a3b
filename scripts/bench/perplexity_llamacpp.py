"""Perplexity of the same GGUF file in attnres and in llama.cpp, on the same text and windows
(docs/import.md#quantised-models).

    python scripts/bench/perplexity_llamacpp.py --attnres target/release/attnres \
        --pair FILE.gguf DIR [--pair ...] --text FILE [--seq 512] [--max-tokens 4096]

Each pair is a GGUF file and the directory `attnres import` wrote from it. attnres measures
with `attnres eval --seq SEQ`: the text's tokens in windows of SEQ + 1 taken with stride SEQ,
every token but the first predicted once, no BOS added. llama.cpp (llama-cpp-python, all
logits kept) evaluates the very same windows of the very same token ids, and the script sums
the same negative log-likelihoods. The text is cut to its first `--max-tokens` tokens first
(in a file beside the cache) so that both measure the same tokens.
"""

import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np


def llama_nll(path, ids, seq, threads):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=seq, n_batch=seq, n_ubatch=seq, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    nats, count = 0.0, 0
    for s in range(0, len(ids) - 1, seq):
        window = ids[s:s + seq + 1]
        x, y = window[:-1], window[1:]
        llm.reset()
        llm.eval(x)
        logits = np.asarray(llm.scores[: len(x)], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nats += float((logz - logits[np.arange(len(y)), y]).sum())
        count += len(y)
    # Freed here, before the next file loads, rather than whenever the collector gets to it.
    llm.close()
    return nats, count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres", required=True)
    ap.add_argument("--pair", nargs=2, action="append", metavar=("GGUF", "DIR"), required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/attnres-llama"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)

    from llama_cpp import Llama

    tok = Llama(model_path=a.pair[0][0], vocab_only=True, verbose=False)
    text = open(a.text, encoding="utf-8").read()
    ids = tok.tokenize(text.encode(), add_bos=False, special=False)[: a.max_tokens]
    cut = tok.detokenize(ids).decode()
    ids = tok.tokenize(cut.encode(), add_bos=False, special=False)
    cut_file = os.path.join(a.work, "perplexity-text.txt")
    with open(cut_file, "w", encoding="utf-8") as f:
        f.write(cut)

    print(f"{len(ids)} tokens of {a.text}, windows of {a.seq}, {a.threads} threads\n")
    print("| weights | attnres perplexity | llama.cpp perplexity | attnres ÷ llama.cpp − 1 |")
    print("|---|---:|---:|---:|")
    for gguf, model in a.pair:
        out = subprocess.run([a.attnres, "eval", "--model", model, "--text", cut_file, "--seq", str(a.seq),
                              "--json", "--threads", str(a.threads)], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"attnres eval failed: {out.stderr}")
        ours = json.loads(out.stdout)
        nats, count = llama_nll(gguf, ids, a.seq, a.threads)
        if ours["tokens"] != count:
            sys.exit(f"attnres predicted {ours['tokens']} tokens, llama.cpp {count}: the tokenizers differ")
        theirs = math.exp(nats / count)
        label = os.path.splitext(os.path.basename(gguf))[0].rsplit(".", 1)[-1]
        print(f"| {label} | {ours['perplexity']:.4f} | {theirs:.4f} | {ours['perplexity'] / theirs - 1:+.2%} |")


if __name__ == "__main__":
    main()
