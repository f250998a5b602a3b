//! attnres: a pure-Rust engine for transformer language models with Attention Residuals.
//!
//! - [`kernels`]: forward and backward of every operation, on contiguous f32 slices.
//! - [`model`]: configuration, parameters, the residual connection (standard / full / block),
//!   the transformer and checkpoints.
//! - [`presets`]: named configurations embedded from `configs/`.
//! - [`generate`]: sampling and batched text generation with the key/value cache.
//! - [`bench`]: the training-step and generation benchmarks.
//! - [`alloc`]: the allocator the binary uses, which recycles large buffers between steps.

pub mod alloc;
pub mod bench;
pub mod compare;
pub mod diagnostics;
pub mod generate;
pub mod kernels;
pub mod model;
pub mod presets;
pub mod profile;
pub mod report;
pub mod train;
pub mod version;

#[cfg(test)]
pub(crate) mod testutil;
