//! Running a trained model: text generation ([`generate`]), measuring it on a text ([`eval`]),
//! one batch with its gradients ([`forward`]), and the OpenAI-compatible server ([`serve`]).

pub mod eval;
pub mod forward;
pub mod generate;
pub mod serve;
