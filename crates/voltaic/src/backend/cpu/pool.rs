//! A caching allocator for host buffers.
//!
//! Large buffers freed by the graph go back to a pool keyed by dtype and
//! length, so a loop that computes the same shapes again reuses memory
//! instead of paying the kernel's page faults for fresh pages every time.

use crate::dtype::DType;
use crate::storage::CpuStorage;
use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Mutex;

/// Buffers smaller than this are left to the system allocator.
const MIN_POOLED_BYTES: usize = 1 << 16;
/// At most this many bytes are kept cached.
const MAX_CACHED_BYTES: usize = 1 << 30;

#[derive(Default)]
struct Pool {
    free: HashMap<(DType, usize), Vec<CpuStorage>>,
    cached: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn with_pool<T>(f: impl FnOnce(&mut Pool) -> T) -> T {
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(Pool::default))
}

/// A buffer of `len` elements whose contents are unspecified (every element
/// will be overwritten by the caller).
pub(crate) fn take(dtype: DType, len: usize) -> CpuStorage {
    if len * dtype.size_in_bytes() >= MIN_POOLED_BYTES {
        let hit = with_pool(|p| {
            let s = p.free.get_mut(&(dtype, len))?.pop()?;
            p.cached -= s.size_in_bytes();
            Some(s)
        });
        if let Some(s) = hit {
            return s;
        }
    }
    CpuStorage::zeros(dtype, len)
}

/// A buffer of `len` zeros.
pub(crate) fn take_zeroed(dtype: DType, len: usize) -> CpuStorage {
    let mut s = take(dtype, len);
    crate::storage::map_storage!(&mut s, v => v.fill(Default::default()));
    s
}

fn give(s: CpuStorage) {
    let bytes = s.size_in_bytes();
    if bytes < MIN_POOLED_BYTES {
        return;
    }
    with_pool(|p| {
        if p.cached + bytes > MAX_CACHED_BYTES {
            return;
        }
        p.cached += bytes;
        p.free.entry((s.dtype(), s.len())).or_default().push(s);
    });
}

/// Bytes held in the host pool, ready for reuse.
pub fn cached_bytes() -> usize {
    with_pool(|p| p.cached)
}

/// Return every cached host buffer to the system.
pub fn empty_cache() {
    with_pool(|p| {
        p.free.clear();
        p.cached = 0;
    });
}

/// Host storage that returns to the pool when dropped.
#[derive(Debug)]
pub(crate) struct HostBuf(Option<CpuStorage>);

impl HostBuf {
    pub(crate) fn new(s: CpuStorage) -> HostBuf {
        HostBuf(Some(s))
    }
}

impl Deref for HostBuf {
    type Target = CpuStorage;
    fn deref(&self) -> &CpuStorage {
        self.0.as_ref().expect("present until dropped")
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            give(s);
        }
    }
}
