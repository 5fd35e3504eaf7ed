//! One WGSL program per kernel kind of the scheduler.
//!
//! Elementwise and reduction kernels splice the fused expression from
//! `codegen`; the others (matmul, gather, scatter_add, index_select, cumsum,
//! cat, unfold) read their inputs through strided views.

use super::codegen::{cast, compute_ty, emit_expr, literal, storage_ty, strided, unravel, Dispatch, Indexer, Program, Shader, Src};
use super::context::Caps;
use crate::dtype::DType;
use crate::error::Result;
use crate::graph::kernel::{Expr, Kernel, KernelKind, RowStage, View};
use crate::graph::UnfoldParams;
use crate::layout::Layout;
use crate::op::ReduceOp;
use std::fmt::Write;

/// Invocations per workgroup of the one-thread-per-element kernels.
const WG: u32 = 256;
/// Elements each thread of an elementwise kernel computes.
const PER: u32 = 4;

/// The program that computes kernel `k`; `inputs` gives each input's dtype
/// and element count.
/// `plan` picks the matmul kernel (the shape heuristic when `None`).
pub(crate) fn program(caps: &Caps, k: &Kernel, inputs: &[(DType, usize)], plan: Option<super::matmul::Plan>) -> Result<Program> {
    let mut p = Program::default();
    if k.numel == 0 {
        return Ok(p);
    }
    let g = Gen { caps, inputs, out: (k.dtype, k.numel) };
    match &k.kind {
        KernelKind::Elementwise { expr, shape } => p.dispatches.push(g.elementwise(expr, shape)?),
        KernelKind::Reduce { op, expr, shape, outer, inner } => g.reduce(&mut p, *op, expr, shape, *outer, *inner)?,
        KernelKind::Matmul { a, b, batch, m, k: kk, n, epilogue } => {
            let r = b.layout.dims().len();
            let (sbk, sbn) = (b.layout.strides()[r - 2], b.layout.strides()[r - 1]);
            let plan = plan.unwrap_or_else(|| super::matmul::default_plan(*batch, *m, *kk, *n, sbn == 1 || sbk != 1));
            g.matmul(&mut p, a, b, *m, *kk, *n, plan, epilogue.as_ref())?
        }
        KernelKind::Gather { dim, input, index } => p.dispatches.push(g.gather(*dim, input, index)),
        KernelKind::IndexSelect { dim, input, index } => p.dispatches.push(g.index_select(*dim, input, index)),
        KernelKind::ScatterAdd { dim, input, index, src } => {
            p.dispatches.push(g.copy(input, "scatter_add_copy"));
            if index.layout.numel() > 0 {
                p.dispatches.push(g.scatter_add(*dim, input, index, src));
            }
        }
        KernelKind::Cumsum { dim, input } => p.dispatches.push(g.cumsum(*dim, input)),
        KernelKind::Cat { dim, parts } => {
            let total: usize = parts.iter().map(|v| v.layout.dims()[*dim]).sum();
            let mut at = 0;
            for part in parts {
                if part.layout.numel() > 0 {
                    p.dispatches.push(g.cat_part(*dim, part, at, total));
                }
                at += part.layout.dims()[*dim];
            }
        }
        KernelKind::Unfold { input, params, pad } => p.dispatches.push(g.unfold(input, params, *pad)),
        KernelKind::Fold { input, params, hw } => p.dispatches.push(g.fold(input, params, *hw)),
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

fn groups(n: usize, per: u32) -> u64 {
    (n as u64).div_ceil(per as u64)
}

impl Gen<'_> {
    fn shader(&self) -> Shader<'_> {
        Shader::new(self.caps)
    }

    pub(crate) fn bind_inputs(&self, sh: &mut Shader, which: &[usize]) {
        for &k in which {
            let (dt, n) = self.inputs[k];
            sh.array(Src::Input(k), &format!("in{k}"), dt, n, false);
        }
    }

    pub(crate) fn bind_out(&self, sh: &mut Shader) {
        sh.array(Src::Output, "out", self.out.0, self.out.1, true);
    }

    /// Large elementwise kernels over 32-bit types whose loads are contiguous
    /// (or single broadcast values) move four elements per thread as vec4,
    /// which reaches the memory bandwidth where scalar accesses fall short.
    fn elementwise_vec4(&self, expr: &Expr) -> Result<Option<Dispatch>> {
        let n = self.out.1;
        let word = |dt: DType| matches!(dt, DType::F32 | DType::I32 | DType::U32);
        let fits = |numel: usize| (numel as u64) * 4 <= self.caps.chunk_bytes();
        if n % 4 != 0 || n < 1 << 16 || !word(self.out.0) || !fits(n) {
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
            let ty = storage_ty(self.inputs[l.input].0);
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
        let ot = storage_ty(self.out.0);
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
                let v = super::codegen::emit_expr_with(&mut b, &mut sh, &mut ix, expr, &overrides)?;
                let _ = writeln!(b, "    r[{lane}] = {};\n    }}", cast(expr.dtype(), self.out.0, &v));
            }
            let _ = writeln!(b, "    outv[i] = r;\n    }}\n    }}");
        }
        Ok(Some(sh.finish(format!("elementwise_vec4 [{n}]"), WG, groups(n4, WG * per as u32), &b)))
    }

    fn elementwise(&self, expr: &Expr, shape: &[usize]) -> Result<Dispatch> {
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

    /// Copy a strided view into the (contiguous) output.
    fn copy(&self, v: &View, label: &str) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[v.input]);
        self.bind_out(&mut sh);
        let n = v.layout.numel();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", v.layout.dims());
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", v.input, strided(&d, &v.layout));
        sh.finish(label.to_string(), WG, groups(n, WG), &b)
    }

    fn reduce(&self, p: &mut Program, op: ReduceOp, expr: &Expr, shape: &[usize], outer: usize, inner: usize) -> Result<()> {
        let vdt = expr.dtype();
        // Bools reduce as 0/1 counters.
        let adt = if vdt == DType::Bool { DType::U32 } else { vdt.compute() };
        let r = Reduction { op, adt, vdt, out: self.out.0 };
        // Reading along the reduced dim with stride 1 favours a workgroup per
        // output; short or strided rows favour a thread per output, whose
        // neighbours then read neighbouring memory.
        // Loads that broadcast along the reduced dims (stride 0) do not count.
        let inner_contig = expr.loads.iter().all(|l| l.path.len() == 1 && matches!(l.path[0].strides().last(), Some(0 | 1)));
        if inner <= 64 || (!inner_contig && outer >= 1024) {
            p.dispatches.push(self.reduce_rows(&r, expr, shape, outer, inner)?);
            return Ok(());
        }
        // Few long rows: split each over several workgroups, then combine.
        let splits = if outer >= 1024 { 1 } else { (inner / 8192).clamp(1, 2048usize.div_ceil(outer).max(1)) };
        let chunk = inner.div_ceil(splits);
        p.dispatches.push(self.reduce_groups(&r, expr, shape, outer, inner, splits, chunk)?);
        if splits > 1 {
            p.scratch.push((adt, outer * splits));
            p.scratch.push((DType::U32, outer * splits));
            p.dispatches.push(self.reduce_partials(&r, outer, splits));
        }
        Ok(())
    }

    /// One thread per output, looping over the reduced elements.
    fn reduce_rows(&self, r: &Reduction, expr: &Expr, shape: &[usize], outer: usize, inner: usize) -> Result<Dispatch> {
        let mut sh = self.shader();
        let used: Vec<usize> = (0..self.inputs.len()).collect();
        self.bind_inputs(&mut sh, &used);
        self.bind_out(&mut sh);
        r.decl(&mut sh);
        let mut b = format!("    let o = group * {WG}u + lid;\n    if (o >= {outer}u) {{ return; }}\n");
        let _ = writeln!(b, "    var acc: {} = {};\n    var ai: u32 = 0xffffffffu;", r.acc_ty(), r.identity());
        let _ = writeln!(b, "    for (var j = 0u; j < {inner}u; j = j + 1u) {{\n    let l = o * {inner}u + j;");
        let mut ix = Indexer::new(shape, "l");
        let v = emit_expr(&mut b, &mut sh, &mut ix, expr)?;
        let _ = writeln!(b, "    {}\n    }}", r.fold("acc", "ai", &r.value(&v), "j"));
        let _ = writeln!(b, "    st_out(o, {});", r.finish("acc", "ai"));
        Ok(sh.finish(format!("reduce_rows {} {outer}x{inner}", r.op.name()), WG, groups(outer, WG), &b))
    }

    /// A workgroup per (output, split), tree-combined in shared memory.
    #[allow(clippy::too_many_arguments)]
    fn reduce_groups(&self, r: &Reduction, expr: &Expr, shape: &[usize], outer: usize, inner: usize, splits: usize, chunk: usize) -> Result<Dispatch> {
        let mut sh = self.shader();
        let used: Vec<usize> = (0..self.inputs.len()).collect();
        self.bind_inputs(&mut sh, &used);
        if splits == 1 {
            self.bind_out(&mut sh);
        } else {
            sh.array(Src::Scratch(0), "pv", r.adt, outer * splits, true);
            sh.array(Src::Scratch(1), "pi", DType::U32, outer * splits, true);
        }
        r.decl(&mut sh);
        let at = r.acc_ty();
        sh.decl(&format!("var<workgroup> sv: array<{at}, {WG}>;\nvar<workgroup> si: array<u32, {WG}>;"));
        let total = outer * splits;
        let mut b = format!("    if (group >= {total}u) {{ return; }}\n    let o = group / {splits}u;\n    let s = group % {splits}u;\n");
        let _ = writeln!(b, "    let j0 = s * {chunk}u;\n    let j1 = min(j0 + {chunk}u, {inner}u);");
        // PER independent accumulators, so PER loads are in flight per thread.
        for k in 0..PER {
            let _ = writeln!(b, "    var acc{k}: {at} = {};\n    var ai{k}: u32 = 0xffffffffu;", r.identity());
        }
        let _ = writeln!(b, "    for (var j = j0 + lid; j < j1; j = j + {}u) {{", WG * PER);
        for k in 0..PER {
            let _ = writeln!(b, "    {{\n    let jj = j + {}u;\n    if (jj < j1) {{\n    let l = o * {inner}u + jj;", WG * k);
            let mut ix = Indexer::new(shape, "l");
            let v = emit_expr(&mut b, &mut sh, &mut ix, expr)?;
            let _ = writeln!(b, "    {}\n    }}\n    }}", r.fold(&format!("acc{k}"), &format!("ai{k}"), &r.value(&v), "jj"));
        }
        let _ = writeln!(b, "    }}\n    var acc = acc0;\n    var ai = ai0;");
        for k in 1..PER {
            let _ = writeln!(b, "    {}", r.fold("acc", "ai", &format!("acc{k}"), &format!("ai{k}")));
        }
        let _ = writeln!(b, "    sv[lid] = acc;\n    si[lid] = ai;\n    workgroupBarrier();");
        let _ = writeln!(
            b,
            "    for (var w = {}u; w > 0u; w = w >> 1u) {{
        if (lid < w) {{
            var x = sv[lid];
            var xi = si[lid];
            {}
            sv[lid] = x;
            si[lid] = xi;
        }}
        workgroupBarrier();
    }}",
            WG / 2,
            r.fold("x", "xi", "sv[lid + w]", "si[lid + w]")
        );
        if splits == 1 {
            let _ = writeln!(b, "    if (lid == 0u) {{ st_out(o, {}); }}", r.finish("sv[0]", "si[0]"));
        } else {
            let _ = writeln!(b, "    if (lid == 0u) {{ st_pv(group, sv[0]); st_pi(group, si[0]); }}");
        }
        Ok(sh.finish(format!("reduce {} {outer}x{inner} in {splits} splits", r.op.name()), WG, total as u64, &b))
    }

    /// Combine the per-split partials of each output, in split order.
    fn reduce_partials(&self, r: &Reduction, outer: usize, splits: usize) -> Dispatch {
        let mut sh = self.shader();
        sh.array(Src::Scratch(0), "pv", r.adt, outer * splits, false);
        sh.array(Src::Scratch(1), "pi", DType::U32, outer * splits, false);
        self.bind_out(&mut sh);
        r.decl(&mut sh);
        let mut b = format!("    let o = group * {WG}u + lid;\n    if (o >= {outer}u) {{ return; }}\n");
        let _ = writeln!(b, "    var acc: {} = {};\n    var ai: u32 = 0xffffffffu;", r.acc_ty(), r.identity());
        let _ = writeln!(
            b,
            "    for (var s = 0u; s < {splits}u; s = s + 1u) {{\n        {}\n    }}",
            r.fold("acc", "ai", &format!("ld_pv(o * {splits}u + s)"), &format!("ld_pi(o * {splits}u + s)"))
        );
        let _ = writeln!(b, "    st_out(o, {});", r.finish("acc", "ai"));
        sh.finish(format!("reduce_partials {}", r.op.name()), WG, groups(outer, WG), &b)
    }

    /// Row-wise stages in one pass: a thread per row for short rows, else a
    /// workgroup per row whose threads stride along it and combine each
    /// reduction in shared memory. Loads of earlier stages read `st{s}`.
    fn rows(&self, outer: usize, inner: usize, stages: &[RowStage], out: &RowStage) -> Result<Dispatch> {
        let mut sh = self.shader();
        let used: Vec<usize> = (0..self.inputs.len()).collect();
        self.bind_inputs(&mut sh, &used);
        self.bind_out(&mut sh);
        let threaded = inner <= 32;
        let wg: u32 = if threaded || inner > 2048 { WG } else { 64 };
        let mut b = String::new();
        if threaded {
            let _ = writeln!(b, "    let row = group * {wg}u + lid;\n    if (row >= {outer}u) {{ return; }}");
        } else {
            // `row` is uniform across the workgroup, so the barriers below are too.
            let _ = writeln!(b, "    let row = group;\n    if (row >= {outer}u) {{ return; }}");
            sh.decl(&format!("var<workgroup> sv: array<f32, {wg}>;"));
        }
        let (j0, step) = if threaded { ("0u", 1) } else { ("lid", wg) };
        // `unroll` elements per thread and trip: that many loads in flight.
        let unroll: u32 = if !threaded && inner as u32 >= 4 * wg { PER } else { 1 };
        let values = |st: &RowStage| -> Vec<(usize, String)> { st.from.iter().map(|&(l, s)| (l, format!("st{s}"))).collect() };
        // The loop over a row's elements: `body(u)` sees `l`, the element's linear index.
        let over_row = |b: &mut String, sh: &mut Shader, st: &RowStage, emit: &dyn Fn(u32, &str) -> String| -> Result<()> {
            let _ = writeln!(b, "    for (var j = {j0}; j < {inner}u; j = j + {}u) {{", step * unroll);
            for u in 0..unroll {
                let _ = writeln!(b, "    {{\n    let jj = j + {}u;\n    if (jj < {inner}u) {{\n    let l = row * {inner}u + jj;", step * u);
                let mut ix = Indexer::new(&st.shape, "l");
                let v = super::codegen::emit_expr_with(b, sh, &mut ix, &st.expr, &values(st))?;
                let _ = writeln!(b, "    {}\n    }}\n    }}", emit(u, &v));
            }
            let _ = writeln!(b, "    }}");
            Ok(())
        };
        for (s, st) in stages.iter().enumerate() {
            let ty = compute_ty(st.dtype);
            let _ = writeln!(b, "    var st{s}: {ty};\n    {{");
            let Some(op) = st.op else {
                let _ = writeln!(b, "    let l = row;");
                let mut ix = Indexer::new(&st.shape, "l");
                let v = super::codegen::emit_expr_with(&mut b, &mut sh, &mut ix, &st.expr, &values(st))?;
                let _ = writeln!(b, "    st{s} = {};\n    }}", cast(st.expr.dtype(), st.dtype, &v));
                continue;
            };
            let r = Reduction { op, adt: DType::F32, vdt: st.expr.dtype(), out: st.dtype };
            let fold = |a: &str, v: &str| match op {
                ReduceOp::Sum => format!("{a} = {a} + {v};"),
                ReduceOp::Prod => format!("{a} = {a} * {v};"),
                // NaN wins, as in the other reductions: once the accumulator is NaN it stays.
                ReduceOp::Max => format!("{{ let vv = {v}; if ((vv > {a} || isnan_(vv)) && !isnan_({a})) {{ {a} = vv; }} }}"),
                _ => format!("{{ let vv = {v}; if ((vv < {a} || isnan_(vv)) && !isnan_({a})) {{ {a} = vv; }} }}"),
            };
            for u in 0..unroll {
                let _ = writeln!(b, "    var acc{u}: f32 = {};", r.identity());
            }
            let vdt = st.expr.dtype();
            over_row(&mut b, &mut sh, st, &|u, v| fold(&format!("acc{u}"), &cast(vdt, DType::F32, v)))?;
            let _ = writeln!(b, "    var acc = acc0;");
            for u in 1..unroll {
                let _ = writeln!(b, "    {}", fold("acc", &format!("acc{u}")));
            }
            if !threaded {
                let _ = writeln!(b, "    sv[lid] = acc;\n    workgroupBarrier();");
                let _ = writeln!(
                    b,
                    "    for (var w = {}u; w > 0u; w = w >> 1u) {{\n        if (lid < w) {{\n            var x = sv[lid];\n            {}\n            sv[lid] = x;\n        }}\n        workgroupBarrier();\n    }}\n    acc = sv[0];\n    workgroupBarrier();",
                    wg / 2,
                    fold("x", "sv[lid + w]")
                );
            }
            let _ = writeln!(b, "    st{s} = {};\n    }}", r.finish("acc", "0u"));
        }
        let (odt, edt) = (self.out.0, out.expr.dtype());
        over_row(&mut b, &mut sh, out, &|_, v| format!("st_out(l, {});", cast(edt, odt, v)))?;
        let groups = if threaded { groups(outer, wg) } else { outer as u64 };
        Ok(sh.finish(format!("rows {outer}x{inner} ({} stages)", stages.len()), wg, groups, &b))
    }

    /// Read an index element (i32 or u32) as i32 into `name`, reporting it and
    /// using 0 when it is outside `[0, size)`.
    fn checked_index(&self, b: &mut String, name: &str, v: &View, off: &str, size: usize, op: u32) {
        let raw = format!("ld_in{}({off})", v.input);
        let as_i32 = if self.inputs[v.input].0 == DType::U32 { format!("bitcast<i32>({raw})") } else { raw };
        let _ = writeln!(
            b,
            "    var {name} = {as_i32};
    if ({name} < 0 || {name} >= {size}) {{ bad_index({op}u, {name}, {size}u); {name} = 0; }}"
        );
    }

    fn gather(&self, dim: usize, input: &View, index: &View) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input, index.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let n = index.layout.numel();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "i", index.layout.dims());
        let off = strided(&d, &index.layout);
        self.checked_index(&mut b, "x", index, &off, input.layout.dims()[dim], OP_GATHER);
        d[dim] = "u32(x)".into();
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", input.input, strided_all(&d, &input.layout));
        sh.finish("gather".into(), WG, groups(n, WG), &b)
    }

    fn index_select(&self, dim: usize, input: &View, index: &View) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input, index.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let mut dims = input.layout.dims().to_vec();
        dims[dim] = index.layout.numel();
        let n: usize = dims.iter().product();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "i", &dims);
        let off = strided(&[d[dim].clone()], &index.layout);
        self.checked_index(&mut b, "x", index, &off, input.layout.dims()[dim], OP_INDEX_SELECT);
        d[dim] = "u32(x)".into();
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", input.input, strided_all(&d, &input.layout));
        sh.finish("index_select".into(), WG, groups(n, WG), &b)
    }

    /// `out[.., index[p], ..] += src[p]`: one thread per line along `dim` of
    /// `index`, so no two threads touch the same output element and the
    /// additions happen in index order, as on the CPU.
    fn scatter_add(&self, dim: usize, input: &View, index: &View, src: &View) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[index.input, src.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let idims = index.layout.dims();
        let len = idims[dim];
        let mut line_dims = idims.to_vec();
        line_dims[dim] = 1;
        let lines: usize = line_dims.iter().product();
        let odims = input.layout.dims();
        let ostrides = crate::shape::Shape::new(odims).contiguous_strides();
        let mut b = format!("    let t = group * {WG}u + lid;\n    if (t >= {lines}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "t", &line_dims);
        let _ = writeln!(b, "    for (var j = 0u; j < {len}u; j = j + 1u) {{");
        d[dim] = "j".into();
        let ioff = strided_all(&d, &index.layout);
        self.checked_index(&mut b, "x", index, &ioff, odims[dim], OP_SCATTER_ADD);
        let soff = strided_all(&d, &src.layout);
        d[dim] = "u32(x)".into();
        let out_l = Layout { shape: crate::shape::Shape::new(odims), strides: ostrides, offset: 0 };
        let ooff = strided_all(&d, &out_l);
        let dt = self.out.0;
        let sum = if dt == DType::Bool {
            format!("ld_out(o) || ld_in{}({soff})", src.input)
        } else {
            super::codegen::round_to(dt, &format!("ld_out(o) + ld_in{}({soff})", src.input))
        };
        let _ = writeln!(b, "    let o = {ooff};\n    st_out(o, {sum});\n    }}");
        sh.finish("scatter_add".into(), WG, groups(lines, WG), &b)
    }

    fn cumsum(&self, dim: usize, input: &View) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let dims = l.dims();
        let len = dims[dim];
        let mut line_dims = dims.to_vec();
        line_dims[dim] = 1;
        let lines: usize = line_dims.iter().product();
        let inner: usize = dims[dim + 1..].iter().product();
        let dt = self.out.0;
        let ct = compute_ty(dt);
        let mut b = format!("    let t = group * {WG}u + lid;\n    if (t >= {lines}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "t", &line_dims);
        let base = strided(&d, l);
        let outer_i = format!("(t / {inner}u)");
        let _ = writeln!(
            b,
            "    let base = {base};
    let obase = {outer_i} * {} + t % {inner}u;
    var acc: {ct} = {};
    for (var j = 0u; j < {len}u; j = j + 1u) {{
        acc = {};
        st_out(obase + j * {inner}u, acc);
    }}",
            format_args!("{}u", len * inner),
            literal(0.0, dt),
            super::codegen::round_to(dt, &format!("acc + ld_in{}(base + j * {}u)", input.input, l.strides()[dim])),
        );
        sh.finish("cumsum".into(), WG, groups(lines, WG), &b)
    }

    fn cat_part(&self, dim: usize, part: &View, at: usize, total: usize) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[part.input]);
        self.bind_out(&mut sh);
        let pd = part.layout.dims();
        let n = part.layout.numel();
        let mut od = pd.to_vec();
        od[dim] = total;
        let ostr = crate::shape::Shape::new(&od).contiguous_strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", pd);
        let out_l = Layout { shape: crate::shape::Shape::new(&od), strides: ostr.clone(), offset: at * ostr[dim] };
        let _ = writeln!(b, "    st_out({}, ld_in{}({}));", strided_all(&d, &out_l), part.input, strided(&d, &part.layout));
        sh.finish("cat".into(), WG, groups(n, WG), &b)
    }

    fn unfold(&self, input: &View, p: &UnfoldParams, pad: f64) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let dd = l.dims();
        let (h, w) = (dd[2], dd[3]);
        let [oh, ow] = p.out_hw(h, w).unwrap_or([0, 0]);
        let dims = [dd[0], dd[1], p.kernel[0], p.kernel[1], oh, ow];
        let n: usize = dims.iter().product();
        let dt = self.out.0;
        let st = l.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", &dims);
        let _ = writeln!(
            b,
            "    let iy = i32({y} * {sy}u + {ki} * {dy}u) - {py};
    let ix = i32({x} * {sx}u + {kj} * {dx}u) - {px};
    var v = {pad};
    if (iy >= 0 && iy < {h} && ix >= 0 && ix < {w}) {{
        v = ld_in{inp}({off}u + {n0} * {s0}u + {c0} * {s1}u + u32(iy) * {s2}u + u32(ix) * {s3}u);
    }}
    st_out(i, v);",
            y = d[4],
            x = d[5],
            ki = d[2],
            kj = d[3],
            n0 = d[0],
            c0 = d[1],
            sy = p.stride[0],
            sx = p.stride[1],
            dy = p.dilation[0],
            dx = p.dilation[1],
            py = p.padding[0],
            px = p.padding[1],
            pad = literal(pad, dt),
            inp = input.input,
            off = l.offset(),
            s0 = st[0],
            s1 = st[1],
            s2 = st[2],
            s3 = st[3],
        );
        sh.finish("unfold".into(), WG, groups(n, WG), &b)
    }
}

