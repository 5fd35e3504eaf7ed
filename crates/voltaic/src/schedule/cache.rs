//! The plan cache: a realization whose pending graph has the same structure
//! as an earlier one reuses that plan instead of being scheduled again.
//!
//! A training or decode loop builds a graph shaped like the one before at
//! every step; only the buffers it reads and the values of its constants
//! (a learning rate, Adam's bias correction) change. The key is the graph's
//! structure in topological order: every node's op (constants without their
//! values), dtype, shape and device, every edge with its layout, which nodes
//! were asked for and which are referenced from outside the graph (these
//! decide which buffers the plan keeps). A hit clones the cached plan, puts
//! the new constants into it, and binds the new input buffers; the clone
//! shares the executor's prepared state (compiled kernels), so a hit skips
//! scheduling and compilation alike.
//!
//! The cache is bounded by entries and by an estimate of the bytes its
//! plans hold, and evicts the least recently used plan first.

use super::collect::Dag;
use crate::device::Device;
use crate::dtype::DType;
use crate::graph::OpKind;
use crate::ir::Plan;
use crate::layout::Layout;
use crate::primitive::{IndexOp, MapOp};
use foldhash::{HashMap, HashMapExt};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

/// The structure of a collected graph (see the module docs): words, and
/// the index ops (whose parameters do not fit a word) in the order the
/// words name them.
///
/// A training step's graph has thousands of nodes and a key of about a
/// hundred thousand words, built, hashed and compared on every
/// realization: words of 8 bytes are hashed and compared as plain memory,
/// the hash is computed once, and the words' buffer is handed back to the
/// next key on this thread after a cache hit (a fresh buffer of a few
/// megabytes per realization cost more in page faults than the words did).
#[derive(Clone, Debug)]
pub(crate) struct Key {
    words: Vec<u64>,
    index_ops: Vec<IndexOp>,
    hash: u64,
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.hash == other.hash && self.words == other.words && self.index_ops == other.index_ops
    }
}

impl Eq for Key {}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_u64(self.hash);
    }
}

thread_local! {
    /// The words' buffer of this thread's last key that found its plan.
    static SPARE: std::cell::Cell<Vec<u64>> = const { std::cell::Cell::new(Vec::new()) };
}

impl Key {
    /// The key of `g` for an executor that does (`rows`) or does not lower row kernels.
    pub(crate) fn of(g: &Dag, caps: crate::backend::Capabilities) -> Key {
        let mut t = SPARE.with(|s| s.take());
        t.clear();
        t.reserve(g.nodes.len() * 16);
        let mut index_ops = vec![];
        t.push(caps.row_kernels as u64 | (caps.multi_output as u64) << 1 | (caps.index_epilogues as u64) << 2);
        t.push(caps.max_inputs as u64);
        t.push(caps.prologue_rows as u64);
        for (i, node) in g.nodes.iter().enumerate() {
            // Our own references are `g.nodes` and two per edge (see
            // `lifetimes::survivors`). Only pending nodes' count: whether a
            // realized input is held elsewhere changes nothing in the plan
            // (and another thread may be taking references to it).
            let external = g.ops[i].is_some() && std::sync::Arc::strong_count(node) > 1 + 2 * g.edges_in[i];
            t.push(((g.target[i] as u64) << 1) | external as u64);
            t.push(dtype_word(node.dtype));
            t.push(match node.device {
                Device::Cpu => 0,
                Device::Gpu(d) => d as u64 + 1,
            });
            push_dims(&mut t, &node.dims);
            let Some(op) = &g.ops[i] else {
                t.push(0);
                continue;
            };
            match &op.kind {
                OpKind::Const(_) => t.push(1),
                OpKind::Map(m) => t.extend([2, map_word(*m)]),
                OpKind::Copy => t.push(3),
                OpKind::Reduce(r, axes) => {
                    t.extend([4, *r as u64]);
                    push_dims(&mut t, axes);
                }
                OpKind::Matmul => t.push(5),
                OpKind::Index(x) => {
                    t.push(6);
                    index_ops.push(*x);
                }
                OpKind::QMatmul(q) => t.extend([7, q.id() as u64]),
            }
            t.push(op.inputs.len() as u64);
            for v in &op.inputs {
                t.push(g.index[&v.node.id] as u64);
                push_layout(&mut t, &v.layout);
            }
        }
        let hash = {
            use std::hash::BuildHasher;
            let state = foldhash::fast::FixedState::default();
            state.hash_one((bytemuck::cast_slice::<u64, u8>(&t), &index_ops))
        };
        Key { words: t, index_ops, hash }
    }

    /// Hand the words' buffer to this thread's next key (after a hit: the
    /// cache keeps the key of a miss).
    pub(crate) fn recycle(self) {
        SPARE.with(|s| s.set(self.words));
    }

    fn bytes(&self) -> usize {
        std::mem::size_of::<Key>() + self.words.len() * 8 + self.index_ops.len() * std::mem::size_of::<IndexOp>()
    }
}

/// `dt` as a key word.
fn dtype_word(dt: DType) -> u64 {
    dt as u64
}

