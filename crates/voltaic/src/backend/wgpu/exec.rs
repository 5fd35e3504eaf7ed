//! Running a plan on a GPU: one command encoder, one submission.

use super::codegen::{check_dtype, elem_bytes, Bind, Src};
use super::context::GpuContext;
use super::pool::{alloc, alloc_in_pass, GpuBuf};
use crate::backend::Buffer;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ir::{Kernel, KernelKind, Plan, SlotSource};
use crate::profile::Phase;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// One dispatch of a kernel, compiled.
pub(crate) struct CompiledDispatch {
    pipeline: Arc<wgpu::ComputePipeline>,
    binds: Vec<Bind>,
    grid: (u32, u32),
    label: String,
}

/// A kernel compiled for one device: its dispatches and scratch buffers.
pub(crate) struct Compiled {
    dispatches: Vec<CompiledDispatch>,
    scratch: Vec<(DType, usize)>,
}

impl Compiled {
    /// The label of the first dispatch, for profiles.
    pub(crate) fn label(&self) -> Option<&str> {
        self.dispatches.first().map(|d| d.label.as_str())
    }
}

/// Compiled kernels of a device by the hash of their signature.
pub(crate) type KernelCache = std::collections::HashMap<u64, Vec<(Signature, Arc<Compiled>)>>;

/// What a compiled kernel depends on besides the device: its structure,
/// not its constants' values (see `ir::Expr`).
#[derive(PartialEq, Hash)]
pub(crate) struct Signature {
    kind: KernelKind,
    inputs: Vec<(DType, usize)>,
    dtype: DType,
    numel: usize,
    variant: Option<super::matmul::Variant>,
}

/// Kernel `k` compiled for `ctx`: from the device's cache when an equal
/// kernel was compiled before (a training loop generates and compiles each
/// kernel once), else generated and compiled now.
pub(crate) fn compile(ctx: &GpuContext, k: &Kernel, inputs: &[(DType, usize)], variant: Option<super::matmul::Variant>) -> Result<Arc<Compiled>> {
    let key = signature_hash(k, inputs, variant);
    // One compile per signature at a time: a thread that finds it being
    // compiled (a dry run's step ahead, another device's realization) waits
    // for the pipeline rather than compiling it again beside it.
    let (busy, done) = &ctx.compiling;
    let mut now = busy.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(c) = cached(ctx, k, inputs, variant) {
            return Ok(c);
        }
        if now.insert(key) {
            break;
        }
        now = done.wait(now).unwrap_or_else(|e| e.into_inner());
    }
    drop(now);
    struct Release<'a>(&'a GpuContext, u64);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            let (busy, done) = &self.0.compiling;
            busy.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.1);
            done.notify_all();
        }
    }
    let _release = Release(ctx, key);
    let prog = super::kernels::program(&ctx.caps, k, inputs, variant)?;
    let mut dispatches = Vec::with_capacity(prog.dispatches.len());
    for d in prog.dispatches {
        if d.binds.len() > ctx.caps.max_storage_buffers as usize {
            return Err(Error::Backend(format!(
                "{}: the kernel binds {} buffers but gpu:{} allows {} per shader",
                d.label,
                d.binds.len(),
                ctx.index,
                ctx.caps.max_storage_buffers
            )));
        }
        let read_only: Vec<bool> = d.binds.iter().map(|b| b.read_only).collect();
        let pipeline = ctx.pipeline(&d.source, &read_only, &d.label).map_err(|e| match e {
            Error::Backend(msg) => Error::Backend(format!("{} ({}, {} -> {} {}): {msg}", d.label, k.ops.join(" "), shapes(inputs), k.numel, k.dtype)),
            e => e,
        })?;
        dispatches.push(CompiledDispatch { pipeline, binds: d.binds, grid: grid(ctx, d.groups)?, label: d.label });
    }
    let c = Arc::new(Compiled { dispatches, scratch: prog.scratch });
    let sig = Signature { kind: k.kind.clone(), inputs: inputs.to_vec(), dtype: k.dtype, numel: k.numel, variant };
    ctx.compiled_kernels.lock().unwrap_or_else(|e| e.into_inner()).entry(key).or_default().push((sig, c.clone()));
    Ok(c)
}

