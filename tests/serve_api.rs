//! The API as clients send it, through real HTTP on a loopback port: the API key, bad requests
//! answered with OpenAI-style errors while the server goes on, content-part arrays, the bytes of
//! log-probabilities, seeds, and `ignore_eos`.

mod common;

use common::serve::{complete, complete_value, http, http_with, post, trained, Server};
use common::RunEnv;
use serde_json::{json, Value};
use std::path::Path;

/// `--api-key` (or ATTNRES_API_KEY): every route but /health and the page answers 401 with the
/// API's error object unless the request carries the key; with it, everything works as before.
#[test]
fn an_api_key_guards_every_route_but_health_and_the_page() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let flag = Server::start(env, &model, &["--api-key", "s3cret"]);
    let var = Server::start_with(env, &model, &[], &[("ATTNRES_API_KEY", "s3cret")]);
    let body = json!({"prompt": "ROMEO:", "max_tokens": 3}).to_string();
    for port in [flag.port, var.port] {
        for (method, path) in [
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/nowhere"),
        ] {
            for headers in ["", "Authorization: Bearer wrong\r\n", "Authorization: s3cret\r\n"] {
                let (status, text) = http_with(port, method, path, &body, headers);
                assert_eq!(status, 401, "{method} {path} with {headers:?}: {text}");
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
            }
        }
        let key = "Authorization: Bearer s3cret\r\n";
        assert_eq!(http_with(port, "GET", "/v1/models", "", key).0, 200);
        let (status, text) = http_with(port, "POST", "/v1/completions", &body, key);
        assert_eq!(status, 200, "{text}");
        assert_eq!(http(port, "GET", "/health", "").0, 200);
        let (status, page) = http(port, "GET", "/", "");
        assert!(status == 200 && page.contains("needs an API key"), "the page asks for the key");
    }
    // An empty key would look closed and be open: refused.
    let o = env.run(&["serve", "--model", model.to_str().unwrap(), "--api-key", " "]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--api-key (or ATTNRES_API_KEY) is empty"));
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_goes_on() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let server = Server::start(env, &model, &[]);
    let port = server.port;
    let long = "the ".repeat(5000);
    let cases: Vec<(&str, &str, String, u16, Option<&str>)> = vec![
        ("POST", "/v1/completions", "{\"prompt\": ".into(), 400, None),
        ("POST", "/v1/completions", "[1, 2]".into(), 400, None),
        ("POST", "/v1/completions", json!({"prompt": "a", "bogus": 1}).to_string(), 400, None),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 5000}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 1}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "temperature": -1}).to_string(),
            400,
            Some("temperature"),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "top_p": 0}).to_string(),
            400,
            Some("top_p"),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "top_k": 0}).to_string(),
            400,
            Some("top_k"),
        ),
        ("POST", "/v1/completions", json!({"prompt": "a", "n": 0}).to_string(), 400, Some("n")),
        ("POST", "/v1/completions", json!({"prompt": "a", "n": 65}).to_string(), 400, Some("n")),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}).to_string(),
            400,
            Some("stop"),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "presence_penalty": 3}).to_string(),
            400,
            Some("presence_penalty"),
        ),
        ("POST", "/v1/completions", json!({"prompt": ""}).to_string(), 400, Some("prompt")),
        ("POST", "/v1/completions", json!({"prompt": 7}).to_string(), 400, Some("prompt")),
        (
            "POST",
            "/v1/completions",
            json!({"prompt": "a", "model": "gpt-4"}).to_string(),
            404,
            Some("model"),
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "robot", "content": "x"}]}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user"}]}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "POST",
            "/v1/completions",
            format!("{{\"prompt\": \"{}\"}}", "a".repeat(17 << 20)),
            413,
            None,
        ),
        ("GET", "/v1/completions", String::new(), 405, None),
        ("GET", "/v2/everything", String::new(), 404, None),
    ];
    for (method, path, body, status, param) in &cases {
        let (got, text) = http(port, method, path, body);
        assert_eq!(got, *status, "{method} {path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
        assert!(v["error"]["type"].is_string(), "{text}");
        assert_eq!(v["error"]["param"].as_str(), *param, "{body}: {text}");
        // After every bad request the server still answers.
        assert_eq!(http(port, "GET", "/health", "").0, 200);
    }
    assert!(!complete(port, &json!({"prompt": "To be", "max_tokens": 3})).is_empty());
    let (_, metrics) = http(port, "GET", "/metrics", "");
    assert!(metrics.contains("attnres_requests_total{outcome=\"invalid\"} 20"), "{metrics}");
    assert!(metrics.contains("attnres_requests_total{outcome=\"completed\"} 1"), "{metrics}");
    let (_, models) = http(port, "GET", "/v1/models", "");
    assert_eq!(serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"], "run");
}

/// The id of `piece` in the run's tokenizer (its vocabulary, or its added tokens).
fn token_id(model: &Path, piece: &str) -> u64 {
    let text = std::fs::read_to_string(model.join("tokenizer.json")).unwrap();
    let t: Value = serde_json::from_str(&text).unwrap();
    if let Some(id) = t["model"]["vocab"][piece].as_u64() {
        return id;
    }
    let added = t["added_tokens"].as_array().unwrap();
    added.iter().find(|a| a["content"] == piece).and_then(|a| a["id"].as_u64()).unwrap()
}

/// A chat's text and the `bytes` of each of its log-probability entries.
fn chat(port: u16, body: &Value) -> (String, Vec<Vec<u8>>, Value) {
    let (status, v) = post(port, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    let bytes = |e: &Value| -> Vec<u8> {
        e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect()
    };
    let entries = choice["logprobs"]["content"].as_array().cloned().unwrap_or_default();
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    (text, entries.iter().map(bytes).collect(), choice.clone())
}

/// What clients send and expect beyond the basics: `content` as an array of text parts in every
/// role (other parts refused by name); each log-probability's `bytes` are the token's own, also
/// for a token that ends inside a character; without a `seed` each request samples afresh, with
/// one it is reproducible; `ignore_eos` runs past the end-of-text token to `max_tokens`.
#[test]
fn content_parts_token_bytes_seeds_and_ignore_eos() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    // No prefix cache: a prompt's second run computes its logits afresh, bit for bit.
    let server = Server::start(env, &model, &["--prefix-cache", "0"]);
    let port = server.port;
    let parts = |texts: &[&str]| -> Value {
        texts.iter().map(|t| json!({"type": "text", "text": t})).collect()
    };
    let messages = |system: Value, user: Value, assistant: Value| {
        json!([{"role": "system", "content": system}, {"role": "user", "content": user},
               {"role": "assistant", "content": assistant}, {"role": "user", "content": "Go on."}])
    };
    let greedy = |m: Value| {
        json!({"messages": m, "max_tokens": 12, "temperature": 0,
                                   "logprobs": true, "top_logprobs": 3})
    };
    // Parts are joined by newlines, in every role: the same prompt, the same answer.
    let plain = messages(json!("Be brief.\nSpeak verse."), json!("ROMEO:"), json!("What, ho!"));
    let split =
        messages(parts(&["Be brief.", "Speak verse."]), parts(&["ROMEO:"]), parts(&["What, ho!"]));
    let (want, bytes, want_choice) = chat(port, &greedy(plain));
    let (got, _, got_choice) = chat(port, &greedy(split));
    assert_eq!(got, want);
    assert_eq!(got_choice["logprobs"], want_choice["logprobs"]);
    // The tokens' bytes, joined, are the text's.
    assert_eq!(bytes.concat(), want.as_bytes());
    for (content, needle) in [
        (json!([{"type": "image_url", "image_url": {"url": "data:,"}}]), "type \"image_url\""),
        (json!([{"type": "input_audio", "input_audio": {}}]), "type \"input_audio\""),
        (json!([{"type": "text", "text": "a", "cache_control": {}}]), "\"cache_control\""),
        (json!([{"type": "text"}]), "without a string text"),
        (json!(["text"]), "must be an object"),
        (json!(null), "is missing or null"),
        (json!(7), "must be a string or an array"),
    ] {
        let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2});
        let (status, v) = post(port, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{content}: {v}");
        assert_eq!(v["error"]["param"], "messages", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("messages[0].content") && message.contains(needle), "{message}");
    }

    // The byte-level token for 0xE6 (`æ`), forced: the first byte of 日 (E6 97 A5). Its entry
    // holds that byte, not the replacement character's three.
    let e6 = token_id(&model, "\u{e6}");
    let forced = json!({"messages": [{"role": "user", "content": "Say it."}], "max_tokens": 1,
                        "logprobs": true, "top_logprobs": 2, "logit_bias": {e6.to_string(): 100}});
    let (_, bytes, choice) = chat(port, &forced);
    assert_eq!(bytes, [vec![0xE6]], "{choice}");
    // The alternatives' bytes are theirs too: their text, where that is whole.
    for alt in choice["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap() {
        let b: Vec<u8> =
            alt["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        let token = alt["token"].as_str().unwrap();
        assert!(!b.is_empty(), "{alt}");
        assert!(String::from_utf8(b).is_ok_and(|t| t == token) || token.contains('\u{fffd}'));
    }

    // Seeds: none drawn twice alike; the same seed, the same text.
    let sampled = |seed: Option<u64>| {
        let mut b = json!({"prompt": "ROMEO:", "max_tokens": 24, "temperature": 1.0});
        if let Some(s) = seed {
            b["seed"] = json!(s);
        }
        complete(port, &b)
    };
    let fresh: std::collections::BTreeSet<String> = (0..3).map(|_| sampled(None)).collect();
    assert_eq!(fresh.len(), 3, "requests without a seed gave the same text: {fresh:?}");
    assert_eq!(sampled(Some(7)), sampled(Some(7)));

    // ignore_eos: the end-of-text token pushed to the top ends the text at once, unless ignored.
    let eot = token_id(&model, "<|endoftext|>");
    let pushed = |ignore: bool| {
        let b = json!({"prompt": "ROMEO:", "max_tokens": 9, "temperature": 0,
                       "logit_bias": {eot.to_string(): 100}, "ignore_eos": ignore});
        let v = complete_value(port, &b);
        (v["choices"][0]["finish_reason"].clone(), v["usage"]["completion_tokens"].clone())
    };
    assert_eq!(pushed(false), (json!("stop"), json!(0)));
    assert_eq!(pushed(true), (json!("length"), json!(9)));
}

/// `--context N` bounds each sequence, prompt and completion together, below the model's own.
#[test]
fn context_bounds_each_sequence() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let server = Server::start(env, &model, &["--context", "64"]);
    let (status, v) =
        post(server.port, "/v1/completions", &json!({"prompt": "To be", "max_tokens": 100}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("context of 64"), "{v}");
    let v = complete_value(server.port, &json!({"prompt": "To be", "max_tokens": 60}));
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 60);
}
