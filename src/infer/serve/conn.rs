//! The server's connections: accepted up to a cap overall and one per client address, each
//! served by hyper's HTTP/1 with a header timeout and a write deadline, and the errors hyper
//! answers itself given the API's error object.
//!
//! A client that stops reading leaves its answer waiting on a full socket, and hyper waits with
//! it: [`WriteDeadline`] fails a write that has made no progress for `--write-timeout`, which
//! closes the connection and drops the answer's stream, so the engine cancels the request.
//!
//! hyper answers a request it cannot parse (a broken request line, a URI or headers too large)
//! on its own, with a bare status and an empty body, before any route sees it. [`JsonErrors`]
//! sits between hyper and the socket and replaces such an answer, recognised by its shape (a
//! 4xx status, `connection: close`, `content-length: 0`, which no route of ours sends), with the
//! same status and an error object.

use super::limits::{Clients, NetLimits};
use super::metrics::Metrics;
use crate::base::progress::log;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The address of the client that sent a request (a request extension).
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub IpAddr);

/// Serves connections until `shutdown` completes, at most `max_connections` at once (more wait
/// in the kernel's queue) and at most the per-client limit from one address (more are answered
/// 429 and closed at once), each with hyper's header timeout (which also ends idle keep-alive
/// connections) and the write deadline; then asks every open connection to finish its request
/// under way and close, and waits for them.
pub async fn accept_loop(
    listener: tokio::net::TcpListener,
    router: Router,
    net: NetLimits,
    clients: Arc<Clients>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(net.max_connections));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: wait, and try again.
                    log(&format!("cannot accept a connection: {e}"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Kernel memory per connection stays bounded however little the client reads (the
        // buffer would otherwise grow to megabytes), and a stalled write shows sooner.
        let _ = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER);
        // A streamed token is a small write: sent at once, not held for the last one's ACK.
        let _ = stream.set_nodelay(true);
        let ip = peer.ip();
        let Some(hold) = clients.connect(ip) else {
            metrics.connection_refused();
            // One try to say why, without waiting for a client that may not read.
            let _ = stream.try_write(TOO_MANY_CONNECTIONS.as_bytes());
            continue;
        };
        let inner = hyper_util::service::TowerToHyperService::new(router.clone());
        let service = hyper::service::service_fn(move |mut req| {
            req.extensions_mut().insert(ClientAddr(ip));
            hyper::service::Service::call(&inner, req)
        });
        let mut stopped = stopped.clone();
        let metrics = metrics.clone();
        connections.spawn(async move {
            let _held = (permit, hold);
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new()).header_read_timeout(net.header_timeout);
            let io = WriteDeadline::new(stream, net.write_timeout, metrics);
            let io = TokioIo::new(JsonErrors { inner: io, pending: None });
            let conn = http.serve_connection(io, service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stopped.changed() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
        // Forget the connections that have ended.
        while connections.try_join_next().is_some() {}
    }
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
}

/// The kernel's send buffer of each connection, in bytes (it holds several times one token's
/// event of a stream with log-probabilities and depth maps).
const SEND_BUFFER: usize = 128 << 10;

/// The answer to a connection beyond its address's limit.
const TOO_MANY_CONNECTIONS: &str = concat!(
    "HTTP/1.1 429 Too Many Requests\r\nconnection: close\r\ncontent-type: application/json\r\n",
    "content-length: 154\r\n\r\n",
    r#"{"error":{"message":"this address has as many connections open as allowed (--max-client-connections)","type":"rate_limit_error","param":null,"code":null}}"#
);

/// A connection whose writes fail once one has waited `timeout` for the client to read.
struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    /// Armed when a write could not go on, disarmed by any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    metrics: Arc<Metrics>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, timeout: Duration, metrics: Arc<Metrics>) -> WriteDeadline<S> {
        WriteDeadline { inner, timeout, stalled: None, metrics }
    }

    /// What a write that returned `poll` amounts to: progress disarms the deadline, waiting
    /// arms it, and waiting past it is an error.
    fn watch<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let timeout = self.timeout;
        let sleep = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.metrics.write_timed_out();
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the client did not read its answer within --write-timeout",
        )))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, poll)
    }
}

/// A connection whose bare error answers from hyper are rewritten with an error object.
struct JsonErrors<S> {
    inner: S,
    /// A rewritten answer being written, and how much of it is out.
    pending: Option<(Vec<u8>, usize)>,
}

/// The answer to write instead of `head`, when `head` is one of hyper's own error answers.
fn rewrite(head: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(head).ok()?;
    let status_line = text.strip_prefix("HTTP/1.1 4")?.split("\r\n").next()?;
    let bare = text.ends_with("\r\n\r\n")
        && text.contains("\r\nconnection: close\r\n")
        && text.contains("\r\ncontent-length: 0\r\n");
    if !bare {
        return None;
    }
    let status: u16 = format!("4{}", status_line.get(..2)?).parse().ok()?;
    let message = match status {
        400 => "the request is not valid HTTP/1.1".to_string(),
        414 => "the request's URI is too long".to_string(),
        431 => "the request's headers are too large".to_string(),
        _ => format!("the request could not be read ({} {})", status, status_line.get(3..)?),
    };
    let body = serde_json::json!({"error": {
        "message": message, "type": "invalid_request_error", "param": null, "code": null
    }})
    .to_string();
    Some(
        format!(
            "HTTP/1.1 4{status_line}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

impl<S: AsyncWrite + Unpin> JsonErrors<S> {
    /// Writes the pending rewritten answer; ready once all of it is out.
    fn flush_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, done)) = &mut self.pending {
            if *done == bytes.len() {
                self.pending = None;
                break;
            }
            match Pin::new(&mut self.inner).poll_write(cx, &bytes[*done..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *done += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonErrors<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonErrors<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // hyper writes again with the same bytes after a pending write: the rewritten answer
        // stands for them until it is out.
        if self.pending.is_none() {
            match rewrite(buf) {
                Some(answer) => self.pending = Some((answer, 0)),
                None => return Pin::new(&mut self.inner).poll_write(cx, buf),
            }
        }
        self.flush_pending(cx).map_ok(|()| buf.len())
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // An error answer is a head alone, one slice.
        if let [only] = bufs {
            return self.poll_write(cx, only);
        }
        if self.pending.is_some() {
            // (Not reached: hyper sends nothing after an error answer but a flush.)
            return self.flush_pending(cx).map_ok(|()| 0);
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.flush_pending(cx)?.is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.flush_pending(cx)?.is_pending() {
            return Poll::Pending;
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_to_a_connection_beyond_the_limit_is_well_formed() {
        let (head, body) = TOO_MANY_CONNECTIONS.split_once("\r\n\r\n").unwrap();
        assert!(head.ends_with(&format!("\r\ncontent-length: {}", body.len())), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
    }

    #[test]
    fn only_hypers_bare_error_answers_are_rewritten() {
        let bare = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Fri, 04 Dec 2026 04:27:14 GMT\r\n\r\n";
        let answer = String::from_utf8(rewrite(bare).unwrap()).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["message"], "the request's headers are too large");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        // Our own answers (a body, or no `connection: close`) and successes pass as they are.
        for kept in [
            &b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 90\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n",
        ] {
            assert!(rewrite(kept).is_none(), "{}", String::from_utf8_lossy(kept));
        }
    }
}
