//! Fused elementwise kernels: a thread per element, or four vec4s per thread
//! for large contiguous 32-bit work.

use super::{groups, Gen, PER, WG};
use crate::backend::wgpu::codegen::{cast, emit_expr, emit_expr_with, storage_ty, Dispatch, Indexer, Src};
use crate::dtype::DType;
use crate::error::Result;
use crate::ir::Expr;
use std::fmt::Write;

impl Gen<'_> {
    /// Large elementwise kernels over 32-bit types whose loads are contiguous
    /// (or single broadcast values) move four elements per thread as vec4,
    /// which reaches the memory bandwidth where scalar accesses fall short.
    fn elementwise_vec4(&self, expr: &Expr) -> Result<Option<Dispatch>> {
        let n = self.out.1;
        let word = |dt: DType| matches!(dt, DType::F32 | DType::I32 | DType::U32);
        let fits = |numel: usize| (numel as u64) * 4 <= self.caps.chunk_bytes();
        if !n.is_multiple_of(4) || n < 1 << 16 || !word(self.out.0) || !fits(n) {
            return Ok(None);
        }
        enum Src4 {
            Vec(usize),
            Scalar(usize),
        }
        let mut kinds = Vec::with_capacity(expr.loads.len());
        for l in &expr.loads {
            let (dt, numel) = self.inputs[l.input];
            if !word(dt) || !fits(numel) || l.path.len() != 1 {
                return Ok(None);
            }
            let p = &l.path[0];
            kinds.push(if p.is_contiguous() && p.offset() % 4 == 0 {
                Src4::Vec(p.offset() / 4)
            } else if p.strides().iter().all(|&s| s == 0) {
                Src4::Scalar(p.offset())
            } else {
                return Ok(None);
            });
        }
        // Large kernels give each thread four vec4s a workgroup apart, all
        // loaded (at clamped indices) before any is used: more bytes in
        // flight per thread, a quarter of the workgroups.
        let n4 = n / 4;
        let per = if n4 >= 16 * 1024 { 4 } else { 1 };
        let mut sh = self.shader();
        let mut b = format!("    let i0 = group * {}u + lid;\n    if (i0 >= {n4}u) {{ return; }}\n", WG as usize * per);
        let mut values = vec![];
        for (li, (l, k)) in expr.loads.iter().zip(&kinds).enumerate() {
            let ty = storage_ty(self.caps, self.inputs[l.input].0);
            match k {
                Src4::Vec(off) => {
                    sh.bind_raw(Src::Input(l.input), &format!("vl{li}"), &format!("array<vec4<{ty}>>"), false);
                    for u in 0..per {
                        let _ = writeln!(b, "    let x{li}_{u} = vl{li}[min(i0 + {}u, {}u) + {off}u];", u * WG as usize, n4 - 1);
                    }
                }
                Src4::Scalar(off) => {
                    sh.bind_raw(Src::Input(l.input), &format!("sl{li}"), &format!("array<{ty}>"), false);
                    let _ = writeln!(b, "    let x{li} = sl{li}[{off}u];");
                }
            }
            values.push(li);
        }
        let ot = storage_ty(self.caps, self.out.0);
        sh.bind_raw(Src::Output, "outv", &format!("array<vec4<{ot}>>"), true);
        for u in 0..per {
            let _ = writeln!(b, "    {{\n    let i = i0 + {}u;\n    if (i < {n4}u) {{\n    var r: vec4<{ot}>;", u * WG as usize);
            for lane in 0..4 {
                let overrides: Vec<(usize, String)> = values
                    .iter()
                    .map(|&li| (li, if matches!(kinds[li], Src4::Vec(_)) { format!("x{li}_{u}[{lane}]") } else { format!("x{li}") }))
                    .collect();
                let _ = writeln!(b, "    {{");
                let mut ix = Indexer::new(&[n], "i");
                let v = emit_expr_with(&mut b, &mut sh, &mut ix, expr, &overrides)?;
                let _ = writeln!(b, "    r[{lane}] = {};\n    }}", cast(expr.dtype(), self.out.0, &v));
            }
            let _ = writeln!(b, "    outv[i] = r;\n    }}\n    }}");
        }
        Ok(Some(sh.finish(format!("elementwise_vec4 [{n}]"), WG, groups(n4, WG * per as u32), &b)))
    }

    pub(crate) fn elementwise(&self, expr: &Expr, shape: &[usize]) -> Result<Dispatch> {
        if let Some(d) = self.elementwise_vec4(expr)? {
            return Ok(d);
        }
        let mut sh = self.shader();
        let used: Vec<usize> = (0..self.inputs.len()).collect();
        self.bind_inputs(&mut sh, &used);
        self.bind_out(&mut sh);
        let n = self.out.1;
        // Each thread takes PER elements, WG apart: loads stay coalesced and
        // more of them are in flight.
        // Small tensors take one element per thread: their latency is the
        // chain of ops, not memory.
        let per = if n >= 1 << 20 { PER } else { 1 };
        let mut b = String::new();
        for k in 0..per {
            let _ = writeln!(b, "    {{\n    let i = group * {}u + {}u + lid;\n    if (i < {n}u) {{", WG * per, WG * k);
            let mut ix = Indexer::new(shape, "i");
            let v = emit_expr(&mut b, &mut sh, &mut ix, expr)?;
            let _ = writeln!(b, "    st_out(i, {});\n    }}\n    }}", cast(expr.dtype(), self.out.0, &v));
        }
        Ok(sh.finish(format!("elementwise {shape:?}"), WG, groups(n, WG * per), &b))
    }
}
