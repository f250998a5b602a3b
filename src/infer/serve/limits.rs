//! What the server lets clients hold (docs/serving.md, "Limits"): connections, how long each
//! part of an exchange may take, the request bodies buffered over all connections, and per
//! client address the connections, requests in flight and tokens those requests ask for, so that
//! one address cannot take what every other client needs.

use anyhow::Result;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The bounds of the network side.
#[derive(Clone, Copy, Debug)]
pub struct NetLimits {
    /// Connections served at once; more wait in the kernel's queue until one closes.
    pub max_connections: usize,
    /// How long a client may take to send a request's head, and how long a keep-alive
    /// connection may sit idle before the next one.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body.
    pub body_timeout: Duration,
    /// How long a request may take from its arrival to its last token.
    pub request_timeout: Duration,
    /// How long an answer may wait for the client to read it: a connection whose writes make
    /// no progress for this long is closed, and its requests cancelled.
    pub write_timeout: Duration,
    /// Request-body bytes buffered over all connections together; past it a request is
    /// answered 503.
    pub body_bytes: usize,
    pub client: ClientLimits,
}

/// What one client address may hold at once; 0 is no limit, `None` the default
/// ([`Clients::new`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct ClientLimits {
    pub connections: Option<usize>,
    /// Requests queued or running, each of a request's `n` choices counting as one.
    pub requests: Option<usize>,
    /// Tokens its requests in flight may take: prompt and `max_tokens`, for each choice.
    pub tokens: Option<usize>,
}

/// Connections one address may hold by default: a quarter of `--max-connections`' default.
pub const CLIENT_CONNECTIONS: usize = 64;

/// The most connections `--max-connections` may allow (each holds a task and a socket).
pub const MAX_CONNECTIONS: usize = 65_536;
/// The longest timeout flag, in seconds (a day).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;
/// The largest request body taken, in bytes.
pub const MAX_BODY: usize = 16 << 20;

impl NetLimits {
    pub fn check(&self) -> Result<()> {
        anyhow::ensure!(
            (1..=MAX_CONNECTIONS).contains(&self.max_connections),
            "--max-connections must lie in 1..={MAX_CONNECTIONS}, got {}",
            self.max_connections
        );
        let timeouts = [
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
            ("--request-timeout", self.request_timeout),
            ("--write-timeout", self.write_timeout),
        ];
        for (flag, t) in timeouts {
            anyhow::ensure!(
                (1..=MAX_TIMEOUT_SECS).contains(&t.as_secs()),
                "{flag} must lie in 1..={MAX_TIMEOUT_SECS} seconds, got {}",
                t.as_secs()
            );
        }
        anyhow::ensure!(
            self.body_bytes >= MAX_BODY,
            "--max-body-total must be at least one request body's limit ({} MiB), got {} MiB",
            MAX_BODY >> 20,
            self.body_bytes >> 20
        );
        Ok(())
    }
}

/// What each client address holds now. An address holding nothing has no entry, so the table
/// grows only with the clients connected.
pub struct Clients {
    /// The most one address may hold (0: no limit).
    limits: Held,
    table: Mutex<HashMap<IpAddr, Held>>,
}

#[derive(Clone, Copy, Default, PartialEq)]
struct Held {
    connections: usize,
    requests: usize,
    tokens: usize,
}

/// Something a client holds (a connection, or a request and its tokens), given back when
/// dropped.
pub struct Hold {
    clients: Arc<Clients>,
    ip: IpAddr,
    held: Held,
}

impl Clients {
    /// The table for a server of `max_batch` slots of `context` tokens. By default one address
    /// may hold half the slots and the tokens they hold at full context, so that the others
    /// always find room, and [`CLIENT_CONNECTIONS`] connections.
    pub fn new(limits: ClientLimits, max_batch: usize, context: usize) -> Arc<Clients> {
        let half = max_batch.div_ceil(2);
        let limits = Held {
            connections: limits.connections.unwrap_or(CLIENT_CONNECTIONS),
            requests: limits.requests.unwrap_or(half),
            tokens: limits.tokens.unwrap_or(half.saturating_mul(context)),
        };
        Arc::new(Clients { limits, table: Mutex::new(HashMap::new()) })
    }

    /// A connection for `ip`, unless it holds as many as allowed.
    pub fn connect(self: &Arc<Self>, ip: IpAddr) -> Option<Hold> {
        let want = Held { connections: 1, ..Held::default() };
        self.take(ip, want).ok()
    }

    /// A request of `choices` sequences and `tokens` in all for `ip`; refused with the reason
    /// when the address would hold more requests, or tokens, than allowed.
    pub fn request(
        self: &Arc<Self>,
        ip: IpAddr,
        choices: usize,
        tokens: usize,
    ) -> Result<Hold, String> {
        self.take(ip, Held { requests: choices, tokens, ..Held::default() })
    }

