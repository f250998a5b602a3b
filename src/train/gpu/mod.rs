//! Training on an NVIDIA GPU: the transformer's forward and backward ([`model`]), the
//! optimiser's state and update ([`optim`]) and whole steps ([`trainer`]) on the device,
//! through the kernels of [`crate::gpu`]. The CPU engine is their oracle in every test.

mod ablation;
pub mod model;
pub mod optim;
mod params;
pub mod residual;
pub mod trainer;
