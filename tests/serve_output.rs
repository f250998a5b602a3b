//! What the server computes, through real HTTP on a loopback port: its texts equal `attnres
//! generate` and do not depend on what else is in the batch; log-probabilities, penalties and
//! depth maps are the model's own; the prefix cache changes no output.

mod common;

use common::serve::{complete, complete_value, events, http, post, trained, Server};
use common::RunEnv;
use serde_json::{json, Value};
use std::path::Path;

fn prompts() -> Vec<(String, usize)> {
    [
        "ROMEO:",
        "To be, or not",
        "KING HENRY",
        "O",
        "What light through yonder window breaks",
        "Good",
    ]
    .iter()
    .zip([24, 9, 40, 17, 5, 31])
    .map(|(p, n)| (p.to_string(), n))
    .collect()
}

#[test]
fn texts_equal_generate_and_do_not_depend_on_the_batch() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let server = Server::start(env, &model, &["--max-batch", "8", "--max-client-requests", "0"]);
    let port = server.port;
    let body = |p: &str, n: usize, temperature: f64| json!({"model": "run", "prompt": p, "max_tokens": n, "temperature": temperature, "seed": 3});

    // One at a time, greedy and sampled.
    let mut alone = Vec::new();
    for (p, n) in prompts() {
        for t in [0.0, 0.8] {
            alone.push(complete(port, &body(&p, n, t)));
        }
    }
    // The same text as `attnres generate` with the same settings.
    for (i, (p, n)) in prompts().iter().enumerate().take(3) {
        for (j, t) in ["0", "0.8"].iter().enumerate() {
            let o = env.run(&[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                p,
                "--max-tokens",
                &n.to_string(),
                "--temperature",
                t,
                "--seed",
                "3",
            ]);
            let out = String::from_utf8(o.stdout).unwrap();
            let continuation = out.strip_prefix(p.as_str()).unwrap().strip_suffix('\n').unwrap();
            assert_eq!(alone[2 * i + j], continuation, "prompt {p:?} at temperature {t}");
        }
    }
    // All at once: each text as it was alone.
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts()
            .into_iter()
            .flat_map(|(p, n)| [0.0, 0.8].map(|t| (p.clone(), n, t)))
            .map(|(p, n, t)| s.spawn(move || complete(port, &body(&p, n, t))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone, "texts changed when requests shared the batch");

    // Streamed: the pieces add up to the whole, then the finish reason, the usage and [DONE].
    let mut b = body("ROMEO:", 24, 0.8);
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let ev = events(port, "/v1/completions", &b);
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let streamed: String =
        chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect::<String>();
    assert_eq!(streamed, alone[1]);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap(),
        usage["total_tokens"].as_u64().unwrap()
    );
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"] && c["object"] == "text_completion"));

    // `n` choices: choice i samples the random stream a batch of generate's gives its i-th
    // prompt, so they equal `generate --prompt-file` of the prompt repeated; streamed, the
    // pieces of each index add up to its whole text.
    let mut b = body("ROMEO:", 24, 0.8);
    b["n"] = json!(3);
    let (status, whole) = post(port, "/v1/completions", &b);
    assert_eq!(status, 200, "{whole}");
    let choices: Vec<String> = (0..3)
        .map(|i| {
            assert_eq!(whole["choices"][i]["index"], i);
            whole["choices"][i]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(choices[0], alone[1], "choice 0 is the request with n = 1");
    assert_ne!(choices[1], choices[2], "the choices sample different streams");
    let prompts_file = env.path("three.txt");
    std::fs::write(&prompts_file, "ROMEO:\nROMEO:\nROMEO:\n").unwrap();
    let o = env.run(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-file",
        prompts_file.to_str().unwrap(),
        "--max-tokens",
        "24",
        "--temperature",
        "0.8",
        "--seed",
        "3",
    ]);
    let batch: Vec<Value> = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let batch_texts: Vec<&str> = batch.iter().map(|v| v["completion"].as_str().unwrap()).collect();
    assert_eq!(choices, batch_texts);
    // The prompt is counted once, the completions' tokens summed.
    let (_, one) = post(port, "/v1/completions", &body("ROMEO:", 24, 0.8));
    assert_eq!(whole["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    // (generate counts an end-of-text token it stopped at; the API does not.)
    let tokens: u64 = batch
        .iter()
        .map(|v| v["new_tokens"].as_u64().unwrap() - (v["stop"] == "end_of_text") as u64)
        .sum();
    assert_eq!(whole["usage"]["completion_tokens"], tokens);
    b["stream"] = json!(true);
    let mut streamed = vec![String::new(); 3];
    for e in events(port, "/v1/completions", &b).iter().filter(|e| *e != "[DONE]") {
        let c: Value = serde_json::from_str(e).unwrap();
        let i = c["choices"][0]["index"].as_u64().unwrap() as usize;
        streamed[i].push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(streamed, choices);

    // max_completion_tokens is max_tokens on completions too.
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "To be", "max_completion_tokens": 4, "temperature": 0, "seed": 1}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(4), "{v}");

    // Chat, whole and streamed, agree.
    let chat = json!({"messages": [{"role": "user", "content": "Who is there?"}], "max_tokens": 20, "temperature": 0});
    let (status, whole) = post(port, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap();
    let mut c = chat.clone();
    c["stream"] = json!(true);
    let ev = events(port, "/v1/chat/completions", &c);
    let deltas: Vec<Value> =
        ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(deltas[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String =
        deltas.iter().filter_map(|d| d["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, text);
    assert!(!text.contains("\nUser:"), "the plain template's stop string ends the reply");
}

/// `ln softmax` of every row of `logits` ([rows, vocab]) in f64.
fn log_softmax(logits: &[f32], vocab: usize) -> Vec<Vec<f64>> {
    logits
        .chunks(vocab)
        .map(|r| {
            let m = r.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
            let lse = m + r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            r.iter().map(|&x| x as f64 - lse).collect()
        })
        .collect()
}

/// The logits `attnres forward` gives for one sequence of ids, `[ids, vocab]`.
fn forward_logits(env: &RunEnv, model: &Path, ids: &[u32]) -> Vec<f32> {
    let (batch, out) = (env.path("batch.json"), env.path("out.safetensors"));
    std::fs::write(&batch, json!({ "input_ids": [ids] }).to_string()).unwrap();
    common::ok(&env.run(&[
        "forward",
        "--model",
        model.to_str().unwrap(),
        "--batch",
        batch.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    attnres::model::checkpoint::f32_values("logits", &st.tensor("logits").unwrap()).unwrap()
}

/// The k largest entries of a row, ties to the lower index.
fn top(row: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

/// Log-probabilities as the API defines them, against the model's own logits (`attnres
/// forward`, log-softmax here): the prompt's with `echo` (the first null; `max_tokens: 0`
/// scores the prompt alone; a prompt of token ids gives the same), the completion's of the
/// distribution before temperature, the alternatives in order; offsets into prompt and
/// completion; a stream carries the same; chat's form.
#[test]
fn logprobs_and_echo_are_the_models_own() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let bpe = attnres::text::tokenizer::Bpe::load(&model.join("tokenizer.json")).unwrap();
    let server = Server::start(env, &model, &[]);
    let port = server.port;
    let prompt = "ROMEO: What say you";
    let ids = bpe.encode(prompt).unwrap();
    let close = |got: &Value, want: f64, what: &str| {
        let got = got.as_f64().unwrap_or_else(|| panic!("{what}: {got}"));
        assert!((got - want).abs() < 1e-4, "{what}: {got} vs {want}");
    };

    // The prompt alone, as text and as token ids.
    let body = |p: Value| json!({"prompt": p, "echo": true, "max_tokens": 0, "logprobs": 3});
    let (status, v) = post(port, "/v1/completions", &body(json!(prompt)));
    assert_eq!(status, 200, "{v}");
    let (_, by_ids) = post(port, "/v1/completions", &body(json!([ids.clone()])));
    assert_eq!(by_ids["choices"], v["choices"]);
    let c = &v["choices"][0];
    assert_eq!((c["text"].as_str(), c["finish_reason"].as_str()), (Some(prompt), Some("length")));
    assert_eq!(v["usage"]["completion_tokens"], 0);
    let lp = &c["logprobs"];
    assert_eq!(strings(&lp["tokens"]).concat(), prompt);
    assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null());
    let want = log_softmax(&forward_logits(env, &model, &ids), 400);
    for t in 1..ids.len() {
        let row = &want[t - 1];
        close(&lp["token_logprobs"][t], row[ids[t] as usize], &format!("prompt token {t}"));
        let alts = lp["top_logprobs"][t].as_object().unwrap();
        assert_eq!(alts.len(), 3);
        for i in top(row, 3) {
            let text = bpe.decode(&[i as u32]).unwrap();
            close(&alts[&text], row[i], &format!("alternative {text:?} at {t}"));
        }
    }
    let offsets: Vec<u64> =
        lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    let mut at = 0;
    for (o, t) in offsets.iter().zip(strings(&lp["tokens"])) {
        assert_eq!(*o, at);
        at += t.chars().count() as u64;
    }

    // A sampled completion: the log-probabilities of the distribution before temperature, at
    // the tokens drawn (ids read back from the texts), with offsets after the prompt.
    let body =
        json!({"prompt": prompt, "max_tokens": 6, "logprobs": 2, "temperature": 1.5, "seed": 5});
    let (_, v) = post(port, "/v1/completions", &body);
    let lp = &v["choices"][0]["logprobs"];
    let drawn: Vec<u32> =
        strings(&lp["tokens"]).iter().map(|t| bpe.encode(t).unwrap()[0]).collect();
    assert_eq!(strings(&lp["tokens"]).concat(), v["choices"][0]["text"].as_str().unwrap());
    let all: Vec<u32> = ids.iter().chain(&drawn).copied().collect();
    let want = log_softmax(&forward_logits(env, &model, &all), 400);
    for (j, &tok) in drawn.iter().enumerate() {
        close(
            &lp["token_logprobs"][j],
            want[ids.len() - 1 + j][tok as usize],
            &format!("token {j}"),
        );
    }
    assert_eq!(lp["text_offset"][0].as_u64(), Some(prompt.chars().count() as u64));
    // Streamed: the same entries, spread over the chunks.
    let mut body = body;
    body["stream"] = json!(true);
    let mut streamed = Vec::new();
    for e in events(port, "/v1/completions", &body) {
        if let Ok(c) = serde_json::from_str::<Value>(&e) {
            if let Some(t) = c["choices"][0]["logprobs"]["token_logprobs"].as_array() {
                streamed.extend(t.iter().cloned());
            }
        }
    }
    assert_eq!(Value::from(streamed), lp["token_logprobs"]);

    // Chat: per token, its text, logprob, bytes and alternatives.
    let body = json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (status, v) = post(port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let text: String = content.iter().map(|e| e["token"].as_str().unwrap()).collect();
    // The tokens make the answer (and any part of a stop string that ended it).
    assert!(text.starts_with(v["choices"][0]["message"]["content"].as_str().unwrap()), "{text:?}");
    for e in content {
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2);
        // Greedy: the chosen token is the most likely one.
        close(&e["logprob"], e["top_logprobs"][0]["logprob"].as_f64().unwrap(), "greedy");
        assert_eq!(e["bytes"], json!(e["token"].as_str().unwrap().as_bytes()));
    }
    // Out of range, and top_logprobs without logprobs: refused by name.
    for (path, body, param) in [
        ("/v1/completions", json!({"prompt": "a", "logprobs": 6}), "logprobs"),
        ("/v1/completions", json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
        ("/v1/completions", json!({"prompt": [[400]]}), "prompt"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
    ] {
        let (status, v) = post(port, path, &body);
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
    }
}

/// Logit bias and penalties, against a reference on the model's own logits: greedy decoding
/// re-done here token by token with `attnres forward` and the penalties applied in f64 gives
/// the server's tokens; a bias of +100 forces a token; a penalised request gives the same text
/// alone and among 32 others; out-of-range values are refused by name.
#[test]
fn penalties_and_logit_bias_change_the_logits_as_defined() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let bpe = attnres::text::tokenizer::Bpe::load(&model.join("tokenizer.json")).unwrap();
    let server = Server::start(env, &model, &["--max-batch", "8", "--max-client-requests", "0"]);
    let port = server.port;
    let prompt = "ROMEO: ROMEO";
    let ids = bpe.encode(prompt).unwrap();
    let bias_id = ids[1];
    let (presence, frequency, repetition, bias) = (0.7, 0.4, 1.3, -2.5);
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0,
        "presence_penalty": presence, "frequency_penalty": frequency, "repetition_penalty": repetition,
        "logit_bias": {bias_id.to_string(): bias}});
    let (status, v) = post(port, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let texts = strings(&v["choices"][0]["logprobs"]["tokens"]);
    let mut seq = ids.clone();
    for (j, text) in texts.iter().enumerate() {
        let logits = forward_logits(env, &model, &seq);
        let row = &logits[(seq.len() - 1) * 400..seq.len() * 400];
        let generated = &seq[ids.len()..];
        let adjusted: Vec<f64> = row
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let mut l = l as f64;
                if seq.contains(&(i as u32)) {
                    l = if l > 0.0 { l / repetition } else { l * repetition };
                }
                let c = generated.iter().filter(|&&t| t == i as u32).count() as f64;
                l -= frequency * c + if c > 0.0 { presence } else { 0.0 };
                l + if i as u32 == bias_id { bias } else { 0.0 }
            })
            .collect();
        let want = top(&adjusted, 1)[0] as u32;
        assert_eq!(*text, bpe.decode(&[want]).unwrap(), "token {j}");
        seq.push(want);
    }
    // Without them the greedy text is another (the test can tell).
    let plain = complete(port, &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}));
    assert_ne!(plain, texts.concat());
    // +100 on one token: every token is it.
    let forced = bpe.encode(" the").unwrap()[0];
    let v = complete(
        port,
        &json!({"prompt": prompt, "max_tokens": 5, "temperature": 0.9, "logit_bias": {forced.to_string(): 100}}),
    );
    assert_eq!(v, bpe.decode(&[forced; 5]).unwrap());
    // Alone and among 32 (sampled, so the random streams matter too).
    let mut sampled = body.clone();
    sampled["temperature"] = json!(0.9);
    sampled["seed"] = json!(11);
    let alone = complete(port, &sampled);
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..32)
            .map(|i| {
                let mut b = sampled.clone();
                if i % 2 == 1 {
                    b["seed"] = json!(i);
                }
                s.spawn(move || complete(port, &b))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for t in together.iter().step_by(2) {
        assert_eq!(*t, alone);
    }
    for (body, param) in [
        (json!({"prompt": "a", "presence_penalty": 2.5}), "presence_penalty"),
        (json!({"prompt": "a", "frequency_penalty": -3}), "frequency_penalty"),
        (json!({"prompt": "a", "repetition_penalty": 0}), "repetition_penalty"),
        (json!({"prompt": "a", "logit_bias": {"400": 1}}), "logit_bias"),
        (json!({"prompt": "a", "logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"prompt": "a", "logit_bias": {"3": 101}}), "logit_bias"),
    ] {
        let (status, v) = post(port, "/v1/completions", &body);
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
    }
}

/// A chat with a long system prompt, its second turn, and requests that share only the system
/// prompt, against a server without the prefix cache: the same texts and log-probabilities,
/// while the cached server reports the reused tokens in `usage` and its metrics.
#[test]
fn the_prefix_cache_changes_no_output() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let (off, on) =
        (Server::start(env, &model, &["--prefix-cache", "0"]), Server::start(env, &model, &[]));
    let system = "You are ROMEO. ".repeat(40);
    let ask = |port: u16, turns: &[(&str, &str)]| {
        let messages: Vec<Value> = std::iter::once(json!({"role": "system", "content": system}))
            .chain(turns.iter().map(|(role, text)| json!({"role": role, "content": text})))
            .collect();
        let body = json!({
            "messages": messages, "max_tokens": 12, "temperature": 0.9, "seed": 5,
            "logprobs": true, "top_logprobs": 2,
        });
        let (status, v) = post(port, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        v
    };
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let logprobs = |v: &Value| -> Vec<f64> {
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        content
            .iter()
            .flat_map(|t| {
                let top = t["top_logprobs"].as_array().unwrap().iter().map(|a| &a["logprob"]);
                std::iter::once(&t["logprob"]).chain(top).map(|x| x.as_f64().unwrap())
            })
            .collect()
    };
    let text = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let mut reused = 0;
    for user in ["Who art thou?", "Where is Juliet?", "Who art thou, then?"] {
        let [a, b] = [off.port, on.port].map(|port| ask(port, &[("user", user)]));
        let answer = text(&a);
        assert_eq!(text(&b), answer, "{user}");
        let (la, lb) = (logprobs(&a), logprobs(&b));
        assert_eq!(la.len(), lb.len());
        for (x, y) in la.iter().zip(&lb) {
            assert!((x - y).abs() < 1e-4, "{user}: log-probability {x} vs {y}");
        }
        // The next turn starts with this whole exchange.
        let turns = [("user", user), ("assistant", answer.as_str()), ("user", "Speak again.")];
        let [a, b] = [off.port, on.port].map(|port| ask(port, &turns));
        assert_eq!(text(&a), text(&b), "{user}, second turn");
        assert_eq!(cached(&a), 0);
        assert!(cached(&b) > 0, "the second turn reused nothing");
        reused += cached(&b);
    }
    let (_, metrics) = http(on.port, "GET", "/metrics", "");
    let counted = metrics
        .lines()
        .find_map(|l| l.strip_prefix("attnres_prompt_tokens_cached_total "))
        .and_then(|n| n.parse::<u64>().ok());
    // The first turns of the later requests reused the system prompt as well.
    assert!(counted.is_some_and(|n| n > reused), "{counted:?} cached tokens counted, {reused}");
}

/// `attnres_depth`: each generated token's depth-attention weights equal those of the full
/// forward pass at the position that made it (greedy tokens recomputed from scratch), whole and
/// streamed; asking for them changes no text; a standard model has none to give.
#[test]
fn each_tokens_depth_attention_is_the_models_own() {
    let env = &RunEnv::new(12_000, 2);
    let model = trained(env);
    let server = Server::start(env, &model, &[]);
    let m = attnres::model::checkpoint::load(&model).unwrap();
    let bpe = attnres::text::tokenizer::Bpe::load(&model.join("tokenizer.json")).unwrap();
    let (prompt, n) = ("ROMEO: What say you", 8);
    let body = |depth: bool, stream: bool| json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "attnres_depth": depth, "stream": stream});
    let (status, v) = post(server.port, "/v1/completions", &body(true, false));
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(complete(server.port, &body(false, false)), choice["text"].as_str().unwrap());
    assert!(complete_value(server.port, &body(false, false))["choices"][0]
        .get("attnres_depth")
        .is_none());
    let depth = &choice["attnres_depth"];
    let labels = |k: &str| -> Vec<String> {
        depth[k].as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_string()).collect()
    };
    let (sources, consumers) = (labels("sources"), labels("consumers"));
    assert_eq!(consumers.len(), 2 * m.config.num_hidden_layers + 1);
    assert_eq!((sources[0].as_str(), consumers.last().unwrap().as_str()), ("emb", "out"));
    let maps = depth["tokens"].as_array().unwrap();
    assert_eq!(maps.len(), n);

    // The reference: greedy decoding by recomputation, the depth weights of each whole pass.
    let mut ids = bpe.encode(prompt).unwrap();
    for (t, map) in maps.iter().enumerate() {
        let fwd = m.forward_probed(&ids, 1, ids.len()).unwrap();
        let w = fwd.residual.depth_weights().unwrap().of_row(ids.len() - 1, sources.len());
        for (c, (got, want)) in map.as_array().unwrap().iter().zip(&w).enumerate() {
            let got = got.as_array().unwrap();
            assert_eq!(got.len(), sources.len());
            for (s, (g, w)) in got.iter().zip(want).enumerate() {
                match (g.as_f64(), w) {
                    (Some(g), Some(w)) => assert!(
                        (g - *w as f64).abs() < 2e-4,
                        "token {t}, {} from {}: {g} vs {w}",
                        consumers[c],
                        sources[s]
                    ),
                    (None, None) => {}
                    _ => panic!("token {t}, {} from {}: {g} vs {w:?}", consumers[c], sources[s]),
                }
            }
        }
        let v = m.config.vocab_size;
        ids.push(attnres::infer::generate::argmax(&fwd.logits[(ids.len() - 1) * v..]));
    }
    // Streamed: the same maps, spread over the chunks.
    let streamed: Vec<Value> = events(server.port, "/v1/completions", &body(true, true))
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0].get("attnres_depth").cloned()
        })
        .flat_map(|d| d["tokens"].as_array().unwrap().clone())
        .collect();
    assert_eq!(&streamed, maps);

    // A standard model has no depth attention.
    let standard = common::train_tiny(env, "standard", &["residual=standard", "max_tokens=4096"]);
    let server = Server::start(env, &standard, &[]);
    let (status, v) = post(server.port, "/v1/completions", &body(true, false));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("attnres_depth")), "{v}");
}
