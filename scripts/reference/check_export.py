"""Checks `attnres export --to gguf` against llama.cpp (llama-cpp-python) as the oracle.

    pip install llama-cpp-python==0.3.36 gguf==0.19.0 numpy    # as in scripts/bench/requirements.txt
    cargo build --release --bin attnres --example tokenize
    python scripts/reference/check_export.py --attnres target/release/attnres --model DIR \
        [--types f32 f16 q8_0 q4_0 q4_1 q5_0 q5_1 q4_k q5_k q6_k] [--reference TYPE FILE.gguf ...]
        [--keep DIR]

DIR is a standard checkpoint with its tokenizer (a training run, an import). For each type the
model is exported and loaded by llama.cpp, and compared with attnres running the same stored
weights: DIR itself for f32, `attnres quantize --dtype TYPE` of it for the others (the export
stores exactly those bytes). Checks, each failing the script (exit 1):

1. Token ids: llama.cpp's tokenizer on the exported file gives the ids of ours
   (examples/tokenize.rs) for TEXTS (special tokens parsed in both).
2. Logits of a prompt (llama.cpp's ids, fed to `attnres forward`): relative error
   max|llama.cpp - attnres| / max|attnres| over all positions and the vocabulary, at most
   LOGIT_TOL[type]; and the most likely token is the same at a share of the positions of at
   least ARGMAX_AGREE.
3. Greedy text: each of PROMPTS continued for --new-tokens tokens (argmax, ties to the lowest id,
   stopping at the end-of-text token) by llama.cpp gives the text `attnres generate
   --temperature 0` gives; for the other types, whose two engines round differently (see
   LOGIT_TOL), at least the first MIN_AGREE tokens' text.
4. With --reference TYPE FILE (a GGUF file of the same model made elsewhere: the file DIR was
   imported from, or llama.cpp's own quantisation of it): the export of that type holds the same
   tensors (type and bytes), the same tokenizer metadata, and llama.cpp continues PROMPTS with
   the same text from both files.

Needs llama-cpp-python, gguf and numpy only (safetensors files are read here by hand).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import llama_cpp
from gguf import GGUFReader

# f32: both engines compute in f32 and differ by the order of sums (measured 7e-7 on a tiny
# model, 2e-6 on SmolLM2-135M). f16 and q8_0, against attnres on the same stored weights:
# llama.cpp rounds the activations of F16 products to F16 (attnres keeps them f32): 5e-4 and
# 1.7e-3; both quantise those of Q8_0 products to Q8_0 but round and sum differently, which on
# SmolLM2-135M moves the logits by 4.7e-2, as much as the quantisation of the weights itself
# (attnres q8_0 against f32: 4.3e-2); the tiny model 7e-8. The 4- and 5-bit types on a
# 1024-wide model: 3.6e-4 to 1.2e-3. Bounds: about twice the largest.
LOGIT_TOL = {"f32": 1e-3, "f16": 5e-3, "q8_0": 1e-1, "q4_0": 1e-1, "q4_1": 1e-1, "q5_0": 1e-1,
             "q5_1": 1e-1, "q4_k": 1e-1, "q5_k": 1e-1, "q6_k": 1e-1}
ARGMAX_AGREE = 0.9
MIN_AGREE = 3
GGML_TYPE_F32 = 0

TEXTS = [
    "Hello world",
    "ROMEO: What say you, my lord?",
    "",
    " leading space",
    "many     spaces   between\twords\t\tand tabs",
    "\n\n\nnewlines\n\n  indented\r\nwindows line",
    "digits 1234567890 and 3.14159, 2024-11-05",
    "ünïcödé — “quotes” 日本語 🙂👍🏽",
    "end<|endoftext|>start",
]
PROMPTS = ["ROMEO:", "The king hath", "The capital of France is"]
LOGIT_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?"
)


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"command failed: {' '.join(cmd)}\n{p.stderr}")
    return p


def read_safetensors(path):
    """The tensors of a safetensors file (F32 only) as numpy arrays."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", f"{name}: {t['dtype']}"
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + a : 8 + n + b], dtype="<f4").reshape(t["shape"])
    return out


