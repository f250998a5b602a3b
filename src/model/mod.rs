//! The model: configuration, parameters, the residual connection, the transformer, decoding,
//! checkpoints, and diagnostics of what a model does with its depth.

pub mod checkpoint;
pub mod chunk;
pub mod config;
pub mod decode;
pub mod diagnostics;
pub mod evaluate;
pub mod params;
pub mod quantize;
pub mod residual;
pub mod transformer;

pub use config::{Config, ResidualKind};
pub use transformer::{Forward, Model};
