//! What every request handler shares: the engine's handle, the served model, the limits and the
//! metrics.

use super::api::Served;
use super::engine::EngineHandle;
use super::limits::{BodyBudget, Clients, NetLimits};
use super::metrics::Metrics;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Everything a request handler needs.
pub(super) struct App {
    pub(super) engine: EngineHandle,
    pub(super) served: Served,
    pub(super) metrics: Arc<Metrics>,
    /// Numbers the ids of responses.
    pub(super) next_id: AtomicU64,
    pub(super) started: u64,
    pub(super) net: NetLimits,
    pub(super) clients: Arc<Clients>,
    /// Request-body bytes buffered over all connections.
    pub(super) bodies: Arc<BodyBudget>,
    pub(super) api_key: Option<String>,
}

/// Seconds since 1970, as the API's `created` fields give them.
pub(super) fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