    fn take(self: &Arc<Self>, ip: IpAddr, want: Held) -> Result<Hold, String> {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let held = table.get(&ip).copied().unwrap_or_default();
        let l = self.limits;
        let over = |limit: usize, now: usize, more: usize| limit > 0 && now + more > limit;
        if over(l.connections, held.connections, want.connections) {
            return Err(format!(
                "this address has {} connections open, the most allowed (--max-client-connections)",
                held.connections
            ));
        }
        if over(l.requests, held.requests, want.requests) {
            return Err(format!(
                "this address has {} requests in flight (each choice counting as one) and this \
                 one would add {}: more than the {} allowed (--max-client-requests); retry when \
                 one has finished",
                held.requests, want.requests, l.requests
            ));
        }
        if over(l.tokens, held.tokens, want.tokens) {
            return Err(format!(
                "this request asks for {} tokens (prompt and max_tokens, for each choice) and \
                 this address's requests in flight for {}: together more than the {} allowed \
                 (--max-client-tokens)",
                want.tokens, held.tokens, l.tokens
            ));
        }
        let entry = table.entry(ip).or_default();
        entry.connections += want.connections;
        entry.requests += want.requests;
        entry.tokens += want.tokens;
        Ok(Hold { clients: self.clone(), ip, held: want })
    }

    /// What `ip` holds now: connections, requests, tokens.
    #[cfg(test)]
    fn held(&self, ip: IpAddr) -> (usize, usize, usize) {
        let table = self.table.lock().unwrap();
        let h = table.get(&ip).copied().unwrap_or_default();
        (h.connections, h.requests, h.tokens)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut table = self.clients.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = table.get_mut(&self.ip) {
            h.connections -= self.held.connections;
            h.requests -= self.held.requests;
            h.tokens -= self.held.tokens;
            if *h == Held::default() {
                table.remove(&self.ip);
            }
        }
    }
}

/// Bytes of request bodies buffered over all connections, within a bound.
pub struct BodyBudget {
    held: AtomicUsize,
    limit: usize,
}

/// Bytes of one body taken from the budget, given back when dropped.
pub struct BodyBytes {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Arc<BodyBudget> {
        Arc::new(BodyBudget { held: AtomicUsize::new(0), limit })
    }

    /// An empty share, to grow as a body arrives.
    pub fn share(self: &Arc<Self>) -> BodyBytes {
        BodyBytes { budget: self.clone(), bytes: 0 }
    }
}

impl BodyBytes {
    /// Takes `n` more bytes; false (taking nothing) when the budget has not that many left.
    pub fn grow(&mut self, n: usize) -> bool {
        let b = &self.budget;
        let taken = b.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(n).filter(|&h| h <= b.limit)
        });
        if taken.is_ok() {
            self.bytes += n;
        }
        taken.is_ok()
    }
}

impl Drop for BodyBytes {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_at_most_its_limits_and_gives_back_on_drop() {
        let limits = ClientLimits { connections: Some(2), requests: Some(3), tokens: Some(100) };
        let clients = Clients::new(limits, 16, 1000);
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "::1".parse().unwrap());
        let c1 = clients.connect(a).unwrap();
        let _c2 = clients.connect(a).unwrap();
        assert!(clients.connect(a).is_none());
        // Another address has limits of its own.
        let _b1 = clients.connect(b).unwrap();
        drop(c1);
        let _c3 = clients.connect(a).unwrap();
        // Requests: a count of choices and a sum of tokens.
        let r1 = clients.request(a, 1, 60).unwrap();
        let e = clients.request(a, 1, 41).err().unwrap();
        assert!(e.contains("--max-client-tokens"), "{e}");
        let e = clients.request(a, 3, 30).err().unwrap();
        assert!(e.contains("--max-client-requests"), "{e}");
        let r2 = clients.request(a, 2, 40).unwrap();
        let e = clients.request(a, 1, 0).err().unwrap();
        assert!(e.contains("--max-client-requests"), "{e}");
        assert_eq!(clients.held(a), (2, 3, 100));
        drop((r1, r2));
        assert_eq!(clients.held(a), (2, 0, 0));
        drop(_c3);
        drop(_c2);
        // Nothing held: no entry is kept.
        assert!(!clients.table.lock().unwrap().contains_key(&a));
        // 0: no limit.
        let off = ClientLimits { connections: Some(0), requests: Some(0), tokens: Some(0) };
        let open = Clients::new(off, 16, 1000);
        let all: Vec<Hold> = (0..1000).map(|_| open.request(a, 1, 1 << 40).unwrap()).collect();
        assert_eq!(open.held(a).1, all.len());
        // The defaults: half the slots, and the tokens they hold at full context.
        let default = Clients::new(ClientLimits::default(), 15, 1000);
        assert_eq!((default.limits.requests, default.limits.tokens), (8, 8000));
        assert_eq!(default.limits.connections, CLIENT_CONNECTIONS);
    }

    #[test]
    fn the_body_budget_is_shared_and_given_back() {
        let budget = BodyBudget::new(100);
        let (mut x, mut y) = (budget.share(), budget.share());
        assert!(x.grow(60));
        assert!(!y.grow(41));
        assert!(y.grow(40));
        assert!(!x.grow(1));
        drop(y);
        assert!(x.grow(40));
        drop(x);
        assert_eq!(budget.held.load(Ordering::Acquire), 0);
        assert!(budget.share().grow(100));
    }
}
