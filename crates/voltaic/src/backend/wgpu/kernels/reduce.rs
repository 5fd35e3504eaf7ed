//! Reduction kernels: a thread per output for short or strided rows, a
//! workgroup per output otherwise, split over several workgroups (plus a
//! combining pass) for few long rows. The fold and identity come from the
//! op table (`ReduceOp::combine`, `ReduceOp::identity`).

use super::{groups, Gen, PER, WG};
use crate::backend::wgpu::codegen::{binary_expr, cast, compute_ty, emit_expr, literal, Dispatch, Indexer, Shader, Src, WgslProgram};
use crate::dtype::DType;
use crate::error::Result;
use crate::ir::Expr;
use crate::primitive::ReduceOp;
use std::fmt::Write;

/// Rows one thread of a column reduction folds (see [`Gen::reduce`]).
const COL_RUN: usize = 16;
/// At most this many splits of a column reduction's rows.
const MAX_COL_SPLITS: usize = 256;
/// At most this many partials of a split reduction (scratch elements).
const MAX_PARTIALS: usize = 1 << 22;

impl Gen<'_> {
    pub(crate) fn reduce(&self, p: &mut WgslProgram, op: ReduceOp, expr: &Expr, shape: &[usize], outer: usize, inner: usize) -> Result<()> {
        let vdt = expr.dtype();
        // Bools reduce as 0/1 counters.
        let adt = if vdt == DType::Bool { DType::U32 } else { vdt.compute() };
        let r = Reduction { op, adt, vdt, out: self.out.0 };
        if inner == 0 {
            // Nothing to fold (a sum over an empty dim): every output is the
            // identity. The general kernels would index a dim of size 0.
            let mut sh = self.shader();
            self.bind_out(&mut sh);
            let b = format!("    let o = group * {WG}u + lid;\n    if (o >= {outer}u) {{ return; }}\n    st_out(o, {});\n", r.finish(&r.identity(), "0u"));
            p.dispatches.push(sh.finish(format!("reduce_empty {}", op.name()), WG, groups(outer, WG), &b));
            return Ok(());
        }
        // Reading along the reduced dim with stride 1 favours a workgroup per
        // output; short or strided rows favour a thread per output, whose
        // neighbours then read neighbouring memory.
        // Loads that broadcast along the reduced dims (stride 0) do not count.
        let inner_contig = expr.loads.iter().all(|l| l.path.len() == 1 && matches!(l.path[0].strides().last(), Some(0 | 1)));
        if !inner_contig && inner > 64 {
            // Strided rows (a bias gradient: a sum over the rows of [4096,
            // 1536], each output a column): a thread per output still, so
            // that neighbours read neighbouring memory, but with the reduced
            // dim split over workgroups into runs of COL_RUN rows, whose
            // partials a workgroup per output then folds. One workgroup per
            // output read 2 bytes per 32-byte sector (16 us for [4096, 384]
            // on the H100); 1536 threads alone waited on 4096 loads each (56
            // us for [4096, 1536]); runs of 195 rows (21 splits, some 32k
            // threads) still waited on their loads one trip after another
            // (28 us on an H200).
            let splits = inner.div_ceil(COL_RUN).clamp(1, MAX_COL_SPLITS).min((MAX_PARTIALS / outer.max(1)).max(1));
            if splits > 1 {
                let chunk = inner.div_ceil(splits);
                p.dispatches.push(self.reduce_cols(&r, expr, shape, outer, inner, splits, chunk)?);
                p.scratch.push((adt, outer * splits));
                p.scratch.push((DType::U32, outer * splits));
                p.dispatches.push(self.reduce_partials(&r, outer, splits, true));
                return Ok(());
            }
        }
        if inner <= 64 || !inner_contig {
            p.dispatches.push(self.reduce_rows(&r, expr, shape, outer, inner)?);
            return Ok(());
        }
        // Few long rows: split each over several workgroups, then combine.
        // Rows past 8,192 elements go about 2,048 to a workgroup (two trips
        // of PER loads a thread): a language model's argmax over 49,152
        // logits took 19 us in 6 splits of 8,192 on the H100.
        let splits = if outer >= 1024 || inner < 8192 { 1 } else { (inner / 2048).clamp(1, 2048usize.div_ceil(outer).max(1)) };
        let chunk = inner.div_ceil(splits);
        p.dispatches.push(self.reduce_groups(&r, expr, shape, outer, inner, splits, chunk)?);
        if splits > 1 {
            p.scratch.push((adt, outer * splits));
            p.scratch.push((DType::U32, outer * splits));
            p.dispatches.push(self.reduce_partials(&r, outer, splits, false));
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

    /// A thread per (output, split of the reduced dim): partial `s` of
    /// output `o` goes to `s * outer + o`, for [`Gen::reduce_partials`].
    #[allow(clippy::too_many_arguments)]
    fn reduce_cols(&self, r: &Reduction, expr: &Expr, shape: &[usize], outer: usize, inner: usize, splits: usize, chunk: usize) -> Result<Dispatch> {
        let mut sh = self.shader();
        let used: Vec<usize> = (0..self.inputs.len()).collect();
        self.bind_inputs(&mut sh, &used);
        sh.array(Src::Scratch(0), "pv", r.adt, outer * splits, true);
        sh.array(Src::Scratch(1), "pi", DType::U32, outer * splits, true);
        r.decl(&mut sh);
        let og = outer.div_ceil(WG as usize);
        let mut b = format!("    let s = group / {og}u;\n    let o = (group % {og}u) * {WG}u + lid;\n    if (s >= {splits}u || o >= {outer}u) {{ return; }}\n");
        let _ = writeln!(b, "    let j0 = s * {chunk}u;\n    let j1 = min(j0 + {chunk}u, {inner}u);");
        fold_range(&mut b, &mut sh, r, expr, shape, inner, "j0", 1)?;
        let _ = writeln!(b, "    st_pv(s * {outer}u + o, acc);\n    st_pi(s * {outer}u + o, ai);");
        Ok(sh.finish(format!("reduce_cols {} {outer}x{inner} in {splits} splits", r.op.name()), WG, (og * splits) as u64, &b))
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
        fold_range(&mut b, &mut sh, r, expr, shape, inner, "j0 + lid", WG as usize)?;
        tree_fold(&mut b, &sh, r);
        if splits == 1 {
            let _ = writeln!(b, "    if (lid == 0u) {{ st_out(o, {}); }}", r.finish("sv[0]", "si[0]"));
        } else {
            let _ = writeln!(b, "    if (lid == 0u) {{ st_pv(group, sv[0]); st_pi(group, si[0]); }}");
        }
        Ok(sh.finish(format!("reduce {} {outer}x{inner} in {splits} splits", r.op.name()), WG, total as u64, &b))
    }

    /// Combine the per-split partials of each output, in split order: at
    /// `o * splits + s`, or at `s * outer + o` when `split_major`. A thread
    /// per output, or for a few outputs of many splits a workgroup each,
    /// whose threads load the partials side by side (one thread's loop over
    /// 24 partials waited on each load in turn).
    fn reduce_partials(&self, r: &Reduction, outer: usize, splits: usize, split_major: bool) -> Dispatch {
        let mut sh = self.shader();
        sh.array(Src::Scratch(0), "pv", r.adt, outer * splits, false);
        sh.array(Src::Scratch(1), "pi", DType::U32, outer * splits, false);
        self.bind_out(&mut sh);
        r.decl(&mut sh);
        // Many partials: a workgroup per output folds them as a tree (a
        // thread per output would wait on each load in turn).
        if splits >= 16 && (outer <= 64 || split_major) {
            let at = r.acc_ty();
            sh.decl(&format!("var<workgroup> sv: array<{at}, {WG}>;\nvar<workgroup> si: array<u32, {WG}>;"));
            let mut b = format!("    let o = group;\n    if (o >= {outer}u) {{ return; }}\n");
            let _ = writeln!(b, "    var acc: {at} = {};\n    var ai: u32 = 0xffffffffu;", r.identity());
            let at_s = if split_major { format!("s * {outer}u + o") } else { format!("o * {splits}u + s") };
            let fold = r.fold("acc", "ai", &format!("ld_pv({at_s})"), &format!("ld_pi({at_s})"));
            let _ = writeln!(b, "    for (var s = lid; s < {splits}u; s = s + {WG}u) {{\n        {fold}\n    }}");
            tree_fold(&mut b, &sh, r);
            let _ = writeln!(b, "    if (lid == 0u) {{ st_out(o, {}); }}", r.finish("sv[0]", "si[0]"));
            return sh.finish(format!("reduce_partials {} of {splits}", r.op.name()), WG, outer as u64, &b);
        }
        let mut b = format!("    let o = group * {WG}u + lid;\n    if (o >= {outer}u) {{ return; }}\n");
        let _ = writeln!(b, "    var acc: {} = {};\n    var ai: u32 = 0xffffffffu;", r.acc_ty(), r.identity());
        let _ = writeln!(
            b,
            "    for (var s = 0u; s < {splits}u; s = s + 1u) {{\n        {}\n    }}",
            {
                let at = if split_major { format!("s * {outer}u + o") } else { format!("o * {splits}u + s") };
                r.fold("acc", "ai", &format!("ld_pv({at})"), &format!("ld_pi({at})"))
            }
        );
        let _ = writeln!(b, "    st_out(o, {});", r.finish("acc", "ai"));
        sh.finish(format!("reduce_partials {}", r.op.name()), WG, groups(outer, WG), &b)
    }
}

/// The lane distances of a butterfly over `span` lanes of a subgroup:
/// `span / 2, span / 4, ..., 1`. Shuffling with each in turn leaves every
/// lane with the fold of its `span`-lane group, pairing lanes as a tree of
/// halving strides does.
pub(crate) fn butterfly(span: u32) -> impl Iterator<Item = u32> {
    std::iter::successors(Some(span / 2), |m| Some(m / 2)).take_while(|&m| m > 0)
}

/// Fold each thread's `acc`/`ai` into `sv[0]`/`si[0]` as thread 0 sees
/// them (partials combine by index, so ties still go to the lowest). With
/// subgroups, a butterfly of shuffles within each subgroup, then thread 0
/// adds the subgroups' results after one barrier; without, a tree of
/// halving strides through workgroup memory.
fn tree_fold(b: &mut String, sh: &Shader, r: &Reduction) {
    if let Some(sg) = sh.subgroup() {
        for m in butterfly(sg) {
            let yi = if r.op.is_arg() { format!("subgroupShuffleXor(ai, {m}u)") } else { "0u".to_string() };
            let _ = writeln!(b, "    {{ let y = subgroupShuffleXor(acc, {m}u); let yi = {yi}; {} }}", r.fold("acc", "ai", "y", "yi"));
        }
        let _ = writeln!(b, "    if (lid % {sg}u == 0u) {{ sv[lid / {sg}u] = acc; si[lid / {sg}u] = ai; }}\n    workgroupBarrier();");
        let _ = writeln!(
            b,
            "    if (lid == 0u) {{\n        for (var g = 1u; g < {}u; g = g + 1u) {{ {} }}\n        sv[0] = acc;\n        si[0] = ai;\n    }}",
            WG / sg,
            r.fold("acc", "ai", "sv[g]", "si[g]")
        );
        return;
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
}

/// Fold output `o`'s reduced elements `start, start + step, ...` below `j1`
/// (`step` = `PER * lane_stride`) into `acc`/`ai`, through PER independent
/// accumulators so that PER loads are in flight per thread. Partial folds
/// combine by index, so ties still go to the lowest.
#[allow(clippy::too_many_arguments)]
fn fold_range(b: &mut String, sh: &mut Shader, r: &Reduction, expr: &Expr, shape: &[usize], inner: usize, start: &str, lane_stride: usize) -> Result<()> {
    for k in 0..PER {
        let _ = writeln!(b, "    var acc{k}: {} = {};\n    var ai{k}: u32 = 0xffffffffu;", r.acc_ty(), r.identity());
    }
    let _ = writeln!(b, "    for (var j = {start}; j < j1; j = j + {}u) {{", lane_stride * PER as usize);
    for k in 0..PER as usize {
        let _ = writeln!(b, "    {{\n    let jj = j + {}u;\n    if (jj < j1) {{\n    let l = o * {inner}u + jj;", lane_stride * k);
        let mut ix = Indexer::new(shape, "l");
        let v = emit_expr(b, sh, &mut ix, expr)?;
        let _ = writeln!(b, "    {}\n    }}\n    }}", r.fold(&format!("acc{k}"), &format!("ai{k}"), &r.value(&v), "jj"));
    }
    let _ = writeln!(b, "    }}\n    var acc = acc0;\n    var ai = ai0;");
    for k in 1..PER {
        let _ = writeln!(b, "    {}", r.fold("acc", "ai", &format!("acc{k}"), &format!("ai{k}")));
    }
    Ok(())
}

/// The WGSL pieces of one reduction over an accumulator type, built from
/// the op table: the identity and the combining primitive.
pub(crate) struct Reduction {
    pub op: ReduceOp,
    /// Accumulator dtype (f32, i32 or u32).
    pub adt: DType,
    /// Dtype of the reduced values.
    pub vdt: DType,
    /// Output dtype.
    pub out: DType,
}

impl Reduction {
    pub(crate) fn acc_ty(&self) -> &'static str {
        compute_ty(self.adt)
    }

    /// The identity in the accumulator type.
    pub(crate) fn identity(&self) -> String {
        literal(self.op.identity_for(self.adt), self.adt)
    }

    /// A reduced value in the accumulator type.
    fn value(&self, v: &str) -> String {
        if self.vdt == DType::Bool {
            format!("select(0u, 1u, {v})")
        } else {
            v.to_string()
        }
    }

    /// Helper functions the fold uses: `better` for arg reductions.
    fn decl(&self, sh: &mut Shader) {
        if !self.op.is_arg() {
            return;
        }
        let t = self.acc_ty();
        let same = |x: &str, y: &str| if t == "f32" { format!("({x} == {y} || (isnan_({x}) && isnan_({y})))") } else { format!("({x} == {y})") };
        let c = binary_expr(self.op.combine(), self.adt, "av", "bv");
        sh.decl(&format!(
            "fn better(av: {t}, ai: u32, bv: {t}, bi: u32) -> bool {{
    // Does (bv, bi) replace (av, ai)? When combining them gives bv; ties go to the lower index.
    if (bi == 0xffffffffu) {{ return false; }}
    if (ai == 0xffffffffu) {{ return true; }}
    if {} {{ return bi < ai; }}
    let c = {c};
    return {};
}}",
            same("av", "bv"),
            same("c", "bv"),
        ));
    }

    /// Statement folding value `v` (index `vi`) into accumulator `a` (index `ai`).
    pub(crate) fn fold(&self, a: &str, ai: &str, v: &str, vi: &str) -> String {
        if self.op.is_arg() {
            return format!("{{ let vv = {v}; let vi = {vi}; if (better({a}, {ai}, vv, vi)) {{ {a} = vv; {ai} = vi; }} }}");
        }
        format!("{a} = {};", binary_expr(self.op.combine(), self.adt, a, v))
    }

    /// Statements that combine each of `wg` threads' accumulator `a` (not
    /// an arg reduction), leaving the total in every thread's `a`. Every
    /// thread of the workgroup must reach them (they may hold barriers).
    pub(crate) fn workgroup_fold(&self, sh: &mut Shader, a: &str, wg: u32) -> String {
        self.tree_fold(sh, a, wg, "lid", "0u")
    }

    /// [`Self::workgroup_fold`] within segments of `width` threads (a power
    /// of two dividing the workgroup; `lane` is the thread's place in its
    /// segment): every thread of a segment ends with the segment's value.
    pub(crate) fn segment_fold(&self, sh: &mut Shader, a: &str, width: u32) -> String {
        self.tree_fold(sh, a, width, "lane", "lid - lane")
    }

    /// The fold of both over `width` threads: `lane` is a thread's place
    /// among them, `first` the index of the first of them. With subgroups,
    /// each subgroup's lanes first exchange values by shuffles (a butterfly,
    /// which pairs lanes as the tree below does, so a fold of at most a
    /// subgroup gives the same bits); a segment wider than a subgroup then
    /// adds its subgroups' totals from `sv`: one barrier where the tree
    /// takes one per halving. Without, a tree of halving strides in `sv`.
    fn tree_fold(&self, sh: &mut Shader, a: &str, width: u32, lane: &str, first: &str) -> String {
        sh.fold_scratch(width.max(super::WG));
        let Some(sg) = sh.subgroup() else {
            return format!(
                "    sv[lid] = {a};\n    workgroupBarrier();\n    for (var w = {}u; w > 0u; w = w >> 1u) {{\n        if ({lane} < w) {{\n            var x = sv[lid];\n            {}\n            sv[lid] = x;\n        }}\n        workgroupBarrier();\n    }}\n    {a} = sv[{first}];\n    workgroupBarrier();",
                width / 2,
                self.fold("x", "0u", "sv[lid + w]", "0u")
            );
        };
        let mut b = format!("    {{\n    var x = {a};\n");
        for m in butterfly(width.min(sg)) {
            let _ = writeln!(b, "    {{ let y = subgroupShuffleXor(x, {m}u); {} }}", self.fold("x", "0u", "y", "0u"));
        }
        if width <= sg {
            let _ = write!(b, "    {a} = x;\n    }}");
            return b;
        }
        // The first lane of each subgroup holds its total for the segment.
        let _ = writeln!(b, "    if (lid % {sg}u == 0u) {{ sv[lid / {sg}u] = x; }}\n    }}\n    workgroupBarrier();");
        let _ = write!(
            b,
            "    {{\n    let g0 = ({first}) / {sg}u;\n    var x = sv[g0];\n    for (var g = 1u; g < {}u; g = g + 1u) {{ let y = sv[g0 + g]; {} }}\n    {a} = x;\n    }}\n    workgroupBarrier();",
            width / sg,
            self.fold("x", "0u", "y", "0u")
        );
        b
    }

    /// The output value from the final accumulator.
    pub(crate) fn finish(&self, a: &str, ai: &str) -> String {
        if self.op.is_arg() {
            // An empty reduction is refused when recorded; 0 is never seen.
            return format!("select(i32({ai}), 0, {ai} == 0xffffffffu)");
        }
        cast(self.adt, self.out, a)
    }
}
