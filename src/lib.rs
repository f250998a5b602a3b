//! attnres: a pure-Rust engine for transformer language models with Attention Residuals.
//!
//! The modules form layers, from the bottom up; a module uses only modules of the layers below
//! its own, and the modules of one layer do not use each other (`tests/layers.rs` checks both,
//! and that no two files use each other):
//!
//! 1. [`base`]: files written atomically, the binary's allocator, phase timers, the code
//!    version, log lines and progress bars, the machine's memory.
//! 2. [`text`]: tokenizers, chat templates, and text streamed back from tokens.
//! 3. [`kernels`]: forward and backward of every operation, on contiguous f32 slices.
//! 4. [`model`], [`gguf`], [`gpu`], side by side: configuration, parameters, the residual
//!    connection (standard / full / block), the transformer, decoding with a key/value cache,
//!    checkpoints and diagnostics; GGUF files (llama.cpp's format) read and written; NVIDIA GPUs
//!    found, the CUDA kernels compiled and run (docs/gpu.md).
//! 5. [`train`], [`infer`], [`import`], side by side: training (data, settings, optimisers, the
//!    loop, and parallel training over ranks); inference (generation, evaluation, one batch
//!    through a model, and the OpenAI-compatible server); Llama checkpoints from GGUF files and
//!    Hugging Face directories, and upcycling.
//! 6. [`export`], [`experiments`], side by side: standard checkpoints as GGUF files for
//!    llama.cpp; comparisons of residual modes over seeds with their report, and benchmarks.
//!
//! The binary (`src/bin/attnres/`) parses the command line and calls these.

pub mod base;
pub mod text;

pub mod kernels;

pub mod gguf;
pub mod gpu;
pub mod model;

pub mod import;
pub mod infer;
pub mod train;

pub mod experiments;
pub mod export;

#[cfg(test)]
pub(crate) mod testutil;
