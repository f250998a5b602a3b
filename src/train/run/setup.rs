//! Setting a run up: the run directory checked and locked, settings, tokenizer, data, model and
//! optimiser loaded (resumed, from a checkpoint with `--init`) or built fresh, and the run
//! announced.

use super::progress::Progress;
use super::{Position, Setup, TrainOptions, Trainer};
use crate::base::fs::write_atomic;
use crate::base::fs::{cache_dir, content_key};
use crate::base::version::CodeVersion;
use crate::model::{checkpoint, Model};
use crate::text::tokenizer::Bpe;
use crate::train::checkpoint::{self as run_dir, TrainState, METRICS};
use crate::train::config::RunConfig;
use crate::train::data::{Corpus, Split};
use crate::train::optim::Optimizer;
use crate::train::parallel;
use crate::train::presets;
use crate::train::tokens::{Tokens, WindowOrder};
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};

impl<'g> Trainer<'g> {
    /// Checks the request against the run directory, loads or builds settings, tokenizer, data,
    /// model and optimiser, and announces the run, which `ranks` ranks will train.
    /// Without `load_state` a resumed run's optimiser state stays in its file (`state_file`).
    pub(super) fn start(
        run: Option<RunConfig>,
        opts: &TrainOptions,
        ranks: usize,
        load_state: bool,
    ) -> Result<Trainer<'g>> {
        let out = &opts.out;
        ensure!(
            !opts.resume || out.is_dir(),
            "{} holds no checkpoint to resume (there is no such directory)",
            out.display()
        );
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        // One writer per run directory, from before anything is read until the process ends.
        let lock = run_dir::lock(out)?;
        run_dir::remove_stale_temporaries(out)?;
        let has_run = run_dir::holds_run(out);
        let (resume, restart_note) = Resume::find(run.as_ref(), opts, has_run)?;

        // Data: as given, else the resumed run's own, else the embedded corpus.
        let data = opts.data.clone().or_else(|| resume.as_ref().and_then(|r| r.state.data.clone()));
        let corpus = match &data {
            Some(p) => Corpus::from_path(p)?,
            None => Corpus::embedded(),
        };
        let split = corpus.split();
        let (run, bpe, model) = match (&resume, &opts.init) {
            (Some(r), _) => resumed_model(r)?,
            (None, Some(dir)) => init_model(run, dir)?,
            (None, None) => fresh_model(run, opts, &split)?,
        };
        let (init, tokenizer_files) = match (&resume, &opts.init) {
            (Some(r), _) => (r.state.init.clone(), run_dir::read_tokenizer_extras(&r.dir)?),
            (None, Some(dir)) => (Some(dir.clone()), run_dir::read_tokenizer_extras(dir)?),
            (None, None) => {
                let config = Bpe::hf_tokenizer_config(run.model.max_position_embeddings);
                (None, vec![("tokenizer_config.json".to_string(), config)])
            }
        };
        let tc = &run.train;
        parallel::check_share(tc, ranks)?;
        let (tokens, reused) = Tokens::load_or_build(&split, &bpe)?;
        let data_key = tokens.key();
        if let Some(r) = &resume {
            check_data_key(&r.state.data_key, &tokens)?;
        }
        ensure!(
            tokens.val_len() >= 2,
            "the validation split is empty: use a corpus with more text"
        );
        let order = WindowOrder::new(tokens.train_len(), tc.seq_len, tc.seed)?;
        if resume.is_none() && has_run {
            // --overwrite, or a run without a checkpoint started again: everything is checked;
            // clear the old run before the new one writes anything.
            run_dir::clear(out)?;
        }

        let mut opt = Optimizer::new(tc.optim.clone(), &model.layout);
        let at = Position::restore(resume.as_ref(), &mut opt, out, load_state)?;
        let state_file =
            resume.as_ref().filter(|_| !load_state).map(|r| r.dir.join("optimizer.safetensors"));

