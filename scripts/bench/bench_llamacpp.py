"""Prefill and decoding speed of an imported model against llama.cpp on the same weights
(docs/import.md#chat-answers-and-speed-against-llamacpp).

    python scripts/bench/bench_llamacpp.py --attnres target/release/attnres --model IMPORTED_DIR \
        --gguf MODEL.gguf [--threads 2] [--rounds 5] [--prompt-tokens 128] [--new-tokens 64]

llama.cpp comes from `llama-cpp-python` (scripts/bench/requirements.txt; pip builds it from
source). It runs the original GGUF file and an F32 copy of it written here (every tensor
dequantised with the `gguf` package: the same numbers `attnres import` computes), and an F16 copy.
attnres runs the imported directory (always f32). Every engine decodes greedily from the same
prompt tokens, one sequence, with the same number of threads; the engines take turns within each
round and the table gives the median over rounds with each round's ratio, so that a machine
shared with other work slows all of them alike.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres", required=True)
    ap.add_argument("--model", required=True, help="the directory `attnres import` wrote from --gguf")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/attnres-llama"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)

    stem = os.path.splitext(os.path.basename(a.gguf))[0]
    files = {"llama.cpp " + stem.rsplit(".", 1)[-1]: a.gguf}
    for kind in ["F32", "F16"]:
        dest = os.path.join(a.work, f"{stem.rsplit('.', 1)[0]}.{kind}.gguf")
        copy_gguf(a.gguf, dest, kind)
        files[f"llama.cpp {kind}"] = dest
    context = a.prompt_tokens + a.new_tokens + 8
    engines = {name: LlamaCpp(path, a.threads, context) for name, path in files.items()}

    # The prompt: the first `prompt-tokens` tokens of the text, as llama.cpp's tokenizer cuts
    # them; attnres must count the same tokens in their text (its tokenizer is the same).
    first = next(iter(engines.values()))
    ids = first.tokens(PROMPT)
    if len(ids) < a.prompt_tokens:
        sys.exit(f"the prompt text has only {len(ids)} tokens")
    ids = ids[: a.prompt_tokens]
    text = first.llm.detokenize(ids).decode()
    assert first.tokens(text) == ids, "the cut prompt does not tokenize back to itself"
    prompt_file = os.path.join(a.work, "prompt.txt")

    times = {"attnres f32": []} | {name: [] for name in engines}
    for r in range(a.rounds + 1):  # round 0 warms up
        got = {"attnres f32": attnres_generate(a.attnres, a.model, text, a.threads, a.new_tokens, prompt_file, len(ids))}
        for name, e in engines.items():
            got[name] = e.run(ids, a.new_tokens)
        if r > 0:
            for name, t in got.items():
                times[name].append(t)
        print(f"round {r}: " + ", ".join(f"{n} {p * 1000:.0f} ms + {d * 1000:.0f} ms" for n, (p, d) in got.items()),
              file=sys.stderr)

    ours = times["attnres f32"]
    print(f"\nprompt {a.prompt_tokens} tokens, {a.new_tokens - 1} decoded greedily after it, batch 1, "
          f"{a.threads} threads, median of {a.rounds} rounds\n")
    print("| engine | prefill tokens/s | decode tokens/s | attnres prefill speed ÷ this | attnres decode speed ÷ this |")
    print("|---|---:|---:|---:|---:|")
    for name, t in times.items():
        prefill = statistics.median(a.prompt_tokens / p for p, _ in t)
        decode = statistics.median((a.new_tokens - 1) / d for _, d in t)
        if name == "attnres f32":
            print(f"| {name} | {prefill:.0f} | {decode:.1f} | — | — |")
            continue
        rp = [p2 / p1 for (p1, _), (p2, _) in zip(ours, t)]
        rd = [d2 / d1 for (_, d1), (_, d2) in zip(ours, t)]
        fmt = lambda rs: f"{statistics.median(rs):.2f}x ({min(rs):.2f}–{max(rs):.2f})"
        print(f"| {name} | {prefill:.0f} | {decode:.1f} | {fmt(rp)} | {fmt(rd)} |")


if __name__ == "__main__":
    main()