/// `m` as a key word: the kind in the high byte, the primitive below.
fn map_word(m: MapOp) -> u64 {
    match m {
        MapOp::Unary(u) => u as u64,
        MapOp::Binary(b) => 1 << 8 | b as u64,
        MapOp::Cmp(c) => 2 << 8 | c as u64,
        MapOp::Where => 3 << 8,
        MapOp::Cast => 4 << 8,
    }
}

fn push_dims(t: &mut Vec<u64>, dims: &[usize]) {
    t.push(dims.len() as u64);
    t.extend(dims.iter().map(|&d| d as u64));
}

fn push_layout(t: &mut Vec<u64>, l: &Layout) {
    push_dims(t, l.dims());
    t.extend(l.strides().iter().map(|&s| s as u64));
    t.push(l.offset as u64);
}

/// A scheduled plan with what ties it to any graph of its key.
pub(crate) struct Entry {
    /// Shared with every realization whose constants are the plan's own.
    pub plan: Arc<Plan>,
    /// Graph positions of the nodes whose buffers are the plan's inputs, in order.
    pub input_nodes: Vec<usize>,
    /// Graph positions of the nodes that receive the plan's outputs, in order.
    pub store_nodes: Vec<usize>,
}

impl Entry {
    /// The plan with the constants of `g` (a graph of the same key): the
    /// cached plan itself when they are its own (a decode step's, a
    /// training step's epsilons and scales), else a copy with them written
    /// in. Copying a plan of hundreds of kernels costs more than keying it.
    pub(crate) fn plan_for(&self, g: &Dag) -> Arc<Plan> {
        let value = |pos: usize| match &g.ops[pos] {
            Some(crate::graph::Op { kind: OpKind::Const(v), .. }) => Some(*v),
            _ => None,
        };
        let same = self.plan.kernels.iter().all(|k| {
            k.kind.exprs().iter().all(|e| e.consts.iter().zip(&e.const_nodes).all(|(c, &pos)| value(pos).is_none_or(|v| v.to_bits() == c.to_bits())))
        });
        if same {
            return self.plan.clone();
        }
        let mut plan = (*self.plan).clone();
        for k in plan.kernels.iter_mut() {
            for e in k.kind.exprs_mut() {
                for (c, &pos) in e.consts.iter_mut().zip(&e.const_nodes) {
                    if let Some(v) = value(pos) {
                        *c = v;
                    }
                }
            }
        }
        Arc::new(plan)
    }

    /// An estimate of the bytes the entry holds (plan, layouts, expressions).
    fn bytes(&self) -> usize {
        let layout = |l: &Layout| std::mem::size_of::<Layout>() + 16 * l.dims().len();
        let mut n = std::mem::size_of::<Entry>() + 8 * (self.input_nodes.len() + self.store_nodes.len());
        n += self.plan.slots.len() * std::mem::size_of::<crate::ir::SlotInfo>();
        for k in &self.plan.kernels {
            n += std::mem::size_of::<crate::ir::Kernel>() + 8 * (k.inputs.len() + k.ops.len());
            for e in k.kind.exprs() {
                n += 24 * e.instrs.len() + 16 * e.consts.len();
                n += e.loads.iter().map(|l| std::mem::size_of::<crate::ir::Load>() + l.path.iter().map(layout).sum::<usize>()).sum::<usize>();
            }
            match &k.kind {
                crate::ir::KernelKind::Matmul { a, b, .. } => n += layout(&a.layout) + layout(&b.layout),
                crate::ir::KernelKind::Index { args, .. } => n += args.iter().map(|s| layout(&s.layout)).sum::<usize>(),
                _ => {}
            }
        }
        n + 8 * self.plan.free_after.iter().map(|f| f.len() + 3).sum::<usize>()
    }
}

/// Counters and size of the plan cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanCacheStats {
    /// Realizations that reused a cached plan.
    pub hits: u64,
    /// Realizations that were scheduled (and their plan cached).
    pub misses: u64,
    /// Plans dropped to stay within the limits.
    pub evictions: u64,
    /// Plans held now.
    pub entries: usize,
    /// Estimated bytes the held plans take.
    pub bytes: usize,
    /// The most plans held.
    pub max_entries: usize,
    /// The most estimated bytes held.
    pub max_bytes: usize,
}

struct Slot {
    entry: Arc<Entry>,
    bytes: usize,
    used: u64,
}

struct Cache {
    map: HashMap<Key, Slot>,
    tick: u64,
    stats: PlanCacheStats,
}

fn cache() -> MutexGuard<'static, Cache> {
    static CACHE: LazyLock<Mutex<Cache>> = LazyLock::new(|| {
        let (max_entries, max_bytes) = default_limits();
        Mutex::new(Cache { map: HashMap::new(), tick: 0, stats: PlanCacheStats { max_entries, max_bytes, ..Default::default() } })
    });
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Limits from `VOLTAIC_PLAN_CACHE` (entries; 0 turns the cache off) and
/// `VOLTAIC_PLAN_CACHE_MB`; by default 1024 plans and 64 MiB.
fn default_limits() -> (usize, usize) {
    let num = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<usize>().ok());
    (num("VOLTAIC_PLAN_CACHE").unwrap_or(1024), num("VOLTAIC_PLAN_CACHE_MB").unwrap_or(64) << 20)
}

