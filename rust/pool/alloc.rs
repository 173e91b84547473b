//! Fallible allocation of the pool's per-block arrays: a pool too large for the memory available
//! is an error naming the array and its size, never an abort.
//!
//! Every array is written as soon as it is allocated, so its pages are taken at once. With
//! Linux's default overcommit an allocation larger than the memory left can still succeed, and
//! writing it then wakes the OOM killer. An array of [`CHECKED_BYTES`] or more is therefore
//! allocated only when it fits in the memory the kernel reports available (`MemAvailable` plus
//! free swap in `/proc/meminfo`, and no more than the room under the memory limit of the
//! process's cgroup, as a container has), read just before: each array is checked against what
//! the arrays before it left.
//!
//! The arrays are [`PageArray`]s: a large one (from [`HUGE_FROM`] bytes) is aligned to huge pages
//! and offered to the kernel for transparent huge pages, since lookups and reference-count updates
//! land all over it.

use std::alloc::Layout;
use std::fmt;
use std::ops::Deref;
use std::ptr::NonNull;

/// An array that could not be allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AllocFailed {
    pub(crate) what: &'static str,
    /// Bytes requested (`usize::MAX` if the size itself overflows).
    pub(crate) bytes: usize,
}

impl fmt::Display for AllocFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cannot allocate {} bytes for the {}",
            self.bytes, self.what
        )
    }
}

/// `len` elements made by `init(i)`, in one allocation that reports failure instead of aborting
/// (the reference pool's arrays; the pool's own are [`PageArray`]s).
pub(crate) fn boxed_slice<T>(
    what: &'static str,
    len: usize,
    mut init: impl FnMut(usize) -> T,
) -> Result<Box<[T]>, AllocFailed> {
    let failed = AllocFailed {
        what,
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    };
    #[cfg(test)]
    if inject::should_fail() {
        return Err(failed);
    }
    if !fits(failed.bytes) {
        return Err(failed);
    }
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(len).map_err(|_| failed)?;
    // Within the reserved capacity: no reallocation.
    v.extend((0..len).map(&mut init));
    Ok(v.into_boxed_slice())
}

/// Arrays from this size on are laid out for transparent huge pages (see [`PageArray`]).
pub(crate) const HUGE_FROM: usize = 512 << 10;

/// The huge page size of x86-64 and of arm64 with 4 KiB pages.
const HUGE_PAGE: usize = 2 << 20;

/// Where `len` elements of `T` go: an array of [`HUGE_FROM`] bytes or more starts on a huge-page
/// boundary and takes whole huge pages; None if the size overflows.
fn array_layout<T>(len: usize) -> Option<Layout> {
    let layout = Layout::array::<T>(len).ok()?;
    if layout.size() < HUGE_FROM {
        return Some(layout);
    }
    let size = layout.size().checked_next_multiple_of(HUGE_PAGE)?;
    Layout::from_size_align(size, HUGE_PAGE.max(layout.align())).ok()
}

/// Bytes a [`PageArray`] of `len` elements takes (`usize::MAX` if that overflows).
pub(crate) fn array_bytes<T>(len: usize) -> usize {
    array_layout::<T>(len).map_or(usize::MAX, |layout| layout.size())
}

/// A fixed-length array of the pool's per-block data (reference counts, key slots, the
/// prefix-cache map's tables), allocated as [`boxed_slice`] does. One of [`HUGE_FROM`] bytes or
/// more is aligned to and rounded up to whole huge pages and offered to the kernel for
/// transparent huge pages before it is written (Linux `madvise(MADV_HUGEPAGE)`; the system's
/// `transparent_hugepage` setting decides): a prefix-cache lookup or a reference-count update
/// lands anywhere in these arrays, and with 4 KiB pages most such accesses also miss the TLB.
/// The rounding costs at most one huge page per array (virtual memory only where the kernel
/// backs the array with small pages).
pub(crate) struct PageArray<T> {
    ptr: NonNull<T>,
    len: usize,
    layout: Layout,
}

