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

use std::fmt;

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

/// `len` elements made by `init(i)`, in one allocation that reports failure instead of aborting.
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
fn available_memory() -> Option<usize> {
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