fn signature_hash(k: &Kernel, inputs: &[(DType, usize)], variant: Option<super::matmul::Variant>) -> u64 {
    use std::hash::BuildHasher;
    // A fast hasher: this runs over whole kernels.
    foldhash::fast::FixedState::default().hash_one((&k.kind, inputs, k.dtype, k.numel, variant))
}

/// Kernel `k` if the device compiled an equal one before.
fn cached(ctx: &GpuContext, k: &Kernel, inputs: &[(DType, usize)], variant: Option<super::matmul::Variant>) -> Option<Arc<Compiled>> {
    let key = signature_hash(k, inputs, variant);
    let same = |s: &Signature| s.kind == k.kind && s.inputs == inputs && s.dtype == k.dtype && s.numel == k.numel && s.variant == variant;
    let cache = ctx.compiled_kernels.lock().unwrap_or_else(|e| e.into_inner());
    cache.get(&key)?.iter().find(|(s, _)| same(s)).map(|(_, c)| c.clone())
}

/// Constants as the 32-bit words kernels read them as.
pub(crate) fn const_words(values: &[(f64, DType)]) -> Vec<u8> {
    use super::codegen::compute_ty;
    values
        .iter()
        .flat_map(|&(v, dt)| {
            let w: u32 = match compute_ty(dt) {
                "f32" => (v as f32).to_bits(),
                "i32" => v as i32 as u32,
                "u32" => v as u32,
                _ => (v != 0.0) as u32,
            };
            w.to_le_bytes()
        })
        .collect()
}

/// One dispatch with its buffers bound, waiting for the pass.
pub(crate) struct Encoded {
    pipeline: Arc<wgpu::ComputePipeline>,
    bind_group: wgpu::BindGroup,
    grid: (u32, u32),
    /// Scratch buffers the dispatch binds; they go back to the pool with it.
    _scratch: Arc<Vec<GpuBuf>>,
}

/// Bind every dispatch of a compiled kernel: `input(i)` is the buffer of
/// the kernel's input `i`. Scratch buffers are taken from the pool.
pub(crate) fn bind<'b>(
    ctx: &'b GpuContext,
    c: &Compiled,
    input: &dyn Fn(usize) -> &'b wgpu::Buffer,
    out: &'b wgpu::Buffer,
    consts: &[(f64, DType)],
) -> Result<Vec<Encoded>> {
    bind_cached(ctx, c, &Mutex::new(None), input, &[out], consts)
}

/// The scratch buffers of kernel `c`, from the pool.
fn fresh_scratch(ctx: &GpuContext, c: &Compiled) -> Result<Vec<GpuBuf>> {
    c.scratch.iter().map(|&(dt, n)| alloc_in_pass(ctx, dt, n, n as u64 * elem_bytes(&ctx.caps, dt))).collect()
}

/// A new buffer holding a kernel's constants (written before the next submit).
fn consts_buffer(ctx: &GpuContext, words: &[u8]) -> Result<GpuBuf> {
    let b = alloc(ctx, DType::U32, words.len() / 4, words.len() as u64)?;
    ctx.queue.write_buffer(b.raw(), 0, words);
    Ok(b)
}

/// What one binding of a dispatch binds: buffer, offset and size.
type Entry<'b> = (&'b wgpu::Buffer, u64, u64);

/// The buffers a dispatch binds, in binding order.
fn entries<'s, 'b: 's>(
    ctx: &'s GpuContext,
    d: &CompiledDispatch,
    input: &dyn Fn(usize) -> &'b wgpu::Buffer,
    outs: &[&'s wgpu::Buffer],
    scratch: &'s [GpuBuf],
    consts_at: Option<usize>,
) -> Result<Vec<Entry<'s>>> {
    if consts_at.is_none() && d.binds.iter().any(|b| matches!(b.src, Src::Consts)) {
        return Err(Error::Backend(format!("kernel {} reads constants but none were given", d.label)));
    }
    Ok(d.binds
        .iter()
        .map(|b| {
            let buf: &wgpu::Buffer = match b.src {
                Src::Input(i) => input(i),
                Src::Output => outs[0],
                Src::Also(j) => outs[j + 1],
                Src::Scratch(i) => scratch[i].raw(),
                Src::IndexError => &ctx.index_error,
                Src::Counters => &ctx.counters,
                // Checked above: a kernel that reads constants has them.
                Src::Consts => consts_at.map(|c| scratch[c].raw()).unwrap_or(&ctx.index_error),
            };
            let offset = b.chunk as u64 * b.chunk_bytes;
            (buf, offset, b.chunk_bytes.min(buf.size() - offset))
        })
        .collect())
}

