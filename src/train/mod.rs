//! Training: corpora, tokenizers, token caches, optimisers, schedules and the training loop.

pub mod data;
pub mod tokenizer;
pub mod optim;
pub mod tokens;
pub mod run;
