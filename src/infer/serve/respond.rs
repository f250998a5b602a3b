//! Answering a checked request: its choices queued on the engine, then the answer whole, or
//! streamed as server-sent events, until the last choice is done, the client goes, or the
//! request's deadline passes.

use super::api::{error, Invalid, Prepared};
use super::app::{unix_time, App};
use super::engine::Refused;
use super::job::{Event, Finish, Job, Usage};
use super::limits::Hold;
use super::shapes::{Kind, PerToken, Shape};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// Queues the request and answers it, whole or as a stream of events.
pub(super) async fn respond(
    app: Arc<App>,
    prepared: Result<Prepared, Invalid>,
    kind: Kind,
    client: IpAddr,
) -> Response {
    let p = match prepared {
        Ok(p) => p,
        Err(e) => {
            app.metrics.finished("invalid");
            return error(e.status, &e.message, e.param);
        }
    };
    // What the client's address may still ask for; held until the answer is out.
    let tokens = (p.prompt.len() + p.max_tokens).saturating_mul(p.choices);
    let hold = match app.clients.request(client, p.choices, tokens) {
        Ok(h) => h,
        Err(why) => {
            app.metrics.finished("rejected");
            return error(StatusCode::TOO_MANY_REQUESTS, &why, None);
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
            ignore_eos: p.ignore_eos,
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
                        let whole = shape.whole(&texts, &tokens, &tally.finish, tally.usage());
                        return axum::Json(whole).into_response();
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
        _hold: hold,
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
    /// The client's share of the limits, given back when the stream ends or the client goes.
    _hold: Hold,
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
