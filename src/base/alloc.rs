//! A global allocator that recycles large buffers.
//!
//! Every training step allocates the same large activation buffers (megabytes each) and frees
//! them again. The system allocator hands such blocks back to the kernel, so each step pays
//! for fresh page faults and TLB shootdowns.
//! [`Recycling`] keeps up to [`SLOTS`] freed blocks of at least [`MIN_BYTES`], together at most
//! [`MAX_PARKED_BYTES`], and returns one of exactly the same size and alignment on the next
//! request. When a freed block would exceed either bound, the oldest kept blocks go back to the
//! system first; a block larger than the byte bound itself is never kept. Blocks of
//! [`HUGE_PAGE`] or more start on a huge-page boundary, and the kernel is asked to back them
//! with huge pages. Small allocations go straight to the system allocator. The binary installs
//! it with `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;

/// Blocks smaller than this are not recycled.
pub const MIN_BYTES: usize = 1 << 20;
/// Blocks of at least this size start on a boundary of it and ask the kernel for transparent
/// huge pages: the depth attention's backward streams rows from a score of such buffers at
/// once, and one address translation per 2 MiB instead of per 4 KiB spares it TLB misses
/// (docs/performance.md, "What makes it fast").
pub const HUGE_PAGE: usize = 2 << 20;
/// Freed blocks kept at most; beyond that the oldest is released.
pub const SLOTS: usize = 512;
/// Bytes of freed blocks kept at most (2 GiB): memory the process holds without using it. A
/// fixed bound, so that it needs no query of the system from inside the allocator; it is well
/// above what one training step of the presets frees and reuses.
pub const MAX_PARKED_BYTES: usize = 2 << 30;

struct Free {
    /// `(size, align, address)`; a fixed array, since the allocator itself must not allocate.
    blocks: [(usize, usize, usize); SLOTS],
    len: usize,
    /// Sum of the sizes of the kept blocks.
    bytes: usize,
}

static FREE: Mutex<Free> = Mutex::new(Free::new());

impl Free {
    const fn new() -> Free {
        Free { blocks: [(0, 0, 0); SLOTS], len: 0, bytes: 0 }
    }

    /// Removes and returns the address of the newest kept block of exactly this size and
    /// alignment.
    fn take(&mut self, size: usize, align: usize) -> Option<usize> {
        let n = self.len;
        let i = self.blocks[..n].iter().rposition(|&(s, a, _)| s == size && a == align)?;
        let (_, _, addr) = self.blocks[i];
        self.blocks.copy_within(i + 1..n, i);
        self.len -= 1;
        self.bytes -= size;
        Some(addr)
    }

    /// Keeps a freed block, first handing the oldest kept blocks to `release` until it fits
    /// within `SLOTS` blocks and `max_bytes` bytes; a block larger than `max_bytes` goes to
    /// `release` itself.
    fn park(
        &mut self,
        block: (usize, usize, usize),
        max_bytes: usize,
        mut release: impl FnMut((usize, usize, usize)),
    ) {
        if block.0 > max_bytes {
            return release(block);
        }
        while self.len == SLOTS || self.bytes + block.0 > max_bytes {
            let oldest = self.blocks[0];
            self.blocks.copy_within(1..self.len, 0);
            self.len -= 1;
            self.bytes -= oldest.0;
            release(oldest);
        }
        self.blocks[self.len] = block;
        self.len += 1;
        self.bytes += block.0;
    }
}

/// Hands every kept block back to the system: after work whose large buffers the coming steps
/// will not ask for again (on a pipeline's rank 0, the whole model it puts together for a
/// checkpoint or a validation), so that they do not stay resident. Without [`Recycling`]
/// installed, nothing is kept and this does nothing.
pub fn release_kept() {
    let mut f = FREE.lock().unwrap_or_else(|e| e.into_inner());
    for &(s, a, p) in &f.blocks[..f.len] {
        // SAFETY: as in `dealloc`: a kept block came from `System` with this size and
        // alignment and nobody holds it; the list is emptied below, so none goes back twice.
        unsafe { system_dealloc(p as *mut u8, Layout::from_size_align_unchecked(s, a)) };
    }
    f.len = 0;
    f.bytes = 0;
}

/// Blocks of at least this size come straight from the kernel (`mmap`), whose fresh pages are
/// zero: a zeroed block then costs nothing until it is written (`System` would fill an
/// over-aligned block with zeros itself, touching every page of it).
pub const MAPPED_BYTES: usize = 32 << 20;

#[cfg(target_os = "linux")]
extern "C" {
    fn mmap(
        addr: *mut std::ffi::c_void,
        len: usize,
        prot: i32,
        flags: i32,
        fd: i32,
        off: i64,
    ) -> *mut std::ffi::c_void;
    fn munmap(addr: *mut std::ffi::c_void, len: usize) -> i32;
}

