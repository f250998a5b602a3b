"""Time to first token of a chat with a long system prompt, with and without the prefix cache
of `attnres serve` (docs/serving.md#prefix-cache).

    python scripts/bench/prefix_ttft.py --attnres target/release/attnres --model DIR \
        [--system-tokens 1000] [--questions 8] [--threads 2]

Two servers run the same model: one with `--prefix-cache 0`, one with the default cache. Each
gets the same chats in turn (one request at a time, the other server idle): a system prompt of
about `--system-tokens` tokens, then a different short question each time; each request asks
for one token, so its latency is its time to first token. The first chat fills the cache (the
cold row); the others find the system prompt there. Both servers first answer the chats that
size the system prompt (its tokens: what it adds to a chat with an empty system message), which
warm them up. Prints each server's first and median times and their ratio, with the prompt's
length and the tokens the cached server reported reusing
(`usage.prompt_tokens_details.cached_tokens`). Needs only the standard library.
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve_vs_llama import Server, free_port  # noqa: E402

QUESTIONS = [
    "What should I pack for a week of hiking?",
    "How do I keep basil alive indoors?",
    "Explain what a compiler does.",
    "Suggest a name for a grey cat.",
    "Why is the sea salty?",
    "How long should I boil an egg?",
    "What is a good first programming language?",
    "How do bees make honey?",
    "What makes bread rise?",
    "How far away is the moon?",
]


def rules(n):
    """A system prompt of `n` numbered rules (about 15 tokens each)."""
    lines = [f"Rule {i + 1}: when the user asks about topic number {i + 1}, answer briefly, "
             f"politely and with one example." for i in range(n)]
    return "You are a helpful assistant. Follow these rules.\n" + "\n".join(lines)


def chat(server, system, question):
    """One chat request for one token: its latency in seconds and its usage."""
    body = {"model": server.model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        sys.exit(f"{server.name}: HTTP {resp.status}: {data[:300].decode(errors='replace')}")
    return elapsed, json.loads(data)["usage"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attnres", required=True)
    ap.add_argument("--model", required=True, help="the directory attnres serves")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()
    if not 2 <= a.questions <= len(QUESTIONS):
        sys.exit(f"--questions must lie in 2..={len(QUESTIONS)}")

    servers = {}
    for name, flags in [("off", ["--prefix-cache", "0"]), ("on", [])]:
        cmd = [a.attnres, "serve", "--model", a.model, "--host", "127.0.0.1",
               "--port", str(free_port()), "--threads", str(a.threads), *flags]
        servers[name] = Server(f"attnres (prefix cache {name})", cmd, f"/tmp/prefix_ttft_{name}.log", {})
    try:
        for s in servers.values():
            s.start()
        # Size the system prompt: its tokens are those a chat gains over one with an empty
        # system message, and grow with the rules about linearly. This also warms both servers
        # up, with prompts the measured ones share no more than the chat layout with.
        _, empty = chat(servers["on"], "", QUESTIONS[-1])
        n = 40
        for s in servers.values():
            _, usage = chat(s, "Be brief.\n" + rules(n), QUESTIONS[-1])
        n = max(1, round(n * a.system_tokens / (usage["prompt_tokens"] - empty["prompt_tokens"])))
        system = rules(n)
        _, usage = chat(servers["off"], system, QUESTIONS[-1])
        system_tokens = usage["prompt_tokens"] - empty["prompt_tokens"]
        times = {"off": [], "on": []}
        cached = []
        for i, q in enumerate(QUESTIONS[: a.questions]):
            # The server that goes first alternates, so that noise falls on both alike.
            order = ["off", "on"] if i % 2 else ["on", "off"]
            for name in order:
                t, usage = chat(servers[name], system, q)
                times[name].append(t)
                if name == "on":
                    cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            prompt_tokens = usage["prompt_tokens"]
    finally:
        for s in servers.values():
            s.stop()
    off, on = statistics.median(times["off"][1:]), statistics.median(times["on"][1:])
    print(f"chat of {prompt_tokens} prompt tokens ({system_tokens} of them the system prompt), one token "
          f"asked, {a.threads} threads, {a.questions - 1} warm requests each\n")
    print("| prefix cache | first request (ms) | median of the rest (ms) | tokens reused |")
    print("|---|---:|---:|---:|")
    print(f"| off | {times['off'][0] * 1e3:.0f} | {off * 1e3:.0f} | 0 |")
    print(f"| on | {times['on'][0] * 1e3:.0f} | {on * 1e3:.0f} | "
          f"{statistics.median(cached[1:]):.0f} |")
    print(f"\ntime to first token, off / on: {off / on:.1f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prompt_tokens": prompt_tokens, "system_tokens": system_tokens, "threads": a.threads, "times": times,
                       "cached_tokens": cached}, f, indent=1)


if __name__ == "__main__":
    main()
