//! What abuse cannot do to the server, through real HTTP on a loopback port: a full queue
//! answers 429 and loses no request; a client that goes frees its slot; SIGTERM finishes the
//! requests under way; bodies, heads, idle and slow connections, never-reading clients and one
//! address's connections, requests and tokens are bounded.

mod common;

use common::serve::{
    complete, connect_from, events, http, http_from, metric, outcome, post, read_until_closed,
    trained, Server,
};
use common::RunEnv;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[test]
fn overload_disconnects_and_shutdown_lose_no_request() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    // One address sends every request: no per-client limit here (the global ones are tested).
    let flags = ["--max-batch", "2", "--max-queue", "2", "--max-client-requests", "0"];
    let mut server = Server::start(env, &model, &flags);
    let port = server.port;
    let body = json!({"prompt": "ROMEO:", "max_tokens": 300, "temperature": 0});
    let alone = complete(port, &body);

    // 24 requests at once on 2 slots and a queue of 2: each is answered whole, or refused with
    // 429 — none is lost or changed. At least the two the queue holds are served, however the
    // arrivals and the engine interleave.
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> =
            (0..24).map(|_| s.spawn(|| post(port, "/v1/completions", &body))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let served = answers.iter().filter(|(s, _)| *s == 200).count();
    for (status, v) in &answers {
        match status {
            200 => assert_eq!(v["choices"][0]["text"].as_str().unwrap(), alone),
            429 => assert_eq!(v["error"]["type"], "rate_limit_error"),
            s => panic!("status {s}: {v}"),
        }
    }
    assert!((2..24).contains(&served), "{served} of 24 served");
    assert_eq!(outcome(port, "rejected") as usize, 24 - served);

    // A client that reads the first piece of a long stream and goes: its slot is freed.
    let mut long = body.clone();
    long["max_tokens"] = json!(4000);
    long["stream"] = json!(true);
    let payload = long.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    drop(s);
    let t = Instant::now();
    while outcome(port, "cancelled") == 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "the abandoned request was never cancelled");
        std::thread::sleep(Duration::from_millis(20));
    }

    // SIGTERM while a request runs: it is answered in full, then the server exits cleanly.
    let pending = std::thread::spawn(move || post(port, "/v1/completions", &body));
    std::thread::sleep(Duration::from_millis(30));
    let killed =
        std::process::Command::new("kill").args(["-TERM", &server.child.id().to_string()]).status();
    assert!(killed.unwrap().success());
    let (status, v) = pending.join().unwrap();
    assert_eq!((status, v["choices"][0]["text"].as_str().unwrap()), (200, alone.as_str()));
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "the server exited with {exit}");
}

