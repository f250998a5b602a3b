//! `attnres serve`: an HTTP server that speaks the OpenAI API (docs/serving.md). axum on tokio
//! takes the requests; one engine thread ([`engine`]) owns the model and decodes every running
//! request in one batch, new requests joining and finished ones leaving at each step.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (with `stream: true` as
//! server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus) and `GET /`,
//! a page to try the model.

mod api;
mod conn;
pub mod engine;
mod logprobs;
pub mod metrics;
mod penalties;
mod prefix;

use crate::base::progress::log;
use crate::model::residual::DepthMap;
use crate::model::Model;
use anyhow::{Context, Result};
use api::{error, prepare_chat, prepare_completion, DepthLabels, Invalid, Prepared, Served};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engine::{EngineHandle, EngineOptions, Event, Finish, Job, Refused, Usage};
use logprobs::TokenLogprob;
use metrics::Metrics;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// What one client may hold of the server (docs/serving.md, "Limits").
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
}

/// The most connections `--max-connections` may allow (each holds a task and a socket).
pub const MAX_CONNECTIONS: usize = 65_536;
/// The longest `--header-timeout`, `--body-timeout` and `--request-timeout`, in seconds (a day).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;

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
        ];
        for (flag, t) in timeouts {
            anyhow::ensure!(
                (1..=MAX_TIMEOUT_SECS).contains(&t.as_secs()),
                "{flag} must lie in 1..={MAX_TIMEOUT_SECS} seconds, got {}",
                t.as_secs()
            );
        }
        Ok(())
    }
}

/// Everything a request handler needs.
struct App {
    engine: EngineHandle,
    served: Served,
    metrics: Arc<Metrics>,
    /// Numbers the ids of responses.
    next_id: AtomicU64,
    started: u64,
    net: NetLimits,
    api_key: Option<String>,
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
    engine::check_options(&model.config, e)?;
    opts.net.check()?;
    let chat = crate::text::chat::ChatTemplate::find(&opts.model)?;
    let (model, bpe) = (Arc::new(model), Arc::new(bpe));
    let metrics = Arc::new(Metrics::new(e.max_batch));
    let (context, vocab) = (model.config.max_position_embeddings, model.config.vocab_size);
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
    let router = Router::new()
        .route("/", get(page))
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such endpoint", None) })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "this endpoint does not take that method", None)
        })
        .layer(axum::middleware::from_fn_with_state(app.clone(), require_key))
        .with_state(app);
    let net = opts.net;
    conn::accept_loop(listener, router, net.max_connections, net.header_timeout, shutdown_signal())
        .await;
    Ok(())
}

/// With `--api-key`, a request without the key is answered 401 before anything else. Open:
/// `/health` (for load balancers) and the page itself, which holds no data (a browser cannot put
/// a header on the address bar's request); the page asks for the key and sends it with its calls.
async fn require_key(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(key) = &app.api_key else { return next.run(req).await };
    if matches!(req.uri().path(), "/health" | "/") {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
        return next.run(req).await;
    }
    let mut r = error(
        StatusCode::UNAUTHORIZED,
        "this server needs an API key: send the header Authorization: Bearer <key>",
        None,
    );
    r.headers_mut().insert(
        axum::http::header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer"),
    );
    r
}

/// Whether two secrets are equal, in time that depends on their lengths only (not on where
/// they first differ).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let diff = (0..n).fold((a.len() != b.len()) as u8, |acc, i| {
        acc | (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0))
    });
    std::hint::black_box(diff) == 0
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

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn page() -> Html<&'static str> {
    Html(include_str!("page.html"))
}

async fn metrics_text(State(app): State<Arc<App>>) -> impl IntoResponse {
    ([("content-type", "text/plain; version=0.0.4")], app.metrics.render())
}

async fn models(State(app): State<Arc<App>>) -> impl IntoResponse {
    // `attnres_depth`: an extension, whether requests may ask for depth maps.
    let depth = app.served.depth.is_some();
    axum::Json(json!({"object": "list", "data": [
        {"id": app.served.name, "object": "model", "created": app.started, "owned_by": "attnres",
         "attnres_depth": depth}
    ]}))
}