        let total = tc.steps();
        let progress =
            Progress::new(opts.shared_bar.as_ref(), opts.progress, total as u64, at.step as u64);
        if let Some(note) = restart_note {
            progress.say(note);
        }
        let (code_versions, other_version) = code_versions(resume.as_ref());
        if let Some(v) = other_version {
            progress.say(format!(
                "resuming a checkpoint written by {v}; this is attnres {}",
                CodeVersion::current()
            ));
        }
        progress.say(format!(
            "{}: {} ({} documents, {:.1} MB), {} train / {} val tokens{}, vocab {}, {} parameters, residual {}{}",
            if resume.is_some() { format!("resuming at step {}/{total}", at.step) } else { format!("training {total} steps") },
            corpus.name,
            corpus.documents.len(),
            corpus.bytes() as f64 / 1e6,
            tokens.train_len(),
            tokens.val_len(),
            if reused { " (cached)" } else { "" },
            bpe.vocab_size(),
            model.params.len(),
            model.config.residual_label(),
            init.as_ref().map_or(String::new(), |p| format!(", from {}", p.display())),
        ));
        let mut trainer = Trainer::new(Setup {
            run,
            data,
            data_key,
            init,
            bpe,
            tokens,
            order,
            model,
            opt,
            at,
            progress,
            group: None,
        });
        // Rank 0's alone: the run directory.
        trainer.out = out.clone();
        trainer.code_versions = code_versions;
        trainer.tokenizer_files = tokenizer_files;
        trainer._lock = Some(lock);
        trainer.state_file = state_file;
        Ok(trainer)
    }
}

/// A checkpoint to resume from: its directory and state.
struct Resume {
    dir: PathBuf,
    state: TrainState,
}

impl Resume {
    /// The checkpoint to resume with `--resume`; without it, none, and an earlier run in the
    /// directory is refused unless `--overwrite` was given. Settings given with `--resume` must
    /// equal the run's own; a run without a checkpoint then starts again from step 0 (none: a
    /// note for the log says so).
    fn find(
        settings: Option<&RunConfig>,
        opts: &TrainOptions,
        has_run: bool,
    ) -> Result<(Option<Resume>, Option<String>)> {
        let out = &opts.out;
        if !opts.resume {
            ensure!(!has_run || opts.overwrite, "{} already holds a training run; pass --resume to continue it or --overwrite to start over", out.display());
            return Ok((None, None));
        }
        let dir = match (run_dir::checkpoint_dir(out), settings) {
            (Ok(dir), _) => dir,
            (Err(_), Some(_)) => {
                let note = format!(
                    "{} holds no checkpoint (the run stopped before it saved one): starting it again from step 0",
                    out.display()
                );
                return Ok((None, Some(note)));
            }
            // Nothing of the run was saved, its settings included: only its command can say them.
            (Err(_), None) if !has_run => bail!(
                "{} holds no checkpoint: the run stopped before saving one, so its settings are unknown; repeat the command that started it (with or without --resume)",
                out.display()
            ),
            (Err(e), None) => return Err(e),
        };
        let mut state = run_dir::read_state(&dir)?;
        if let Some(init) = &opts.init {
            ensure!(
                state.init.as_deref() == Some(init.as_path()),
                "{} was not started from {} (--init): it started from {}; resume it with its own command",
                out.display(),
                init.display(),
                state.init.as_ref().map_or("a fresh model".to_string(), |p| p.display().to_string())
            );
        }
        if let Some(want) = settings {
            if let Some((key, have, asked)) = state.run.first_difference(want)? {
                bail!(
                    "{} was trained with other settings ({key}: {have} there, {asked} asked); resume it with its own settings (drop --preset/--config/--set), or start over with --overwrite",
                    out.display()
                );
            }
            // A run may go on with or without recomputation: the same bits either way.
            state.run.train.recompute = want.train.recompute;
        }
        Ok((Some(Resume { dir, state }), None))
    }
}

