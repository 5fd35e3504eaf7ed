//! A caching allocator for host buffers.
//!
//! Kernel outputs freed by the graph go back to a pool keyed by dtype and
//! length, so a loop that computes the same shapes again (a training step)
//! reuses memory instead of paying the kernel's page faults for fresh pages
//! every time. Only buffers the pool handed out come back: uploaded data (a
//! data loader's fresh batch every step) is freed, since nothing asks for it
//! again. The cache is capped and evicts the buffers unused the longest, so
//! shapes that stop recurring (the evaluation batches, a last short batch)
//! do not hold memory for the rest of the run.

use crate::backend::MemoryStats;
use crate::dtype::DType;
use crate::storage::CpuStorage;
use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Mutex;

/// Buffers smaller than this are left to the system allocator.
const MIN_POOLED_BYTES: usize = 1 << 16;
/// Default cap of the cache (`VOLTAIC_HOST_POOL_MB` sets another).
const DEFAULT_MAX_CACHED_MB: usize = 256;

#[derive(Default)]
struct Pool {
    /// Free buffers by (dtype, length), each with the tick it was returned at.
    free: HashMap<(DType, usize), Vec<(u64, CpuStorage)>>,
    tick: u64,
    cached: usize,
    stats: MemoryStats,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn with_pool<T>(f: impl FnOnce(&mut Pool) -> T) -> T {
    let mut g = POOL.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(Pool::default))
}

fn max_cached_bytes() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("VOLTAIC_HOST_POOL_MB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(DEFAULT_MAX_CACHED_MB) << 20
    })
}

/// A buffer of `len` elements whose contents are unspecified (every element
/// will be overwritten by the caller).
pub(crate) fn take(dtype: DType, len: usize) -> CpuStorage {
    if len * dtype.size_in_bytes() >= MIN_POOLED_BYTES {
        let hit = with_pool(|p| {
            let hit = p.free.get_mut(&(dtype, len)).and_then(|v| v.pop()).map(|(_, s)| s);
            match &hit {
                Some(s) => {
                    p.cached -= s.size_in_bytes();
                    p.stats.hits += 1;
                }
                None => {
                    p.stats.misses += 1;
                    p.stats.allocations += 1;
                }
            }
            hit
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
    let max = max_cached_bytes();
    if bytes < MIN_POOLED_BYTES || bytes > max {
        return;
    }
    // Evicted buffers are dropped after the lock is released.
    let _evicted = with_pool(|p| {
        let mut evicted = Vec::new();
        while p.cached + bytes > max {
            let Some(s) = evict_oldest(p) else { break };
            evicted.push(s);
        }
        p.tick += 1;
        p.cached += bytes;
        p.stats.peak_cached = p.stats.peak_cached.max(p.cached as u64);
        let tick = p.tick;
        p.free.entry((s.dtype(), s.len())).or_default().push((tick, s));
        evicted
    });
}

/// Remove the buffer returned longest ago (each list is in return order).
fn evict_oldest(p: &mut Pool) -> Option<CpuStorage> {
    let key = *p.free.iter().filter_map(|(k, v)| Some((k, v.first()?.0))).min_by_key(|(_, t)| *t)?.0;
    let list = p.free.get_mut(&key)?;
    let (_, s) = list.remove(0);
    if list.is_empty() {
        p.free.remove(&key);
    }
    p.cached -= s.size_in_bytes();
    p.stats.evictions += 1;
    Some(s)
}

/// The pool's counters, with the bytes it holds now.
pub(crate) fn stats() -> MemoryStats {
    with_pool(|p| MemoryStats { cached: p.cached as u64, ..p.stats })
}

/// Return every cached host buffer to the system.
pub fn empty_cache() {
    let _freed = with_pool(|p| {
        p.cached = 0;
        std::mem::take(&mut p.free)
    });
}

/// Host storage, returned to the pool when dropped if the pool made it.
#[derive(Debug)]
pub(crate) struct HostBuf {
    data: Option<CpuStorage>,
    pooled: bool,
}

impl HostBuf {
    /// A kernel's output (from [`take`]): reused when freed.
    pub(crate) fn pooled(s: CpuStorage) -> HostBuf {
        HostBuf { data: Some(s), pooled: true }
    }

    /// Data from outside (an upload): freed when dropped.
    pub(crate) fn foreign(s: CpuStorage) -> HostBuf {
        HostBuf { data: Some(s), pooled: false }
    }
}

impl Deref for HostBuf {
    type Target = CpuStorage;
    fn deref(&self) -> &CpuStorage {
        self.data.as_ref().expect("present until dropped")
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if let Some(s) = self.data.take() {
            if self.pooled {
                give(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Free buffers of exactly this dtype and length: unlike the hit
    /// counters, not disturbed by other tests using the pool meanwhile.
    fn free_count(dtype: DType, len: usize) -> usize {
        with_pool(|p| p.free.get(&(dtype, len)).map_or(0, |v| v.len()))
    }

    // The pool is process-wide, so one test drives it through every case,
    // with lengths (odd, over 1 Mi) that no other test frees.
    #[test]
    fn reuses_evicts_the_oldest_and_stays_under_its_cap() {
        let max = max_cached_bytes();
        let len = (1 << 20) + 3; // 4 MiB of f32
        let a = take(DType::F32, len);
        drop(HostBuf::pooled(a));
        assert_eq!(free_count(DType::F32, len), 1, "a freed buffer is kept");
        let b = take(DType::F32, len);
        assert_eq!(free_count(DType::F32, len), 0, "the freed buffer is reused");
        drop(HostBuf::foreign(b));
        assert_eq!(free_count(DType::F32, len), 0, "uploaded data is not cached");
        // Many distinct shapes: the cache stays under its cap, evicting the oldest.
        let shapes = 2 * max / (len * 4) + 8;
        for i in 0..shapes {
            drop(HostBuf::pooled(CpuStorage::zeros(DType::F32, len + 2 * i)));
            assert!(stats().cached as usize <= max);
        }
        let s = stats();
        assert!(s.evictions > 0 && s.peak_cached as usize <= max, "{s:?}");
        // The newest shape survived, the oldest did not.
        assert_eq!(free_count(DType::F32, len + 2 * (shapes - 1)), 1, "the newest shape was kept");
        assert_eq!(free_count(DType::F32, len), 0, "the oldest shape was evicted");
        empty_cache();
        assert_eq!(free_count(DType::F32, len + 2 * (shapes - 1)), 0);
    }
}