/// The largest request body taken, in bytes.
const MAX_BODY: usize = 16 << 20;

/// The request body, up to [`MAX_BODY`], within `--body-timeout`; each failure an error
/// object: 413 for a body too large (at once when its `Content-Length` says so), 400 for one
/// that is malformed or cut off, 408 for one that does not arrive in time.
async fn read_body(
    app: &App,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<axum::body::Bytes, Response> {
    use futures_util::StreamExt;
    let too_large = || {
        let msg = format!("the request body is larger than {} MB", MAX_BODY >> 20);
        error(StatusCode::PAYLOAD_TOO_LARGE, &msg, None)
    };
    let declared = headers.get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok());
    if declared.and_then(|v| v.parse::<u128>().ok()).is_some_and(|n| n > MAX_BODY as u128) {
        return Err(too_large());
    }
    let read = async {
        let mut bytes = Vec::new();
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                let msg = format!("the request body is malformed or was cut off: {e}");
                error(StatusCode::BAD_REQUEST, &msg, None)
            })?;
            if bytes.len() + chunk.len() > MAX_BODY {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(axum::body::Bytes::from(bytes))
    };
    match tokio::time::timeout(app.net.body_timeout, read).await {
        Ok(body) => body,
        Err(_) => {
            let secs = app.net.body_timeout.as_secs();
            let msg = format!("the request body did not arrive within {secs} s");
            Err(error(StatusCode::REQUEST_TIMEOUT, &msg, None))
        }
    }
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let body = match read_body(&app, &headers, body).await {
        Ok(b) => b,
        Err(r) => {
            app.metrics.finished("invalid");
            return r;
        }
    };
    let prepared = prepare_completion(&app.served, &body);
    respond(app, prepared, Kind::Completion).await
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let body = match read_body(&app, &headers, body).await {
        Ok(b) => b,
        Err(r) => {
            app.metrics.finished("invalid");
            return r;
        }
    };
    let prepared = prepare_chat(&app.served, &body);
    respond(app, prepared, Kind::Chat).await
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// Queues the request and answers it, whole or as a stream of events.
async fn respond(app: Arc<App>, prepared: Result<Prepared, Invalid>, kind: Kind) -> Response {
    let p = match prepared {
        Ok(p) => p,
        Err(e) => {
            app.metrics.finished("invalid");
            return error(e.status, &e.message, e.param);
        }
    };
    // The request's choices share one channel; each event names its choice.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let received = Instant::now();
    // Past it the request is given up: dropping `rx` makes the engine cancel its choices.
    let deadline = tokio::time::Instant::now() + app.net.request_timeout;
    let late = format!(
        "the request ran past the server's deadline of {} s (--request-timeout)",
        app.net.request_timeout.as_secs()
    );
    for choice in 0..p.choices {
        let job = Job {
            prompt: p.prompt.clone(),
            max_tokens: p.max_tokens,
            sampling: p.sampling,
            seed: p.seed,
            stop: p.stop.clone(),
            prompt_text: p.prompt_text.clone(),
            echo: p.echo,
            logprobs: p.logprobs,
            penalties: p.penalties.clone().map(Arc::new),
            depth: p.depth,
            choice,
            events: tx.clone(),
            received,
        };
        // On a refusal, the choices already queued are cancelled when `rx` goes.
        match app.engine.submit(job, &app.metrics) {
            Ok(()) => {}
            Err(Refused::Busy) => {
                app.metrics.finished("rejected");
                return error(
                    StatusCode::TOO_MANY_REQUESTS,
                    "the server is at capacity (its queue is full): retry later",
                    None,
                );
            }
            Err(Refused::Stopped) => {
                return error(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down", None)
            }
        }
    }
    drop(tx);
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat { "chatcmpl" } else { "cmpl" },
        app.next_id.fetch_add(1, Relaxed)
    );
    let created = unix_time();
    let shape = Shape {
        id,
        created,
        model: app.served.name.clone(),
        kind,
        logprobs: p.logprobs.is_some(),
        depth: app.served.depth.clone().filter(|_| p.depth),
    };
    let mut tally = Tally::new(p.choices);
    if !p.stream {
        let mut texts = vec![String::new(); p.choices];
        let mut tokens = vec![PerToken::default(); p.choices];
        loop {
            let Ok(next) = tokio::time::timeout_at(deadline, rx.recv()).await else {
                return error(StatusCode::GATEWAY_TIMEOUT, &late, None);
            };
            let Some((i, ev)) = next else { break };
            match ev {
                Event::Text(t) => texts[i].push_str(&t),
                Event::Logprobs(l) => tokens[i].logprobs.extend(l),
                Event::Depth(m) => tokens[i].depth.push(m),
                Event::Done { finish, usage } => {
                    tally.done(i, finish, usage);
                    if tally.all_done() {
                        return axum::Json(shape.whole(&texts, &tokens, &tally)).into_response();
                    }
                }
                Event::Failed(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e, None),
            }
        }
        return error(StatusCode::INTERNAL_SERVER_ERROR, "the engine stopped", None);
    }
    // Server-sent events: a chunk per piece of text, the last of each choice with its finish
    // reason, the usage when asked for, then `[DONE]`. The stream owns the engine's receiver: a
    // client that goes drops it, and the engine frees the slots at its next step.
    let state = Events {
        rx,
        shape,
        first: vec![true; p.choices],
        tokens: vec![PerToken::default(); p.choices],
        tally,
        include_usage: p.include_usage,
        queue: std::collections::VecDeque::new(),
        ended: false,
        deadline,
        late,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(e), st));
            }
            if st.ended {
                return None;
            }
            st.next().await;
        }
    });
    Sse::new(stream).into_response()
}