impl Gen<'_> {
    /// col2im: one thread per image element, summing the patch entries that
    /// read it (a deterministic gather, where a scatter would need atomics).
    fn fold(&self, input: &View, p: &UnfoldParams, hw: [usize; 2]) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let dd = l.dims();
        let (kh, kw, oh, ow) = (dd[2], dd[3], dd[4], dd[5]);
        let [h, w] = hw;
        let n: usize = dd[0] * dd[1] * h * w;
        let dt = self.out.0;
        let st = l.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", &[dd[0], dd[1], h, w]);
        let _ = writeln!(
            b,
            "    let base = {off}u + {n0} * {s0}u + {c0} * {s1}u;
    var acc = {zero};
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
        let ty = i32({iy}) + {py} - i32(ki * {dy}u);
        if (ty < 0 || ty % {sy} != 0 || ty / {sy} >= {oh}) {{ continue; }}
        for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
            let tx = i32({ix}) + {px} - i32(kj * {dx}u);
            if (tx < 0 || tx % {sx} != 0 || tx / {sx} >= {ow}) {{ continue; }}
            acc = {sum};
        }}
    }}
    st_out(i, acc);",
            off = l.offset(),
            n0 = d[0],
            c0 = d[1],
            iy = d[2],
            ix = d[3],
            s0 = st[0],
            s1 = st[1],
            py = p.padding[0],
            px = p.padding[1],
            dy = p.dilation[0],
            dx = p.dilation[1],
            sy = p.stride[0],
            sx = p.stride[1],
            zero = literal(0.0, dt),
            sum = super::codegen::round_to(
                dt,
                &format!(
                    "acc + ld_in{}(base + ki * {}u + kj * {}u + u32(ty / {}) * {}u + u32(tx / {}) * {}u)",
                    input.input, st[2], st[3], p.stride[0], st[4], p.stride[1], st[5]
                )
            ),
        );
        sh.finish("fold".into(), WG, groups(n, WG), &b)
    }
}

