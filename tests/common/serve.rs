//! A server under test: `attnres serve` on a loopback port, the requests the tests send it,
//! and what they read back.

use super::RunEnv;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

/// A small model with a long context (so that a long generation takes a while), trained briefly.
pub fn trained(env: &RunEnv) -> std::path::PathBuf {
    let sets = [
        "vocab_size=400",
        "seq_len=64",
        "micro_batch=4",
        "batch_tokens=512",
        "max_tokens=10240",
        "eval_every=10",
        "eval_tokens=512",
        "max_position_embeddings=4096",
    ];
    super::train_tiny(env, "run", &sets)
}

/// A running server, stopped when dropped.
pub struct Server {
    pub child: Child,
    pub port: u16,
}

impl Server {
    pub fn start(env: &RunEnv, model: &Path, flags: &[&str]) -> Server {
        Self::start_with(env, model, flags, &[])
    }

    /// With environment variables set for the server.
    pub fn start_with(env: &RunEnv, model: &Path, flags: &[&str], vars: &[(&str, &str)]) -> Server {
        let mut args = vec!["serve", "--model", model.to_str().unwrap(), "--port", "0"];
        args.extend(flags);
        let mut cmd = env.cmd(&args);
        cmd.envs(vars.iter().copied());
        let mut child = cmd.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let first = lines.next().unwrap().unwrap();
        let port = first
            .rsplit_once("http://127.0.0.1:")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {first:?}"));
        // Keep reading the log so that the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, port }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status and body of one HTTP/1.1 request (the body de-chunked).
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    http_with(port, method, path, body, "")
}

/// [`http`] with more header lines (each ending in `\r\n`).
pub fn http_with(port: u16, method: &str, path: &str, body: &str, headers: &str) -> (u16, String) {
    http_from(LOCAL, port, method, path, body, headers)
}

/// The loopback address the tests' requests come from unless they name another.
pub const LOCAL: [u8; 4] = [127, 0, 0, 1];
/// The address metrics are read from: a client of its own, never near a per-client limit.
const OBSERVER: [u8; 4] = [127, 0, 0, 254];

/// A connection to the server on `port` from the loopback address `from` (to the server, each
/// address is a client of its own), with a receive buffer of `rcvbuf` bytes when given.
pub fn connect_from(from: [u8; 4], port: u16, rcvbuf: Option<usize>) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    if let Some(n) = rcvbuf {
        s.set_recv_buffer_size(n).unwrap();
    }
    s.bind(&std::net::SocketAddr::from((from, 0)).into()).unwrap();
    s.connect(&std::net::SocketAddr::from((LOCAL, port)).into()).unwrap();
    s.into()
}

/// [`http_with`] from the loopback address `from`.
pub fn http_from(
    from: [u8; 4],
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    headers: &str,
) -> (u16, String) {
    let mut s = connect_from(from, port, None);
    // A server that refuses a body too large answers before reading all of it and closes the
    // connection: the rest of the write may fail, the answer is still there to read.
    let _ = write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{headers}Connection: close\r\n\r\n{body}",
        body.len()
    );
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    assert!(!raw.is_empty(), "no answer to {method} {path}");
    let text = String::from_utf8(raw).unwrap();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    (status, if chunked { super::dechunk(rest) } else { rest.to_string() })
}

pub fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(port, "POST", path, &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// The text of a whole completion.
pub fn complete(port: u16, body: &Value) -> String {
    complete_value(port, body)["choices"][0]["text"].as_str().unwrap().to_string()
}

/// A whole completion's response.
pub fn complete_value(port: u16, body: &Value) -> Value {
    let (status, v) = post(port, "/v1/completions", body);
    assert_eq!(status, 200, "{v}");
    v
}

/// The `data:` payloads of a streamed answer.
pub fn events(port: u16, path: &str, body: &Value) -> Vec<String> {
    let (status, text) = http(port, "POST", path, &body.to_string());
    assert_eq!(status, 200, "{text}");
    text.split("\n\n").filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_string)).collect()
}

/// The count of `outcome` in the server's metrics.
pub fn outcome(port: u16, outcome: &str) -> u64 {
    metric(port, &format!("attnres_requests_total{{outcome=\"{outcome}\"}}"))
}

/// The value of the metric `name` (with its labels) in the server's metrics.
pub fn metric(port: u16, name: &str) -> u64 {
    let (_, m) = http_from(OBSERVER, port, "GET", "/metrics", "", "");
    let key = format!("{name} ");
    m.lines().find_map(|l| l.strip_prefix(&key)).unwrap().parse().unwrap()
}

/// Reads from `s` until the server closes it or `limit` passes; what came, and whether it closed.
pub fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (String, bool) {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut raw = Vec::new();
    let closed = s.read_to_end(&mut raw).is_ok();
    (String::from_utf8_lossy(&raw).into_owned(), closed)
}