def load(path, n_ctx):
    # An F32 key/value cache (llama.cpp's default is F16; attnres keeps f32).
    return llama_cpp.Llama(
        model_path=path, logits_all=True, n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False,
        type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32,
    )


def greedy(llm, prompt, new_tokens):
    """llama.cpp's greedy continuation of `prompt` (no BOS, as attnres encodes prompts): the new
    token ids and their text."""
    llm.reset()
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    out = []
    llm.eval(ids)
    for _ in range(new_tokens):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if t == llm.token_eos():
            break
        out.append(t)
        llm.eval([t])
    return out, llm.detokenize(out).decode("utf-8", errors="replace")


def our_greedy(args, model, work, new_tokens):
    path = os.path.join(work, "prompts.txt")
    with open(path, "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    p = run([args.attnres, "generate", "--model", model, "--prompt-file", path,
             "--max-tokens", str(new_tokens), "--temperature", "0"])
    return [json.loads(line)["completion"] for line in p.stdout.splitlines()]


def our_logits(args, model, ids, work):
    batch, out = os.path.join(work, "batch.json"), os.path.join(work, "logits.safetensors")
    with open(batch, "w") as f:
        json.dump({"input_ids": [ids]}, f)
    run([args.attnres, "forward", "--model", model, "--batch", batch, "--out", out])
    return read_safetensors(out)["logits"][0].astype(np.float64)


