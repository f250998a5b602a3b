//! The HTTP layer: the routes, the API key, and request bodies read within their size, time and
//! the budget all connections share, before the API's checks ([`super::api`]) see them.

use super::api::{error, prepare_completion};
use super::app::App;
use super::chat::prepare_chat;
use super::conn::ClientAddr;
use super::limits::{BodyBytes, MAX_BODY};
use super::respond::respond;
use super::shapes::Kind;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use serde_json::json;
use std::sync::Arc;

/// The server's routes, behind the API key when there is one.
pub(super) fn router(app: Arc<App>) -> Router {
    Router::new()
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
        .with_state(app)
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

/// The request body, up to [`MAX_BODY`], within `--body-timeout`, its bytes taken from the
/// budget all connections share (held until the request is checked); each failure an error
/// object: 413 for a body too large (at once when its `Content-Length` says so), 400 for one
/// that is malformed or cut off, 408 for one that does not arrive in time, 503 when the bodies
/// being read fill the budget.
async fn read_body(
    app: &App,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<(axum::body::Bytes, BodyBytes), Response> {
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
        let (mut bytes, mut share) = (Vec::new(), app.bodies.share());
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                let msg = format!("the request body is malformed or was cut off: {e}");
                error(StatusCode::BAD_REQUEST, &msg, None)
            })?;
            if bytes.len() + chunk.len() > MAX_BODY {
                return Err(too_large());
            }
            if !share.grow(chunk.len()) {
                let msg = "the server is reading as many request bodies as it buffers at once \
                           (--max-body-total): retry later";
                let mut r = error(StatusCode::SERVICE_UNAVAILABLE, msg, None);
                r.headers_mut()
                    .insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(1));
                return Err(r);
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok((axum::body::Bytes::from(bytes), share))
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

/// A request whose body was not taken, counted.
fn refused(app: &App, answer: Response) -> Response {
    let busy = answer.status() == StatusCode::SERVICE_UNAVAILABLE;
    app.metrics.finished(if busy { "rejected" } else { "invalid" });
    answer
}

async fn completions(
    State(app): State<Arc<App>>,
    Extension(ClientAddr(client)): Extension<ClientAddr>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    answer(app, client, &headers, body, Kind::Completion).await
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    Extension(ClientAddr(client)): Extension<ClientAddr>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    answer(app, client, &headers, body, Kind::Chat).await
}

/// Reads the body of a request to the `kind` endpoint, checks it, and answers it.
async fn answer(
    app: Arc<App>,
    client: std::net::IpAddr,
    headers: &HeaderMap,
    body: axum::body::Body,
    kind: Kind,
) -> Response {
    let prepare = match kind {
        Kind::Completion => prepare_completion,
        Kind::Chat => prepare_chat,
    };
    let prepared = match read_body(&app, headers, body).await {
        Ok((body, _share)) => prepare(&app.served, &body),
        Err(r) => return refused(&app, r),
    };
    respond(app, prepared, kind, client).await
}
