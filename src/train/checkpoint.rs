//! A run directory on disk. It holds the latest model as a checkpoint (`config.json`,
//! `model.safetensors`, `tokenizer.json`), `metrics.jsonl` (one JSON object per step) and
//! `ckpt/`, the full state a resume needs: model, tokenizer, optimiser moments, step, data
//! position and the run's settings. `ckpt/` is replaced as a whole: the new state is written to
//! `.ckpt.tmp/`, the old one renamed away, the new one renamed in, so a run killed at any moment
//! resumes from the last complete checkpoint.

use super::config::RunConfig;
use super::optim::Optimizer;
use crate::base::fs::write_atomic;
use crate::base::version::CodeVersion;
use crate::model::checkpoint::{self, f32_values, le_bytes, safetensors_header};
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};

const CKPT: &str = "ckpt";
pub(super) const METRICS: &str = "metrics.jsonl";
/// The lock file a training process holds for as long as it writes the run directory.
pub const LOCK: &str = "train.lock";

/// The resumable state besides model and optimiser moments.
#[derive(Serialize, Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct TrainState {
    pub(super) run: RunConfig,
    /// Optimiser steps completed.
    pub(super) step: usize,
    pub(super) tokens_seen: u64,
    /// Training windows consumed (the data position).
    pub(super) windows_seen: u64,
    pub(super) elapsed_seconds: f64,
    /// Time spent in training steps alone (no validation or checkpoints).
    #[serde(default)]
    pub(super) train_seconds: f64,
    /// Hash of the corpus split and tokenizer, to refuse resuming on other data.
    pub(super) data_key: String,
    /// `--data` of the run (none: the embedded corpus).
    pub(super) data: Option<PathBuf>,
    /// Every version of the code that trained part of the run, oldest first (empty in
    /// checkpoints written before versions were recorded).
    #[serde(default)]
    pub(super) code_versions: Vec<CodeVersion>,
    /// `--init` of the run: the checkpoint it started from (none: a fresh model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) init: Option<PathBuf>,
}

/// The files of a run, in the order [`clear`] removes them: the resumable state first, so
/// that a removal cut short never leaves a checkpoint beside missing files.
const RUN_FILES: [&str; 11] = [
    CKPT,
    ".ckpt.old",
    ".ckpt.tmp",
    METRICS,
    "summary.json",
    "diagnostics.json",
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
];

/// The tokenizer files of an imported model that a run started from it (`--init`) keeps beside
/// its `tokenizer.json`: its end-of-text token and chat template.
/// (The names `attnres import` writes.)
pub const TOKENIZER_EXTRAS: [&str; 2] = ["tokenizer_config.json", "chat_template.jinja"];

/// Whether `out` holds (part of) a training run, or a model that a run would replace.
pub(super) fn holds_run(out: &Path) -> bool {
    RUN_FILES.iter().filter(|f| **f != ".ckpt.tmp").any(|f| out.join(f).exists())
}

/// Takes the run directory's lock (`train.lock`, which then holds this process's id) for as
/// long as the returned file is open; the operating system releases it when the process ends,
/// however it ends. A directory locked by another process is refused, naming the holder.
pub fn lock(out: &Path) -> Result<std::fs::File> {
    use std::io::{Seek, Write};
    let path = out.join(LOCK);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = match holder.trim() {
                "" => "another process".to_string(),
                pid => format!("process {pid}"),
            };
            bail!(
                "{} is in use by {holder}, which holds {}; wait for it to finish or stop it",
                out.display(),
                path.display()
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", path.display()))
        }
    }
    f.set_len(0)?;
    f.rewind()?;
    f.write_all(format!("{}\n", std::process::id()).as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(f)
}