impl Position {
    /// Where a resumed run stopped (its optimiser state restored into `opt`, metrics after its
    /// checkpoint dropped), or the start of a new run in a new directory. Without `load`, only
    /// the state's step is restored (and its file checked): a pipeline's rank 0 reads the rest
    /// as it hands it out ([`Trainer::state_file`]).
    fn restore(
        resume: Option<&Resume>,
        opt: &mut Optimizer,
        out: &Path,
        load: bool,
    ) -> Result<Position> {
        let Some(r) = resume else {
            return Ok(Position {
                step: 0,
                tokens_seen: 0,
                windows_seen: 0,
                train_seconds: 0.0,
                earlier_seconds: 0.0,
            });
        };
        let path = r.dir.join("optimizer.safetensors");
        if load {
            run_dir::load_optimizer(opt, &path)?;
        } else {
            opt.step = run_dir::StateFile::open(&path, opt.m.len())?.step();
        }
        let s = &r.state;
        ensure!(
            opt.step as usize == s.step,
            "the checkpoint's optimizer state is from step {}, its train_state from step {}",
            opt.step,
            s.step
        );
        run_dir::truncate_metrics(&out.join(METRICS), s.step)?;
        Ok(Position {
            step: s.step,
            tokens_seen: s.tokens_seen,
            windows_seen: s.windows_seen,
            train_seconds: s.train_seconds,
            earlier_seconds: s.elapsed_seconds,
        })
    }
}

/// The versions of the code that trained the run so far, this one last, and the version that
/// wrote the checkpoint being resumed, when it is another one.
fn code_versions(resume: Option<&Resume>) -> (Vec<CodeVersion>, Option<String>) {
    let current = CodeVersion::current();
    let mut versions = resume.map(|r| r.state.code_versions.clone()).unwrap_or_default();
    let other = match (resume, versions.last()) {
        (None, _) => None,
        (Some(_), None) => Some("a version of attnres that did not record itself".to_string()),
        (Some(_), Some(v)) => (*v != current).then(|| format!("attnres {v}")),
    };
    if versions.last() != Some(&current) {
        versions.push(current);
    }
    (versions, other)
}

/// Refuses to resume on other data than the run's. Keys written before they were taken from
/// the content named the token cache's path: those match only at that same path.
fn check_data_key(saved: &str, tokens: &Tokens) -> Result<()> {
    if saved == tokens.key() {
        return Ok(());
    }
    let by_path = content_key(&[tokens.path.to_string_lossy().as_bytes()]);
    if saved == by_path {
        return Ok(());
    }
    if !saved.starts_with("tokens-") {
        bail!(
            "the run being resumed identified its data by the path of its token cache file (an older attnres) and the cache is now {}; resume with the token cache it was trained with (ATTNRES_CACHE), or check that the training data (or tokenizer) is the same",
            tokens.path.display()
        );
    }
    bail!("the training data (or tokenizer) differs from the run being resumed")
}

/// Settings, tokenizer and model of the checkpoint being resumed.
fn resumed_model(r: &Resume) -> Result<(RunConfig, Bpe, Model)> {
    let bpe = Bpe::load(&r.dir.join("tokenizer.json"))?;
    let model = checkpoint::load(&r.dir).context("cannot load the checkpoint's model")?;
    ensure!(
        model.config == r.state.run.model,
        "the checkpoint's config.json does not match its train_state.json"
    );
    Ok((r.state.run.clone(), bpe, model))
}

/// What the command line says of a run's settings: a TOML file or a named preset, `--set`
/// overrides, a checkpoint to start from, and whether the run resumes.
pub struct Settings<'a> {
    pub config: Option<&'a Path>,
    pub preset: Option<&'a str>,
    pub sets: &'a [String],
    pub init: Option<&'a Path>,
    pub resume: bool,
}

/// A run's settings from the command line. With `resume` and no settings given, none: the run
/// continues with its own; settings given with `resume` must equal the run's (the training
/// loop names the first difference).
pub fn settings(s: &Settings) -> Result<Option<RunConfig>> {
    let given = !s.sets.is_empty() || s.config.is_some() || s.preset.is_some() || s.init.is_some();
    if s.resume && !given {
        return Ok(None);
    }
    let base = match s.config {
        Some(p) => {
            let text = crate::base::fs::read_utf8(p)?;
            if s.init.is_some() {
                let doc = crate::train::config::parse_toml(&text, &p.display().to_string())?;
                ensure!(!doc.contains_key("model"), "{}: a [model] table does not go with --init (the model's settings are its checkpoint's config.json)", p.display());
            }
            RunConfig::from_toml(&text, &p.display().to_string())?
        }
        None => presets::run_config(s.preset.unwrap_or(presets::DEFAULT_PRESET))?,
    };
    Ok(Some(match s.init {
        Some(dir) => init_settings(dir, &base, s.sets)?,
        None => base.with_overrides(s.sets)?,
    }))
}

