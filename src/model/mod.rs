//! The model: configuration, parameters, the residual connection and the transformer.

pub mod checkpoint;
pub mod chunk;
pub mod config;
pub mod decode;
pub mod params;
pub mod residual;
pub mod transformer;

pub use config::{Config, ResidualKind};
pub use transformer::{Forward, Model};