/// Like `strided`, but keeps every digit (they may be runtime values that
/// replace a size-1 dim).
fn strided_all(digits: &[String], l: &Layout) -> String {
    let mut terms = vec![format!("{}u", l.offset())];
    for (d, &s) in digits.iter().zip(l.strides()) {
        if s != 0 && d != "0u" {
            terms.push(format!("{d} * {s}u"));
        }
    }
    format!("({})", terms.join(" + "))
}

/// Codes that index kernels report with a bad index.
pub(crate) const OP_GATHER: u32 = 1;
pub(crate) const OP_INDEX_SELECT: u32 = 2;
pub(crate) const OP_SCATTER_ADD: u32 = 3;

/// The op name behind an index-error code.
pub(crate) fn index_op_name(code: u32) -> &'static str {
    match code {
        OP_GATHER => "gather",
        OP_INDEX_SELECT => "index_select",
        OP_SCATTER_ADD => "scatter_add",
        _ => "index",
    }
}

/// The WGSL pieces of one reduction op over an accumulator type.
struct Reduction {
    op: ReduceOp,
    /// Accumulator dtype (f32, i32 or u32).
    adt: DType,
    /// Dtype of the reduced values.
    vdt: DType,
    /// Output dtype.
    out: DType,
}

impl Reduction {
    fn acc_ty(&self) -> &'static str {
        compute_ty(self.adt)
    }

    fn is_max(&self) -> bool {
        matches!(self.op, ReduceOp::Max | ReduceOp::ArgMax)
    }

    fn identity(&self) -> String {
        let t = self.acc_ty();
        match self.op {
            ReduceOp::Sum => literal(0.0, self.adt),
            ReduceOp::Prod => literal(1.0, self.adt),
            _ => {
                let max = self.is_max();
                match t {
                    "f32" => format!("bitcast<f32>(0x{:08x}u)", if max { f32::NEG_INFINITY } else { f32::INFINITY }.to_bits()),
                    "i32" => format!("bitcast<i32>(0x{:08x}u)", if max { i32::MIN } else { i32::MAX } as u32),
                    _ => if max { "0u".into() } else { "0xffffffffu".into() },
                }
            }
        }
    }

    /// A reduced value in the accumulator type.
    fn value(&self, v: &str) -> String {
        if self.vdt == DType::Bool {
            format!("select(0u, 1u, {v})")
        } else {
            v.to_string()
        }
    }

    /// Helper functions the fold uses.
    fn decl(&self, sh: &mut Shader) {
        let t = self.acc_ty();
        let cmp = if self.is_max() { ">" } else { "<" };
        let nan = |v: &str| if t == "f32" { format!("isnan_({v})") } else { "false".into() };
        let (an, bn) = (nan("av"), nan("bv"));
        sh.decl(&format!(
            "fn better(av: {t}, ai: u32, bv: {t}, bi: u32) -> bool {{
    // Does (bv, bi) replace (av, ai)? NaN wins, then the extreme value, then the lower index.
    if (bi == 0xffffffffu) {{ return false; }}
    if (ai == 0xffffffffu) {{ return true; }}
    let an = {an};
    let bn = {bn};
    if (an || bn) {{ return bn && (!an || bi < ai); }}
    if (bv {cmp} av) {{ return true; }}
    return bv == av && bi < ai;
}}"
        ));
    }

    /// Statement folding value `v` (index `vi`) into accumulator `a` (index `ai`).
    fn fold(&self, a: &str, ai: &str, v: &str, vi: &str) -> String {
        match self.op {
            ReduceOp::Sum => format!("{a} = {a} + {v};"),
            ReduceOp::Prod => format!("{a} = {a} * {v};"),
            // Max/min track an index too, so NaN and ties resolve the same way.
            _ => format!("{{ let vv = {v}; let vi = {vi}; if (better({a}, {ai}, vv, vi)) {{ {a} = vv; {ai} = vi; }} }}"),
        }
    }

    /// The output value from the final accumulator.
    fn finish(&self, a: &str, ai: &str) -> String {
        if self.op.is_arg() {
            // An empty reduction is refused when recorded; 0 is never seen.
            return format!("select(i32({ai}), 0, {ai} == 0xffffffffu)");
        }
        cast(self.adt, self.out, a)
    }
}