/// The cached entry for `key`, if any (counted as a hit or a miss).
pub(crate) fn lookup(key: &Key) -> Option<Arc<Entry>> {
    let mut c = cache();
    if c.stats.max_entries == 0 {
        return None;
    }
    c.tick += 1;
    let tick = c.tick;
    match c.map.get_mut(key) {
        Some(s) => {
            s.used = tick;
            let e = s.entry.clone();
            c.stats.hits += 1;
            Some(e)
        }
        None => {
            c.stats.misses += 1;
            None
        }
    }
}

/// Remember `entry` under `key`, evicting the least recently used plans
/// beyond the limits.
pub(crate) fn insert(key: Key, entry: Entry) {
    let mut c = cache();
    let bytes = key.bytes() + entry.bytes();
    if c.stats.max_entries == 0 || bytes > c.stats.max_bytes {
        return;
    }
    c.tick += 1;
    let used = c.tick;
    if let Some(old) = c.map.insert(key, Slot { entry: Arc::new(entry), bytes, used }) {
        c.stats.bytes -= old.bytes;
    }
    c.stats.bytes += bytes;
    evict(&mut c);
}

fn evict(c: &mut Cache) {
    while c.map.len() > c.stats.max_entries || c.stats.bytes > c.stats.max_bytes {
        let Some(oldest) = c.map.iter().min_by_key(|(_, s)| s.used).map(|(k, _)| k.clone()) else { break };
        if let Some(s) = c.map.remove(&oldest) {
            c.stats.bytes -= s.bytes;
            c.stats.evictions += 1;
        }
    }
    c.stats.entries = c.map.len();
}

/// Counters and size of the plan cache (one cache serves every device).
pub fn plan_cache_stats() -> PlanCacheStats {
    let c = cache();
    PlanCacheStats { entries: c.map.len(), ..c.stats }
}

/// Bound the plan cache to `entries` plans and about `bytes` bytes (0
/// entries turns it off), evicting what no longer fits. The defaults are
/// 1024 plans and 64 MiB, or `VOLTAIC_PLAN_CACHE` / `VOLTAIC_PLAN_CACHE_MB`.
pub fn set_plan_cache_limits(entries: usize, bytes: usize) {
    let mut c = cache();
    c.stats.max_entries = entries;
    c.stats.max_bytes = bytes;
    evict(&mut c);
}

/// Drop every cached plan (counters are kept).
pub fn clear_plan_cache() {
    let mut c = cache();
    c.map.clear();
    c.stats.bytes = 0;
    c.stats.entries = 0;
}

#[cfg(test)]
mod tests {
    use super::Key;
    use crate::primitive::{BinaryOp, UnaryOp};
    use crate::schedule::collect::collect;
    use crate::schedule::testing::{attention_scaled, binary, cpu_caps, input, unary};

    fn key(v: &crate::graph::Value) -> Key {
        Key::of(&collect(&[v]), cpu_caps())
    }

    #[test]
    fn keys_tell_apart_what_the_plan_depends_on_and_nothing_else() {
        let (a, b) = (input(&[4, 3]), input(&[4, 3]));
        let same = |f: &dyn Fn(&crate::graph::Value, &crate::graph::Value) -> crate::graph::Value| key(&f(&a, &b)) == key(&f(&input(&[4, 3]), &input(&[4, 3])));
        // The same structure over other buffers: one key (and one hash).
        assert!(same(&|x, y| unary(&binary(x, y, BinaryOp::Add), UnaryOp::Exp)));
        let k = key(&unary(&binary(&a, &b, BinaryOp::Add), UnaryOp::Exp));
        assert_eq!(k.hash, key(&unary(&binary(&a, &b, BinaryOp::Add), UnaryOp::Exp)).hash);
        // Another primitive, kind of primitive, shape or index parameter: another key.
        assert_ne!(k, key(&unary(&binary(&a, &b, BinaryOp::Mul), UnaryOp::Exp)));
        assert_ne!(k, key(&unary(&binary(&a, &b, BinaryOp::Add), UnaryOp::Log)));
        assert_ne!(k, key(&binary(&binary(&a, &b, BinaryOp::Add), &a, BinaryOp::Add)));
        assert_ne!(k, key(&unary(&binary(&input(&[3, 4]), &input(&[3, 4]), BinaryOp::Add), UnaryOp::Exp)));
        let (q, kv, mask) = (input(&[2, 3, 4]), input(&[2, 5, 4]), input(&[3, 5]));
        let at = |scale: f64| key(&attention_scaled(&q, &kv, &kv, &mask, scale));
        assert_eq!(at(0.5), at(0.5));
        assert_ne!(at(0.5), at(0.25));
        // A thread's recycled buffer leaves the next key as it would be.
        let k2 = key(&unary(&binary(&a, &b, BinaryOp::Add), UnaryOp::Exp));
        k2.recycle();
        assert_eq!(k, key(&unary(&binary(&a, &b, BinaryOp::Add), UnaryOp::Exp)));
    }
}
