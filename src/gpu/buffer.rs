//! Buffers on a device and what they hold: the element types (f32, bfloat16, indices), the
//! bytes a device's buffers hold, kernel arguments, and slices of a buffer (a tensor inside
//! the parameters' buffer).

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What a buffer may hold.
pub trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + 'static {
    /// What the emulator fills an [`Device::output`](super::device::Device::output) buffer with, so that a kernel that reads
    /// a value before it is written shows it: NaN, or the most negative integer.
    const POISON: Self;
}
impl Elem for f32 {
    const POISON: f32 = f32::NAN;
}
impl Elem for u32 {
    const POISON: u32 = u32::MAX;
}
impl Elem for i32 {
    const POISON: i32 = i32::MIN;
}
impl Elem for i64 {
    const POISON: i64 = i64::MIN;
}
impl Elem for f64 {
    const POISON: f64 = f64::NAN;
}
impl Elem for Bf16 {
    const POISON: Bf16 = Bf16(0x7fc1);
}

/// A bfloat16 value as the kernels store it (`bf16` in `reduce.cuh`): the upper half of an
/// f32's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

// SAFETY: a plain 16-bit value, passed and stored as the kernels' `bf16` is.
unsafe impl DeviceRepr for Bf16 {}
// SAFETY: all zero bits are bfloat16's +0.
unsafe impl ValidAsZeroBits for Bf16 {}

/// Values in the device's memory (in host memory where the kernels are emulated).
pub struct Buf<T: Elem> {
    pub(super) mem: Mem<T>,
    /// The device's count of bytes held, which this buffer leaves when dropped.
    meter: Arc<Meter>,
}

impl<T: Elem> Drop for Buf<T> {
    fn drop(&mut self) {
        self.meter.live.fetch_sub(self.len() * size_of::<T>(), Ordering::Relaxed);
    }
}

/// Where a buffer's values are.
pub(super) enum Mem<T: Elem> {
    Cuda(CudaSlice<T>),
    #[cfg(test)]
    Host(Vec<T>),
}

/// Bytes the buffers of a device hold: now, and the most since the last [`Meter::reset_peak`].
#[derive(Default)]
pub struct Meter {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl Meter {
    /// `mem` as a buffer counted in these bytes until it is dropped.
    pub(super) fn hold<T: Elem>(self: &Arc<Meter>, mem: Mem<T>) -> Buf<T> {
        let buf = Buf { mem, meter: self.clone() };
        let bytes = buf.len() * size_of::<T>();
        let live = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(live, Ordering::Relaxed);
        buf
    }

    /// Bytes held now, and the most held since the last [`Self::reset_peak`].
    pub(super) fn now_and_peak(&self) -> (usize, usize) {
        (self.live.load(Ordering::Relaxed), self.peak.load(Ordering::Relaxed))
    }

    /// Starts the peak again from what is held now.
    pub(super) fn reset_peak(&self) {
        self.peak.store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// One kernel argument: a scalar's bits, or the address of a buffer's value. Kernels read as
/// many bytes as their parameter's type holds (little-endian).
#[derive(Clone, Copy, Debug)]
pub struct Arg(u64);

impl Arg {
    pub fn i32(v: i32) -> Arg {
        Arg(v as u32 as u64)
    }
    /// A count or index as the kernels' `long long`.
    pub fn i64(v: usize) -> Arg {
        Arg(v as u64)
    }
    pub fn f32(v: f32) -> Arg {
        Arg(v.to_bits() as u64)
    }
    pub fn f64(v: f64) -> Arg {
        Arg(v.to_bits())
    }
    /// A null pointer, for an optional buffer the kernel checks.
    pub fn null() -> Arg {
        Arg(0)
    }
    /// The value as the kernel reads it: an address, or a scalar's bits.
    pub fn bits(self) -> u64 {
        self.0
    }
}

impl<T: Elem> Buf<T> {
    pub fn len(&self) -> usize {
        match &self.mem {
            Mem::Cuda(s) => s.len(),
            #[cfg(test)]
            Mem::Host(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer as a kernel argument that the kernel reads.
    pub fn arg(&self) -> Arg {
        self.arg_at(0)
    }

    /// The buffer as a kernel argument that the kernel writes.
    pub fn arg_mut(&mut self) -> Arg {
        self.arg_mut_at(0)
    }

    /// Value `at` onward as a kernel argument that the kernel reads.
    pub fn arg_at(&self, at: usize) -> Arg {
        assert!(at <= self.len(), "offset {at} past a buffer of {}", self.len());
        let base = match &self.mem {
            Mem::Cuda(s) => s.device_ptr(s.stream()).0,
            #[cfg(test)]
            Mem::Host(v) => v.as_ptr() as u64,
        };
        Arg(base + (at * size_of::<T>()) as u64)
    }

    /// Value `at` onward as a kernel argument that the kernel writes.
    pub fn arg_mut_at(&mut self, at: usize) -> Arg {
        assert!(at <= self.len(), "offset {at} past a buffer of {}", self.len());
        let base = match &mut self.mem {
            Mem::Cuda(s) => s.device_ptr(s.stream()).0,
            #[cfg(test)]
            Mem::Host(v) => v.as_mut_ptr() as u64,
        };
        Arg(base + (at * size_of::<T>()) as u64)
    }
}

/// Values `at..at + len` of a buffer, which a kernel reads: a tensor of the model's parameters.
#[derive(Clone, Copy)]
pub struct Slice<'a, T: Elem> {
    buf: &'a Buf<T>,
    at: usize,
    len: usize,
}

/// Values of a buffer that a kernel writes: a tensor's gradient.
pub struct SliceMut<'a, T: Elem> {
    buf: &'a mut Buf<T>,
    at: usize,
    len: usize,
}

impl<T: Elem> Buf<T> {
    pub fn slice(&self, r: Range<usize>) -> Slice<'_, T> {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "{r:?} outside a buffer of {}",
            self.len()
        );
        Slice { buf: self, at: r.start, len: r.len() }
    }

    pub fn slice_mut(&mut self, r: Range<usize>) -> SliceMut<'_, T> {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "{r:?} outside a buffer of {}",
            self.len()
        );
        SliceMut { buf: self, at: r.start, len: r.len() }
    }

    /// The whole buffer as a slice.
    pub fn all(&self) -> Slice<'_, T> {
        self.slice(0..self.len())
    }

    pub fn all_mut(&mut self) -> SliceMut<'_, T> {
        let n = self.len();
        self.slice_mut(0..n)
    }
}

impl<T: Elem> Slice<'_, T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn arg(&self) -> Arg {
        self.buf.arg_at(self.at)
    }
}

impl<T: Elem> SliceMut<'_, T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn arg_mut(&mut self) -> Arg {
        self.buf.arg_mut_at(self.at)
    }
}
