//! The CPU executor: runs plans with rayon and gemm.

pub(crate) mod elementwise;
pub(crate) mod index;
pub(crate) mod matmul;
pub(crate) mod maxpool2x2;
pub(crate) mod pool;
pub(crate) mod qdot;
pub(crate) mod quant;
pub(crate) mod reduce;
pub(crate) mod simd;

use super::{Buffer, Capabilities, Completion, DeviceStats, Executor, HostData, HostView, PendingRead};
use crate::error::{bail, Result};
use crate::ir::{Kernel, KernelKind, Plan, SlotSource, Strided};
use crate::layout::Layout;
use crate::storage::{check_alloc, CpuStorage};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The process's CPU executor.
pub(crate) struct CpuExecutor {
    kernels: AtomicU64,
}

/// The CPU executor (one per process: rayon's pool is shared anyway).
pub(crate) fn executor() -> Arc<dyn Executor> {
    static EXEC: OnceLock<Arc<CpuExecutor>> = OnceLock::new();
    EXEC.get_or_init(|| Arc::new(CpuExecutor { kernels: AtomicU64::new(0) })).clone()
}

impl CpuExecutor {
    fn run_plan(&self, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
        if inputs.len() != plan.input_count() {
            bail!(Device, "realize", "internal: a plan of {} inputs was run with {}", plan.input_count(), inputs.len());
        }
        let mut bufs: Vec<Option<Arc<pool::HostBuf>>> = Vec::with_capacity(plan.slots.len());
        for s in &plan.slots {
            bufs.push(match s.source {
                SlotSource::Input(k) => match &inputs[k] {
                    Buffer::Host(b) => Some(b.clone()),
                    _ => bail!(Device, "realize", "a buffer of another device reached the CPU executor; move tensors with to_device"),
                },
                SlotSource::Kernel => None,
            });
        }
        // Outputs are taken as their kernels finish: a later kernel may free them.
        let mut outs: Vec<Option<Arc<pool::HostBuf>>> = vec![None; plan.outputs.len()];
        let profile = super::profiling();
        let mut times = vec![];
        for (k, kernel) in plan.kernels.iter().enumerate() {
            let t0 = web_time::Instant::now();
            let out = Arc::new(pool::HostBuf::pooled(run_kernel(kernel, &bufs)?));
            if profile {
                times.push((t0.elapsed().as_secs_f64() * 1e6, kernel.numel, format!("{} ({})", kernel.kind.name(), kernel.ops.join(" "))));
            }
            for (o, &slot) in outs.iter_mut().zip(&plan.outputs) {
                if slot == kernel.out {
                    *o = Some(out.clone());
                }
            }
            bufs[kernel.out] = Some(out);
            for &s in &plan.free_after[k] {
                bufs[s] = None;
            }
        }
        self.kernels.fetch_add(plan.kernels.len() as u64, Ordering::Relaxed);
        if profile && !times.is_empty() {
            eprintln!("voltaic profile (cpu):");
            for (us, n, label) in &times {
                eprintln!("  {us:>10.1} us  {n:>12} elements  {label}");
            }
            let m = pool::stats();
            eprintln!(
                "  host pool: {:.1} MiB cached (peak {:.1} MiB), {:.1}% of {} requests reused, {} evicted",
                m.cached as f64 / 1048576.0,
                m.peak_cached as f64 / 1048576.0,
                100.0 * m.hit_rate(),
                m.hits + m.misses,
                m.evictions
            );
        }
        outs.into_iter()
            .zip(&plan.outputs)
            .map(|(o, &slot)| match o.or_else(|| bufs[slot].clone()) {
                Some(b) => Ok(Buffer::Host(b)),
                None => bail!(Device, "realize", "internal: output slot {slot} of the plan was never computed"),
            })
            .collect()
    }
}

impl Executor for CpuExecutor {
    fn capabilities(&self) -> Capabilities {
        Capabilities { row_kernels: false, strided_reads: true, dense_wide_qmatmul: false, multi_output: false, max_inputs: usize::MAX, prologue_rows: 0, index_epilogues: true }
    }

    fn run(&self, plan: &Plan, inputs: &[Buffer]) -> Result<Vec<Buffer>> {
        // The whole plan runs on a worker of rayon's pool: each parallel
        // kernel then splits its work by stealing among the workers, where
        // from the caller's thread every one of them would be a job injected
        // into the pool and a sleep until it is done (a decode step of a
        // language model runs some 300 small kernels; that cost was a third
        // of its time on 2 cores).
        crate::profile::time(crate::profile::Phase::Execute, || {
            if rayon::current_thread_index().is_some() {
                self.run_plan(plan, inputs)
            } else {
                rayon::join(|| self.run_plan(plan, inputs), || ()).0
            }
        })
    }

