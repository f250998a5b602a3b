"""`attnres serve` against the official `openai` client (docs/serving.md).

    python scripts/ci/serve_check.py --attnres target/release/attnres --model RUN_DIR
    python scripts/ci/serve_check.py --attnres target/release/attnres --model RUN_DIR --bench

Without --bench: starts the server, then checks with the client what people rely on (models,
completions and chat, whole and streamed, usage, errors) and runs a bounded load test: 64
concurrent streaming requests of mixed lengths, each of which must complete with its usage or
be refused with 429, none lost; then a soak (`soak`): 2,000 requests from 32 clients with
cancelled streams, slow readers and bad bodies, after which every request has its answer,
/metrics counts each one and the server's memory is within 10% of its size after warm-up.
Exits non-zero on any failure.

With --bench: throughput and latency at concurrency 1, 4, 16 and 64 (a markdown table).

With --browser CHROMIUM: the page at `/` is run in headless Chromium, which must show the
streamed text and the speed, and for an AttnRes model a depth-attention map per token;
--screenshot PNG keeps a picture of it.
"""

import argparse
import base64
import concurrent.futures
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

import openai


def start(attnres, model, flags):
    proc = subprocess.Popen(
        [attnres, "serve", "--model", model, "--port", "0", *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        sys.exit(f"the server did not start: {line}")
    # Keep draining the log so the server never blocks on it.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, int(m.group(1))


def streamed(client, model, prompt, max_tokens, **kw):
    """Text, usage, and the times of the request, its first and its last piece."""
    t0 = time.perf_counter()
    first = last = None
    text, usage, finish = [], None, None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.text:
                now = time.perf_counter()
                first = first or now
                last = now
                text.append(c.text)
            if c.finish_reason:
                finish = c.finish_reason
    return "".join(text), usage, finish, t0, first, last


def check(client, model):
    names = [m.id for m in client.models.list().data]
    assert names == [model], names
    whole = client.completions.create(model=model, prompt="ROMEO:", max_tokens=24, temperature=0)
    text, usage, finish, *_ = streamed(client, model, "ROMEO:", 24, temperature=0)
    assert whole.choices[0].text == text, (whole.choices[0].text, text)
    assert whole.usage.completion_tokens == usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish == whole.choices[0].finish_reason
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "A play."}, {"role": "user", "content": "Who is there?"}],
        max_tokens=16,
        temperature=0,
    )
    reply = chat.choices[0].message.content
    pieces = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "A play."}, {"role": "user", "content": "Who is there?"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == reply
    # n choices: the first is the single request's text; each has its own index.
    several = client.completions.create(model=model, prompt="ROMEO:", max_tokens=12, temperature=0.8, n=3)
    single = client.completions.create(model=model, prompt="ROMEO:", max_tokens=12, temperature=0.8)
    assert [c.index for c in several.choices] == [0, 1, 2], several
    assert several.choices[0].text == single.choices[0].text, (several, single)
    assert several.usage.prompt_tokens == single.usage.prompt_tokens
    for bad, error in [
        (dict(max_tokens=0), openai.BadRequestError),
        (dict(temperature=-1.0), openai.BadRequestError),
        (dict(model="no-such-model"), openai.NotFoundError),
    ]:
        args = dict(model=model, prompt="ROMEO:", max_tokens=4)
        args.update(bad)
        try:
            client.completions.create(**args)
        except error as e:
            assert e.body and e.body.get("message"), e
        else:
            raise AssertionError(f"{bad} was accepted")
    print(f"client checks passed: completions, chat, streaming, n choices, usage, errors ({model})")


def curl(port, model):
    """The same endpoints through curl, whole and streamed (skipped where curl is missing)."""
    if not shutil.which("curl"):
        print("curl: not installed, skipped")
        return
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": model, "prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}
    run = lambda b: subprocess.run(
        ["curl", "-sN", url, "-H", "content-type: application/json", "-d", json.dumps(b)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    whole = json.loads(run(body))["choices"][0]["text"]
    events = [e[len("data: "):] for e in run({**body, "stream": True}).split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == whole, (streamed, whole)
    print("curl: whole and streamed completions agree")


def load(client, model, n=64):
    """`n` concurrent streamed requests of mixed lengths: each completes or gets 429."""
    lengths = [8 + (37 * i) % 93 for i in range(n)]
    outcomes = []

    def one(i):
        try:
            text, usage, finish, *_ = streamed(client, model, f"Scene {i}.", lengths[i], temperature=0.8, seed=i)
            assert usage is not None and usage.completion_tokens <= lengths[i], usage
            assert finish in ("stop", "length"), finish
            return "completed"
        except openai.RateLimitError:
            return "refused"

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(one, range(n)))
    done, refused = outcomes.count("completed"), outcomes.count("refused")
    assert done + refused == n, outcomes
    print(f"load: {n} concurrent streamed requests (max_tokens 8..100): {done} completed, {refused} refused with 429, none lost")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def outcomes(port):
    """The server's request counts by outcome, from /metrics."""
    text = raw(port, "GET", "/metrics")[1].decode()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r'attnres_requests_total\{outcome="(\w+)"\} (\d+)', text)}


