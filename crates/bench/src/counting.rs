//! A counting global allocator: the servers' allocator (jemalloc, as
//! `markov-serve`'s; the system's where jemalloc does not build) plus the
//! net bytes allocated, their peak and the number of allocations, while a
//! measurement window is open.
//!
//! Counting is off by default, so the timed figures pay one relaxed atomic
//! load per allocation and nothing more. [`Window::open`] starts counting from
//! zero; [`Window::close`] stops and reports. The net figure is exact for the
//! window: a block allocated before it and freed during it counts negative,
//! which is what "live bytes now minus live bytes then" means.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// What every allocation goes to: the allocator `markov-serve` runs on, so
/// the figures are of the server as it is shipped.
#[cfg(not(target_env = "msvc"))]
const INNER: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
#[cfg(target_env = "msvc")]
const INNER: std::alloc::System = std::alloc::System;

/// The servers' allocator, counting while a [`Window`] is open.
#[derive(Debug)]
pub(crate) struct Counting;

static ENABLED: AtomicBool = AtomicBool::new(false);
static NET: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static CALLS: AtomicIsize = AtomicIsize::new(0);

fn add(bytes: usize) {
    if ENABLED.load(Ordering::Relaxed) {
        let bytes = isize::try_from(bytes).unwrap_or(isize::MAX);
        CALLS.fetch_add(1, Ordering::Relaxed);
        let now = NET.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

fn sub(bytes: usize) {
    if ENABLED.load(Ordering::Relaxed) {
        NET.fetch_sub(
            isize::try_from(bytes).unwrap_or(isize::MAX),
            Ordering::Relaxed,
        );
    }
}

// A `GlobalAlloc` can only be implemented with `unsafe impl`; the workspace
// forbids `unsafe_code`, so this crate's manifest lowers it to `deny` and this
// one impl is allowed. Every method forwards to `INNER` under the caller's
// contract, unchanged, and only adds counting.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which
        // is `INNER`'s.
        let ptr = unsafe { INNER.alloc(layout) };
        if !ptr.is_null() {
            add(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let ptr = unsafe { INNER.alloc_zeroed(layout) };
        if !ptr.is_null() {
            add(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `INNER` (every method here
        // forwards to it) with `layout`, as the caller guarantees.
        unsafe { INNER.dealloc(ptr, layout) };
        sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; `new_size` is valid per the caller.
        let new = unsafe { INNER.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            sub(layout.size());
            add(new_size);
        }
        new
    }
}

/// An open measurement window (only one at a time).
#[derive(Debug)]
pub(crate) struct Window(());

/// What a closed [`Window`] saw, in bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counted {
    /// Allocated minus freed while the window was open.
    pub(crate) net: isize,
    /// The highest `net` reached.
    pub(crate) peak: isize,
    /// Allocations (`alloc`, `alloc_zeroed`, and `realloc` as one) made.
    pub(crate) allocations: isize,
}

impl Window {
    /// Starts counting from zero.
    pub(crate) fn open() -> Window {
        NET.store(0, Ordering::SeqCst);
        PEAK.store(0, Ordering::SeqCst);
        CALLS.store(0, Ordering::SeqCst);
        ENABLED.store(true, Ordering::SeqCst);
        Window(())
    }

    /// The net bytes so far, without closing.
    pub(crate) fn net(&self) -> isize {
        NET.load(Ordering::SeqCst)
    }

    /// Stops counting and reports.
    pub(crate) fn close(self) -> Counted {
        ENABLED.store(false, Ordering::SeqCst);
        Counted {
            net: NET.load(Ordering::SeqCst),
            peak: PEAK.load(Ordering::SeqCst),
            allocations: CALLS.load(Ordering::SeqCst),
        }
    }
}