fn bind_group(ctx: &GpuContext, d: &CompiledDispatch, entries: &[Entry<'_>]) -> wgpu::BindGroup {
    ctx.bind_groups.fetch_add(1, Ordering::Relaxed);
    let entries: Vec<wgpu::BindGroupEntry> = entries
        .iter()
        .enumerate()
        .map(|(i, &(buffer, offset, size))| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size: std::num::NonZeroU64::new(size) }),
        })
        .collect();
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &d.pipeline.get_bind_group_layout(0), entries: &entries })
}

/// What a cached plan's kernel keeps from its last run: its scratch and
/// constants buffers, and the bind groups of the buffers it bound then. A
/// training step gets the same buffers from the pool step after step, so
/// most kernels bind nothing new.
pub(crate) struct Bound {
    /// Scratch buffers, then the constants' buffer if any.
    scratch: Arc<Vec<GpuBuf>>,
    /// The constants as written into their buffer.
    words: Vec<u8>,
    /// Per dispatch: bind groups of the last few sets of buffers it bound
    /// ((buffer, offset, size) each), the most recent first.
    groups: Vec<Vec<(Vec<OwnedEntry>, wgpu::BindGroup)>>,
}

/// Bind groups kept per dispatch. A step's buffers are not the last
/// step's: an optimizer writes each weight to a new buffer and frees the
/// old one, and the pool hands the freed buffers to the next step's
/// intermediates, so the buffers a kernel binds cycle through a few sets.
const GROUPS_KEPT: usize = 4;

/// A binding kept with its bind group: buffer, offset and size.
type OwnedEntry = (wgpu::Buffer, u64, u64);

/// A kernel to compile: the kernel, its inputs' (dtype, length), its matmul variant.
type Work<'k> = (&'k Kernel, Vec<(DType, usize)>, Option<super::matmul::Variant>);

/// [`bind`] for a kernel of a cached plan: reuses what `cell` kept from
/// the last run where the buffers and constants are the same.
fn bind_cached<'b>(
    ctx: &'b GpuContext,
    c: &Compiled,
    cell: &Mutex<Option<Bound>>,
    input: &dyn Fn(usize) -> &'b wgpu::Buffer,
    outs: &[&'b wgpu::Buffer],
    consts: &[(f64, DType)],
) -> Result<Vec<Encoded>> {
    // Taken out while in use: a second thread running the same plan binds afresh.
    let last = cell.lock().unwrap_or_else(|e| e.into_inner()).take();
    let words = const_words(consts);
    let mut groups = Vec::with_capacity(c.dispatches.len());
    let (scratch, mut old_groups) = match last {
        // The constants' buffer is reused only with the same values: a new
        // value goes to a new buffer, since queued work may still read the old.
        Some(b) if b.words == words => (b.scratch, b.groups),
        last => {
            // The scratch buffers stay when no other thread holds them.
            let mut scratch = match last.and_then(|b| Arc::try_unwrap(b.scratch).ok()) {
                Some(mut v) if v.len() == c.scratch.len() + !consts.is_empty() as usize => {
                    v.truncate(c.scratch.len());
                    v
                }
                _ => fresh_scratch(ctx, c)?,
            };
            if !consts.is_empty() {
                scratch.push(consts_buffer(ctx, &words)?);
            }
            (Arc::new(scratch), vec![])
        }
    };
    let consts_at = (!consts.is_empty()).then(|| scratch.len() - 1);
    let mut encoded = Vec::with_capacity(c.dispatches.len());
    for (i, d) in c.dispatches.iter().enumerate() {
        let entries = entries(ctx, d, input, outs, &scratch, consts_at)?;
        let mut kept = if i < old_groups.len() { std::mem::take(&mut old_groups[i]) } else { vec![] };
        let same = |bound: &[OwnedEntry]| bound.len() == entries.len() && bound.iter().zip(&entries).all(|(a, b)| &a.0 == b.0 && a.1 == b.1 && a.2 == b.2);
        match kept.iter().position(|(bound, _)| same(bound)) {
            Some(j) => kept[..=j].rotate_right(1),
            None => {
                kept.truncate(GROUPS_KEPT - 1);
                kept.insert(0, (entries.iter().map(|&(b, o, s)| (b.clone(), o, s)).collect(), bind_group(ctx, d, &entries)));
            }
        }
        encoded.push(Encoded { pipeline: d.pipeline.clone(), bind_group: kept[0].1.clone(), grid: d.grid, _scratch: scratch.clone() });
        groups.push(kept);
    }
    *cell.lock().unwrap_or_else(|e| e.into_inner()) = Some(Bound { scratch, words, groups });
    Ok(encoded)
}