/// Removes the temporary files of writes that a killed process left in the run directory and
/// its checkpoints (`.NAME.tmp-PID`, see [`write_atomic`]); only the lock's holder calls this,
/// so no other process is writing them.
pub(super) fn remove_stale_temporaries(out: &Path) -> Result<()> {
    for dir in [out.to_path_buf(), out.join(CKPT), out.join(".ckpt.old")] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if crate::base::fs::is_temporary(&name) {
                let p = e.path();
                std::fs::remove_file(&p)
                    .with_context(|| format!("cannot remove {}", p.display()))?;
            }
        }
    }
    Ok(())
}

/// The state saved beside a checkpoint's model, checked like user input: unknown keys,
/// ill-typed and invalid settings are errors naming the file and the key.
pub(super) fn read_state(dir: &Path) -> Result<TrainState> {
    let path = dir.join("train_state.json");
    let text = crate::base::fs::read_utf8(&path)?;
    let mut v: Value = serde_json::from_str(&text)
        .with_context(|| format!("the checkpoint's {} is corrupt", path.display()))?;
    let run = v
        .get("run")
        .with_context(|| format!("{}: the run settings (run) are missing", path.display()))?;
    let run = RunConfig::from_saved(run).with_context(|| format!("{}", path.display()))?;
    v["run"] = serde_json::to_value(&run)?;
    let st: TrainState =
        serde_json::from_value(v).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    ensure!(
        st.tokens_seen == st.step as u64 * run.train.batch_tokens as u64,
        "{}: tokens_seen = {} does not match step = {} batches of {} tokens",
        path.display(),
        st.tokens_seen,
        st.step,
        run.train.batch_tokens
    );
    let windows = st.step as u64 * (run.train.batch_tokens / run.train.seq_len) as u64;
    ensure!(
        st.windows_seen == windows,
        "{}: windows_seen = {} does not match step = {} (expected {windows})",
        path.display(),
        st.windows_seen,
        st.step
    );
    for (k, x) in [("elapsed_seconds", st.elapsed_seconds), ("train_seconds", st.train_seconds)] {
        ensure!(
            x.is_finite() && x >= 0.0,
            "{}: {k} must be a finite non-negative number, got {x}",
            path.display()
        );
    }
    Ok(st)
}

/// Removes every file of an earlier run (for `--overwrite`, and before a run without a
/// checkpoint starts again), the resumable state first. Nothing of the new run exists yet.
pub(super) fn clear(out: &Path) -> Result<()> {
    for p in RUN_FILES {
        let p = out.join(p);
        if p.is_dir() {
            std::fs::remove_dir_all(&p)
                .with_context(|| format!("cannot remove {}", p.display()))?;
        } else if p.exists() {
            std::fs::remove_file(&p).with_context(|| format!("cannot remove {}", p.display()))?;
        }
    }
    Ok(())
}

/// The checkpoint directory to resume from (the previous one if a swap was interrupted).
pub(super) fn checkpoint_dir(out: &Path) -> Result<PathBuf> {
    for name in [CKPT, ".ckpt.old"] {
        let d = out.join(name);
        if d.join("train_state.json").exists() {
            return Ok(d);
        }
    }
    bail!(
        "{} holds no checkpoint to resume (no {CKPT}/train_state.json): nothing of it was saved; start it again with --overwrite",
        out.display()
    )
}

/// The optimiser state a checkpoint holds, by name: AdamW's moments and Muon's momentum, each
/// laid out like the whole model's parameters.
pub(super) const STATE_TENSORS: [&str; 3] = ["adam.m", "adam.v", "muon.momentum"];

/// Where [`save`] takes the optimiser state from: its step and the values of its
/// [`STATE_TENSORS`], handed over one at a time as they are written (so that state put together
/// from the stages of a pipeline is whole one tensor at a time).
pub(super) trait StateSource {
    fn step(&self) -> u64;
    /// Values per tensor.
    fn len(&self) -> usize;
    /// The values of tensor `i` of [`STATE_TENSORS`]; asked for in order, each at most once.
    fn tensor(&mut self, i: usize) -> &[f32];
}

impl StateSource for &Optimizer {
    fn step(&self) -> u64 {
        self.step
    }

    fn len(&self) -> usize {
        self.m.len()
    }