/// The bytes a mapped block of `size` spans: whole small pages.
fn mapped_len(size: usize) -> usize {
    size.next_multiple_of(4096)
}

/// A block from the system for `layout`: mapped from the kernel (zeroed) when it is at least
/// [`MAPPED_BYTES`] (Linux), else from `System` with [`system_layout`]. Null when refused.
unsafe fn system_alloc(layout: Layout, zeroed: bool) -> *mut u8 {
    #[cfg(target_os = "linux")]
    if layout.size() >= MAPPED_BYTES && layout.align() <= HUGE_PAGE {
        const PROT_READ_WRITE: i32 = 0x1 | 0x2;
        const MAP_PRIVATE_ANONYMOUS: i32 = 0x02 | 0x20;
        let len = mapped_len(layout.size());
        // Map a huge page more than needed, then give back the ends around a block that
        // starts on a huge-page boundary.
        let p = mmap(
            std::ptr::null_mut(),
            len + HUGE_PAGE,
            PROT_READ_WRITE,
            MAP_PRIVATE_ANONYMOUS,
            -1,
            0,
        );
        if p as isize == -1 {
            return std::ptr::null_mut();
        }
        let start = (p as usize).next_multiple_of(HUGE_PAGE);
        let head = start - p as usize;
        if head > 0 {
            munmap(p, head);
        }
        let tail = HUGE_PAGE - head;
        if tail > 0 {
            munmap((start + len) as *mut _, tail);
        }
        return start as *mut u8;
    }
    if zeroed {
        System.alloc_zeroed(system_layout(layout))
    } else {
        System.alloc(system_layout(layout))
    }
}

/// Gives back a block [`system_alloc`] made for `layout`.
unsafe fn system_dealloc(p: *mut u8, layout: Layout) {
    #[cfg(target_os = "linux")]
    if layout.size() >= MAPPED_BYTES && layout.align() <= HUGE_PAGE {
        munmap(p.cast(), mapped_len(layout.size()));
        return;
    }
    System.dealloc(p, system_layout(layout))
}

/// The layout a block of `layout` is allocated with from `System`: aligned to [`HUGE_PAGE`]
/// when it is that large. A pure function of the caller's layout, so that a block goes back
/// with the layout it came with.
fn system_layout(layout: Layout) -> Layout {
    match layout.size() >= HUGE_PAGE && layout.align() < HUGE_PAGE {
        // (A size too close to `isize::MAX` to round up to a huge page keeps its alignment.)
        true => Layout::from_size_align(layout.size(), HUGE_PAGE).unwrap_or(layout),
        false => layout,
    }
}

