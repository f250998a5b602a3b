//! attnres: a pure-Rust engine for transformer language models with Attention Residuals.
//!
//! From the bottom up (each module uses only those above it in this list):
//!
//! - [`profile`], [`alloc`], [`fs`]: phase timers, the binary's allocator (which recycles large
//!   buffers between steps), and files written atomically.
//! - [`kernels`]: forward and backward of every operation, on contiguous f32 slices.
//! - [`comm`]: communication between the ranks of a distributed run (MPI, or threads in tests)
//!   and the gradient sums over them.
//! - [`model`]: configuration, parameters, the residual connection (standard / full / block),
//!   the transformer, decoding with a key/value cache, and checkpoints.
//! - [`diagnostics`]: what a model does with its depth (RMS per sublayer, depth-attention
//!   weights, gradient norms).
//! - [`train`]: corpora, tokenizers, a run's settings, optimisers and the training loop.
//! - [`presets`]: named run settings embedded from `configs/`.
//! - [`suite`]: what a comparison trains: variants, named suites and the plan.
//! - [`report`]: a comparison's report (statistics, figures, HTML) from its runs.
//! - [`compare`]: trains a plan's runs, then writes the report.
//! - [`pipeline`]: pipeline-parallel planning: chunks, the cross-stage cache's transfers and
//!   the interleaved 1F1B schedule.
//! - [`serve`]: the OpenAI-compatible HTTP server and its continuous-batching engine.
//! - [`eval`], [`forward`], [`generate`], [`bench`]: the other commands of the binary: measuring
//!   a model on a text, one batch through a model, text generation, and benchmarks.
//! - [`import`]: Llama checkpoints from GGUF files and Hugging Face directories; [`chat`]: their
//!   chat templates.

pub mod alloc;
pub mod bench;
pub mod chat;
pub mod comm;
pub mod compare;
pub mod diagnostics;
pub mod eval;
pub mod forward;
pub mod fs;
pub mod generate;
pub mod import;
pub mod kernels;
pub mod model;
pub mod pipeline;
pub mod presets;
pub mod profile;
pub mod report;
pub mod serve;
pub mod suite;
pub mod train;
pub mod version;

#[cfg(test)]
pub(crate) mod testutil;