    fn tensor(&mut self, i: usize) -> &[f32] {
        [&self.m, &self.v, &self.momentum][i]
    }
}

/// Writes a checkpoint of the run into `ckpt/` (swapped in whole) and the latest model beside it.
/// If writing or swapping fails (a full or read-only disk), `.ckpt.tmp/` is removed, so the disk
/// is not left full and `--resume` continues from the previous checkpoint (`ckpt/`, or
/// `.ckpt.old/` if the swap stopped half way); the error names the path that failed.
pub(super) fn save(
    out: &Path,
    model: &Model,
    bpe: &Bpe,
    tokenizer_files: &[(String, String)],
    state: &mut dyn StateSource,
    st: &TrainState,
) -> Result<()> {
    let tmp = out.join(".ckpt.tmp");
    let (cur, old) = (out.join(CKPT), out.join(".ckpt.old"));
    let remove_dir = |d: &Path| {
        std::fs::remove_dir_all(d).with_context(|| format!("cannot remove {}", d.display()))
    };
    let rename = |from: &Path, to: &Path| {
        std::fs::rename(from, to)
            .with_context(|| format!("cannot rename {} to {}", from.display(), to.display()))
    };
    let tok = bpe.to_json()?;
    let mut write_and_swap = || -> Result<()> {
        if tmp.exists() {
            remove_dir(&tmp)?;
        }
        checkpoint::save(model, &tmp)?;
        write_tokenizer(&tmp, &tok, tokenizer_files)?;
        let meta =
            std::collections::HashMap::from([("step".to_string(), state.step().to_string())]);
        let n = state.len();
        let shapes: Vec<(String, Vec<usize>)> =
            STATE_TENSORS.iter().map(|t| (t.to_string(), vec![n])).collect();
        let header = safetensors_header(&shapes, Some(meta))?;
        crate::base::fs::write_atomic_with(&tmp.join("optimizer.safetensors"), |w| {
            w.write_all(&header)?;
            (0..STATE_TENSORS.len()).try_for_each(|i| w.write_all(&le_bytes(state.tensor(i))))
        })?;
        write_atomic(&tmp.join("train_state.json"), serde_json::to_string_pretty(st)?.as_bytes())?;
        // Without `ckpt/`, `.ckpt.old/` is the last complete checkpoint: kept until the new
        // one is in place.
        if cur.exists() {
            if old.exists() {
                remove_dir(&old)?;
            }
            rename(&cur, &old)?;
        }
        rename(&tmp, &cur)
    };
    if let Err(e) = write_and_swap() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("cannot save the checkpoint {}", cur.display())));
    }
    if old.exists() {
        remove_dir(&old)?;
    }
    // The latest model, loadable as a plain checkpoint directory.
    checkpoint::save(model, out)?;
    write_tokenizer(out, &tok, tokenizer_files)
}

/// `tokenizer.json` and the files kept beside it (name, text).
fn write_tokenizer(dir: &Path, tok: &str, extras: &[(String, String)]) -> Result<()> {
    for (name, text) in extras {
        write_atomic(&dir.join(name), text.as_bytes())?;
    }
    write_atomic(&dir.join("tokenizer.json"), tok.as_bytes())
}

/// The [`TOKENIZER_EXTRAS`] that `dir` holds (name, text).
pub(super) fn read_tokenizer_extras(dir: &Path) -> Result<Vec<(String, String)>> {
    let mut found = Vec::new();
    for name in TOKENIZER_EXTRAS {
        let p = dir.join(name);
        if p.exists() {
            found.push((name.to_string(), crate::base::fs::read_utf8(&p)?));
        }
    }
    Ok(found)
}