/// Run `plan` on `ctx` with `inputs`; returns the buffers of `plan.outputs`.
pub(crate) fn run_plan(ctx: &GpuContext, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
    ctx.check_alive()?;
    // Allocation and compilation run in error scopes of their own; a
    // validation error while binding or encoding (a bug, not bad input)
    // reaches the uncaptured-error record, checked here. No scopes around the
    // whole encoding: pushing and popping them costs on every realization.
    let res = crate::profile::exclusive(Phase::Encode, || encode_and_submit(ctx, plan, inputs));
    if let Some(e) = ctx.take_uncaptured() {
        return Err(e);
    }
    res
}

/// [`run_plan`] without running: the plan's kernels compiled (kept with
/// the plan, as a run keeps them) and its outputs as pooled buffers of
/// their sizes, contents undefined (see `voltaic::dry_run`).
pub(crate) fn dry_run(ctx: &GpuContext, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
    ctx.check_alive()?;
    crate::profile::time(Phase::Compile, || prepare(ctx, plan))?;
    crate::backend::dry_outputs(plan, inputs, |dt, numel| {
        let bytes = numel as u64 * elem_bytes(&ctx.caps, dt);
        Ok(Buffer::Wgpu(Arc::new(super::pool::alloc(ctx, dt, numel, bytes)?)))
    })
}

/// The compiled kernels of a plan, kept with the plan while it is cached
/// (valid while the tuner's choices are those of `generation`).
struct Prepared {
    device: usize,
    generation: u64,
    kernels: Vec<Arc<Compiled>>,
    /// What each kernel bound last time (see [`Bound`]).
    bound: Vec<Mutex<Option<Bound>>>,
}