/// Asks for transparent huge pages over the whole huge pages of a fresh block (where the
/// system leaves them to `madvise`; a refusal only leaves the block on small pages).
fn advise_huge(p: *mut u8, size: usize) {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        const MADV_HUGEPAGE: i32 = 14;
        if !p.is_null() && size >= HUGE_PAGE {
            // SAFETY: the range lies inside the block just allocated; the advice changes only
            // how its pages are backed, never their contents.
            unsafe { madvise(p.cast(), size / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, size);
}

/// `n` zeros in a buffer of which most pages may never be touched (a quantised model's f32
/// parameters, whose quantised ranges are never read): the kernel is told not to back it with
/// huge pages, since one touched page would then commit 2 MiB, and the kernel's background
/// collapsing of pages would in time commit all of it.
pub fn untouched_zeros(n: usize) -> Vec<f32> {
    let v = vec![0.0f32; n];
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        const MADV_NOHUGEPAGE: i32 = 15;
        let (p, size) = (v.as_ptr() as usize, n * 4);
        // Whole pages inside the buffer only.
        let start = p.next_multiple_of(4096);
        if p + size > start + 4096 {
            // SAFETY: the range lies inside the buffer just allocated; the advice changes only
            // how its pages are backed, never their contents.
            unsafe { madvise(start as *mut _, (p + size - start) / 4096 * 4096, MADV_NOHUGEPAGE) };
        }
    }
    v
}

/// Zeros for a buffer of which each part is written only when it is first needed (a server's
/// key/value pool, sized for every slot at the full context; the prefix cache's runs). From
/// [`HUGE_PAGE`] up (Linux), mapped straight from the kernel on small pages, apart from the
/// global allocator: an untouched page costs nothing, and a page is first touched at the cost
/// of one small zeroed page, never a huge page's compaction and zeroing (which the allocator's
/// huge-page advice would bring) nor a `memset` of the whole buffer (which a recycled or
/// over-aligned zeroed block costs). Smaller buffers, which the allocator gives no huge pages,
/// come from it as a zeroed vector: a mapping each would take a whole page and one of the
/// process's limited number of mappings.
pub struct ZeroPages(Storage);

enum Storage {
    #[cfg(target_os = "linux")]
    Mapped {
        ptr: std::ptr::NonNull<f32>,
        len: usize,
    },
    Heap(Vec<f32>),
}

// SAFETY: a `ZeroPages` owns its mapping alone, as a `Vec<f32>` owns its buffer.
unsafe impl Send for ZeroPages {}
// SAFETY: shared access only reads.
unsafe impl Sync for ZeroPages {}

impl ZeroPages {
    /// `n` zeros; `None` when the system refuses the mapping.
    pub fn new(n: usize) -> Option<ZeroPages> {
        let bytes = n.checked_mul(4)?;
        #[cfg(target_os = "linux")]
        if bytes >= HUGE_PAGE {
            extern "C" {
                fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
            }
            const PROT_READ_WRITE: i32 = 0x1 | 0x2;
            const MAP_PRIVATE_ANONYMOUS: i32 = 0x02 | 0x20;
            const MADV_NOHUGEPAGE: i32 = 15;
            let len = mapped_len(bytes);
            // SAFETY: a fresh private anonymous mapping, which nothing else refers to; the
            // advice changes only how its pages are backed.
            unsafe {
                let p =
                    mmap(std::ptr::null_mut(), len, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS, -1, 0);
                if p as isize == -1 {
                    return None;
                }
                madvise(p, len, MADV_NOHUGEPAGE);
                return Some(ZeroPages(Storage::Mapped {
                    ptr: std::ptr::NonNull::new(p.cast())?,
                    len: n,
                }));
            }
        }
        Some(ZeroPages(Storage::Heap(vec![0.0; bytes / 4])))
    }
}

impl Default for ZeroPages {
    /// An empty buffer.
    fn default() -> ZeroPages {
        ZeroPages(Storage::Heap(Vec::new()))
    }
}

impl std::ops::Deref for ZeroPages {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.0 {
            #[cfg(target_os = "linux")]
            // SAFETY: the mapping holds `len` f32s (zero or written since), owned by `self`.
            Storage::Mapped { ptr, len } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
            Storage::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for ZeroPages {
    fn deref_mut(&mut self) -> &mut [f32] {
        match &mut self.0 {
            #[cfg(target_os = "linux")]
            // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
            Storage::Mapped { ptr, len } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
            Storage::Heap(v) => v,
        }
    }
}

impl Drop for ZeroPages {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Storage::Mapped { ptr, len } = self.0 {
            // SAFETY: the mapping `new` made, of this length, unmapped once.
            unsafe { munmap(ptr.as_ptr().cast(), mapped_len(len * 4)) };
        }
    }
}

/// Keeps the system allocator from handing small blocks (below [`MIN_BYTES`], which
/// [`Recycling`] keeps itself) back to the kernel after every use (glibc on Linux; elsewhere it
/// does nothing). By default glibc maps each block of 128 KiB or more afresh and returns the
/// freed top of its heaps, so every prefill's per-layer buffers of a few hundred KiB cost page
/// faults and zeroing again: prefill of 128 tokens ran about 1.4x faster with this
/// (docs/performance-log/quantised.md, "The system allocator"). The bounds cap what the
/// process holds without using it at [`KEPT_BY_SYSTEM`] per heap.
pub fn keep_small_blocks() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only changes the allocator's thresholds; a refused value (0) leaves
        // glibc's own, which is only slower.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, MIN_BYTES as i32);
            mallopt(M_TRIM_THRESHOLD, KEPT_BY_SYSTEM as i32);
        }
    }
}

/// Free bytes at the top of one of the system allocator's heaps that it keeps rather than
/// returns to the kernel ([`keep_small_blocks`]).
pub const KEPT_BY_SYSTEM: usize = 64 << 20;

pub struct Recycling;