/// Restores the optimiser's step and moments.
pub(super) fn load_optimizer(opt: &mut Optimizer, path: &Path) -> Result<()> {
    let bytes = crate::base::fs::read_bytes(path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{} is corrupt: {e}", path.display()))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
    opt.step = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("step"))
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{} has no step", path.display()))?;
    for (name, buf) in STATE_TENSORS.into_iter().zip([&mut opt.m, &mut opt.v, &mut opt.momentum]) {
        let t = st.tensor(name).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let vals = f32_values(name, &t)?;
        ensure!(
            vals.len() == buf.len(),
            "{}: {name} has {} values, the model needs {}",
            path.display(),
            vals.len(),
            buf.len()
        );
        buf.copy_from_slice(&vals);
    }
    Ok(())
}

/// A checkpoint's optimiser state read one tensor at a time, so that a whole tensor is the most
/// it holds: a pipeline's rank 0 hands every stage its part of one before it reads the next.
/// The file is checked as [`load_optimizer`] checks it: every error names it.
pub(super) struct StateFile {
    path: PathBuf,
    file: std::fs::File,
    step: u64,
    /// Where each of [`STATE_TENSORS`] starts, in bytes from the start of the file.
    starts: Vec<u64>,
    /// Values per tensor.
    len: usize,
}

impl StateFile {
    /// Opens `path`, whose tensors must hold `len` values each (the model's parameters).
    pub(super) fn open(path: &Path, len: usize) -> Result<StateFile> {
        use std::io::Read;
        let corrupt = |why: String| anyhow::anyhow!("{} is corrupt: {why}", path.display());
        let mut file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let size =
            file.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(|e| corrupt(format!("its header: {e}")))?;
        let n = u64::from_le_bytes(n);
        // The safetensors crate's own bound on a header (100 MB), and the file's size.
        ensure!(
            n <= 100_000_000 && 8 + n <= size,
            "{} is corrupt: a header of {n} bytes in a file of {size}",
            path.display()
        );
        let mut head = vec![0u8; n as usize];
        file.read_exact(&mut head).map_err(|e| corrupt(format!("its header: {e}")))?;
        let head: Value =
            serde_json::from_slice(&head).map_err(|e| corrupt(format!("its header: {e}")))?;
        let step = head["__metadata__"]["step"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("{} has no step", path.display()))?;
        let mut starts = Vec::new();
        for name in STATE_TENSORS {
            let t = &head[name];
            let offsets: Vec<u64> = t["data_offsets"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            ensure!(
                t["dtype"] == "F32" && offsets.len() == 2,
                "{}: {name} is missing or not an f32 tensor",
                path.display()
            );
            let (a, b) = (offsets[0], offsets[1]);
            ensure!(
                a <= b && 8 + n + b <= size,
                "{} is corrupt: {name} lies outside the file",
                path.display()
            );
            ensure!(
                (b - a) as usize == 4 * len,
                "{}: {name} has {} values, the model needs {len}",
                path.display(),
                (b - a) / 4
            );
            starts.push(8 + n + a);
        }
        Ok(StateFile { path: path.to_path_buf(), file, step, starts, len })
    }

    pub(super) fn step(&self) -> u64 {
        self.step
    }

    /// The values of tensor `i` of [`STATE_TENSORS`].
    pub(super) fn read(&mut self, i: usize) -> Result<Vec<f32>> {
        use std::io::{Read, Seek, SeekFrom};
        let failed = |e: std::io::Error| {
            anyhow::anyhow!("cannot read {} from {}: {e}", STATE_TENSORS[i], self.path.display())
        };
        self.file.seek(SeekFrom::Start(self.starts[i])).map_err(failed)?;
        let mut values = Vec::with_capacity(self.len);
        // A piece at a time: no second copy of the tensor as bytes.
        let mut piece = vec![0u8; 1 << 20];
        while values.len() < self.len {
            let bytes = (4 * (self.len - values.len())).min(piece.len());
            self.file.read_exact(&mut piece[..bytes]).map_err(failed)?;
            values.extend(
                piece[..bytes]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        Ok(values)
    }
}

/// Drops metric lines after `step` (written after the checkpoint the run resumes from).
pub(super) fn truncate_metrics(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    write_atomic(path, kept.as_bytes())
}