// SAFETY: a `PageArray<T>` owns its elements as a `Box<[T]>` does (no other pointer to them
// exists), so it may move to and be shared between threads exactly when `T` may.
unsafe impl<T: Send> Send for PageArray<T> {}
// SAFETY: as above: `&PageArray<T>` only hands out `&[T]`.
unsafe impl<T: Sync> Sync for PageArray<T> {}

impl<T> PageArray<T> {
    /// `len` elements made by `init(i)`; failure (as [`boxed_slice`]'s) is an error.
    pub(crate) fn new(
        what: &'static str,
        len: usize,
        mut init: impl FnMut(usize) -> T,
    ) -> Result<Self, AllocFailed> {
        let layout = array_layout::<T>(len);
        let failed = AllocFailed {
            what,
            bytes: layout.map_or(usize::MAX, |layout| layout.size()),
        };
        #[cfg(test)]
        if inject::should_fail() {
            return Err(failed);
        }
        let layout = layout.ok_or(failed)?;
        if !fits(layout.size()) {
            return Err(failed);
        }
        let ptr = if layout.size() == 0 {
            // Nothing to allocate (no elements, or zero-sized ones, which are still made).
            NonNull::<T>::dangling()
        } else {
            // SAFETY: `layout` has a non-zero size (checked just above).
            let raw = unsafe { std::alloc::alloc(layout) };
            let Some(bytes) = NonNull::new(raw) else {
                return Err(failed);
            };
            if layout.align() == HUGE_PAGE {
                advise_huge_pages(bytes.as_ptr(), layout.size());
            }
            bytes.cast::<T>()
        };
        for i in 0..len {
            // SAFETY: the allocation holds `len` elements of `T` (`layout` is at least
            // `Layout::array::<T>(len)`, with at least its alignment; for a zero size, writes
            // through a dangling aligned pointer are allowed); element `i` is written once,
            // before anything reads it. Should `init` panic, the allocation leaks with nothing
            // dropped: no uninitialised element is ever read.
            unsafe { ptr.as_ptr().add(i).write(init(i)) };
        }
        Ok(PageArray { ptr, len, layout })
    }
}

impl<T> Deref for PageArray<T> {
    type Target = [T];

    #[inline]
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialised elements owned by `self` (see `new`), which
        // live as long as `self` and are never handed out mutably.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for PageArray<T> {
    fn drop(&mut self) {
        // SAFETY: the `len` elements were initialised in `new` and are dropped once, here;
        // the memory was allocated with `self.layout` (unless its size is zero) and is freed
        // once, after them. `&mut self`: nobody else can reach them.
        unsafe {
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ));
            if self.layout.size() != 0 {
                std::alloc::dealloc(self.ptr.as_ptr().cast(), self.layout);
            }
        }
    }
}

/// Asks the kernel to back `[ptr, ptr + len)` (huge-page aligned, whole huge pages, freshly
/// allocated and not yet written) with transparent huge pages. Advice only: the answer is
/// ignored, and nothing but how the pages are backed changes.
#[cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    not(loom)
))]
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    extern "C" {
        fn madvise(
            addr: *mut std::ffi::c_void,
            len: usize,
            advice: std::ffi::c_int,
        ) -> std::ffi::c_int;
    }
    /// `MADV_HUGEPAGE` (the generic value, used by x86-64 and arm64).
    const MADV_HUGEPAGE: std::ffi::c_int = 14;
    // SAFETY: the range is page aligned (huge-page aligned) and lies inside one live allocation
    // this thread made and alone holds; `MADV_HUGEPAGE` changes no byte of it and no mapping
    // anyone else relies on (only how the kernel may back the pages), and the call touches no
    // Rust or Python state, so it needs no lock and holds without the GIL.
    unsafe {
        madvise(ptr.cast(), len, MADV_HUGEPAGE);
    }
}

#[cfg(not(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    not(loom)
)))]
fn advise_huge_pages(_ptr: *mut u8, _len: usize) {}

/// Arrays from this size on are checked against the memory available (smaller ones are not: a
/// pool of them all takes under a few hundred MiB, and the check reads a file).
pub(crate) const CHECKED_BYTES: usize = 64 << 20;

/// Whether `bytes` more may be allocated and written: always under [`CHECKED_BYTES`], else
/// when they fit in the memory available (or that is not known).
pub(crate) fn fits(bytes: usize) -> bool {
    bytes < CHECKED_BYTES || available_memory().is_none_or(|available| bytes <= available)
}