/// Every kernel of `plan` compiled: from the plan's prepared state when it
/// was prepared on this device before, else checked, its matmul variants
/// chosen, and the kernels not yet compiled compiled on parallel threads.
fn prepare(ctx: &GpuContext, plan: &Plan) -> Result<Arc<Prepared>> {
    let generation = ctx.tuner.generation();
    let forced = super::matmul::FORCE.with(|f| f.get()).is_some();
    let mut cell = plan.prepared.lock().unwrap_or_else(|e| e.into_inner());
    // One prepared state per device, should a plan ever be run on several
    // (plan keys name the device today, so each plan sees one).
    let per_device: Arc<Vec<Arc<Prepared>>> = cell.as_ref().and_then(|p| p.clone().downcast::<Vec<Arc<Prepared>>>().ok()).unwrap_or_default();
    if let Some(p) = per_device.iter().find(|p| p.device == ctx.index) {
        if p.generation == generation && !forced {
            return Ok(p.clone());
        }
    }
    let mut work = Vec::with_capacity(plan.kernels.len());
    for k in &plan.kernels {
        check_dtype(&ctx.caps, k.dtype, k.kind.name())?;
        // A buffer too large for the device is out of memory, before any compile error it would cause.
        super::pool::fits(ctx, k.dtype, k.numel, k.numel as u64 * elem_bytes(&ctx.caps, k.dtype))?;
        // Kernels index with u32: a larger iteration space is refused here,
        // not by the shader compiler.
        let space = match &k.kind {
            crate::ir::KernelKind::Reduce { outer, inner, .. } | crate::ir::KernelKind::Rows { outer, inner, .. } => outer.saturating_mul(*inner),
            _ => k.numel,
        };
        if space > u32::MAX as usize {
            return Err(crate::error::Error::Value {
                op: k.kind.name(),
                msg: format!("{space} elements exceed what a kernel on gpu:{} can index (2^32 - 1, 32-bit indices); split the work", ctx.index),
            });
        }
        let inputs: Vec<_> = k.inputs.iter().map(|&s| (plan.slots[s].dtype, plan.slots[s].numel)).collect();
        for &(dt, _) in &inputs {
            check_dtype(&ctx.caps, dt, k.kind.name())?;
        }
        // Fused intermediates too: `x.to_dtype(F64).to_dtype(F32)` never stores an f64.
        for e in k.kind.exprs() {
            for &(_, dt) in &e.instrs {
                check_dtype(&ctx.caps, dt, k.ops.first().copied().unwrap_or("realize"))?;
            }
        }
        let mut variant = super::autotune::variant_for(ctx, k, &inputs)?;
        if let Some(v) = variant.filter(|_| !forced) {
            if cached(ctx, k, &inputs, Some(v)).is_none() {
                variant = super::autotune::stand_in(ctx, k, &inputs, v, signature_hash(k, &inputs, Some(v))).or(variant);
            }
        }
        work.push((k, inputs, variant));
    }
    let kernels = compile_all(ctx, &work)?;
    let bound = kernels.iter().map(|_| Mutex::new(None)).collect();
    let p = Arc::new(Prepared { device: ctx.index, generation, kernels, bound });
    if !forced {
        let mut all: Vec<Arc<Prepared>> = per_device.iter().filter(|q| q.device != ctx.index).cloned().collect();
        all.push(p.clone());
        *cell = Some(Arc::new(all));
    }
    Ok(p)
}

/// Compile `work` (kernel, input shapes, variant), the kernels that are
/// not compiled yet on up to one thread per core (one on GL): a driver compiles a
/// pipeline in milliseconds to tens of them, and a cold training step
/// needs dozens.
fn compile_all(ctx: &GpuContext, work: &[Work<'_>]) -> Result<Vec<Arc<Compiled>>> {
    let mut out: Vec<Option<Arc<Compiled>>> = work.iter().map(|(k, i, v)| cached(ctx, k, i, *v)).collect();
    // One of each distinct kernel; its twins find it compiled afterwards.
    let mut seen = std::collections::HashSet::new();
    let missing: Vec<usize> = (0..work.len()).filter(|&i| out[i].is_none() && seen.insert(signature_hash(work[i].0, &work[i].1, work[i].2))).collect();
    // GL compiles under one context lock that wgpu-hal gives up on after 6
    // s: threads there only queue behind each other, and a slow software
    // driver (llvmpipe on a loaded machine) made a waiting one panic.
    let cores = if ctx.info.backend == wgpu::Backend::Gl { 1 } else { std::thread::available_parallelism().map_or(1, |n| n.get()) };
    let threads = cores.min(missing.len());
    if threads > 1 {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let results: Vec<Vec<(usize, Result<Arc<Compiled>>)>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        let mut done = vec![];
                        loop {
                            let j = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&i) = missing.get(j) else { break };
                            let (k, inputs, v) = &work[i];
                            done.push((i, compile(ctx, k, inputs, *v)));
                        }
                        done
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap_or_default()).collect()
        });
        for (i, r) in results.into_iter().flatten() {
            out[i] = Some(r?);
        }
    }
    // Serially: what one thread suffices for, and anything a worker lost.
    for (i, (k, inputs, v)) in work.iter().enumerate() {
        if out[i].is_none() {
            out[i] = Some(compile(ctx, k, inputs, *v)?);
        }
    }
    Ok(out.into_iter().map(|c| c.expect("every kernel compiled above")).collect())
}

