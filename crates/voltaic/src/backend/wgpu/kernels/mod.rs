//! One WGSL renderer per kernel kind of the IR.
//!
//! Elementwise, reduction and row kernels splice the fused expressions from
//! `codegen`; matmul (`../matmul.rs`) and the index-like kernels read their
//! inputs through strided views.

mod elementwise;
mod index;
pub(crate) use index::UNSIGNED_INDEX;
mod reduce;
pub(crate) use reduce::{butterfly, Reduction};
mod rows;
pub(crate) use rows::stage_values;

use super::codegen::{Shader, Src, WgslProgram};
use super::context::Caps;
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::ir::{Kernel, KernelKind};

/// Invocations per workgroup of the one-thread-per-element kernels.
pub(crate) const WG: u32 = 256;
/// Elements each thread of an elementwise kernel computes.
pub(crate) const PER: u32 = 4;

/// The program that computes kernel `k`; `inputs` gives each input's dtype
/// and element count. `variant` picks the matmul kernel (the shape
/// heuristic when `None`).
pub(crate) fn program(caps: &Caps, k: &Kernel, inputs: &[(DType, usize)], variant: Option<super::matmul::Variant>) -> Result<WgslProgram> {
    let mut p = WgslProgram::default();
    if k.numel == 0 {
        return Ok(p);
    }
    let g = Gen { caps, inputs, out: (k.dtype, k.numel) };
    match &k.kind {
        KernelKind::Elementwise { expr, shape } => p.dispatches.push(g.elementwise(expr, shape, &[expr.instrs.len().saturating_sub(1)])?),
        KernelKind::Multi { expr, shape, stores } => p.dispatches.push(g.elementwise(expr, shape, stores)?),
        KernelKind::Reduce { op, expr, shape, outer, inner } => g.reduce(&mut p, *op, expr, shape, *outer, *inner)?,
        KernelKind::Matmul { a, b, m, k: kk, n, epilogue, quant: Some(q), prologue, .. } => {
            g.qmatmul(&mut p, a, b, *q, (*m, *kk, *n), epilogue.as_ref(), prologue.as_ref())?
        }
        KernelKind::Matmul { prologue: Some(_), .. } => bail!(Device, "realize", "a prologue before a dense product (only quantized GEMVs take one)"),
        KernelKind::Matmul { a, b, batch, m, k: kk, n, epilogue, quant: None, prologue: None } => {
            let r = b.layout.dims().len();
            let (sbk, sbn) = (b.layout.strides()[r - 2], b.layout.strides()[r - 1]);
            let variant = variant.unwrap_or_else(|| super::matmul::default_variant(*batch, *m, *kk, *n, sbn == 1 || sbk != 1));
            g.matmul(&mut p, a, b, *m, *kk, *n, variant, epilogue.as_ref())?
        }
        // The GPU does not ask for them (`Capabilities::index_epilogues`).
        KernelKind::Index { epilogue: Some(_), .. } => bail!(Device, "realize", "an index kernel with a fused epilogue reached the GPU executor"),
        KernelKind::Index { op, args, prologues, epilogue: None } => g.index(&mut p, op, args, prologues)?,
        KernelKind::Rows { outer, inner, stages, out } => p.dispatches.push(g.rows(*outer, *inner, stages, out)?),
    }
    Ok(p)
}

/// Generates the programs of one kernel.
pub(crate) struct Gen<'a> {
    pub caps: &'a Caps,
    pub inputs: &'a [(DType, usize)],
    pub out: (DType, usize),
}

pub(crate) fn groups(n: usize, per: u32) -> u64 {
    (n as u64).div_ceil(per as u64)
}

impl Gen<'_> {
    pub(crate) fn shader(&self) -> Shader<'_> {
        Shader::new(self.caps)
    }

    /// Bind the kernel's inputs `which` (each once, though a kernel may read
    /// one buffer twice: `x.t().matmul(&x)`) as `in{k}`.
    pub(crate) fn bind_inputs(&self, sh: &mut Shader, which: &[usize]) {
        for (i, &k) in which.iter().enumerate() {
            if which[..i].contains(&k) {
                continue;
            }
            let (dt, n) = self.inputs[k];
            sh.array(Src::Input(k), &format!("in{k}"), dt, n, false);
        }
    }

    pub(crate) fn bind_out(&self, sh: &mut Shader) {
        sh.array(Src::Output, "out", self.out.0, self.out.1, true);
    }
}
