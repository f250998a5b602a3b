"""Prefill and decoding speed of attnres against llama.cpp on the same GGUF files
(docs/import.md#speed-against-llamacpp).

    python scripts/bench/bench_llamacpp.py --attnres target/release/attnres \
        --pair FILE.gguf DIR [--pair FILE2.gguf DIR2 ...] [--threads 2] [--rounds 5] \
        [--prompt-tokens 128] [--new-tokens 64]
    python scripts/bench/bench_llamacpp.py --make-files MODEL.gguf    # writes the files below

Each pair is a GGUF file, which llama.cpp runs, and the directory `attnres import` wrote from
that same file, which attnres runs (block formats kept: both engines read the same weights).
`--make-files` writes, beside nothing but the cache directory (--work): an F32 copy of the
given file (every tensor dequantised with the `gguf` package), an F16 copy (matrices in half
precision, norms in F32, as llama.cpp's converter keeps them), and Q8_0 and Q4_0 files made from
the F32 copy by llama.cpp's own quantizer (`llama_model_quantize`, as `llama-quantize` does).

llama.cpp comes from `llama-cpp-python` (scripts/bench/requirements.txt; pip builds it from
source). Every engine decodes greedily from the same prompt tokens, one sequence, with the same
number of threads; the engines take turns within each round and the table gives the median over
rounds with each round's ratio, so that a machine shared with other work slows all of them alike.
"""
import argparse
import os
import re
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from attnres_run import run_attnres  # noqa: E402

PROMPT = (
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange grain, salt and cloth. Over the centuries it grew into a market town, then a port, "
    "and finally the capital of a province whose roads and canals carried goods to every corner "
    "of the country. Its old walls still stand in places, and the cathedral, begun in the twelfth "
    "century and finished three hundred years later, dominates the skyline. Today the city is "
    "known for its university, its museums and its food, and visitors come from all over the "
    "world to walk its narrow streets and sit in its crowded squares on summer evenings. In "
    "winter the river sometimes freezes, and the whole town skates on it under lanterns strung "
    "between the bridges, while the bakers sell hot bread and spiced wine from stalls on the ice."
)


def copy_gguf(source, dest, kind):
    """Writes `source` with every tensor dequantised to `kind` (F32 or F16), metadata kept."""
    import gguf

    if os.path.exists(dest):
        return
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(dest + ".tmp", bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        # Vectors (the norms' gains) stay F32 in an F16 file, as llama.cpp's own converter keeps
        # them (its kernels multiply F32 activations by F32 gains only).
        half = kind == "F16" and len(t.shape) > 1
        values = values.astype(np.float16 if half else np.float32)
        writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dest + ".tmp", dest)


class LlamaCpp:
    def __init__(self, path, threads, context):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=path,
            n_ctx=context,
            n_batch=context,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def tokens(self, text):
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)

    def run(self, prompt, new_tokens):
        """Seconds to prefill `prompt` and to decode `new_tokens - 1` more tokens greedily."""
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


def attnres_generate(attnres, model, text, threads, new_tokens, prompt_file, expected_prompt):
    with open(prompt_file, "w") as f:
        f.write(text + "\n")
    out = run_attnres(
        [attnres, "generate", "--model", model, "--prompt-file", prompt_file, "--temperature", "0",
         "--max-tokens", str(new_tokens), "--ignore-eos", "--threads", str(threads)],
    ).stderr
    m = re.search(r"prefill (\d+) tokens in ([\d.]+) ms.*decode (\d+) tokens in ([\d.]+) s", out)
    if not m:
        sys.exit(f"attnres printed no timing: {out}")
    if int(m.group(1)) != expected_prompt or int(m.group(3)) != new_tokens - 1:
        sys.exit(f"attnres ran {m.group(1)} + {m.group(3)} tokens, expected {expected_prompt} + {new_tokens - 1}")
    return float(m.group(2)) / 1000, float(m.group(4))