fn encode_and_submit(ctx: &GpuContext, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
    if inputs.len() != plan.input_count() {
        return Err(Error::Backend(format!("internal: a plan of {} inputs was run with {}", plan.input_count(), inputs.len())));
    }
    let mut bufs: Vec<Option<Arc<GpuBuf>>> = Vec::with_capacity(plan.slots.len());
    // Buffers freed while encoding; they return to the pool after the submit.
    let mut retired: Vec<GpuBuf> = Vec::new();
    for s in &plan.slots {
        bufs.push(match s.source {
            SlotSource::Input(k) => match &inputs[k] {
                Buffer::Wgpu(b) => Some(b.clone()),
                _ => {
                    return Err(Error::Device {
                        op: "realize",
                        msg: format!("a buffer of another device reached gpu:{}; move tensors with to_device", ctx.index),
                    })
                }
            },
            SlotSource::Kernel => None,
        });
    }
    let compiled_plan = crate::profile::time(Phase::Compile, || prepare(ctx, plan))?;
    // Outputs are taken as their kernels are encoded: a later kernel may free them.
    let mut outs: Vec<Option<Arc<GpuBuf>>> = vec![None; plan.outputs.len()];
    let mut encoded: Vec<(Encoded, usize)> = Vec::new();
    let mut labels: Vec<String> = Vec::new();
    for (ki, k) in plan.kernels.iter().enumerate() {
        // The kernel's outputs: its own, then those of a `Multi` kernel.
        let mut written: Vec<(usize, Arc<GpuBuf>)> = Vec::with_capacity(1 + k.also.len());
        for slot in k.outputs() {
            let dt = plan.slots[slot].dtype;
            let bytes = k.numel as u64 * elem_bytes(&ctx.caps, dt);
            let buf = match retired.iter().position(|b| b.size() == super::pool::bucket(bytes.max(4))) {
                Some(i) => retired.swap_remove(i).reuse(dt, k.numel),
                None => alloc_in_pass(ctx, dt, k.numel, bytes)?,
            };
            written.push((slot, Arc::new(buf)));
        }
        let compiled = &compiled_plan.kernels[ki];
        let input_buf = |i: usize| bufs[k.inputs[i]].as_ref().expect("inputs are live").raw();
        let out_bufs: Vec<&wgpu::Buffer> = written.iter().map(|(_, b)| b.raw()).collect();
        for e in bind_cached(ctx, compiled, &compiled_plan.bound[ki], &input_buf, &out_bufs, &k.kind.consts())? {
            encoded.push((e, ki));
        }
        if crate::backend::profiling() {
            let mut label = compiled.label().unwrap_or(k.kind.name()).to_string();
            // Which types a product ran in: an f32 operand keeps it off the tensor cores.
            if let KernelKind::Matmul { a, b, prologue, .. } = &k.kind {
                let dt = |i: usize| k.inputs.get(i).map_or(k.dtype, |&s| plan.slots[s].dtype);
                // A prologue computes the left operand in f32; it has no buffer.
                let left = if prologue.is_some() { "f32 prologue".to_string() } else { dt(a.input).to_string() };
                label.push_str(&format!(" [{left} x {} -> {}] {}", dt(b.input), k.dtype, k.ops.join(" ")));
            }
            labels.push(label);
        }
        for (slot, buf) in written {
            for (o, &s) in outs.iter_mut().zip(&plan.outputs) {
                if s == slot {
                    *o = Some(buf.clone());
                }
            }
            bufs[slot] = Some(buf);
        }
        // A buffer whose last reader is encoded may hold the output of a later
        // kernel of this same pass (wgpu orders that write after these reads).
        // It must not reach the shared pool before this submission does: another
        // thread could take it and submit a write that runs before our reads.
        for &s in &plan.free_after[ki] {
            if let Some(b) = bufs[s].take() {
                if let Ok(b) = Arc::try_unwrap(b) {
                    retired.push(b);
                }
            }
        }
    }
    let outs = outs
        .into_iter()
        .zip(&plan.outputs)
        .map(|(o, &slot)| match o.or_else(|| bufs[slot].clone()) {
            Some(b) => Ok(Buffer::Wgpu(b)),
            None => Err(Error::Backend(format!("internal: output slot {slot} of the plan was never computed"))),
        })
        .collect::<Result<Vec<_>>>()?;
    if encoded.is_empty() {
        return Ok(outs);
    }
    ctx.dispatches.fetch_add(encoded.len() as u64, Ordering::Relaxed);
    if !(crate::backend::profiling() && ctx.caps.timestamps) {
        ctx.encode_pending(encoded.len(), is_large(plan), |pass| {
            for (e, _) in &encoded {
                dispatch(pass, e);
            }
        })?;
        return Ok(outs);
    }
    // Profiling: a pass per kernel (`VOLTAIC_PROFILE=1`) or all kernels in
    // one pass as they run unprofiled (`=pass`), each pass bracketed by
    // timestamps, submitted and read back at once.
    let mode = crate::profile::mode();
    let mut encoder = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("voltaic") });
    if mode == Some(crate::profile::GpuTiming::Dispatch) && ctx.device.features().contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES) {
        // Stamp 0 at the pass's start and stamp k + 1 after kernel k.
        let n = plan.kernels.len();
        let t = super::transfer::Timing::with_stamps(ctx, n + 1);
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            pass.write_timestamp(t.set(), 0);
            let mut next = encoded.iter().peekable();
            for k in 0..n {
                while let Some((e, _)) = next.next_if(|(_, ek)| *ek == k) {
                    dispatch(&mut pass, e);
                }
                pass.write_timestamp(t.set(), k as u32 + 1);
            }
        }
        t.resolve(&mut encoder);
        let idx = ctx.submit(encoder.finish())?;
        let rows: Vec<(String, usize)> = plan.kernels.iter().zip(&labels).map(|(k, l)| (l.clone(), k.numel)).collect();
        t.report_stamps(ctx, idx, &rows)?;
        return Ok(outs);
    }
    let per_kernel = mode != Some(crate::profile::GpuTiming::Pass);
    let passes = if per_kernel { plan.kernels.len() } else { 1 };
    let t = super::transfer::Timing::new(ctx, passes);
    for pi in 0..passes {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: None,
            timestamp_writes: Some(t.writes(pi)),
        });
        for (e, _) in encoded.iter().filter(|(_, k)| !per_kernel || *k == pi) {
            dispatch(&mut pass, e);
        }
    }
    t.resolve(&mut encoder);
    let idx = ctx.submit(encoder.finish())?;
    let rows: Vec<(String, usize)> = if per_kernel {
        plan.kernels.iter().zip(&labels).map(|(k, l)| (l.clone(), k.numel)).collect()
    } else {
        vec![(format!("one pass of {} kernels, {} dispatches", plan.kernels.len(), encoded.len()), plan.kernels.iter().map(|k| k.numel).sum())]
    };
    t.report(ctx, idx, &rows)?;
    Ok(outs)
}