/// The server's bounds on one client: a body too large is refused from its header at once, a
/// malformed one is a 400, a slow one a 408, all as error objects; a request head that does
/// not arrive, or a keep-alive connection left idle, is closed after the header timeout; and no
/// more connections are served at once than allowed, the next one served when one closes.
#[test]
fn network_limits_bound_what_a_client_holds() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    // One slot: the sixteen choices of a long request run one after another, well past the
    // request deadline however fast the machine decodes.
    let flags = [
        "--max-batch",
        "1",
        "--max-client-requests",
        "0",
        "--max-client-tokens",
        "0",
        "--max-connections",
        "3",
        "--header-timeout",
        "2",
        "--body-timeout",
        "1",
        "--request-timeout",
        "1",
    ];
    let server = Server::start(env, &model, &flags);
    let port = server.port;
    let connect = || TcpStream::connect(("127.0.0.1", port)).unwrap();
    let error_of = |answer: &str, status: u16| {
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{answer:?}"));
        assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{answer}");
        let body = if head.to_ascii_lowercase().contains("chunked") {
            common::dechunk(body)
        } else {
            body.into()
        };
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert!(v["error"]["message"].is_string(), "{answer}");
    };

    // 413 from the header alone: nothing of the body is sent, the answer comes at once.
    let t = Instant::now();
    let mut s = connect();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999\r\n\r\n")
        .unwrap();
    let (answer, _) = read_until_closed(&mut s, Duration::from_secs(10));
    error_of(&answer, 413);
    assert!(t.elapsed() < Duration::from_secs(1), "413 took {:?}", t.elapsed());

    // What hyper cannot parse (a broken request line, a URI or headers too large) gets the
    // API's error object too, not a bare status.
    // (Too many headers: one huge header is refused only when it arrives in pieces.)
    let many: String = (0..300).map(|i| format!("X-{i}: v\r\n")).collect();
    let long_header = format!("GET /health HTTP/1.1\r\nHost: x\r\n{many}\r\n");
    let long_uri = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000));
    for (request, status) in
        [("GARBAGE\r\n\r\n".to_string(), 400), (long_header, 431), (long_uri, 414)]
    {
        let mut s = connect();
        let _ = s.write_all(request.as_bytes());
        let (answer, _) = read_until_closed(&mut s, Duration::from_secs(10));
        error_of(&answer, status);
    }

    // A chunked body whose chunk size is not a number: 400.
    let mut s = connect();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{{}}\r\n0\r\n\r\n").unwrap();
    let (answer, _) = read_until_closed(&mut s, Duration::from_secs(10));
    error_of(&answer, 400);

    // A body that stops coming: 408 after the body timeout.
    let mut s = connect();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    )
    .unwrap();
    let (answer, _) = read_until_closed(&mut s, Duration::from_secs(10));
    error_of(&answer, 408);

    // Half a request head, and a keep-alive connection after its answer: both closed after
    // the header timeout (2 s), not held.
    let t = Instant::now();
    let mut half = connect();
    write!(half, "GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let mut idle = connect();
    write!(idle, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let (answer, closed) = read_until_closed(&mut idle, Duration::from_secs(10));
    assert!(closed && answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    let (answer, closed) = read_until_closed(&mut half, Duration::from_secs(10));
    assert!(closed, "a half-sent head was held open: {answer:?}");
    assert!(t.elapsed() < Duration::from_secs(8), "closed after {:?}", t.elapsed());

    // Three connections allowed: with three open, a fourth waits; when one closes, it is served.
    let held: Vec<TcpStream> = (0..3).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut waiting = connect();
    write!(waiting, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    waiting.set_read_timeout(Some(Duration::from_millis(700))).unwrap();
    let mut byte = [0u8; 1];
    assert!(waiting.read(&mut byte).is_err(), "a fourth connection was served at once");
    drop(held);
    let (answer, _) = read_until_closed(&mut waiting, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert_eq!(http(port, "GET", "/health", "").0, 200);

    // Requests that run past --request-timeout (1 s): sixteen long choices each, cancelled;
    // answered with 504 whole, or with an error event and [DONE] streamed.
    let long = json!({"prompt": "To be", "max_tokens": 4000, "n": 16, "temperature": 1.0,
                      "ignore_eos": true});
    let t = Instant::now();
    let (status, v) = post(port, "/v1/completions", &long);
    assert_eq!(status, 504, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("deadline of 1 s"), "{v}");
    let mut streamed = long.clone();
    streamed["stream"] = json!(true);
    let got = events(port, "/v1/completions", &streamed);
    assert!(got[got.len() - 2].contains("deadline of 1 s"), "{:?}", &got[got.len() - 2..]);
    assert_eq!(got.last().unwrap(), "[DONE]");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // The engine frees their slots at its next step.
    let t = Instant::now();
    while outcome(port, "cancelled") == 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "the late requests were not cancelled");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A streamed completion of `max_tokens` (all of them: `ignore_eos`) with log-probabilities and
/// depth maps (events of about a kilobyte), sent from `from` on a connection with a small receive buffer, whose answer is
/// left unread once its status line has come: it fills the socket, and the server holds it until
/// the write deadline.
fn unread_stream(from: [u8; 4], port: u16, max_tokens: usize) -> TcpStream {
    let body = json!({"prompt": "To be", "max_tokens": max_tokens, "stream": true,
                      "temperature": 1.0, "logprobs": 5, "attnres_depth": true,
                      "ignore_eos": true})
    .to_string();
    let mut s = connect_from(from, port, Some(4096));
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut status = [0u8; 12];
    s.read_exact(&mut status).unwrap();
    assert_eq!(&status, b"HTTP/1.1 200");
    s
}

/// What one address may hold: a fourth connection is answered 429 and closed while another
/// address is served; two unread streams fill the address's share of the batch (half of 4
/// slots), so its third request gets 429 while another address is answered at once (and its
/// `n` counts choice by choice); a third address's requests in flight may not ask for more
/// tokens than allowed; a client that stops reading is cut off after the write deadline, which
/// gives its share back.
#[test]
fn one_address_cannot_hold_what_the_others_need() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let flags = [
        "--max-batch",
        "4",
        "--max-client-connections",
        "3",
        "--max-client-tokens",
        "6000",
        "--write-timeout",
        "3",
    ];
    let server = Server::start(env, &model, &flags);
    let port = server.port;
    let (a, b, c) = ([127, 0, 0, 1], [127, 0, 0, 2], [127, 0, 0, 3]);
    let health = |from| http_from(from, port, "GET", "/health", "", "").0;

    // Three connections of a's, each served once (so the server has taken them): a fourth is
    // refused at once, with the API's error object; b is served.
    let held: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = connect_from(a, port, None);
            write!(s, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut status = [0u8; 12];
            s.read_exact(&mut status).unwrap();
            s
        })
        .collect();
    let t = Instant::now();
    let mut fourth = connect_from(a, port, None);
    let (answer, closed) = read_until_closed(&mut fourth, Duration::from_secs(5));
    assert!(closed && answer.starts_with("HTTP/1.1 429 "), "{answer:?}");
    assert!(answer.contains("--max-client-connections"), "{answer:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "refused after {:?}", t.elapsed());
    assert_eq!(health(b), 200);
    assert_eq!(metric(port, "attnres_connections_refused_total"), 1);
    drop(held);
    let t = Instant::now();
    while health(a) != 200 {
        assert!(t.elapsed() < Duration::from_secs(10), "a's connections were not given back");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Requests: two unread streams are a's share.
    let streams = [unread_stream(a, port, 2900), unread_stream(a, port, 2900)];
    let small = json!({"prompt": "To be", "max_tokens": 2}).to_string();
    let (status, text) = http_from(a, port, "POST", "/v1/completions", &small, "");
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("--max-client-requests"), "{text}");
    let t = Instant::now();
    let (status, text) = http_from(b, port, "POST", "/v1/completions", &small, "");
    assert_eq!(status, 200, "{text}");
    assert!(t.elapsed() < Duration::from_secs(5), "b waited {:?}", t.elapsed());
    let three = json!({"prompt": "To be", "max_tokens": 2, "n": 3}).to_string();
    let (status, text) = http_from(b, port, "POST", "/v1/completions", &three, "");
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("would add 3"), "{text}");

    // Tokens: c holds a stream of 4000 and its prompt; 2000 more pass the 6000 allowed.
    let c_stream = unread_stream(c, port, 4000);
    let more = json!({"prompt": "To be", "max_tokens": 2000}).to_string();
    let (status, text) = http_from(c, port, "POST", "/v1/completions", &more, "");
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("--max-client-tokens"), "{text}");

    // The write deadline: the three unread streams stall and are cut off 3 s later; the
    // connections close, and a is served again.
    let t = Instant::now();
    while metric(port, "attnres_write_timeouts_total") < 3 {
        assert!(t.elapsed() < Duration::from_secs(40), "the unread streams were not cut off");
        std::thread::sleep(Duration::from_millis(100));
    }
    for mut s in streams.into_iter().chain([c_stream]) {
        let (_, closed) = read_until_closed(&mut s, Duration::from_secs(10));
        assert!(closed, "a cut-off connection is still open");
    }
    let (status, text) = http_from(a, port, "POST", "/v1/completions", &small, "");
    assert_eq!(status, 200, "{text}");
}

/// Request bodies buffered over all connections share one bound (16 MiB here): while one
/// connection holds 9 MiB of an unfinished body, another's 8 MiB is refused with 503 and
/// Retry-After; the first completes, and then a body of 10 MiB is taken.
#[test]
fn request_bodies_share_one_bound() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let server = Server::start(env, &model, &["--max-body-total", "16"]);
    let port = server.port;
    let json = r#"{"prompt": "To be", "max_tokens": 1}"#;
    let mib = 1 << 20;
    let head = |len: usize| {
        format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
    };
    // A body of leading spaces and the request: valid JSON of any length.
    let padded = |len: usize| format!("{}{json}", " ".repeat(len - json.len()));

    let first = padded(10 * mib);
    let mut x = connect_from([127, 0, 0, 1], port, None);
    x.write_all(head(first.len()).as_bytes()).unwrap();
    x.write_all(&first.as_bytes()[..9 * mib]).unwrap();
    std::thread::sleep(Duration::from_millis(500));

    let mut y = connect_from([127, 0, 0, 2], port, None);
    y.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = y.write_all(head(10 * mib).as_bytes());
    let _ = y.write_all(&padded(10 * mib).as_bytes()[..8 * mib]);
    let (answer, _) = read_until_closed(&mut y, Duration::from_secs(10));
    assert!(answer.starts_with("HTTP/1.1 503 "), "{:?}", &answer[..answer.len().min(300)]);
    assert!(answer.to_ascii_lowercase().contains("retry-after: 1"), "{answer:?}");
    assert!(answer.contains("--max-body-total"), "{answer:?}");
    assert_eq!(outcome(port, "rejected"), 1);

    x.write_all(&first.as_bytes()[9 * mib..]).unwrap();
    let (answer, _) = read_until_closed(&mut x, Duration::from_secs(30));
    assert!(answer.starts_with("HTTP/1.1 200 "), "{:?}", &answer[..answer.len().min(300)]);
    let (status, text) = http(port, "POST", "/v1/completions", &padded(10 * mib));
    assert_eq!(status, 200, "{}", &text[..text.len().min(300)]);
}
