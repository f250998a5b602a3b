//! `attnres serve`: an HTTP server that speaks the OpenAI API (docs/serving.md). axum on tokio
//! takes the requests; one engine thread ([`engine`]) owns the model and decodes every running
//! request in one batch, new requests joining and finished ones leaving at each step.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (with `stream: true` as
//! server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus) and `GET /`,
//! a page to try the model.

pub mod engine;
pub mod metrics;

use crate::base::progress::log;
use crate::infer::generate::Sampling;
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engine::{EngineHandle, EngineOptions, Event, Finish, Job, Refused};
use metrics::Metrics;
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// What `attnres serve` was asked for.
pub struct ServeOptions {
    pub model: PathBuf,
    pub host: String,
    pub port: u16,
    pub engine: EngineOptions,
    /// The name clients use in `model` (default: the model directory's name).
    pub name: Option<String>,
}

/// Everything a request handler needs.
struct App {
    engine: EngineHandle,
    bpe: Arc<Bpe>,
    name: String,
    context: usize,
    /// The most choices (`n`) one request may ask for: all of them must fit in the queue.
    max_choices: usize,
    metrics: Arc<Metrics>,
    /// The model's own chat template (an imported instruction model), else the plain one.
    chat: Option<crate::text::chat::ChatTemplate>,
    /// Numbers the ids of responses.
    next_id: AtomicU64,
    started: u64,
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
    anyhow::ensure!(e.max_batch >= 1, "--max-batch must be at least 1");
    anyhow::ensure!(e.max_queue >= 1, "--max-queue must be at least 1");
    anyhow::ensure!(e.prefill_tokens >= 1, "--prefill-tokens must be at least 1");
    let chat = crate::text::chat::ChatTemplate::find(&opts.model)?;
    let (model, bpe) = (Arc::new(model), Arc::new(bpe));
    let metrics = Arc::new(Metrics::new(e.max_batch));
    let context = model.config.max_position_embeddings;
    let (engine, thread) = engine::start(model.clone(), bpe.clone(), *e, metrics.clone())?;
    let app = Arc::new(App {
        engine,
        bpe,
        name,
        context,
        max_choices: e.max_queue,
        metrics,
        chat,
        next_id: AtomicU64::new(0),
        started: unix_time(),
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
        app.name,
        model.params.len(),
        model.config.residual_label(),
        app.context,
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
        .with_state(app);
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("the server failed")
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

/// An error response in the OpenAI shape.
fn error(status: StatusCode, message: &str, param: Option<&str>) -> Response {
    let kind = match status {
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::NOT_FOUND => "not_found_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    let body =
        json!({"error": {"message": message, "type": kind, "param": param, "code": Value::Null}});
    (status, axum::Json(body)).into_response()
}

/// A request that cannot be served as asked, with the field at fault.
struct Invalid {
    message: String,
    param: Option<&'static str>,
    status: StatusCode,
}

fn invalid(param: &'static str, message: impl Into<String>) -> Invalid {
    Invalid { message: message.into(), param: Some(param), status: StatusCode::BAD_REQUEST }
}

async fn page() -> Html<&'static str> {
    Html(include_str!("page.html"))
}

async fn metrics_text(State(app): State<Arc<App>>) -> impl IntoResponse {
    ([("content-type", "text/plain; version=0.0.4")], app.metrics.render())
}

async fn models(State(app): State<Arc<App>>) -> impl IntoResponse {
    axum::Json(json!({"object": "list", "data": [
        {"id": app.name, "object": "model", "created": app.started, "owned_by": "attnres"}
    ]}))
}

/// `stop`: a string or a list of up to four.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The fields both endpoints take. Fields of the OpenAI API that this server does not implement
/// are accepted only with their neutral values.
#[derive(Deserialize, Default)]
struct Common {
    model: Option<String>,
    max_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<u64>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<i64>,
    frequency_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    logprobs: Option<Value>,
    user: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionRequest {
    prompt: Value,
    echo: Option<bool>,
    best_of: Option<i64>,
    suffix: Option<String>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatRequest {
    messages: Vec<Message>,
    max_completion_tokens: Option<i64>,
    top_logprobs: Option<i64>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Message {
    role: String,
    content: String,
    name: Option<String>,
}

/// A request, checked and tokenized, ready for the engine.
struct Prepared {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    seed: u64,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// Completions to make of the prompt (`n`).
    choices: usize,
}

/// Parses a JSON body into `T`, naming the field at fault (unknown fields are errors).
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Invalid> {
    serde_json::from_slice(body).map_err(|e| Invalid {
        message: format!("the request body is not a valid request: {e}"),
        param: None,
        status: StatusCode::BAD_REQUEST,
    })
}

impl Common {
    /// Checks the settings and the prompt's room in the context; `default_max`: the
    /// endpoint's default for `max_tokens`.
    fn prepare(
        self,
        app: &App,
        prompt: Vec<u32>,
        default_max: Option<usize>,
        mut stop: Vec<String>,
    ) -> Result<Prepared, Invalid> {
        if let Some(m) = &self.model {
            if *m != app.name {
                return Err(Invalid {
                    status: StatusCode::NOT_FOUND,
                    ..invalid(
                        "model",
                        format!("the model {m:?} does not exist here (it serves {:?})", app.name),
                    )
                });
            }
        }
        if prompt.is_empty() {
            return Err(invalid("prompt", "the prompt is empty"));
        }
        let choices = match self.n {
            None => 1,
            Some(n) if n >= 1 && n as usize <= app.max_choices => n as usize,
            Some(n) => {
                return Err(invalid(
                    "n",
                    format!("n must be between 1 and {} (--max-queue), got {n}", app.max_choices),
                ))
            }
        };
        for (param, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(invalid(param, format!("{param} is not supported (only 0)")));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(invalid("logit_bias", "logit_bias is not supported"));
        }
        if self.logprobs.as_ref().is_some_and(|v| !v.is_null() && *v != Value::Bool(false)) {
            return Err(invalid("logprobs", "logprobs are not supported"));
        }
        let _ = self.user;
        let room = app.context + 1 - prompt.len().min(app.context + 1);
        if room == 0 {
            return Err(invalid(
                "prompt",
                format!(
                    "the prompt has {} tokens; the model's context is {} tokens",
                    prompt.len(),
                    app.context
                ),
            ));
        }
        let max_tokens = match self.max_tokens {
            Some(m) if m < 1 => {
                return Err(invalid(
                    "max_tokens",
                    format!("max_tokens must be at least 1, got {m}"),
                ))
            }
            Some(m) => m as usize,
            None => default_max.unwrap_or(room).min(room),
        };
        if max_tokens > room {
            return Err(invalid(
                "max_tokens",
                format!(
                    "the prompt has {} tokens and max_tokens is {max_tokens}: together they need {} positions, beyond the model's context of {}",
                    prompt.len(),
                    prompt.len() + max_tokens - 1,
                    app.context
                ),
            ));
        }
        let top_k = match self.top_k {
            Some(k) if k < 1 => {
                return Err(invalid("top_k", format!("top_k must be at least 1, got {k}")))
            }
            k => k.map(|k| k as usize),
        };
        let sampling = Sampling {
            temperature: self.temperature.unwrap_or(1.0) as f32,
            top_k,
            top_p: self.top_p.map(|p| p as f32),
        };
        if let Err(e) = sampling.validate() {
            let param =
                if e.to_string().starts_with("temperature") { "temperature" } else { "top_p" };
            return Err(invalid(param, e.to_string()));
        }
        match self.stop {
            Some(Stop::One(s)) => stop.push(s),
            Some(Stop::Many(v)) if v.len() > 4 => {
                return Err(invalid("stop", format!("at most 4 stop strings, got {}", v.len())))
            }
            Some(Stop::Many(v)) => stop.extend(v),
            None => {}
        }
        if stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "a stop string is empty"));
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = self.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        Ok(Prepared {
            prompt,
            max_tokens,
            sampling,
            seed: self.seed.unwrap_or(0),
            stop,
            stream,
            include_usage,
            choices,
        })
    }
}

fn encode(app: &App, text: &str, param: &'static str) -> Result<Vec<u32>, Invalid> {
    app.bpe.encode(text).map_err(|e| invalid(param, format!("cannot tokenize the {param}: {e:#}")))
}

/// The prompt of a conversation and the stop strings it needs: the model's own chat template
/// when it has one (its end-of-turn token ends the reply), else the plain template: system
/// messages first as they are, then each turn as `User: …` / `Assistant: …` on its own line,
/// ending with `Assistant:` for the reply, which stops where the model starts the next user
/// turn.
fn chat_prompt(app: &App, messages: &[Message]) -> Result<(String, Vec<String>), Invalid> {
    if messages.is_empty() {
        return Err(invalid("messages", "messages is empty"));
    }
    if let Some(r) = messages
        .iter()
        .map(|m| m.role.as_str())
        .find(|r| !["system", "developer", "user", "assistant"].contains(r))
    {
        return Err(invalid("messages", format!("unknown role {r:?} (system, user or assistant)")));
    }
    if let Some(t) = &app.chat {
        let turns: Vec<(&str, &str)> =
            messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        let text = t.render(&turns).map_err(|e| invalid("messages", format!("{e:#}")))?;
        return Ok((text, Vec::new()));
    }
    let mut text = String::new();
    for m in messages {
        let _ = &m.name;
        match m.role.as_str() {
            "system" | "developer" => {
                text.push_str(&m.content);
                text.push_str("\n\n");
            }
            "user" => text.push_str(&format!("User: {}\n", m.content)),
            _ => text.push_str(&format!("Assistant: {}\n", m.content)),
        }
    }
    text.push_str("Assistant:");
    Ok((text, vec![CHAT_STOP.to_string()]))
}

/// The stop string of the plain chat template.
const CHAT_STOP: &str = "\nUser:";

/// The largest request body taken, in bytes.
const MAX_BODY: usize = 16 << 20;

/// The request body, up to [`MAX_BODY`]; a larger one is answered with 413 and an error object.
async fn read_body(body: axum::body::Body) -> Result<axum::body::Bytes, Response> {
    axum::body::to_bytes(body, MAX_BODY).await.map_err(|_| {
        let msg = format!("the request body is larger than {} MB or was cut off", MAX_BODY >> 20);
        error(StatusCode::PAYLOAD_TOO_LARGE, &msg, None)
    })
}

async fn completions(State(app): State<Arc<App>>, body: axum::body::Body) -> Response {
    let body = match read_body(body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let prepared = (|| {
        let r: CompletionRequest = parse(&body)?;
        if r.echo == Some(true) {
            return Err(invalid("echo", "echo is not supported"));
        }
        if r.best_of.is_some_and(|b| b != 1) {
            return Err(invalid("best_of", "best_of must be 1"));
        }
        if r.suffix.is_some() {
            return Err(invalid("suffix", "suffix is not supported"));
        }
        let text = match &r.prompt {
            Value::String(s) => s.clone(),
            Value::Array(a) if a.len() == 1 && a[0].is_string() => {
                a[0].as_str().unwrap().to_string()
            }
            Value::Array(a) if a.len() > 1 => {
                return Err(invalid("prompt", "one prompt per request (send several requests)"))
            }
            _ => return Err(invalid("prompt", "prompt must be a string")),
        };
        let prompt = encode(&app, &text, "prompt")?;
        r.common.prepare(&app, prompt, Some(16), Vec::new())
    })();
    respond(app, prepared, Kind::Completion).await
}

async fn chat_completions(State(app): State<Arc<App>>, body: axum::body::Body) -> Response {
    let body = match read_body(body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let prepared = (|| {
        let mut r: ChatRequest = parse(&body)?;
        if r.top_logprobs.is_some() {
            return Err(invalid("top_logprobs", "logprobs are not supported"));
        }
        if r.common.max_tokens.is_none() {
            r.common.max_tokens = r.max_completion_tokens;
        }
        let (text, stop) = chat_prompt(&app, &r.messages)?;
        let prompt = encode(&app, &text, "messages")?;
        r.common.prepare(&app, prompt, None, stop)
    })();
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
    for choice in 0..p.choices {
        let job = Job {
            prompt: p.prompt.clone(),
            max_tokens: p.max_tokens,
            sampling: p.sampling,
            seed: p.seed,
            stop: p.stop.clone(),
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
    let shape = Shape { id, created, model: app.name.clone(), kind };
    let mut tally = Tally::new(p.choices);
    if !p.stream {
        let mut texts = vec![String::new(); p.choices];
        while let Some((i, ev)) = rx.recv().await {
            match ev {
                Event::Text(t) => texts[i].push_str(&t),
                Event::Done { finish, prompt_tokens, completion_tokens } => {
                    tally.done(i, finish, prompt_tokens, completion_tokens);
                    if tally.all_done() {
                        return axum::Json(shape.whole(&texts, &tally)).into_response();
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
        tally,
        include_usage: p.include_usage,
        queue: std::collections::VecDeque::new(),
        ended: false,
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
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl Tally {
    fn new(choices: usize) -> Tally {
        Tally { finish: vec![None; choices], prompt_tokens: 0, completion_tokens: 0 }
    }

    fn done(&mut self, choice: usize, finish: Finish, prompt_tokens: usize, completion: usize) {
        self.finish[choice] = Some(finish);
        // The prompt is counted once however many choices it has, as the API does.
        self.prompt_tokens = prompt_tokens;
        self.completion_tokens += completion;
    }

    fn all_done(&self) -> bool {
        self.finish.iter().all(Option::is_some)
    }

    fn usage(&self) -> Value {
        let (p, c) = (self.prompt_tokens, self.completion_tokens);
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    }
}

/// The state of a streamed response.
struct Events {
    rx: tokio::sync::mpsc::UnboundedReceiver<(usize, Event)>,
    shape: Shape,
    /// Per choice: no chunk sent yet (a chat stream's first chunk carries the role).
    first: Vec<bool>,
    tally: Tally,
    include_usage: bool,
    /// Events made and not yet sent.
    queue: std::collections::VecDeque<SseEvent>,
    ended: bool,
}

impl Events {
    /// Turns the engine's next message into events.
    async fn next(&mut self) {
        let data = |v: Value| SseEvent::default().data(v.to_string());
        match self.rx.recv().await {
            Some((i, Event::Text(t))) => {
                let chunk = self.shape.chunk(i, Some(&t), None, &mut self.first[i]);
                self.queue.push_back(data(chunk));
                return;
            }
            Some((i, Event::Done { finish, prompt_tokens, completion_tokens })) => {
                let chunk = self.shape.chunk(i, None, Some(finish), &mut self.first[i]);
                self.queue.push_back(data(chunk));
                self.tally.done(i, finish, prompt_tokens, completion_tokens);
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
}

impl Shape {
    fn whole(&self, texts: &[String], tally: &Tally) -> Value {
        let choices = texts
            .iter()
            .zip(&tally.finish)
            .enumerate()
            .map(|(index, (text, finish))| {
                let finish = finish.map(Finish::as_str);
                match self.kind {
                    Kind::Completion => {
                        json!({"index": index, "text": text, "logprobs": null, "finish_reason": finish})
                    }
                    Kind::Chat => {
                        json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish})
                    }
                }
            })
            .collect::<Vec<_>>();
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices, "usage": tally.usage()})
    }

    fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        finish: Option<Finish>,
        first: &mut bool,
    ) -> Value {
        let finish = finish.map(Finish::as_str);
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if std::mem::take(first) {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
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