def prefix_cache_kib(port):
    """What the server's prefix cache holds, from /metrics (it grows by design, to its bound)."""
    text = raw(port, "GET", "/metrics")[1].decode()
    return int(re.search(r"^attnres_prefix_cache_bytes (\d+)$", text, re.M).group(1)) / 1024


def raw(port, method, path, body=b"", read_slowly=False, cancel_after=None, head=None):
    """One request on its own connection: (status, whole answer). `cancel_after` bytes read,
    the connection is closed and status is None; `read_slowly` reads 64 bytes at a time with
    pauses; `head` replaces the request's head (for lies about the body)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        head = head or (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        s.sendall(head.encode() + body)
        got = b""
        while True:
            chunk = s.recv(64 if read_slowly else 65536)
            if not chunk:
                break
            got += chunk
            if cancel_after is not None and len(got) >= cancel_after:
                return None, got
            if read_slowly:
                time.sleep(0.005)
    finally:
        s.close()
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    assert status is not None, f"no answer to {method} {path}: {got[:200]!r}"
    assert b"\r\n\r\n" in got, f"a cut answer to {method} {path}: {got[:200]!r}"
    return status, got


def soak(proc, port, model, total=2000, clients=32, warmup=200):
    """`total` requests from `clients` threads: whole and streamed completions, streams closed
    after their first piece, streams read slowly, malformed and oversized bodies, health and
    model listings. Every request must get its whole answer (but the ones closed on purpose),
    /metrics must count every completion request once, and the server's RSS after the soak must
    be within 10% of its RSS after the warm-up."""
    rng_lock = threading.Lock()
    import random
    rng = random.Random(20261204)

    def one(i):
        with rng_lock:
            kind, n, stream = rng.randrange(100), rng.randrange(1, 24), rng.random() < 0.5
        body = json.dumps({"model": model, "prompt": f"Act {i}.", "max_tokens": n, "temperature": 0.8, "seed": i, "stream": stream}).encode()
        if kind < 55:
            status, _ = raw(port, "POST", "/v1/completions", body)
            assert status in (200, 429), status
            return "api"
        if kind < 70:
            # As long a stream as the tiny model's context allows, closed at its first bytes.
            sbody = json.dumps({"model": model, "prompt": f"Act {i}.", "max_tokens": 115, "stream": True}).encode()
            raw(port, "POST", "/v1/completions", sbody, cancel_after=1)
            return "api"
        if kind < 77:
            status, _ = raw(port, "POST", "/v1/completions", body, read_slowly=True)
            assert status in (200, 429), status
            return "api"
        if kind < 85:
            status, answer = raw(port, "POST", "/v1/completions", b'{"prompt": "unclosed')
            assert status == 400 and b'"error"' in answer, answer[:300]
            return "api"
        if kind < 90:
            head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n"
                    "Connection: close\r\n\r\n")
            status, answer = raw(port, "POST", "/v1/chat/completions", head=head)
            assert status == 413 and b'"error"' in answer, answer[:300]
            return "api"
        status, _ = raw(port, "GET", "/health" if kind < 95 else "/v1/models")
        assert status == 200, status
        return "other"

    def run(ids):
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            return list(pool.map(one, ids))

    before = outcomes(port)
    t0 = time.perf_counter()
    kinds = run(range(warmup))
    settled, cached = rss_kib(proc.pid), prefix_cache_kib(port)
    kinds += run(range(warmup, total))
    elapsed = time.perf_counter() - t0
    # Cancelled streams finish on the server a step later: wait for every count to land.
    api = kinds.count("api")
    deadline = time.time() + 30
    while True:
        after = outcomes(port)
        counted = sum(after.values()) - sum(before.values())
        if counted == api or time.time() > deadline:
            break
        time.sleep(0.1)
    assert counted == api, f"/metrics counts {counted} completion requests of {api}: {after}"
    # What the prefix cache took meanwhile is not a leak: it is bounded and counted.
    end, kept = rss_kib(proc.pid), prefix_cache_kib(port) - cached
    growth = (end - kept) / settled - 1
    delta = {k: after[k] - before.get(k, 0) for k in after}
    print(f"soak: {total} requests from {clients} clients in {elapsed:.0f} s, every one answered; "
          f"/metrics counts all {api} completion requests {delta}; RSS {settled / 1024:.0f} MiB after "
          f"{warmup} requests, {end / 1024:.0f} MiB at the end, of which {kept / 1024:.0f} MiB more "
          f"prefix cache ({growth:+.1%} beside it)")
    assert growth <= 0.10, f"the server's memory grew by {growth:.1%}"


def bench(client, model, levels, tokens=64):
    rows = []
    for c in levels:
        n = max(2 * c, 8)
        prompts = [f"Scene {i}. Enter ROMEO." for i in range(n)]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(c) as pool:
            results = list(pool.map(lambda p: streamed(client, model, p, tokens, temperature=0), prompts))
        wall = time.perf_counter() - t0
        out = sum(r[1].completion_tokens for r in results)
        ttft = sorted(r[4] - r[3] for r in results if r[4])
        tpot = sorted((r[5] - r[4]) / (r[1].completion_tokens - 1) for r in results if r[1].completion_tokens > 1)
        pct = lambda v, q: v[min(len(v) - 1, int(q * len(v)))]
        rows.append((c, n, out / wall, pct(ttft, 0.5), pct(ttft, 0.99), pct(tpot, 0.5), pct(tpot, 0.99)))
    print("| concurrency | requests | output tokens/s | TTFT p50 | TTFT p99 | time per token p50 | p99 |")
    print("|---|---|---|---|---|---|---|")
    for c, n, tps, t50, t99, p50, p99 in rows:
        print(f"| {c} | {n} | {tps:.0f} | {t50*1e3:.1f} ms | {t99*1e3:.1f} ms | {p50*1e3:.2f} ms | {p99*1e3:.2f} ms |")
    print(f"batching gain (tokens/s at {levels[-1]} over 1): {rows[-1][2] / rows[0][2]:.1f}x")


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
    JSON messages ending in NUL on file descriptors 3 and 4), so the check waits for what the
    page does in real time rather than guessing a delay."""

    def __init__(self, binary):
        to_browser, self.commands = os.pipe()
        self.replies, from_browser = os.pipe()

        def fds():
            # Move the browser's ends to 3 and 4 (dup2 is a no-op when one already is there, so
            # mark both inheritable).
            for fd, want in [(to_browser, 3), (from_browser, 4)]:
                if fd != want:
                    os.dup2(fd, want)
                os.set_inheritable(want, True)

        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--remote-debugging-pipe", "about:blank",
        ]
        self.proc = subprocess.Popen(
            [binary, *flags], preexec_fn=fds, close_fds=False,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self.buf, self.next_id, self.session = b"", 0, None

    def call(self, method, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            msg["sessionId"] = self.session
        os.write(self.commands, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self.buf:
                chunk = os.read(self.replies, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url):
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=900, height=980, deviceScaleFactor=1, mobile=False)

    def evaluate(self, expression):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self):
        self.proc.kill()
        self.proc.wait()


def browser(chromium, port, screenshot=None):
    """The page in a real headless browser: it fills its form from the URL, streams a
    completion and shows the speed; for an AttnRes model, with the depth attention of every
    token (a small map each, the last one large)."""
    url = f"http://127.0.0.1:{port}/?prompt=ROMEO:&max_tokens=40&temperature=0.8&seed=1&depth=1&autorun=1"
    b = Chromium(chromium)
    try:
        b.open(url)
        deadline = time.time() + 60
        while b.evaluate("document.body && document.body.dataset.done") != "1":
            assert time.time() < deadline, "the page did not finish within 60 s"
            time.sleep(0.1)
        stats = b.evaluate("document.getElementById('stats').textContent")
        out = b.evaluate("document.getElementById('out').textContent")
        assert re.match(r"\d+ tokens in [0-9.]+ s", stats), stats
        assert out.startswith("ROMEO:") and len(out) > len("ROMEO:"), out
        print(f"page: headless Chromium streamed a completion ({stats})")
        if b.evaluate("!document.getElementById('depth_opt').hidden"):
            tokens = int(stats.split()[0])
            maps = b.evaluate("document.querySelectorAll('#strip canvas').length")
            size = b.evaluate("[document.getElementById('map').width, document.getElementById('map').height]")
            # A token that ends the text (end of text) has no map.
            assert maps in (tokens, tokens - 1) and maps > 0, (maps, tokens)
            assert size[0] > 100 and size[1] > 100, size
            print(f"page: the depth attention of {maps} tokens, the last drawn {size[0]}x{size[1]}")
        if screenshot:
            data = b.call("Page.captureScreenshot", format="png")["data"]
            with open(screenshot, "wb") as f:
                f.write(base64.b64decode(data))
    finally:
        b.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--browser", help="a Chromium binary: also check the page at /")
    ap.add_argument("--screenshot", help="with --browser: save the page as this PNG")
    a = ap.parse_args()
    flags = ["--max-batch", "64", "--max-queue", "256"] if a.bench else ["--max-batch", "16", "--max-queue", "32"]
    proc, port = start(a.attnres, a.model, flags)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        if a.bench:
            bench(client, model, [int(x) for x in a.levels.split(",")])
        else:
            check(client, model)
            curl(port, model)
            load(client, model)
            soak(proc, port, model)
            if a.browser:
                browser(a.browser, port, a.screenshot)
    finally:
        proc.terminate()
        if proc.wait(timeout=60) != 0:
            sys.exit(f"the server exited with {proc.returncode}")


if __name__ == "__main__":
    main()
