//! The model's parameters as the residual connection and the depth attention read them.

use crate::gpu::act::Act;
use crate::gpu::buffer::Buf;
use crate::model::params::Layout;

/// The f32 master weights, the weights the matrix products take (the masters themselves, or
/// their bf16 copy), and where each tensor lies.
#[derive(Clone, Copy)]
pub struct Params<'a, A: Act> {
    pub params: &'a Buf<f32>,
    pub weights: &'a Buf<A>,
    pub layout: &'a Layout,
}
