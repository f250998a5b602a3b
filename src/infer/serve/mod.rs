//! `attnres serve`: an HTTP server that speaks the OpenAI API (docs/serving.md). axum on tokio
//! takes the requests; one engine thread ([`engine`]) owns the model and decodes every running
//! request in one batch, new requests joining and finished ones leaving at each step.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (with `stream: true` as
//! server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus) and `GET /`,
//! a page to try the model.
//!
//! The parts, in the order a request meets them: [`conn`] (connections and their deadlines),
//! [`limits`] (what clients may hold), [`http`] (routes, the API key, bodies), [`api`] and
//! [`chat`] (the request shapes and their checks), [`respond`] (queueing and streaming), [`shapes`] (the
//! response objects); the [`engine`] schedules the batch and each [`sequence`] makes its text,
//! log-probabilities and depth maps; [`prefix`] keeps prompts' keys and values for reuse.

mod api;
mod app;
mod chat;
mod conn;
pub mod engine;
mod http;
mod job;
pub mod limits;
mod logprobs;
pub mod metrics;
mod penalties;
mod prefix;
mod respond;
mod sequence;
mod shapes;

use crate::base::progress::log;
use crate::model::Model;
use anyhow::{Context, Result};
use api::{DepthLabels, Served};
use app::{unix_time, App};
use engine::EngineOptions;
use limits::{BodyBudget, Clients};
pub use limits::{ClientLimits, NetLimits};
use metrics::Metrics;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// What `attnres serve` was asked for.
pub struct ServeOptions {
    pub model: PathBuf,
    pub host: String,
    pub port: u16,
    pub engine: EngineOptions,
    /// The name clients use in `model` (default: the model directory's name).
    pub name: Option<String>,
    pub net: NetLimits,
    /// When set, every route but `/health` and the page needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
}

/// Serves until SIGTERM or Ctrl-C; requests under way are finished before it returns.
pub fn run(opts: ServeOptions) -> Result<()> {
    let (model, bpe) = crate::model::checkpoint::load_with_tokenizer(&opts.model)?;
    crate::infer::generate::check_tokenizer(model.config.vocab_size, &bpe)?;
    let name = match &opts.name {
        Some(n) => n.clone(),
        None => opts
            .model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "attnres".into()),
    };
    let e = &opts.engine;
    engine::check_options(&model, e)?;
    opts.net.check()?;
    let chat = crate::text::chat::ChatTemplate::find(&opts.model)?;
    let (model, bpe) = (Arc::new(model), Arc::new(bpe));
    let metrics = Arc::new(Metrics::new(e.max_batch));
    let (context, vocab) = (e.context(&model.config), model.config.vocab_size);
    let c = &model.config;
    let depth = c.block_size().map(|_| {
        use crate::model::diagnostics::{consumer_labels, source_labels};
        let sources = source_labels(c.sublayers(), c.block_size());
        Arc::new(DepthLabels { sources, consumers: consumer_labels(c.sublayers()) })
    });
    // Prompts of token ids may use the ids that have text.
    let tokenizer_vocab = bpe.vocab_size();
    let (engine, thread) = engine::start(model.clone(), bpe.clone(), *e, metrics.clone())?;
    let app = Arc::new(App {
        engine,
        served: Served {
            bpe,
            name,
            context,
            vocab: vocab.min(tokenizer_vocab),
            max_choices: e.max_queue,
            chat,
            depth,
        },
        metrics,
        next_id: AtomicU64::new(0),
        started: unix_time(),
        net: opts.net,
        clients: Clients::new(opts.net.client, e.max_batch, context),
        bodies: BodyBudget::new(opts.net.body_bytes),
        api_key: opts.api_key.clone(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the server's runtime")?;
    runtime.block_on(serve(app, &opts, &model))?;
    // The router and its handles are gone: the engine finishes what it holds and stops.
    let _ = thread.join();
    log("stopped");
    Ok(())
}

async fn serve(app: Arc<App>, opts: &ServeOptions, model: &Model) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", opts.host, opts.port))?;
    let addr = listener.local_addr()?;
    log(&format!(
        "serving {} ({} parameters, residual {}, context {}) on http://{addr} with up to {} sequences per batch",
        app.served.name,
        model.params.len(),
        model.config.residual_label(),
        app.served.context,
        opts.engine.max_batch
    ));
    let (clients, metrics) = (app.clients.clone(), app.metrics.clone());
    let router = http::router(app);
    conn::accept_loop(listener, router, opts.net, clients, metrics, shutdown_signal()).await;
    Ok(())
}

/// SIGTERM or Ctrl-C: stop taking connections; requests under way finish.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    log("shutting down: finishing the requests under way");
}
