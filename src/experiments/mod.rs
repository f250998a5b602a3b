//! Experiments on the residual modes: what a comparison trains ([`suite`]), training it over
//! seeds ([`compare`]) and its report ([`report`]); speed and memory benchmarks ([`bench`]).

pub mod bench;
pub mod compare;
pub mod report;
pub mod suite;
