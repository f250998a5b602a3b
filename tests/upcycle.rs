//! `attnres convert` and `attnres train --init` through the binary: a converted model computes
//! its source's logits (to f32 rounding with eps at 0, within the derived bound at a real eps),
//! starts its depth parameters where the method says (pseudo-queries 0, key-norm gains 1, so the
//! queries can learn), a run from a checkpoint starts at `eval`'s loss of it and resumes like any
//! run, and bad input is refused with one named error line and nothing written. The real-model
//! measurement is scripts/reference/check_upcycle.py (docs/import.md, "Upcycling").

mod common;

use attnres::model::{checkpoint, Model, ResidualKind};
use attnres::text::tokenizer::Bpe;
use attnres::train::data::Corpus;
use common::{leftovers, max_abs, noise, ok, perturbed, tiny, RunEnv};
use std::path::Path;
use std::process::Output;

const IDS: [u32; 6] = [1, 5, 9, 2, 10, 0];
const TARGETS: [u32; 6] = [5, 9, 2, 10, 0, 3];

fn attnres(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_attnres")).args(args).output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A standard model with a stream of the size training starts from (as in tests/model.rs, so
/// that `n²·eps` is a visible fraction of its mean square) at norm eps `eps`.
fn standard(eps: f64) -> Model {
    let mut cfg = tiny(ResidualKind::Standard, 0);
    cfg.rms_norm_eps = eps;
    let mut m = perturbed(cfg);
    let emb = m.layout.embed.clone();
    for (i, p) in m.params[emb].iter_mut().enumerate() {
        *p = 0.05 * noise(i, 7);
    }
    for lp in m.layout.layers.clone() {
        for r in [lp.o_proj, lp.down] {
            m.params[r].iter_mut().for_each(|p| *p *= 0.1);
        }
    }
    m
}

/// Sources consumer `l` reads with blocks of `block` sublayers (`l = L`: the output).
fn sources_read(l: usize, block: usize) -> f64 {
    (1 + l / block + usize::from(!l.is_multiple_of(block))) as f64
}

#[test]
fn a_converted_model_computes_its_sources_logits() {
    let tmp = tempfile::tempdir().unwrap();
    // eps = 1e-30 is eps = 0 in f32 (it vanishes beside any mean square above ~1e-23); the
    // config refuses 0 itself.
    for (eps, label) in [(1e-30, "eps 0"), (1e-6, "eps 1e-6")] {
        let src = standard(eps);
        let dir = tmp.path().join(format!("src-{eps}"));
        checkpoint::save(&src, &dir).unwrap();
        for (name, text) in [
            ("tokenizer.json", "{\"not\": \"parsed\"}"),
            ("tokenizer_config.json", "{}"),
            ("chat_template.jinja", "{{ x }}"),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let fs = src.forward(&IDS, 2, 3).unwrap();
        let scale = max_abs(&fs.logits) as f64;
        // ms of the standard stream at each consumer (its smallest over the tokens).
        let d = src.config.hidden_size;
        let streams: Vec<&[f32]> =
            fs.sublayer_inputs().into_iter().chain([fs.final_input()]).collect();
        let ms: Vec<f64> = streams
            .iter()
            .map(|h| {
                h.chunks(d)
                    .map(|r| r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / d as f64)
                    .fold(f64::MAX, f64::min)
            })
            .collect();
        for (sets, block) in [
            (&["residual=block", "num_blocks=2"][..], 2),
            (&["residual=block", "num_blocks=1"][..], 4),
            (&["residual=full"][..], 1),
        ] {
            let what = format!("{label}, {sets:?}");
            let out = tmp.path().join(format!("out-{eps}-{block}"));
            let mut args = vec!["convert", "--model", s(&dir), "--out", s(&out)];
            for set in sets {
                args.extend(["--set", set]);
            }
            ok(&attnres(&args));
            for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
                let (a, b) = (dir.join(name), out.join(name));
                assert_eq!(std::fs::read(a).unwrap(), std::fs::read(b).unwrap(), "{name}");
            }
            let m = checkpoint::load(&out).unwrap();
            assert_eq!(m.config.block_size(), Some(block));
            // Every weight of the source as it was; the depth parameters as the method starts
            // them (docs/method.md §3): pseudo-queries 0, key-norm gains 1.
            let mut new = 0;
            for spec in &m.layout.specs {
                let got = &m.params[spec.range.clone()];
                match src.layout.spec(&spec.name) {
                    Some(f) => assert_eq!(got, &src.params[f.range.clone()], "{}", spec.name),
                    None if spec.name.ends_with("res_proj.weight") => {
                        assert!(got.iter().all(|x| *x == 0.0), "{what}: {} not 0", spec.name);
                        new += 1;
                    }
                    None => {
                        assert!(spec.name.ends_with("res_norm.weight"), "{}", spec.name);
                        assert!(got.iter().all(|x| *x == 1.0), "{what}: {} not 1", spec.name);
                        new += 1;
                    }
                }
            }
            assert_eq!(new, 2 * (2 * src.config.num_hidden_layers + 1), "{what}");

            let f = m.forward(&IDS, 2, 3).unwrap();
            let gap = f
                .logits
                .iter()
                .zip(&fs.logits)
                .fold(0f64, |a, (x, y)| a.max((*x as f64 - *y as f64).abs()));
            if eps < 1e-20 {
                // Exact arithmetic gives equal logits: what is left is f32 rounding (the mean of
                // n sources against the running sum), ~1e-7 of the largest logit.
                assert!(gap <= 1e-5 * scale, "{what}: logits moved by {gap:.2e} of {scale:.2}");
            } else {
                // RMSNorm(s/n; eps) = RMSNorm(s; n²·eps): norm l's output shrinks by a relative
                // δ_l <= (n_l² - 1)·eps / (2·ms_l); to first order the logits move by at most
                // Σ δ_l of the largest logit.
                let delta: f64 = ms
                    .iter()
                    .enumerate()
                    .map(|(l, ms)| (sources_read(l, block).powi(2) - 1.0) * eps / (2.0 * ms))
                    .sum();
                assert!(gap <= delta * scale, "{what}: {gap:.2e} > bound {:.2e}", delta * scale);
                assert!(gap > 1e-5 * scale, "{what}: eps should show, moved only {gap:.2e}");
            }
            // The queries can learn: every consumer that reads two sources or more has a
            // gradient into its pseudo-query (a key-norm gain of 0 would leave it none).
            let (_, grad) = m.backward(&f, &TARGETS).unwrap();
            for l in 0..=2 * src.config.num_hidden_layers {
                let q = &m.layout.depth_params(l).unwrap().query;
                let g = max_abs(&grad[q.clone()]);
                assert!(
                    sources_read(l, block) < 2.0 || g > 1e-6,
                    "{what}: consumer {l}'s query gets gradient {g}"
                );
            }
        }
    }
}

/// A tokenizer trained on the corpus and a small standard model for it, as a checkpoint
/// directory with an imported model's extra tokenizer files.
fn small_checkpoint(env: &RunEnv, dir: &Path) -> Bpe {
    let corpus = Corpus::from_path(&env.path("corpus.txt")).unwrap();
    let bpe = Bpe::train(&corpus.split().train, 300).unwrap();
    let mut cfg = tiny(ResidualKind::Standard, 0);
    cfg.vocab_size = bpe.vocab_size();
    cfg.hidden_size = 16;
    cfg.intermediate_size = 24;
    cfg.head_dim = 8;
    cfg.max_position_embeddings = 16;
    checkpoint::save(&perturbed(cfg), dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), bpe.to_json().unwrap()).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages }}").unwrap();
    bpe
}