impl Recycling {
    /// A kept block of exactly `layout`'s size and alignment, removed from the list (so it is
    /// handed out once).
    fn take(layout: Layout) -> Option<*mut u8> {
        let mut f = FREE.lock().unwrap_or_else(|e| e.into_inner());
        f.take(layout.size(), layout.align()).map(|addr| addr as *mut u8)
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
        let p = system_alloc(layout, false);
        advise_huge(p, layout.size());
        p
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
        let p = system_alloc(layout, true);
        advise_huge(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() < MIN_BYTES {
            // SAFETY: small blocks only ever come from `System`, with this layout (below
            // `MAPPED_BYTES` and `HUGE_PAGE`, so `system_layout` leaves it as it is).
            return System.dealloc(ptr, layout);
        }
        let mut f = FREE.lock().unwrap_or_else(|e| e.into_inner());
        f.park((layout.size(), layout.align(), ptr as usize), MAX_PARKED_BYTES, |(s, a, p)| {
            // SAFETY: a released block came from `System` with size `s` and alignment `a`,
            // which a valid `Layout` had, and is in no list (it just left it, or is the block
            // being freed), so nobody holds it. `System` never calls back into this allocator,
            // so releasing under the lock cannot deadlock.
            system_dealloc(p as *mut u8, Layout::from_size_align_unchecked(s, a));
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Zeros read as zeros and keep what is written (across pages, to the last value), below
    /// a huge page (from the allocator) and above it (mapped; where `mapped` tells); an empty
    /// buffer is empty.
    #[test]
    fn zero_pages_start_zero_and_keep_writes() {
        for (n, mapped) in
            [(3 * 4096 + 5, false), (HUGE_PAGE / 4 + 4096 + 7, cfg!(target_os = "linux"))]
        {
            let mut z = ZeroPages::new(n).expect("a small buffer");
            assert_eq!(matches!(z.0, Storage::Heap(_)), !mapped, "{n} values");
            assert_eq!(z.len(), n);
            assert!(z.iter().all(|&x| x == 0.0));
            for (i, x) in z.iter_mut().enumerate().step_by(1021) {
                *x = i as f32;
            }
            z[n - 1] = -1.0;
            assert!(z.iter().enumerate().step_by(1021).all(|(i, &x)| x == i as f32));
            assert_eq!(z[n - 1], -1.0);
            assert_eq!(z[1], 0.0);
        }
        assert!(ZeroPages::new(0).unwrap().is_empty() && ZeroPages::default().is_empty());
    }

    /// A freed block comes back for the same layout (zeroed when asked), not for another; a
    /// block of a huge page starts on a huge-page boundary.
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
            let other = Layout::from_size_align(HUGE_PAGE, 64).unwrap();
            let r = a.alloc(other);
            assert_ne!(r, p, "a different size is not served from the cache");
            assert_eq!(r as usize % HUGE_PAGE, 0, "a huge page's worth starts on a boundary");
            a.dealloc(r, other);
        }
    }

    /// A block of [`MAPPED_BYTES`] or more comes zeroed from the kernel, on a huge-page
    /// boundary, and is zeroed again when it is handed out a second time.
    #[test]
    fn large_blocks_are_mapped_zeroed_and_recycled() {
        let a = Recycling;
        let l = Layout::from_size_align(MAPPED_BYTES + 12345, 64).unwrap();
        // SAFETY: each block is used within its layout and freed once, with that layout.
        unsafe {
            let p = a.alloc_zeroed(l);
            assert_eq!(p as usize % HUGE_PAGE, 0);
            assert!((0..l.size()).step_by(4093).all(|i| *p.add(i) == 0));
            std::ptr::write_bytes(p, 7, l.size());
            a.dealloc(p, l);
            let q = a.alloc_zeroed(l);
            assert_eq!(q, p, "the freed block is reused");
            assert!((0..l.size()).all(|i| *q.add(i) == 0));
            a.dealloc(q, l);
        }
    }

    /// The kept blocks stay within the byte bound: the oldest go first, and a block larger
    /// than the bound is not kept at all.
    #[test]
    fn parked_bytes_are_bounded() {
        let mut f = Free::new();
        let mut released = Vec::new();
        let mb = MIN_BYTES;
        for (i, size) in [3 * mb, 4 * mb, 2 * mb].into_iter().enumerate() {
            f.park((size, 64, i), 8 * mb, |b| released.push(b));
        }
        // 3 + 4 + 2 > 8: the oldest (3 MB) went back.
        assert_eq!(released, vec![(3 * mb, 64, 0)]);
        assert_eq!((f.len, f.bytes), (2, 6 * mb));
        f.park((9 * mb, 64, 9), 8 * mb, |b| released.push(b));
        assert_eq!(released.last(), Some(&(9 * mb, 64, 9)), "too large to keep");
        assert_eq!(f.take(4 * mb, 64), Some(1));
        assert_eq!((f.len, f.bytes), (1, 2 * mb));
        f.park((8 * mb, 64, 8), 8 * mb, |b| released.push(b));
        assert_eq!(released.last(), Some(&(2 * mb, 64, 2)));
        assert_eq!((f.len, f.bytes), (1, 8 * mb));
        // The slot bound still holds.
        let mut g = Free::new();
        for i in 0..SLOTS + 3 {
            g.park((mb, 64, i), usize::MAX, |b| released.push(b));
        }
        assert_eq!((g.len, g.bytes, g.blocks[0].2), (SLOTS, SLOTS * mb, 3));
    }
}
