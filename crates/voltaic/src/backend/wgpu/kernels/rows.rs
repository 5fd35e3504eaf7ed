//! Row kernels: softmax, layer norm and the like in one pass over each row.

use super::reduce::Reduction;
use super::{groups, Gen, PER, WG};
use crate::backend::wgpu::codegen::{cast, compute_ty, emit_expr_with, Dispatch, Indexer, Shader};
use crate::dtype::DType;
use crate::error::Result;
use crate::ir::RowStage;
use std::fmt::Write;

/// Threads per row of a segmented row kernel.
const SEG: u32 = 32;

/// The names of the earlier stages' values that `st`'s loads stand for
/// (`st{s}`), for `emit_expr_with`.
pub(crate) fn stage_values(st: &RowStage) -> Vec<(usize, String)> {
    st.from.iter().map(|&(l, s)| (l, format!("st{s}"))).collect()
}

impl Gen<'_> {
    /// Row-wise stages in one pass: a thread per row for short rows; a
    /// segment of `SEG` threads per row, several rows to a workgroup, for
    /// many rows of moderate length (a softmax over attention scores); else
    /// a workgroup per row. Threads stride along their row and combine
    /// each reduction in shared memory. Loads of earlier stages read `st{s}`.
    pub(crate) fn rows(&self, outer: usize, inner: usize, stages: &[RowStage], out: &RowStage) -> Result<Dispatch> {
        let mut sh = self.shader();
        let used: Vec<usize> = (0..self.inputs.len()).collect();
        self.bind_inputs(&mut sh, &used);
        self.bind_out(&mut sh);
        let threaded = inner <= 32;
        // A workgroup per row leaves most of a 64-thread group waiting on
        // its barriers when a row is a few hundred elements, and the rows
        // then run in many waves (98,304 rows of 128 for BERT's softmax at
        // batch 64); segments keep the threads busy and the waves few.
        let segmented = !threaded && inner <= 1024 && outer >= 1024;
        let wg: u32 = if threaded || segmented || inner > 2048 { WG } else { 64 };
        // Threads per row.
        let seg: u32 = if threaded { 1 } else if segmented { SEG } else { wg };
        let mut b = String::new();
        if threaded {
            let _ = writeln!(b, "    let row = group * {wg}u + lid;\n    if (row >= {outer}u) {{ return; }}");
        } else if segmented {
            // Every thread reaches every barrier: a row past the end reads
            // the last row again and stores nothing.
            let _ = writeln!(
                b,
                "    let lane = lid % {seg}u;\n    let row0 = group * {}u + lid / {seg}u;\n    let live = row0 < {outer}u;\n    let row = min(row0, {}u);",
                wg / seg,
                outer - 1
            );
        } else {
            // `row` is uniform across the workgroup, so the barriers below are too.
            let _ = writeln!(b, "    let row = group;\n    if (row >= {outer}u) {{ return; }}");
        }
        // A row's threads start at their place in it and step by their count.
        let (j0, step) = (if threaded { "0u" } else if segmented { "lane" } else { "lid" }, seg);
        // `unroll` elements per thread and trip: that many loads in flight.
        let unroll: u32 = if !threaded && inner as u32 >= 4 * step { PER } else { 1 };
        // The loop over a row's elements: `body(u)` sees `l`, the element's linear index.
        let over_row = |b: &mut String, sh: &mut Shader, st: &RowStage, emit: &dyn Fn(u32, &str) -> String| -> Result<()> {
            let _ = writeln!(b, "    for (var j = {j0}; j < {inner}u; j = j + {}u) {{", step * unroll);
            for u in 0..unroll {
                let _ = writeln!(b, "    {{\n    let jj = j + {}u;\n    if (jj < {inner}u) {{\n    let l = row * {inner}u + jj;", step * u);
                let mut ix = Indexer::new(&st.shape, "l");
                let v = emit_expr_with(b, sh, &mut ix, &st.expr, &stage_values(st))?;
                let _ = writeln!(b, "    {}\n    }}\n    }}", emit(u, &v));
            }
            let _ = writeln!(b, "    }}");
            Ok(())
        };
        // Each stage's constants follow the earlier stages' (`KernelKind::exprs` order).
        let mut bases = vec![0];
        for st in stages {
            bases.push(bases[bases.len() - 1] + st.expr.consts.len());
        }
        for (s, st) in stages.iter().enumerate() {
            sh.set_const_base(bases[s]);
            let ty = compute_ty(st.dtype);
            let _ = writeln!(b, "    var st{s}: {ty};\n    {{");
            let Some(op) = st.op else {
                let _ = writeln!(b, "    let l = row;");
                let mut ix = Indexer::new(&st.shape, "l");
                let v = emit_expr_with(&mut b, &mut sh, &mut ix, &st.expr, &stage_values(st))?;
                let _ = writeln!(b, "    st{s} = {};\n    }}", cast(st.expr.dtype(), st.dtype, &v));
                continue;
            };
            let r = Reduction { op, adt: DType::F32, vdt: st.expr.dtype(), out: st.dtype };
            // The op table's combining primitive (row reductions are never arg reductions).
            let fold = |a: &str, v: &str| r.fold(a, "0u", v, "0u");
            for u in 0..unroll {
                let _ = writeln!(b, "    var acc{u}: f32 = {};", r.identity());
            }
            let vdt = st.expr.dtype();
            over_row(&mut b, &mut sh, st, &|u, v| fold(&format!("acc{u}"), &cast(vdt, DType::F32, v)))?;
            let _ = writeln!(b, "    var acc = acc0;");
            for u in 1..unroll {
                let _ = writeln!(b, "    {}", fold("acc", &format!("acc{u}")));
            }
            if segmented {
                let _ = writeln!(b, "{}", r.segment_fold(&mut sh, "acc", seg));
            } else if !threaded {
                let _ = writeln!(b, "{}", r.workgroup_fold(&mut sh, "acc", wg));
            }
            let _ = writeln!(b, "    st{s} = {};\n    }}", r.finish("acc", "0u"));
        }
        let (odt, edt) = (self.out.0, out.expr.dtype());
        sh.set_const_base(bases[stages.len()]);
        if segmented {
            let _ = writeln!(b, "    if (live) {{");
        }
        over_row(&mut b, &mut sh, out, &|_, v| format!("st_out(l, {});", cast(edt, odt, v)))?;
        if segmented {
            let _ = writeln!(b, "    }}");
        }
        let groups = groups(outer, wg / seg);
        Ok(sh.finish(format!("rows {outer}x{inner} ({} stages)", stages.len()), wg, groups, &b))
    }
}