def llama_logits(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def relative(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def agreeing_tokens(llm, ids, ours):
    """How many of llama.cpp's new tokens `ids` spell a prefix of our text."""
    n = 0
    while n < len(ids) and ours.startswith(llm.detokenize(ids[: n + 1]).decode("utf-8", "replace")):
        n += 1
    return n


def check_reference(ty, reference, exported, llm, n_ctx, new_tokens, failures, lines):
    ref, ours = GGUFReader(reference), GGUFReader(exported)
    rt, ot = {t.name: t for t in ref.tensors}, {t.name: t for t in ours.tensors}
    if sorted(rt) != sorted(ot):
        failures.append(f"{ty} reference: tensor names differ: {sorted(set(rt) ^ set(ot))}")
    same = sum(
        1 for n in rt if n in ot and rt[n].tensor_type == ot[n].tensor_type
        and rt[n].data.tobytes() == ot[n].data.tobytes()
    )
    lines.append(f"{ty} reference: {same} of {len(rt)} tensors identical (type and bytes) "
                 f"to {os.path.basename(reference)}")
    if same != len(rt):
        failures.append(f"{ty} reference: {len(rt) - same} tensors differ")

    def field(r, key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    keys = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"]
    differ = [k for k in keys if field(ref, k) != field(ours, k)]
    lines.append(f"{ty} reference: tokenizer metadata "
                 + ("equal" if not differ else f"differs in {differ}"))
    if differ:
        failures.append(f"{ty} reference: tokenizer metadata differs: {differ}")
    original = load(reference, n_ctx)
    for prompt in PROMPTS:
        a = greedy(original, prompt, new_tokens)[1]
        b = greedy(llm, prompt, new_tokens)[1]
        lines.append(f"{ty} reference: greedy {prompt!r}: {'same' if a == b else 'DIFFERENT'} text")
        if a != b:
            failures.append(f"{ty} reference: greedy text of {prompt!r} differs: {a!r} vs {b!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attnres", required=True)
    ap.add_argument("--model", required=True, help="a standard checkpoint with tokenizer.json")
    ap.add_argument("--tokenize", help="examples/tokenize (default: beside --attnres)")
    ap.add_argument("--types", nargs="+", default=list(LOGIT_TOL))
    ap.add_argument("--new-tokens", type=int, default=30)
    ap.add_argument("--reference", nargs=2, action="append", default=[],
                    metavar=("TYPE", "FILE"), help="a GGUF file of the same model and type")
    ap.add_argument("--keep", help="write the files here instead of a temporary directory")
    args = ap.parse_args()
    tokenize = args.tokenize or os.path.join(os.path.dirname(args.attnres), "examples", "tokenize")
    with open(os.path.join(args.model, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    n_ctx = min(context, 512)
    new_tokens = min(args.new_tokens, n_ctx // 2)
    failures, lines = [], []
    work = args.keep or tempfile.mkdtemp(prefix="check-export-")
    os.makedirs(work, exist_ok=True)

    ours_ids = json.loads(run([tokenize, args.model], input=json.dumps(TEXTS)).stdout)["ids"]
    f32_logits = None
    for ty in args.types:
        path = os.path.join(work, f"model.{ty}.gguf")
        log = run([args.attnres, "export", "--model", args.model, "--to", "gguf",
                   "--dtype", ty, "--out", path, "--force"]).stderr.strip()
        lines.append(f"{ty}: {log.splitlines()[-1]}")
        same_weights = args.model
        if ty != "f32":
            same_weights = os.path.join(work, f"quantized-{ty}")
            run([args.attnres, "quantize", "--model", args.model, "--dtype", ty,
                 "--out", same_weights, "--force"])
        llm = load(path, n_ctx)

        wrong = [t for t, ids in zip(TEXTS, ours_ids)
                 if llm.tokenize(t.encode(), add_bos=False, special=True) != ids]
        lines.append(f"{ty}: token ids equal on {len(TEXTS) - len(wrong)} of {len(TEXTS)} texts")
        if wrong:
            failures.append(f"{ty}: token ids differ for {wrong}")

        ids = llm.tokenize(LOGIT_TEXT.encode(), add_bos=False, special=True)[: n_ctx // 2]
        theirs = llama_logits(llm, ids)
        ours = our_logits(args, same_weights, ids, work)
        rel = relative(theirs, ours)
        extra = ""
        if ty == "f32":
            f32_logits = ours
        elif f32_logits is not None:
            extra = f" (against attnres f32: {relative(theirs, f32_logits):.2e})"
        top = float(np.mean(theirs.argmax(-1) == ours.argmax(-1)))
        lines.append(f"{ty}: logits of {len(ids)} positions x {ours.shape[1]}: relative error "
                     f"{rel:.2e} (bound {LOGIT_TOL[ty]:.0e}){extra}; same top token at "
                     f"{top:.0%} of positions")
        if rel > LOGIT_TOL[ty]:
            failures.append(f"{ty}: logits relative error {rel:.2e} > {LOGIT_TOL[ty]:.0e}")
        if top < ARGMAX_AGREE:
            failures.append(f"{ty}: the top token agrees at {top:.0%} of positions only")

        texts = our_greedy(args, same_weights, work, new_tokens)
        for prompt, mine in zip(PROMPTS, texts):
            new, text = greedy(llm, prompt, new_tokens)
            agree = agreeing_tokens(llm, new, mine)
            same = text == mine
            lines.append(f"{ty}: greedy {prompt!r}: {'same text' if same else f'{agree} of {len(new)} tokens agree'}"
                         f" ({len(new)} tokens): {text!r}")
            if ty == "f32" and not same:
                failures.append(f"f32: greedy text of {prompt!r} differs: {text!r} vs ours {mine!r}")
            if ty != "f32" and agree < min(MIN_AGREE, len(new)):
                failures.append(f"{ty}: greedy text of {prompt!r} agrees for {agree} tokens only")
        for ref_ty, reference in args.reference:
            if ref_ty == ty:
                check_reference(ty, reference, path, llm, n_ctx, new_tokens, failures, lines)
        del llm

    print("\n".join(lines))
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