/// Bytes the kernel can hand out without killing anyone: `MemAvailable` plus `SwapFree` from
/// `/proc/meminfo`, at most the room under each memory limit of the process's cgroups that can
/// be read (Linux); None where that is not known (the allocation then decides alone).
pub(crate) fn available_memory() -> Option<usize> {
    #[cfg(test)]
    if let Some(bytes) = inject::available() {
        return Some(bytes);
    }
    if !cfg!(target_os = "linux") {
        return None;
    }
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let mut available = parse_meminfo(&read("/proc/meminfo")?)?;
    let groups = read("/proc/self/cgroup").unwrap_or_default();
    for (limit, usage) in cgroup_memory_files(&groups) {
        if let (Some(limit), Some(usage)) = (read(&limit), read(&usage)) {
            if let Some(room) = cgroup_room(&limit, &usage) {
                available = available.min(room);
            }
        }
    }
    Some(available)
}

/// The memory limit and usage files of the cgroups listed in the text of `/proc/self/cgroup`:
/// the unified (v2) group's `memory.max` and `memory.current`, a v1 memory controller's
/// `memory.limit_in_bytes` and `memory.usage_in_bytes`.
pub(crate) fn cgroup_memory_files(groups: &str) -> Vec<(String, String)> {
    groups
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let path = path.trim_end_matches('/');
            if controllers.is_empty() {
                let dir = format!("/sys/fs/cgroup{path}");
                Some((format!("{dir}/memory.max"), format!("{dir}/memory.current")))
            } else if controllers.split(',').any(|c| c == "memory") {
                let dir = format!("/sys/fs/cgroup/memory{path}");
                Some((
                    format!("{dir}/memory.limit_in_bytes"),
                    format!("{dir}/memory.usage_in_bytes"),
                ))
            } else {
                None
            }
        })
        .collect()
}

/// Bytes left under a cgroup's memory limit from the text of its limit and usage files; None
/// without a limit (`max`, or v1's page-rounded `i64::MAX`) or for text that is not a number.
pub(crate) fn cgroup_room(limit: &str, usage: &str) -> Option<usize> {
    let limit = limit.trim().parse::<u64>().ok()?;
    let usage = usage.trim().parse::<u64>().ok()?;
    if limit >= 1 << 62 {
        return None;
    }
    usize::try_from(limit.saturating_sub(usage)).ok()
}

/// `MemAvailable + SwapFree` in bytes from the text of `/proc/meminfo` (swap counts as 0 when
/// the line is missing); None without `MemAvailable`.
pub(crate) fn parse_meminfo(info: &str) -> Option<usize> {
    let field = |name: &str| {
        info.lines().find_map(|line| {
            let value = line.strip_prefix(name)?.strip_prefix(':')?;
            let kib = value
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<usize>()
                .ok()?;
            Some(kib.saturating_mul(1024))
        })
    };
    Some(field("MemAvailable")?.saturating_add(field("SwapFree").unwrap_or(0)))
}

/// Tests: make the `n`-th next allocation (0-based) of this thread fail.
#[cfg(test)]
pub(crate) mod inject {
    use std::cell::Cell;

    thread_local! {
        static FAIL_AFTER: Cell<Option<usize>> = const { Cell::new(None) };
        static AVAILABLE: Cell<Option<usize>> = const { Cell::new(None) };
    }

    /// Reports `bytes` as the memory available to this thread's allocations (None: the real
    /// figure).
    pub(crate) fn set_available(bytes: Option<usize>) {
        AVAILABLE.with(|c| c.set(bytes));
    }

    pub(crate) fn available() -> Option<usize> {
        AVAILABLE.with(Cell::get)
    }

    pub(crate) fn fail_after(n: Option<usize>) {
        FAIL_AFTER.with(|c| c.set(n));
    }

    pub(crate) fn should_fail() -> bool {
        FAIL_AFTER.with(|c| match c.get() {
            Some(0) => {
                c.set(None);
                true
            }
            Some(n) => {
                c.set(Some(n - 1));
                false
            }
            None => false,
        })
    }
}