fn init_args(from: &Path, out: &Path, data: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> =
        ["train", "--no-progress", "--init", s(from), "--out", s(out), "--data", s(data)]
            .iter()
            .map(|x| x.to_string())
            .collect();
    for set in [
        "seq_len=8",
        "micro_batch=8",
        "batch_tokens=64",
        "max_tokens=384",
        "eval_every=2",
        "eval_tokens=0",
        "checkpoint_every=2",
        "lr=3e-3",
        "warmup_steps=1",
    ] {
        v.extend(["--set".to_string(), set.to_string()]);
    }
    v.extend(extra.iter().map(|x| x.to_string()));
    v
}

/// `(step, val_loss)` of the lines of a run's metrics.jsonl that have one.
fn val_losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64().unwrap(), v["val_loss"].as_f64()?))
        })
        .collect()
}

#[test]
fn a_run_from_a_checkpoint_starts_at_its_eval_loss_and_resumes() {
    let env = &RunEnv::new(3_000, 2);
    let data = env.path("corpus.txt");
    let src = env.path("src");
    let bpe = small_checkpoint(env, &src);
    let block = env.path("block");
    ok(&env.run(&[
        "convert",
        "--model",
        s(&src),
        "--out",
        s(&block),
        "--set",
        "residual=block",
        "--set",
        "num_blocks=2",
    ]));
    // The validation split as eval reads it: its one document, then the end-of-text token that
    // the training data puts after every document.
    let val = Corpus::from_path(&data).unwrap().split().val;
    assert_eq!(val.len(), 1);
    let text = format!("{}{}", val[0], bpe.decode(&[bpe.eot]).unwrap());
    std::fs::write(env.path("val.txt"), &text).unwrap();
    for (from, name) in [(&src, "standard"), (&block, "block")] {
        let out = env.path(&format!("run-{name}"));
        let log = ok(&env.run(&init_args(from, &out, &data, &[])));
        assert!(log.contains(&format!("from {}", from.display())), "{log}");
        let o = env.run(
            &["eval", "--json", "--seq", "8", "--model", s(from), "--text"]
                .iter()
                .map(|x| x.to_string())
                .chain([env.path("val.txt").display().to_string()])
                .collect::<Vec<_>>(),
        );
        ok(&o);
        let eval: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let losses = val_losses(&out);
        assert_eq!(losses[0].0, 0, "{name}: the first line is the loss before any step");
        // The same windows in the same batches through the same forward pass: equal bits.
        assert_eq!(losses[0].1, eval["loss"].as_f64().unwrap(), "{name}: step 0 vs eval");
        assert!(losses.last().unwrap().1 < losses[0].1, "{name}: training lowers the loss");
        // The run keeps the model's tokenizer files and architecture.
        assert!(
            out.join("chat_template.jinja").exists()
                && out.join("ckpt/chat_template.jinja").exists()
        );
        let trained = checkpoint::load(&out).unwrap();
        assert_eq!(trained.config, checkpoint::load(from).unwrap().config);

        // Killed in step 3 and resumed with the same command: the same losses as the
        // uninterrupted run.
        let killed = env.path(&format!("killed-{name}"));
        let mut c = env.cmd(&init_args(from, &killed, &data, &[]));
        c.env("ATTNRES_TEST_ABORT_AT", "0:3");
        assert!(!c.output().unwrap().status.success());
        ok(&env.run(&init_args(from, &killed, &data, &["--resume"])));
        assert_eq!(val_losses(&killed), losses, "{name}: resumed run differs");
    }
    // Resuming from another checkpoint than the run's, or with another model, is refused.
    let o = env.run(&init_args(&block, &env.path("run-standard"), &data, &["--resume"]));
    fails(&o, "was not started from");
}

