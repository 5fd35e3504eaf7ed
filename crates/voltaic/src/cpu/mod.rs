//! The CPU executor: runs the scheduler's kernels with rayon and gemm.

pub(crate) mod elementwise;
pub mod fastmath;
pub(crate) mod index;
pub(crate) mod matmul;
pub mod pool;
pub(crate) mod reduce;

use crate::error::Result;
use crate::graph::kernel::{Kernel, KernelKind, View};
use crate::graph::Buffer;
use crate::storage::CpuStorage;
use std::sync::Arc;

/// Run one kernel; `bufs` holds every live slot of the plan.
pub(crate) fn run_kernel(k: &Kernel, bufs: &[Option<Buffer>]) -> Result<Buffer> {
    check_alloc(k.numel * k.dtype.size_in_bytes())?;
    let mut inputs: Vec<&CpuStorage> = Vec::with_capacity(k.inputs.len());
    for &s in &k.inputs {
        match bufs[s].as_ref().expect("input slot is live") {
            Buffer::Cpu(b) => inputs.push(b),
            Buffer::Gpu(_) => crate::error::bail!(Device, "realize", "a GPU buffer reached the CPU executor; move tensors with to_device"),
        }
    }
    let out = match &k.kind {
        KernelKind::Elementwise { expr, shape } => elementwise::run(expr, shape, &inputs, k.dtype),
        KernelKind::Reduce { op, expr, shape, outer, inner } => {
            reduce::run(*op, expr, shape, *outer, *inner, &inputs, k.dtype)
        }
        KernelKind::Matmul { a, b, batch: _, m, k: kk, n, epilogue } => match epilogue {
            None => matmul::run(a, b, *m, *kk, *n, &inputs, k.dtype),
            Some(e) => {
                // The product first, then the epilogue with it as one more input.
                let product = matmul::run(a, b, *m, *kk, *n, &inputs, e.acc_dtype);
                let mut expr = e.expr.clone();
                expr.loads[e.acc].input = inputs.len();
                let mut all = inputs.clone();
                all.push(&product);
                elementwise::run(&expr, &e.shape, &all, k.dtype)
            }
        },
        KernelKind::Gather { dim, input, index } => index::gather(*dim, input, index, &inputs)?,
        KernelKind::ScatterAdd { dim, input, index, src } => index::scatter_add(*dim, input, index, src, &inputs)?,
        KernelKind::IndexSelect { dim, input, index } => index::index_select(*dim, input, index, &inputs)?,
        KernelKind::Cumsum { dim, input } => index::cumsum(*dim, input, &inputs),
        KernelKind::Cat { dim, parts } => index::cat(*dim, parts, &inputs, k.dtype, k.numel),
        KernelKind::Unfold { input, params, pad } => index::unfold(input, params, *pad, &inputs),
        KernelKind::Fold { input, params, hw } => index::fold(input, params, *hw, &inputs),
        // The CPU scheduler keeps reductions as their own kernels (rows are in cache anyway).
        KernelKind::Rows { .. } => crate::error::bail!(Device, "realize", "a row-fused kernel reached the CPU executor"),
    };
    debug_assert_eq!(out.len(), k.numel, "{} kernel wrote the wrong number of elements", k.kind.name());
    Ok(Buffer::Cpu(Arc::new(pool::HostBuf::new(out))))
}

/// Fail with `OutOfMemory` instead of aborting when a large output cannot be
/// allocated (Rust aborts the process on a failed infallible allocation).
pub(crate) fn check_alloc(bytes: usize) -> Result<()> {
    if bytes >= 1 << 28 {
        let mut probe: Vec<u8> = Vec::new();
        if probe.try_reserve_exact(bytes).is_err() {
            return Err(crate::Error::OutOfMemory(format!("cannot allocate {bytes} bytes of host memory")));
        }
    }
    Ok(())
}

/// The storage a view reads.
pub(crate) fn input<'a>(v: &View, inputs: &[&'a CpuStorage]) -> &'a CpuStorage {
    inputs[v.input]
}

/// Number of worker threads.
pub(crate) fn threads() -> usize {
    rayon::current_num_threads().max(1)
}