/// Whether a plan moves enough data (or does enough arithmetic) that the
/// GPU should start on it at once rather than wait for a batch (about a
/// tenth of a millisecond of work on a large GPU): below that, a submission
/// costs the host, and the GPU between submissions, more than the kernels take.
fn is_large(plan: &Plan) -> bool {
    let mut elements = 0usize;
    for k in &plan.kernels {
        elements += k.numel + k.inputs.iter().map(|&s| plan.slots[s].numel).sum::<usize>();
        if let KernelKind::Matmul { batch, m, k: kk, n, .. } = &k.kind {
            elements += batch * m * kk * n / 64;
        }
    }
    elements > 1 << 26
}

pub(crate) fn dispatch(pass: &mut wgpu::ComputePass<'_>, e: &Encoded) {
    pass.set_pipeline(&e.pipeline);
    pass.set_bind_group(0, &e.bind_group, &[]);
    pass.dispatch_workgroups(e.grid.0, e.grid.1, 1);
}

/// Spread `groups` workgroups over x and y within the adapter's per-dimension limit.
fn grid(ctx: &GpuContext, groups: u64) -> Result<(u32, u32)> {
    let max = ctx.caps.max_groups as u64;
    let x = groups.clamp(1, max);
    let y = groups.div_ceil(x).max(1);
    if y > max {
        return Err(Error::Backend(format!("a dispatch of {groups} workgroups exceeds gpu:{}'s grid of {max} x {max}", ctx.index)));
    }
    Ok((x as u32, y as u32))
}

/// `[n x dtype, ...]` of a kernel's inputs, for error messages.
fn shapes(inputs: &[(DType, usize)]) -> String {
    let parts: Vec<String> = inputs.iter().map(|(dt, n)| format!("{n} {dt}")).collect();
    format!("[{}]", parts.join(", "))
}
