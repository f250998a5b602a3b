//! attnres: a pure-Rust engine for transformer language models with Attention Residuals.
//!
//! - [`kernels`]: forward and backward of every operation, on contiguous f32 slices.
//! - [`model`]: configuration, parameters, the residual connection (standard / full / block),
//!   the transformer and checkpoints.

pub mod kernels;
pub mod model;

#[cfg(test)]
pub(crate) mod testutil;
