//! The command line end to end: init → forward round trip, and clear errors (never a panic)
//! on malformed checkpoints and batches.

use attnres::model::checkpoint::{self, f32_values, safetensors_bytes};
use safetensors::SafeTensors;
use std::path::Path;
use std::process::{Command, Output};

fn attnres(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attnres")).args(args).output().expect("binary runs")
}

fn ok(args: &[&str]) -> String {
    let o = attnres(args);
    assert!(o.status.success(), "attnres {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs a command that must fail with exit code 1 and a one-line `error:` naming `needle`.
/// `attnres forward` on checkpoint `ck` and batch file `batch` fails, naming `needle`.
fn forward_fails(ck: &Path, batch: &Path, out: &Path, needle: &str) {
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let (ck, batch, out) = (path(ck), path(batch), path(out));
    fails(&["forward", "--model", &ck, "--batch", &batch, "--out", &out], needle);
}

fn fails(args: &[&str], needle: &str) {
    let o = attnres(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "attnres {args:?} should fail cleanly, stderr: {err}");
    assert!(
        err.starts_with("error: ") && err.contains(needle),
        "attnres {args:?}: expected {needle:?} in {err:?}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

fn init(dir: &Path, sets: &[&str]) {
    let mut args = vec!["init", "--out", dir.to_str().unwrap(), "--preset", "tiny", "--seed", "3"];
    for s in sets {
        args.extend(["--set", s]);
    }
    ok(&args);
}

#[test]
fn init_then_forward_writes_logits_loss_and_every_gradient() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    init(&ck, &["residual=block", "num_blocks=2", "hidden_size=32", "intermediate_size=64"]);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (cfg["residual"].as_str(), cfg["num_blocks"].as_u64(), cfg["head_dim"].as_u64()),
        (Some("block"), Some(2), Some(8))
    );
    assert_eq!(cfg["model_type"], "attnres");
    let batch = tmp.path().join("b.json");
    std::fs::write(
        &batch,
        r#"{"input_ids": [[1, 2, 3], [4, 5, 6]], "targets": [[2, 3, 4], [5, 6, 7]]}"#,
    )
    .unwrap();
    let out = tmp.path().join("out.safetensors");
    let log = ok(&[
        "forward",
        "--model",
        ck.to_str().unwrap(),
        "--batch",
        batch.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(log.contains("loss"));
    let bytes = std::fs::read(&out).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("logits").unwrap().shape(), &[2, 3, 512]);
    // The written results equal the library's own forward/backward on the same checkpoint.
    let model = checkpoint::load(&ck).unwrap();
    let f = model.forward(&[1, 2, 3, 4, 5, 6], 2, 3).unwrap();
    let (loss, grads) = model.backward(&f, &[2, 3, 4, 5, 6, 7]).unwrap();
    assert_eq!(f32_values("loss", &st.tensor("loss").unwrap()).unwrap(), vec![loss]);
    assert_eq!(f32_values("logits", &st.tensor("logits").unwrap()).unwrap(), f.logits);
    for s in &model.layout.specs {
        let t = st.tensor(&format!("grad.{}", s.name)).unwrap();
        assert_eq!(t.shape(), s.shape.as_slice());
        assert_eq!(f32_values(&s.name, &t).unwrap(), grads[s.range.clone()].to_vec());
    }
    // Without targets only logits are written.
    std::fs::write(&batch, r#"{"input_ids": [[1, 2]]}"#).unwrap();
    ok(&[
        "forward",
        "--model",
        ck.to_str().unwrap(),
        "--batch",
        batch.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(SafeTensors::deserialize(&bytes).unwrap().names(), vec!["logits"]);
}

#[test]
fn init_is_deterministic_and_refuses_to_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    init(&a, &[]);
    init(&b, &[]);
    assert_eq!(
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(b.join("model.safetensors")).unwrap()
    );
    fails(
        &["init", "--out", a.to_str().unwrap(), "--preset", "tiny"],
        "already holds a checkpoint",
    );
    ok(&["init", "--out", a.to_str().unwrap(), "--preset", "tiny", "--seed", "4", "--force"]);
    assert_ne!(
        std::fs::read(a.join("model.safetensors")).unwrap(),
        std::fs::read(b.join("model.safetensors")).unwrap()
    );
    // A bare checkpoint has no tokenizer to generate text with.
    fails(&["generate", "--model", a.to_str().unwrap(), "--prompt", "x"], "has no tokenizer.json");
}

#[test]
fn bad_init_arguments_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x");
    let o = out.to_str().unwrap();
    fails(&["init", "--out", o, "--preset", "huge"], "invalid value 'huge' for '--preset");
    fails(&["init", "--out", o, "--set", "num_blocks=3"], "num_blocks = 3");
    fails(&["init", "--out", o, "--set", "hidden_size=0"], "hidden_size");
    fails(&["init", "--out", o, "--set", "colour=blue"], "unknown config key \"colour\"");
    fails(&["init", "--out", o, "--set", "novalue"], "expected key=value");
    fails(
        &["init", "--out", o, "--set", "vocab_size=many"],
        "vocab_size must be a non-negative integer",
    );
    assert!(!out.exists(), "nothing is written on error");
}

/// Rewrites a checkpoint's weights through `edit` on (name, shape, values) triples.
fn rewrite(ck: &Path, edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>)>)) {
    let bytes = std::fs::read(ck.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<(String, Vec<usize>, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n.clone(), t.shape().to_vec(), f32_values(&n, &t).unwrap()))
        .collect();
    edit(&mut ts);
    let refs: Vec<(String, Vec<usize>, &[f32])> =
        ts.iter().map(|(n, s, v)| (n.clone(), s.clone(), v.as_slice())).collect();
    std::fs::write(ck.join("model.safetensors"), safetensors_bytes(&refs, None).unwrap()).unwrap();
}

#[test]
fn malformed_checkpoints_fail_with_the_problem_named() {
    let tmp = tempfile::tempdir().unwrap();
    let batch = tmp.path().join("b.json");
    std::fs::write(&batch, r#"{"input_ids": [[1, 2]]}"#).unwrap();
    let out = tmp.path().join("o.safetensors");
    let run = |ck: &Path, needle: &str| forward_fails(ck, &batch, &out, needle);
    let fresh = |name: &str| {
        let ck = tmp.path().join(name);
        init(&ck, &["residual=full"]);
        ck
    };
    run(&tmp.path().join("nowhere"), "is not a directory");

    let ck = fresh("missing");
    rewrite(&ck, |ts| ts.retain(|(n, _, _)| n != "model.layers.1.mlp_res_proj.weight"));
    run(&ck, "missing tensor(s) for residual = Full: model.layers.1.mlp_res_proj.weight");

    let ck = fresh("extra");
    rewrite(&ck, |ts| ts.push(("model.layers.0.bonus.weight".into(), vec![2], vec![0.0, 1.0])));
    run(&ck, "unexpected tensor(s)");

    let ck = fresh("shape");
    rewrite(&ck, |ts| {
        let t = ts.iter_mut().find(|(n, _, _)| n == "model.norm.weight").unwrap();
        t.1 = vec![8, 8];
    });
    run(&ck, "tensor \"model.norm.weight\" has shape [8, 8], expected [64]");

    let ck = fresh("nan");
    rewrite(&ck, |ts| ts[0].2[5] = f32::NAN);
    run(&ck, "non-finite");

    let ck = fresh("dtype");
    {
        let bytes = std::fs::read(ck.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| {
                if n == "model.norm.weight" {
                    (n, safetensors::Dtype::F64, t.shape().to_vec(), vec![0u8; t.data().len() * 2])
                } else {
                    (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())
                }
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = owned
            .iter()
            .map(|(n, d, s, b)| {
                (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())
            })
            .collect();
        std::fs::write(ck.join("model.safetensors"), safetensors::serialize(views, None).unwrap())
            .unwrap();
    }
    run(&ck, "has dtype F64, expected F32");

    let ck = fresh("truncated");
    let bytes = std::fs::read(ck.join("model.safetensors")).unwrap();
    std::fs::write(ck.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    run(&ck, "not a valid safetensors file");

    let ck = fresh("badjson");
    std::fs::write(ck.join("config.json"), "{\"hidden_size\": ").unwrap();
    run(&ck, "not valid JSON");

    let ck = fresh("impossible");
    let text = std::fs::read_to_string(ck.join("config.json"))
        .unwrap()
        .replace("\"full\"", "\"block\"")
        .replace("\"num_blocks\": 4", "\"num_blocks\": 3");
    std::fs::write(ck.join("config.json"), text).unwrap();
    run(&ck, "num_blocks = 3 must be a positive divisor of the sublayer count");

    let ck = fresh("mismatch");
    let text = std::fs::read_to_string(ck.join("config.json"))
        .unwrap()
        .replace("\"full\"", "\"standard\"");
    std::fs::write(ck.join("config.json"), text).unwrap();
    run(&ck, "unexpected tensor(s) for residual = Standard");
    assert!(!out.exists(), "nothing is written on error");
}

#[test]
fn malformed_batches_fail_with_the_problem_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    init(&ck, &[]);
    let batch = tmp.path().join("b.json");
    let out = tmp.path().join("o.safetensors");
    let case = |json: &str, needle: &str| {
        std::fs::write(&batch, json).unwrap();
        forward_fails(&ck, &batch, &out, needle);
    };
    case("[1, 2]", "not a valid batch file");
    case(r#"{"input_ids": []}"#, "input_ids is empty");
    case(r#"{"input_ids": [[1, 2], [3]]}"#, "input_ids[1] has 1 ids");
    case(r#"{"input_ids": [[1, -2]]}"#, "input_ids[0][1] = -2 is not a valid token id");
    case(
        r#"{"input_ids": [[1, 512]]}"#,
        "token id 512 at position 1 is out of range for vocab_size = 512",
    );
    case(
        r#"{"input_ids": [[1, 2]], "targets": [[1, 2, 3]]}"#,
        "targets are 1 x 3, input_ids are 1 x 2",
    );
    case(r#"{"input_ids": [[1, 2]], "targets": [[1, 999]]}"#, "target id 999");
    case(r#"{"input_ids": [[1, 2]], "labels": [[1, 2]]}"#, "unknown field `labels`");
    let long: Vec<u32> = vec![1; 129];
    case(&format!("{{\"input_ids\": [{:?}]}}", long), "exceeds max_position_embeddings = 128");
    std::fs::write(&batch, r#"{"input_ids": [[1, 2]]}"#).unwrap();
    fails(
        &[
            "forward",
            "--model",
            ck.to_str().unwrap(),
            "--batch",
            batch.to_str().unwrap(),
            "--out",
            "/nonexistent/dir/o.safetensors",
        ],
        "does not exist",
    );
    assert!(!out.exists());
}

#[test]
fn generation_benchmark_reports_every_mode_and_batch() {
    let o = attnres(&[
        "bench",
        "--generate",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--prompt-tokens",
        "8",
        "--new-tokens",
        "3",
        "--batches",
        "1,2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let modes = r["modes"].as_array().unwrap();
    assert_eq!(
        modes.iter().map(|m| m["residual"].as_str().unwrap()).collect::<Vec<_>>(),
        ["standard", "block", "full"]
    );
    // tiny: 4 layers, 4 KV heads of 16, hidden 64, block with 4 blocks of 2 sublayers.
    let bytes: Vec<(u64, u64)> = modes
        .iter()
        .map(|m| {
            (
                m["kv_cache_bytes_per_token"].as_u64().unwrap(),
                m["depth_cache_bytes_per_token"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(bytes, [(2048, 256), (2048, (1 + 4 + 1) * 65 * 4), (2048, (1 + 8) * 65 * 4)]);
    for m in modes {
        let b = m["batches"].as_array().unwrap();
        assert_eq!(b.iter().map(|x| x["batch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2]);
        for x in b {
            assert!(
                x["decode_tokens_per_second"].as_f64().unwrap() > 0.0
                    && x["prefill_tokens_per_second"].as_f64().unwrap() > 0.0
            );
        }
    }
    assert_eq!(modes[0]["batches"][0]["latency_relative_to_standard"].as_f64(), Some(1.0));
    fails(
        &[
            "bench",
            "--generate",
            "--preset",
            "tiny",
            "--prompt-tokens",
            "120",
            "--new-tokens",
            "20",
        ],
        "exceeds max_position_embeddings",
    );
    fails(&["bench", "--generate", "--preset", "tiny", "--batches", "0"], "--batches");
}

/// `plan` prints the transfers of the report's example (P = 4, V = 2, one block per chunk:
/// 28 block transfers without the cache, 22 with it) and refuses shapes it cannot schedule.
#[test]
fn plan_prints_the_reports_example_and_refuses_impossible_shapes() {
    let shape = ["plan", "--pp", "4", "--vpp", "2", "--layers", "8", "--block-layers", "1"];
    let o = attnres(&[&shape[..], &["--micro-batches", "8", "--schedule"]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let row = |cache: &str| {
        let line = out.lines().find(|l| l.trim_start().starts_with(cache)).unwrap();
        line.split_whitespace().map(str::to_string).collect::<Vec<_>>()
    };
    assert_eq!(row("off")[1..4], ["28", "Eq.", "7:"]);
    assert_eq!(row("received")[1], "22");
    assert_eq!(row("received")[4], "22.0");
    assert_eq!(row("on")[1], "18");
    assert_eq!(out.lines().filter(|l| l.starts_with("  rank ")).count(), 4);
    fails(&[&shape[..], &["--micro-batches", "6"]].concat(), "multiple of --pp");
    fails(&["plan", "--pp", "40", "--vpp", "2", "--layers", "8"], "only 16 sublayers");
    fails(&["plan", "--pp", "0"], "--pp must be at least 1");
    fails(&["plan", "--pp", "2", "--pp-cache", "sometimes"], "--pp-cache");
}

/// `device` says what the machine has, GPUs or why there are none, and exits 0 either way; a
/// malformed architecture is a one-line error.
#[test]
fn device_reports_the_machine_and_why_there_is_no_gpu() {
    let o = attnres(&["device"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("threads: "), "{out}");
    assert!(
        lines.iter().any(|l| l.starts_with("GPU 0: ") || l.starts_with("GPUs: none (")),
        "{out}"
    );
    assert!(lines.iter().any(|l| l.starts_with("NVRTC: ")), "{out}");
    fails(&["device", "--compile-for", "hopper"], "write it sm_XY");
}
