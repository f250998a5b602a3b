//! Tokenized corpora cached on disk and memory-mapped, and the batches drawn from them.
//!
//! A corpus is tokenized once per (corpus text, tokenizer) pair into
//! `<cache>/tokens-<key>.bin`, where `<cache>` is `$ATTNRES_CACHE`, else
//! `$XDG_CACHE_HOME/attnres`, else `~/.cache/attnres`, and `<key>` hashes the text of both.
//! Later runs map the file instead of tokenizing again. File layout (little-endian): the magic
//! `ATRTOK01`, then `u64` train and validation token counts, then the `u32` tokens.

use super::data::Split;
use crate::base::fs::{cache_dir, content_key};
use crate::text::tokenizer::Bpe;
use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"ATRTOK01";
const HEADER: usize = 24;

/// The train and validation token streams of a corpus.
pub struct Tokens {
    map: Mmap,
    n_train: usize,
    n_val: usize,
    /// UTF-8 bytes of the validation text, for bits per byte.
    pub val_bytes: usize,
    pub path: PathBuf,
}

impl Tokens {
    /// The content key of these tokens (the cache file's name without extension: a hash of the
    /// corpus split and the tokenizer), the same wherever the cache lives.
    pub fn key(&self) -> String {
        self.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// Maps the cached tokens of `split` under `bpe`, tokenizing and writing the cache first if
    /// it is missing. Returns whether the cache was reused.
    pub fn load_or_build(split: &Split, bpe: &Bpe) -> Result<(Tokens, bool)> {
        let json = bpe.to_json()?;
        let mut parts: Vec<&[u8]> = vec![json.as_bytes(), b"train"];
        parts.extend(split.train.iter().map(|d| d.as_bytes()));
        parts.push(b"val");
        parts.extend(split.val.iter().map(|d| d.as_bytes()));
        let dir = cache_dir();
        let path = dir.join(format!("tokens-{}.bin", content_key(&parts)));
        let val_bytes = split.val.iter().map(|d| d.len()).sum();
        if path.exists() {
            if let Ok(t) = Self::open(&path, val_bytes) {
                return Ok((t, true));
            }
        }
        let train = bpe.encode_documents(&split.train)?;
        let val = bpe.encode_documents(&split.val)?;
        let mut bytes = Vec::with_capacity(HEADER + 4 * (train.len() + val.len()));
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(train.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&(val.len() as u64).to_le_bytes());
        for t in train.iter().chain(&val) {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create the cache directory {}", dir.display()))?;
        crate::base::fs::write_atomic(&path, &bytes)?;
        Ok((Self::open(&path, val_bytes)?, false))
    }

    fn open(path: &Path, val_bytes: usize) -> Result<Tokens> {
        let f =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: cache files are written once (atomically) and never modified in place.
        let map =
            unsafe { Mmap::map(&f) }.with_context(|| format!("cannot map {}", path.display()))?;
        ensure!(
            map.len() >= HEADER && &map[..8] == MAGIC,
            "{} is not a token cache",
            path.display()
        );
        let n_train = u64::from_le_bytes(map[8..16].try_into().unwrap()) as usize;
        let n_val = u64::from_le_bytes(map[16..24].try_into().unwrap()) as usize;
        ensure!(map.len() == HEADER + 4 * (n_train + n_val), "{} is truncated", path.display());
        Ok(Tokens { map, n_train, n_val, val_bytes, path: path.to_path_buf() })
    }

    fn token(&self, i: usize) -> u32 {
        let o = HEADER + 4 * i;
        u32::from_le_bytes(self.map[o..o + 4].try_into().unwrap())
    }

    pub fn train_len(&self) -> usize {
        self.n_train
    }

    pub fn val_len(&self) -> usize {
        self.n_val
    }

    pub fn train(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        range.map(|i| self.token(i)).collect()
    }

    pub fn val(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        range.map(|i| self.token(self.n_train + i)).collect()
    }
}

/// The order in which training windows are visited: the training stream is cut into
/// `windows = (n − 1) / seq` non-overlapping windows of `seq + 1` tokens (inputs and shifted
/// targets), and each epoch visits them in a fresh permutation drawn from ChaCha8 seeded by
/// `(seed, epoch)`. The position is a single counter, so a resumed run continues exactly.
pub struct WindowOrder {
    pub seq: usize,
    pub windows: usize,
    seed: u64,
    epoch: u64,
    perm: Vec<u32>,
}

impl WindowOrder {
    pub fn new(train_tokens: usize, seq: usize, seed: u64) -> Result<WindowOrder> {
        if train_tokens < seq + 1 {
            bail!(
                "the training text is too small: {train_tokens} tokens, but one sequence needs {} (seq_len + 1); \
                 use more text or a smaller seq_len",
                seq + 1
            );
        }
        let windows = (train_tokens - 1) / seq;
        Ok(WindowOrder { seq, windows, seed, epoch: u64::MAX, perm: Vec::new() })
    }

    /// Start of the training window visited at global position `pos`.
    pub fn start(&mut self, pos: u64) -> usize {
        let epoch = pos / self.windows as u64;
        if epoch != self.epoch {
            let mut rng =
                ChaCha8Rng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9E3779B97F4A7C15));
            self.perm = (0..self.windows as u32).collect();
            for i in (1..self.perm.len()).rev() {
                let j = (rng.next_u64() % (i as u64 + 1)) as usize;
                self.perm.swap(i, j);
            }
            self.epoch = epoch;
        }
        self.perm[(pos % self.windows as u64) as usize] as usize * self.seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_order_is_a_permutation_per_epoch_and_reproducible() {
        let mut a = WindowOrder::new(1001, 10, 7).unwrap();
        let first: Vec<usize> = (0..100).map(|p| a.start(p)).collect();
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, (0..100).map(|w| w * 10).collect::<Vec<_>>());
        let second: Vec<usize> = (100..200).map(|p| a.start(p)).collect();
        assert_ne!(first, second, "each epoch reshuffles");
        // A fresh order (as after a resume) gives the same windows at the same positions.
        let mut b = WindowOrder::new(1001, 10, 7).unwrap();
        assert_eq!(b.start(150), second[50]);
        assert!(WindowOrder::new(10, 10, 0).err().unwrap().to_string().contains("too small"));
    }

    #[test]
    fn cache_round_trips_and_is_reused() {
        let tmp = tempfile::tempdir().unwrap();
        std::env::set_var("ATTNRES_CACHE", tmp.path());
        let docs: Vec<String> =
            (0..30).map(|i| format!("document number {i} with some words\n")).collect();
        let bpe = Bpe::train(&docs, 300).unwrap();
        let split = Split { train: docs[..27].to_vec(), val: docs[27..].to_vec() };
        let (t, reused) = Tokens::load_or_build(&split, &bpe).unwrap();
        assert!(!reused);
        assert_eq!(t.train(0..t.train_len()), bpe.encode_documents(&split.train).unwrap());
        assert_eq!(t.val(0..t.val_len()), bpe.encode_documents(&split.val).unwrap());
        let (u, reused) = Tokens::load_or_build(&split, &bpe).unwrap();
        assert!(reused && u.path == t.path);
        // A truncated cache is rebuilt rather than trusted.
        let bytes = std::fs::read(&t.path).unwrap();
        std::fs::write(&t.path, &bytes[..bytes.len() - 2]).unwrap();
        let (v, reused) = Tokens::load_or_build(&split, &bpe).unwrap();
        assert!(!reused && v.train_len() == t.train_len());
    }
}
