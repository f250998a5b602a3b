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
    # n choices: the first is the single request's text (the same seed); each has its own index.
    several = client.completions.create(model=model, prompt="ROMEO:", max_tokens=12, temperature=0.8, n=3, seed=11)
    single = client.completions.create(model=model, prompt="ROMEO:", max_tokens=12, temperature=0.8, seed=11)
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


# Request fields of the client's types (openai's CompletionCreateParams and the chat's), each
# with a value this server takes and, for a field it does not implement, one it refuses by name
# (None: it takes every value). A field the pinned client adds that is missing here fails the
# check until it is classified (docs/serving.md, "The API, field by field").
COMPLETION_FIELDS = {
    "model": (None, None), "prompt": ("ROMEO:", None), "max_tokens": (3, None),
    "temperature": (0.5, None), "top_p": (0.9, None), "n": (2, None), "stream": (False, None),
    "stream_options": (None, None), "stop": (["\n\n"], None), "seed": (3, None),
    "frequency_penalty": (0.5, None), "presence_penalty": (0.5, None), "logit_bias": ({"5": 1}, None),
    "logprobs": (2, None), "echo": (True, None), "user": ("u", None),
    "best_of": (1, 2), "suffix": (None, "!"),
}
CHAT_FIELDS = {
    "model": (None, None), "messages": (None, None), "max_tokens": (3, None),
    "max_completion_tokens": (3, None), "temperature": (0.5, None), "top_p": (0.9, None),
    "n": (2, None), "stream": (False, None), "stream_options": (None, None), "stop": ("\n\n", None), "seed": (3, None),
    "frequency_penalty": (0.5, None), "presence_penalty": (0.5, None), "logit_bias": ({"5": 1}, None),
    "logprobs": (True, None), "top_logprobs": (2, None), "user": ("u", None),
    "tools": ([], [{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": ("none", "auto"), "parallel_tool_calls": (False, None),
    "functions": ([], [{"name": "f"}]), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"}, {"type": "json_object"}),
    "modalities": (["text"], ["text", "audio"]), "audio": (None, {"voice": "alloy", "format": "wav"}),
    "prediction": (None, {"type": "content", "content": "x"}), "web_search_options": (None, {}),
    "reasoning_effort": (None, "low"), "verbosity": (None, "low"), "moderation": (None, {}),
    "store": (False, True), "service_tier": ("auto", "flex"), "metadata": ({"k": "v"}, None),
    "prompt_cache_key": ("k", None), "prompt_cache_retention": ("24h", None),
    "prompt_cache_options": ({}, None), "safety_identifier": ("s", None),
}


# Fields that are sent only beside another.
NEEDS = {"top_logprobs": {"logprobs": True}}


def request_fields(port, model):
    """Every request field of the client's types, one at a time: taken, or refused by name."""
    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat
    cases = [("/v1/completions", completion, COMPLETION_FIELDS, {"model": model, "prompt": "ROMEO:", "max_tokens": 3}),
             ("/v1/chat/completions", chat, CHAT_FIELDS, {"model": model, "max_tokens": 3,
                                                         "messages": [{"role": "user", "content": "Who is there?"}]})]
    refused = []
    for path, params, table, base in cases:
        names = set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}
        missing = names - set(table)
        assert not missing, f"{path}: the client has fields this check does not classify: {sorted(missing)}"
        for name in sorted(names):
            good, bad = table[name]
            base_with = {**base, **NEEDS.get(name, {})}
            if good is not None:
                status, answer = raw(port, "POST", path, json.dumps({**base_with, name: good}).encode())
                assert status == 200, (path, name, good, answer[-300:])
            if bad is not None:
                status, answer = raw(port, "POST", path, json.dumps({**base_with, name: bad}).encode())
                error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
                assert status == 400 and error["param"] == name, (path, name, bad, answer[-300:])
                refused.append(name)
    print(f"request fields: every field of the client's types taken or refused by name "
          f"({len(refused)} refused unless neutral: {', '.join(refused)})")


def conforms(value, cls, path, extensions):
    """`value` (a response's JSON) holds every required field of the client's type `cls` and no
    field it lacks but `extensions` (paths like `choices[].attnres_depth`), recursively."""
    import typing

    import pydantic

    def models(annotation):
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            return [annotation]
        return [m for a in typing.get_args(annotation) for m in models(a)]

    fields = {(f.alias or n): f for n, f in cls.model_fields.items()}
    for key, f in fields.items():
        assert not f.is_required() or key in value, f"{path}.{key} is missing ({cls.__name__})"
    for key, v in value.items():
        at = f"{path}.{key}".lstrip(".")
        if key not in fields:
            assert at in extensions, f"{at} is not a field of {cls.__name__}"
            continue
        inner = models(fields[key].annotation)
        if not inner or v is None:
            continue
        for i, item in enumerate(v if isinstance(v, list) else [v]):
            if isinstance(item, dict):
                conforms(item, inner[0], at + ("[]" if isinstance(v, list) else ""), extensions)


def response_shapes(port, model):
    """Whole and streamed answers of both endpoints, with log-probabilities, against the client's
    response types, field by field, and validated by them."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    chat = {"model": model, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "user", "content": "Who is there?"}]}
    # Without echo: with it the prompt's first token has null log-probabilities, as the API
    # answers, where the client's type asks for numbers (lm-eval reads the null).
    completion = {"model": model, "prompt": "ROMEO:", "max_tokens": 4, "logprobs": 2}
    checked = 0
    for path, body, whole, chunk in [("/v1/chat/completions", chat, ChatCompletion, ChatCompletionChunk),
                                     ("/v1/completions", completion, Completion, Completion)]:
        for stream in (False, True):
            b = {**body, "stream": stream, "stream_options": {"include_usage": True}} if stream else body
            answer = raw(port, "POST", path, json.dumps(b).encode())[1].split(b"\r\n\r\n", 1)[1]
            if stream:
                text = dechunk(answer).decode()
                objects = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            else:
                objects = [json.loads(answer)]
            for o in objects:
                conforms(o, chunk if stream else whole, "", set())
                # The client reads a streamed completion's chunks as whole completions, whose
                # finish_reason may not be null, as it is (and is in the API) until the last.
                if not (stream and chunk is Completion):
                    (chunk if stream else whole).model_validate(o)
                checked += 1
    print(f"response shapes: {checked} objects conform to the client's types field by field")


def dechunk(body):
    out = b""
    while body:
        size, body = body.split(b"\r\n", 1)
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + body[:n], body[n + 2:]
    return out


def client_extras(client, model):
    """Content-part arrays, token bytes, fresh seeds and ignore_eos through the client."""
    parts = [{"type": "text", "text": "A play."}, {"type": "text", "text": "Who is there?"}]
    as_parts = client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                              max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    as_text = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A play.\nWho is there?"}],
                                             max_tokens=12, temperature=0)
    reply = as_parts.choices[0].message.content
    assert reply == as_text.choices[0].message.content, (reply, as_text)
    tokens = as_parts.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in tokens) == reply.encode(), tokens
    try:
        client.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])
    except openai.BadRequestError as e:
        assert "image_url" in e.body["message"], e
    else:
        raise AssertionError("an image part was accepted")
    texts = {client.completions.create(model=model, prompt="ROMEO:", max_tokens=16, temperature=1.0).choices[0].text
             for _ in range(3)}
    assert len(texts) == 3, f"requests without a seed gave the same text: {texts}"
    same = {client.completions.create(model=model, prompt="ROMEO:", max_tokens=16, temperature=1.0, seed=5).choices[0].text
            for _ in range(2)}
    assert len(same) == 1, same
    eot = client.completions.create(model=model, prompt="ROMEO:", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert eot.choices[0].finish_reason == "length" and eot.usage.completion_tokens == 8, eot
    print("client extras: content parts, token bytes, fresh and fixed seeds, ignore_eos")


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


def connect(port, source="127.0.0.1", timeout=120):
    """A connection to the server from the loopback address `source` (to the server, each
    address is a client of its own)."""
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))


def raw(port, method, path, body=b"", read_slowly=False, cancel_after=None, head=None, source="127.0.0.1"):
    """One request on its own connection: (status, whole answer). `cancel_after` bytes read,
    the connection is closed and status is None; `read_slowly` reads 64 bytes at a time with
    pauses; `head` replaces the request's head (for lies about the body); `source`: the client's
    loopback address."""
    s = connect(port, source)
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


def abuse(attnres, model, never_reading=300, flood_seconds=8, bound_s=10.0):
    """A server with the default per-client limits while `never_reading` clients on one address
    (127.0.0.1) each send a streamed completion and never read, and another address (127.0.0.3)
    opens connections as fast as it can: a client on a third address (127.0.0.2), asking one
    completion after another meanwhile, must get each answer within `bound_s`, and the server's
    memory may grow by 10% or 16 MiB, whichever is more."""
    proc, port = start(attnres, model, ["--max-batch", "16", "--max-queue", "32", "--prefix-cache", "0"])
    try:
        def request(source, body):
            return raw(port, "POST", "/v1/completions", json.dumps(body).encode(), source=source)

        request("127.0.0.2", {"prompt": "Warm up.", "max_tokens": 8})
        before = rss_kib(proc.pid)
        stream = json.dumps({"prompt": "Act 1.", "max_tokens": 115, "stream": True,
                             "logprobs": 5}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(stream)}\r\n\r\n").encode()
        silent = []
        for _ in range(never_reading):
            s = connect(port)
            s.sendall(head + stream)
            silent.append(s)
        stop = time.time() + flood_seconds
        opened = [0]

        def flood():
            held = []
            while time.time() < stop:
                try:
                    held.append(connect(port, "127.0.0.3", timeout=5))
                    opened[0] += 1
                except OSError:
                    time.sleep(0.01)
                if len(held) > 2000:
                    held.pop(0).close()
            for h in held:
                h.close()

        flooder = threading.Thread(target=flood)
        flooder.start()
        waits = []
        while time.time() < stop:
            t0 = time.perf_counter()
            status, _ = request("127.0.0.2", {"prompt": "Enter ROMEO.", "max_tokens": 8})
            waits.append(time.perf_counter() - t0)
            assert status == 200, status
        flooder.join()
        during = rss_kib(proc.pid)
        text = raw(port, "GET", "/metrics", source="127.0.0.2")[1].decode()
        refused = int(re.search(r"^attnres_connections_refused_total (\d+)$", text, re.M).group(1))
        for s in silent:
            s.close()
        growth = during / before - 1
        print(f"abuse: {never_reading} never-reading streams from one address and {opened[0]} connections "
              f"opened by another in {flood_seconds} s ({refused} refused at once): a third address got "
              f"{len(waits)} answers, the slowest in {max(waits) * 1000:.0f} ms (median "
              f"{statistics.median(waits) * 1000:.0f} ms); RSS {before / 1024:.0f} -> {during / 1024:.0f} MiB "
              f"({growth:+.1%})")
        assert max(waits) <= bound_s, f"a request from another address waited {max(waits):.1f} s"
        assert during - before <= max(0.10 * before, 16 * 1024), f"the server's memory grew by {growth:.1%}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


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
    # The load and the soak stand for many clients but come from one address: no per-client
    # limit on requests there (`abuse` runs a server with the default limits).
    flags = ["--max-batch", "64", "--max-queue", "256"] if a.bench else ["--max-batch", "16", "--max-queue", "32"]
    flags += ["--max-client-requests", "0"]
    proc, port = start(a.attnres, a.model, flags)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        if a.bench:
            bench(client, model, [int(x) for x in a.levels.split(",")])
        else:
            check(client, model)
            client_extras(client, model)
            request_fields(port, model)
            response_shapes(port, model)
            curl(port, model)
            load(client, model)
            soak(proc, port, model)
            abuse(a.attnres, a.model)
            if a.browser:
                browser(a.browser, port, a.screenshot)
    finally:
        proc.terminate()
        if proc.wait(timeout=60) != 0:
            sys.exit(f"the server exited with {proc.returncode}")


if __name__ == "__main__":
    main()
