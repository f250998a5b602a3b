//! Training: corpora, tokenizers, token caches, settings, optimisers, schedules and the
//! training loop.
//!
//! - [`data`]: text corpora and the train/validation split.
//! - [`tokenizer`], [`tokens`]: the byte-level BPE and the cached token stream.
//! - [`config`]: a run's settings.
//! - [`optim`]: AdamW, Muon and the learning-rate schedule.
//! - [`run`]: the training loop; [`checkpoint`]: the run directory it writes;
//!   [`progress`]: its output; [`validation`]: its loss measurements.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod optim;
pub mod progress;
pub mod run;
pub mod tokenizer;
pub mod tokens;
pub mod validation;
