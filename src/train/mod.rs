//! Training: corpora, token caches, settings, optimisers, schedules, the training loop and
//! training over several ranks.
//!
//! - [`data`]: text corpora and the train/validation split; [`tokens`]: the cached token stream.
//! - [`config`]: a run's settings; [`presets`]: the named settings embedded from `configs/`.
//! - [`optim`]: AdamW, Muon and the learning-rate schedule.
//! - [`run`]: the training loop; [`checkpoint`]: the run directory it writes;
//!   [`validation`]: its loss measurements.
//! - [`parallel`]: data and pipeline parallelism over the ranks of an MPI job.
//! - [`gpu`]: the model, optimiser and steps on an NVIDIA GPU (`train --device cuda`).

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod gpu;
pub mod optim;
pub mod parallel;
pub mod presets;
pub mod run;
pub mod step;
pub mod tokens;
pub mod validation;