/// How a request's choices ended, and the tokens they took.
struct Tally {
    finish: Vec<Option<Finish>>,
    usage: Usage,
}

impl Tally {
    fn new(choices: usize) -> Tally {
        Tally { finish: vec![None; choices], usage: Usage::default() }
    }

    fn done(&mut self, choice: usize, finish: Finish, usage: Usage) {
        self.finish[choice] = Some(finish);
        // The prompt is counted once however many choices it has, as the API does.
        self.usage.prompt_tokens = usage.prompt_tokens;
        self.usage.cached_tokens = self.usage.cached_tokens.max(usage.cached_tokens);
        self.usage.completion_tokens += usage.completion_tokens;
    }

    fn all_done(&self) -> bool {
        self.finish.iter().all(Option::is_some)
    }

    fn usage(&self) -> Value {
        let Usage { prompt_tokens: p, cached_tokens, completion_tokens: c } = self.usage;
        json!({
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        })
    }
}

/// The state of a streamed response.
struct Events {
    rx: tokio::sync::mpsc::UnboundedReceiver<(usize, Event)>,
    shape: Shape,
    /// Per choice: no chunk sent yet (a chat stream's first chunk carries the role).
    first: Vec<bool>,
    /// Per choice: what goes with tokens whose text is not sent yet (it goes with the next
    /// chunk).
    tokens: Vec<PerToken>,
    tally: Tally,
    include_usage: bool,
    /// Events made and not yet sent.
    queue: std::collections::VecDeque<SseEvent>,
    ended: bool,
    /// When the request is given up, and what the stream then says.
    deadline: tokio::time::Instant,
    late: String,
}

