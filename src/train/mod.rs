//! Training: corpora, tokenizers, token caches, optimisers, schedules and the training loop.

pub mod data;
pub mod optim;
pub mod run;
pub mod tokenizer;
pub mod tokens;
