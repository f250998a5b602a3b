//! The activations' type, f32 or bfloat16, and what differs between the two: the kernels'
//! names, the type cuBLASLt is told, and the bfloat16 copy of the weights the products take.

use super::buffer::{Arg, Bf16, Buf, Elem};
use super::device::Device;
use anyhow::Result;

/// The type of the activations: f32 (the exact mode) or bfloat16 (mixed precision). Kernels
/// that take either are named `NAME` for f32 and `NAME_bf16` for bfloat16.
pub trait Act: Elem {
    /// The kernels' name suffix.
    const SUFFIX: &'static str;
    /// The type cuBLASLt is told.
    const TYPE: super::blas::DType;
    /// The nearest value of this type (for bfloat16: ties to even, as the kernels round).
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// `x` as values of this type: `x` itself for f32, a copy rounded to bfloat16.
    fn narrow(dev: &Device, x: Buf<f32>) -> Result<Buf<Self>>;
    /// Keeps `copy` the values of `master` in this type, where they differ: for bfloat16 the
    /// weights the matrix products take (made on first use, then overwritten); nothing for f32,
    /// whose products take the master weights themselves ([`Act::weights`]).
    fn refresh(dev: &Device, copy: &mut Option<Buf<Self>>, master: &Buf<f32>) -> Result<()>;
    /// The values of `master` in this type: `master` for f32, `copy` (kept by
    /// [`Act::refresh`]) for bfloat16.
    fn weights<'a>(master: &'a Buf<f32>, copy: &'a Option<Buf<Self>>) -> &'a Buf<Self>;
    /// `copy` as the bfloat16 buffer it is (for bfloat16), for the kernels that write it.
    fn bf16_copy(copy: &mut Option<Buf<Self>>) -> Option<&mut Buf<Bf16>>;
}

impl Act for f32 {
    const SUFFIX: &'static str = "";
    const TYPE: super::blas::DType = super::blas::DType::F32;
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn narrow(_: &Device, x: Buf<f32>) -> Result<Buf<f32>> {
        Ok(x)
    }
    fn refresh(_: &Device, _: &mut Option<Buf<f32>>, _: &Buf<f32>) -> Result<()> {
        Ok(())
    }
    fn weights<'a>(master: &'a Buf<f32>, _: &'a Option<Buf<f32>>) -> &'a Buf<f32> {
        master
    }
    fn bf16_copy(_: &mut Option<Buf<f32>>) -> Option<&mut Buf<Bf16>> {
        None
    }
}

impl Act for Bf16 {
    const SUFFIX: &'static str = "_bf16";
    const TYPE: super::blas::DType = super::blas::DType::Bf16;
    fn from_f32(x: f32) -> Bf16 {
        Bf16(half::bf16::from_f32(x).to_bits())
    }
    fn to_f32(self) -> f32 {
        half::bf16::from_bits(self.0).to_f32()
    }
    fn narrow(dev: &Device, x: Buf<f32>) -> Result<Buf<Bf16>> {
        let mut y = dev.output(x.len())?;
        to_bf16(dev, &mut y, &x)?;
        Ok(y)
    }
    fn refresh(dev: &Device, copy: &mut Option<Buf<Bf16>>, master: &Buf<f32>) -> Result<()> {
        if copy.is_none() {
            *copy = Some(dev.output(master.len())?);
        }
        to_bf16(dev, copy.as_mut().expect("made above"), master)
    }
    fn weights<'a>(_: &'a Buf<f32>, copy: &'a Option<Buf<Bf16>>) -> &'a Buf<Bf16> {
        copy.as_ref().expect("the bf16 weights are kept by Act::refresh before use")
    }
    fn bf16_copy(copy: &mut Option<Buf<Bf16>>) -> Option<&mut Buf<Bf16>> {
        copy.as_mut()
    }
}

/// `y = x` rounded to bfloat16 (`to_bf16` in `kernels/convert.cu`).
fn to_bf16(dev: &Device, y: &mut Buf<Bf16>, x: &Buf<f32>) -> Result<()> {
    let n = x.len();
    assert_eq!(y.len(), n);
    let args = [y.arg_mut(), x.arg(), Arg::i64(n)];
    // SAFETY: the kernel's arguments in its order; two buffers of `n` values.
    unsafe { dev.launch("to_bf16", super::per_value(n), &args) }
}

/// The name of kernel `name` for activations of type `A`.
pub fn kernel<A: Act>(name: &str) -> String {
    format!("{name}{}", A::SUFFIX)
}
