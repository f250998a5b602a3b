//! attnres: a pure-Rust engine for transformer language models with Attention Residuals.

pub mod kernels;

#[cfg(test)]
pub(crate) mod testutil;
