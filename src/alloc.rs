//! A global allocator that recycles large buffers.
//!
//! Every training step allocates the same large activation buffers (megabytes each) and frees
//! them again. The system allocator hands such blocks back to the kernel, so each step pays
//! for fresh page faults and TLB shootdowns — about a tenth of a step on the benchmark model.
//! [`Recycling`] keeps up to [`SLOTS`] freed blocks of at least [`MIN_BYTES`] and returns one
//! of exactly the same size and alignment on the next request. Small allocations go straight
//! to the system allocator. The binary installs it with `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;

/// Blocks smaller than this are not recycled.
pub const MIN_BYTES: usize = 1 << 20;
/// Freed blocks kept at most; beyond that the oldest is released.
pub const SLOTS: usize = 512;

struct Free {
    /// `(size, align, address)`; a fixed array, since the allocator itself must not allocate.
    blocks: [(usize, usize, usize); SLOTS],
    len: usize,
}

static FREE: Mutex<Free> = Mutex::new(Free { blocks: [(0, 0, 0); SLOTS], len: 0 });

pub struct Recycling;

impl Recycling {
    /// A kept block of exactly `layout`'s size and alignment, removed from the list (so it is
    /// handed out once).
    fn take(layout: Layout) -> Option<*mut u8> {
        let mut f = FREE.lock().unwrap_or_else(|e| e.into_inner());
        let n = f.len;
        let i = f.blocks[..n]
            .iter()
            .rposition(|&(s, a, _)| s == layout.size() && a == layout.align())?;
        let (_, _, addr) = f.blocks[i];
        f.blocks.copy_within(i + 1..n, i);
        f.len -= 1;
        Some(addr as *mut u8)
    }
}

// SAFETY: every block handed out is either fresh from `System` for this layout or a block
// `System` allocated with exactly this size and alignment, freed by its owner (`dealloc` keeps
// it) and taken out of the list under the lock, so no block is live twice. Blocks leave the
// list only to be handed out or to go back to `System` with the layout they were allocated
// with. Nothing here allocates (the list is a fixed array) or panics.
unsafe impl GlobalAlloc for Recycling {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_BYTES {
            if let Some(p) = Self::take(layout) {
                return p;
            }
        }
        // SAFETY: `layout` has a non-zero size (the caller's contract), as `System` needs.
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_BYTES {
            if let Some(p) = Self::take(layout) {
                // SAFETY: `p` is a block of `layout.size()` bytes that nobody else holds.
                std::ptr::write_bytes(p, 0, layout.size());
                return p;
            }
        }
        // SAFETY: as in `alloc`.
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() < MIN_BYTES {
            // SAFETY: small blocks only ever come from `System`, with this layout.
            return System.dealloc(ptr, layout);
        }
        let evicted = {
            let mut f = FREE.lock().unwrap_or_else(|e| e.into_inner());
            let evicted = if f.len == SLOTS {
                let oldest = f.blocks[0];
                f.blocks.copy_within(1..SLOTS, 0);
                f.len -= 1;
                Some(oldest)
            } else {
                None
            };
            let n = f.len;
            f.blocks[n] = (layout.size(), layout.align(), ptr as usize);
            f.len += 1;
            evicted
        };
        if let Some((s, a, p)) = evicted {
            // SAFETY: the evicted block came from `System` with size `s` and alignment `a`,
            // which a valid `Layout` had, and left the list above, so nobody holds it.
            System.dealloc(p as *mut u8, Layout::from_size_align_unchecked(s, a));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycles_same_sized_blocks_and_zeroes_on_request() {
        let a = Recycling;
        let l = Layout::from_size_align(MIN_BYTES + 64, 64).unwrap();
        // SAFETY: each block is used within its layout and freed once, with that layout.
        unsafe {
            let p = a.alloc(l);
            std::ptr::write_bytes(p, 7, l.size());
            a.dealloc(p, l);
            let q = a.alloc_zeroed(l);
            assert_eq!(q, p, "the freed block is reused");
            assert!((0..l.size()).all(|i| *q.add(i) == 0));
            a.dealloc(q, l);
            let other = Layout::from_size_align(MIN_BYTES * 2, 64).unwrap();
            let r = a.alloc(other);
            assert_ne!(r, p, "a different size is not served from the cache");
            a.dealloc(r, other);
        }
    }
}