impl Events {
    /// Turns the engine's next message into events.
    async fn next(&mut self) {
        let data = |v: Value| SseEvent::default().data(v.to_string());
        let Ok(next) = tokio::time::timeout_at(self.deadline, self.rx.recv()).await else {
            let late = json!({"error": {"message": self.late, "type": "server_error"}});
            self.queue.push_back(data(late));
            self.queue.push_back(SseEvent::default().data("[DONE]"));
            self.ended = true;
            return;
        };
        match next {
            Some((i, Event::Text(t))) => {
                let tokens = std::mem::take(&mut self.tokens[i]);
                let chunk = self.shape.chunk(i, Some(&t), &tokens, None, &mut self.first[i]);
                self.queue.push_back(data(chunk));
                return;
            }
            Some((i, Event::Logprobs(l))) => {
                self.tokens[i].logprobs.extend(l);
                return;
            }
            Some((i, Event::Depth(m))) => {
                self.tokens[i].depth.push(m);
                return;
            }
            Some((i, Event::Done { finish, usage })) => {
                let tokens = std::mem::take(&mut self.tokens[i]);
                let chunk = self.shape.chunk(i, None, &tokens, Some(finish), &mut self.first[i]);
                self.queue.push_back(data(chunk));
                self.tally.done(i, finish, usage);
                if !self.tally.all_done() {
                    return;
                }
                if self.include_usage {
                    self.queue.push_back(data(self.shape.usage_chunk(self.tally.usage())));
                }
            }
            Some((_, Event::Failed(e))) => {
                self.queue
                    .push_back(data(json!({"error": {"message": e, "type": "server_error"}})));
            }
            None => {}
        }
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.ended = true;
    }
}

/// The response objects of one request.
struct Shape {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Whether the request asked for log-probabilities.
    logprobs: bool,
    /// The depth map's labels, when the request asked for depth maps.
    depth: Option<Arc<DepthLabels>>,
}

/// What goes beside the text of a choice's tokens, when asked for.
#[derive(Clone, Default)]
struct PerToken {
    logprobs: Vec<TokenLogprob>,
    depth: Vec<DepthMap>,
}

impl Shape {
    /// A choice's `logprobs` field: null unless asked for.
    fn logprobs(&self, entries: &[TokenLogprob]) -> Value {
        match (self.logprobs, self.kind) {
            (false, _) => Value::Null,
            (true, Kind::Completion) => logprobs::completion_object(entries),
            (true, Kind::Chat) => logprobs::chat_object(entries),
        }
    }

    /// A choice's `attnres_depth` field, when asked for: the labels, and the depth map of each
    /// token (weights to 4 decimals, null for a source a consumer does not read).
    fn add_depth(&self, choice: &mut Value, maps: &[DepthMap]) {
        let Some(labels) = &self.depth else { return };
        let round = |w: &Option<f32>| w.map(|w| (w as f64 * 1e4).round() / 1e4);
        let maps: Vec<Vec<Vec<Option<f64>>>> = maps
            .iter()
            .map(|m| m.iter().map(|row| row.iter().map(round).collect()).collect())
            .collect();
        choice["attnres_depth"] =
            json!({"sources": labels.sources, "consumers": labels.consumers, "tokens": maps});
    }

    fn whole(&self, texts: &[String], tokens: &[PerToken], tally: &Tally) -> Value {
        let choices = texts
            .iter()
            .zip(&tally.finish)
            .zip(tokens)
            .enumerate()
            .map(|(index, ((text, finish), t))| {
                let (finish, lp) = (finish.map(Finish::as_str), self.logprobs(&t.logprobs));
                let mut choice = match self.kind {
                    Kind::Completion => {
                        json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
                    }
                    Kind::Chat => {
                        json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": finish})
                    }
                };
                self.add_depth(&mut choice, &t.depth);
                choice
            })
            .collect::<Vec<_>>();
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices, "usage": tally.usage()})
    }

    fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        tokens: &PerToken,
        finish: Option<Finish>,
        first: &mut bool,
    ) -> Value {
        let finish = finish.map(Finish::as_str);
        let lp = self.logprobs(&tokens.logprobs);
        let mut choice = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if std::mem::take(first) {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
        };
        self.add_depth(&mut choice, &tokens.depth);
        self.envelope(vec![choice], None)
    }

    fn usage_chunk(&self, usage: Value) -> Value {
        self.envelope(Vec::new(), Some(usage))
    }

    fn envelope(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let object =
            if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}