def make_files(source, work):
    """The F32, F16, Q8_0 and Q4_0 files of `source`'s model (see the module's notes)."""
    import ctypes

    import llama_cpp

    stem = os.path.splitext(os.path.basename(source))[0].rsplit(".", 1)[0]
    out = {}
    for kind in ["F32", "F16"]:
        out[kind] = os.path.join(work, f"{stem}.{kind}.gguf")
        copy_gguf(source, out[kind], kind)
    # llama.cpp's file types (enum llama_ftype): MOSTLY_Q8_0 = 7, MOSTLY_Q4_0 = 2.
    for kind, ftype in [("Q8_0", 7), ("Q4_0", 2)]:
        out[kind] = os.path.join(work, f"{stem}.{kind}.gguf")
        if os.path.exists(out[kind]):
            continue
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        tmp = out[kind] + ".tmp"
        if llama_cpp.llama_model_quantize(out["F32"].encode(), tmp.encode(), ctypes.byref(params)) != 0:
            sys.exit(f"llama.cpp could not quantise {out['F32']} to {kind}")
        os.replace(tmp, out[kind])
    for kind, path in out.items():
        print(f"{kind}: {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres")
    ap.add_argument("--pair", nargs=2, action="append", metavar=("GGUF", "DIR"), default=[])
    ap.add_argument("--make-files", metavar="GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/attnres-llama"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    if a.make_files:
        make_files(a.make_files, a.work)
        return
    if not a.attnres or not a.pair:
        sys.exit("give --attnres and at least one --pair GGUF DIR (or --make-files GGUF)")

    context = a.prompt_tokens + a.new_tokens + 8
    label = lambda path: os.path.splitext(os.path.basename(path))[0].rsplit(".", 1)[-1]
    pairs = [(label(g), LlamaCpp(g, a.threads, context), d) for g, d in a.pair]

    # The prompt: the first `prompt-tokens` tokens of the text, as llama.cpp's tokenizer cuts
    # them; attnres must count the same tokens in their text (its tokenizer is the same).
    first = pairs[0][1]
    ids = first.tokens(PROMPT)
    if len(ids) < a.prompt_tokens:
        sys.exit(f"the prompt text has only {len(ids)} tokens")
    ids = ids[: a.prompt_tokens]
    text = first.llm.detokenize(ids).decode()
    assert first.tokens(text) == ids, "the cut prompt does not tokenize back to itself"
    prompt_file = os.path.join(a.work, "prompt.txt")

    times = {(kind, engine): [] for kind, _, _ in pairs for engine in ["attnres", "llama.cpp"]}
    for r in range(a.rounds + 1):  # round 0 warms up
        got = {}
        for kind, llm, model in pairs:
            got[(kind, "attnres")] = attnres_generate(
                a.attnres, model, text, a.threads, a.new_tokens, prompt_file, len(ids))
            got[(kind, "llama.cpp")] = llm.run(ids, a.new_tokens)
        if r > 0:
            for key, t in got.items():
                times[key].append(t)
        print(f"round {r}: " + ", ".join(f"{e} {k} {p * 1000:.0f} ms + {d * 1000:.0f} ms"
                                        for (k, e), (p, d) in got.items()), file=sys.stderr)

    print(f"\nprompt {a.prompt_tokens} tokens, {a.new_tokens - 1} decoded greedily after it, batch 1, "
          f"{a.threads} threads, median of {a.rounds} rounds\n")
    print("| weights | attnres prefill tokens/s | llama.cpp prefill tokens/s | attnres ÷ llama.cpp, prefill "
          "| attnres decode tokens/s | llama.cpp decode tokens/s | attnres ÷ llama.cpp, decode |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    fmt = lambda rs: f"{statistics.median(rs):.2f}x ({min(rs):.2f}–{max(rs):.2f})"
    for kind, _, _ in pairs:
        ours, theirs = times[(kind, "attnres")], times[(kind, "llama.cpp")]
        speed = lambda t, i, n: statistics.median(n / x[i] for x in t)
        rp = [p2 / p1 for (p1, _), (p2, _) in zip(ours, theirs)]
        rd = [d2 / d1 for (_, d1), (_, d2) in zip(ours, theirs)]
        n = a.new_tokens - 1
        print(f"| {kind} | {speed(ours, 0, a.prompt_tokens):.0f} | {speed(theirs, 0, a.prompt_tokens):.0f} | {fmt(rp)} "
              f"| {speed(ours, 1, n):.1f} | {speed(theirs, 1, n):.1f} | {fmt(rd)} |")


if __name__ == "__main__":
    main()