fn fails(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "expected a clean failure, got: {err}");
    let line = err.trim_end();
    assert!(!line.contains('\n'), "one line expected: {err}");
    assert!(line.starts_with("error: ") && line.contains(needle), "expected {needle:?} in {err:?}");
}

#[test]
fn bad_conversions_and_inits_are_named_errors_that_write_nothing() {
    let env = &RunEnv::new(3_000, 2);
    let data = env.path("corpus.txt");
    let src = env.path("src");
    small_checkpoint(env, &src);
    let block = env.path("block");
    let convert = |model: &Path, out: &Path, sets: &[&str]| {
        let mut a = vec!["convert".to_string(), "--model".into(), s(model).into()];
        a.extend(["--out".into(), s(out).into()]);
        for set in sets {
            a.extend(["--set".into(), set.to_string()]);
        }
        env.run(&a)
    };
    ok(&convert(&src, &block, &["residual=block", "num_blocks=2"]));
    let out = env.path("out");
    for (model, sets, needle) in [
        (&block, &["residual=full"][..], "already residual = block2"),
        (&src, &["residual=block", "num_blocks=3"], "num_blocks = 3 must be a positive divisor"),
        (&src, &["residual=block"], "needs --set num_blocks=N"),
        (&src, &["residual=full", "num_blocks=2"], "applies to residual = block only"),
        (&src, &["residual=full", "hidden_size=32"], "--set hidden_size: convert changes only"),
        (&src, &["residual=full", "attn_res_window=1"], "--set attn_res_window"),
        (&src, &["residual=full", "rms_norm_eps=0"], "rms_norm_eps must be a positive"),
        (&src, &["residual=sideways"], "residual must be"),
        (&src, &["residual=standard"], "nothing to convert"),
        (&src, &[], "nothing to convert"),
        (&env.path("missing"), &["residual=full"], "missing"),
        (&data, &["residual=full"], "is not a directory"),
    ] {
        fails(&convert(model, &out, sets), needle);
        assert!(!out.exists(), "{needle}: {} was written", out.display());
    }
    // A damaged source: named, nothing written.
    let broken = env.path("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::copy(src.join("config.json"), broken.join("config.json")).unwrap();
    std::fs::write(broken.join("model.safetensors"), b"\x02\0\0\0\0\0\0\0{}").unwrap();
    fails(&convert(&broken, &out, &["residual=full"]), "missing tensor");
    assert!(!out.exists());
    // An occupied --out is kept unless --force.
    fails(&convert(&src, &block, &["residual=full"]), "already exists and is not empty");
    assert_eq!(checkpoint::load(&block).unwrap().config.residual, ResidualKind::Block);
    assert_eq!(leftovers(env.tmp.path()), Vec::<std::path::PathBuf>::new());

    // train --init: the model's settings come from the checkpoint; its files must be there.
    let run = env.path("run");
    let no_tok = env.path("no-tokenizer");
    std::fs::create_dir(&no_tok).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), no_tok.join(f)).unwrap();
    }
    let only_config = env.path("only-config");
    std::fs::create_dir(&only_config).unwrap();
    std::fs::copy(src.join("config.json"), only_config.join("config.json")).unwrap();
    let toml = env.path("model.toml");
    std::fs::write(&toml, "[model]\nhidden_size = 32\n").unwrap();
    for (from, extra, needle) in [
        (
            &src,
            &["--set", "hidden_size=32"][..],
            "--set hidden_size: with --init the model's settings are those of",
        ),
        (&src, &["--set", "residual=full"], "attnres convert"),
        (
            &src,
            &["--set", "seq_len=64"],
            "seq_len = 64 exceeds the model's max_position_embeddings = 16",
        ),
        (&env.path("missing"), &[], "is not a checkpoint directory"),
        (&only_config, &[], "holds no model.safetensors"),
        (&no_tok, &[], "has no tokenizer.json"),
        (&src, &["--config", s(&toml)], "a [model] table does not go with --init"),
        (&src, &["--tokenizer", s(&src.join("tokenizer.json"))], "cannot be used with"),
    ] {
        let o = env.run(&init_args(from, &run, &data, extra));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{needle}: {err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "expected {needle:?}: {err}");
        assert!(!run.exists(), "{needle}: {} was created", run.display());
    }
    // Damaged weights are found once the run directory is locked: it holds nothing else.
    std::fs::copy(src.join("tokenizer.json"), broken.join("tokenizer.json")).unwrap();
    let o = env.run(&init_args(&broken, &run, &data, &[]));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.code() == Some(1) && err.contains("missing tensor"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&run).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["train.lock"]);
}