/// The settings of a run that starts from the checkpoint in `dir` (`train --init`): the model's
/// are its `config.json`; the training settings are `base`'s with `sets` laid over. A model
/// setting in `sets` is an error: the weights fix the model.
pub fn init_settings(dir: &Path, base: &RunConfig, sets: &[String]) -> Result<RunConfig> {
    ensure!(dir.is_dir(), "--init {} is not a checkpoint directory", dir.display());
    let path = dir.join(checkpoint::CONFIG_FILE);
    // Checked before the run directory is touched.
    for f in [checkpoint::CONFIG_FILE, checkpoint::WEIGHTS_FILE] {
        ensure!(dir.join(f).exists(), "--init {} holds no {f}", dir.display());
    }
    ensure!(
        dir.join("tokenizer.json").exists(),
        "--init {} has no tokenizer.json: a run continues with its model's own tokenizer (an import or a training run has one)",
        dir.display()
    );
    let model = crate::model::Config::from_json(&crate::base::fs::read_utf8(&path)?)
        .with_context(|| format!("in {}", path.display()))?;
    let model_keys = model.keys();
    for s in sets {
        let k = s.split_once('=').map_or(s.as_str(), |(k, _)| k).trim();
        ensure!(
            !model_keys.iter().any(|m| m == k),
            "--set {k}: with --init the model's settings are those of {} (to change the residual connection, convert it: attnres convert)",
            path.display()
        );
    }
    RunConfig { model, train: base.train.clone() }.with_overrides(sets)
}

/// A run from the checkpoint in `dir`: its tokenizer (with the end-of-text token its
/// `tokenizer_config.json` names) and its weights, which must be those `run` describes.
fn init_model(run: Option<RunConfig>, dir: &Path) -> Result<(RunConfig, Bpe, Model)> {
    let run = run.context("no settings given")?;
    let bpe = Bpe::load(&dir.join("tokenizer.json"))?;
    let model = checkpoint::load(dir)
        .with_context(|| format!("--init {}: cannot load the model", dir.display()))?;
    ensure!(
        !model.is_quantized(),
        "--init {}: the model is quantised, and training needs f32 weights: start from its f32 original (for a GGUF file: attnres import --dtype f32)",
        dir.display()
    );
    ensure!(
        model.config == run.model,
        "--init {}: config.json changed while the run was set up",
        dir.display()
    );
    ensure!(
        bpe.vocab_size() <= model.config.vocab_size,
        "--init {}: tokenizer.json has {} tokens, the model only {}",
        dir.display(),
        bpe.vocab_size(),
        model.config.vocab_size
    );
    Ok((run, bpe, model))
}

/// A new run: the tokenizer given or trained on the data (its size sets the vocabulary), then a
/// freshly initialised model.
fn fresh_model(
    run: Option<RunConfig>,
    opts: &TrainOptions,
    split: &Split,
) -> Result<(RunConfig, Bpe, Model)> {
    let mut run = run.context("no settings given")?;
    let bpe = match &opts.tokenizer {
        Some(p) => Bpe::load(p)?,
        None => cached_tokenizer(split, run.model.vocab_size)?,
    };
    run.model.vocab_size = bpe.vocab_size();
    run.model.validate()?;
    run.train.validate(&run.model)?;
    let model = Model::init(run.model.clone(), run.train.seed)?;
    Ok((run, bpe, model))
}

/// A tokenizer trained on the training split, cached by (text, vocabulary size).
fn cached_tokenizer(split: &Split, vocab_size: usize) -> Result<Bpe> {
    let mut parts: Vec<&[u8]> = split.train.iter().map(|d| d.as_bytes()).collect();
    let v = vocab_size.to_le_bytes();
    parts.push(&v);
    let path = cache_dir().join(format!("tokenizer-{}.json", content_key(&parts)));
    if let Ok(b) = Bpe::load(&path) {
        return Ok(b);
    }
    let b = Bpe::train(&split.train, vocab_size)?;
    std::fs::create_dir_all(cache_dir())?;
    write_atomic(&path, b.to_json()?.as_bytes())?;
    Ok(b)
}