    fn upload(&self, data: CpuStorage) -> Result<Buffer> {
        Ok(Buffer::Host(Arc::new(pool::HostBuf::foreign(data))))
    }

    fn read_start(&self, buf: &Buffer, layout: &Layout) -> Result<PendingRead> {
        match buf {
            Buffer::Host(b) => Ok(PendingRead::ready(HostView { data: HostData::Shared(b.clone()), layout: layout.clone() })),
            _ => bail!(Device, "to_vec", "a buffer of another device reached the CPU executor"),
        }
    }

    fn completion(&self) -> Result<Option<Box<dyn Completion>>> {
        // Plans run to the end when they are given.
        Ok(None)
    }

    fn stats(&self) -> DeviceStats {
        DeviceStats {
            dispatches: self.kernels.load(Ordering::Relaxed),
            memory: pool::stats(),
            ..Default::default()
        }
    }

    fn empty_cache(&self) -> Result<()> {
        pool::empty_cache();
        Ok(())
    }
}

/// Run one kernel; `bufs` holds every live slot of the plan.
fn run_kernel(k: &Kernel, bufs: &[Option<Arc<pool::HostBuf>>]) -> Result<CpuStorage> {
    check_alloc(k.numel * k.dtype.size_in_bytes())?;
    let live = |s: usize| -> &CpuStorage { bufs[s].as_ref().expect("input slot is live") };
    let inputs: Vec<&CpuStorage> = k.inputs.iter().map(|&s| live(s)).collect();
    let out = match &k.kind {
        KernelKind::Elementwise { expr, shape } => elementwise::run(expr, shape, &inputs, k.dtype),
        KernelKind::Reduce { op, expr, outer, inner, .. } => reduce::run(*op, expr, *outer, *inner, &inputs, k.dtype),
        // The CPU does not ask for them (`Capabilities::prologue_rows`).
        KernelKind::Matmul { prologue: Some(_), .. } => bail!(Device, "realize", "a product with a fused prologue reached the CPU executor"),
        KernelKind::Matmul { a, b, batch: _, m, k: kk, n, epilogue, quant, prologue: None } => {
            let product = |dtype| match quant {
                Some(q) => quant::matmul(a, b, *q, *m, *kk, *n, &inputs),
                None => matmul::run(a, b, *m, *kk, *n, &inputs, dtype),
            };
            match epilogue {
                None => product(k.dtype),
                Some(e) => match quant.is_none().then(|| matmul::run_with_epilogue(a, b, *m, *kk, *n, &inputs, e, k.dtype)).flatten() {
                    Some(out) => out,
                    None => epilogue_after(product(e.acc_dtype), e, &inputs, k.dtype),
                },
            }
        }
        KernelKind::Index { prologues, .. } if prologues.iter().any(Option::is_some) => bail!(Device, "realize", "an index kernel with a fused prologue reached the CPU executor"),
        KernelKind::Index { op, args, epilogue: None, .. } => index::run(op, args, &inputs, k.dtype, k.numel)?,
        KernelKind::Index { op, args, epilogue: Some(e), .. } => match index::run_with_epilogue(op, args, &inputs, e, k.dtype, k.numel) {
            Some(out) => out,
            None => epilogue_after(index::run(op, args, &inputs, e.acc_dtype, k.numel)?, e, &inputs, k.dtype),
        },
        // The CPU keeps reductions as their own kernels (rows are in cache anyway).
        KernelKind::Rows { .. } => bail!(Device, "realize", "a row-fused kernel reached the CPU executor"),
        // The CPU does not ask for them (`Capabilities::multi_output`).
        KernelKind::Multi { .. } => bail!(Device, "realize", "a kernel of several outputs reached the CPU executor"),
    };
    debug_assert_eq!(out.len(), k.numel, "{} kernel wrote the wrong number of elements", k.kind.name());
    Ok(out)
}

/// A kernel's `result`, then its epilogue as a pass of its own, with the
/// result as one more input.
fn epilogue_after(result: CpuStorage, e: &crate::ir::Epilogue, inputs: &[&CpuStorage], dtype: crate::dtype::DType) -> CpuStorage {
    // Wrapped so that the temporary goes back to the pool when dropped.
    let result = pool::HostBuf::pooled(result);
    let mut expr = e.expr.clone();
    expr.loads[e.acc].input = inputs.len();
    let mut all = inputs.to_vec();
    all.push(&result);
    elementwise::run(&expr, &e.shape, &all, dtype)
}

/// The storage a strided operand reads.
pub(crate) fn input<'a>(v: &Strided, inputs: &[&'a CpuStorage]) -> &'a CpuStorage {
    inputs[v.input]
}

/// Number of worker threads.
pub(crate) fn threads() -> usize {
    rayon::current_num_threads().max(1)
}
