//! attnres: a pure-Rust engine for transformer language models with Attention Residuals.
//!
//! - [`kernels`]: forward and backward of every operation, on contiguous f32 slices.
//! - [`model`]: configuration, parameters, the residual connection (standard / full / block),
//!   the transformer and checkpoints.
//! - [`presets`]: named configurations embedded from `configs/`.
//! - [`bench`]: the training-step benchmark.

pub mod bench;
pub mod kernels;
pub mod model;
pub mod presets;

#[cfg(test)]
pub(crate) mod testutil;
