//! Text in and out of a model: the byte-level BPE tokenizer ([`tokenizer`]) and an imported
//! model's chat template ([`chat`]).

pub mod chat;
pub mod tokenizer;
