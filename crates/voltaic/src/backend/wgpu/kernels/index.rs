//! The index-like kernels: gather, index_select, scatter_add, cumsum, cat,
//! unfold, fold, and max pooling with its gradient. Index tensors are checked in the kernel; an index out of
//! range is flagged in the device's index-error buffer and reported by the
//! next read.

use super::reduce::Reduction;
use super::{groups, Gen, WG};
use crate::backend::wgpu::codegen::{cast, compute_ty, literal, round_to, strided, unravel, Dispatch, Shader, Src, WgslProgram};
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::ir::{Prologue, Strided as View};
use crate::layout::Layout;
use crate::primitive::{IndexOp, ReduceOp, UnfoldParams};
use std::fmt::Write;

/// The WGSL functions that compute an attention kernel's queries, keys and
/// values where it has prologues for them.
const ATTENTION_PROLOGUES: [&str; 3] = ["pro_q", "pro_k", "pro_v"];

impl Gen<'_> {
    /// The dispatches of an index-like kernel.
    pub(crate) fn index(&self, p: &mut WgslProgram, op: &IndexOp, args: &[View], prologues: &[Option<Prologue>]) -> Result<()> {
        if prologues.iter().any(Option::is_some) && !matches!(op, IndexOp::Attention { .. }) {
            bail!(Device, "realize", "a prologue before {} (only attention takes one)", op.name());
        }
        match *op {
            IndexOp::Gather { dim, .. } => p.dispatches.push(self.gather(dim, &args[0], &args[1], op.error_code())),
            IndexOp::IndexSelect { dim, .. } => p.dispatches.push(self.index_select(dim, &args[0], &args[1], op.error_code())),
            IndexOp::ScatterAdd { dim, .. } => {
                p.dispatches.push(self.copy(&args[0], "scatter_add_copy"));
                if args[1].layout.numel() > 0 {
                    p.dispatches.push(self.scatter_add(dim, &args[0], &args[1], &args[2], op.error_code()));
                }
            }
            IndexOp::Cumsum { dim } => self.cumsum(p, dim, &args[0]),
            IndexOp::Cat { dim } => {
                if args.iter().any(|a| a.layout.numel() > 0) {
                    p.dispatches.push(self.cat(dim, args));
                }
            }
            IndexOp::Unfold { params, pad, by_tap } => p.dispatches.push(self.unfold(&args[0], &params, pad, by_tap)),
            IndexOp::Fold { params, hw } => p.dispatches.push(self.fold(&args[0], &params, hw)),
            IndexOp::MaxPool { params } => p.dispatches.push(self.max_pool(&args[0], &params)),
            IndexOp::MaxPoolGrad { params } => self.max_pool_grad(p, &args[0], &args[1], &params),
            IndexOp::Dequantize { qtype, cols, .. } => p.dispatches.push(self.dequantize_rows(qtype, cols, &args[0], &args[1], op.error_code())),
            IndexOp::Attention { scale } => self.attention(p, scale, args, prologues)?,
        }
        Ok(())
    }

    /// `softmax(q k^T * scale + mask) v` (see `IndexOp::Attention`), a
    /// workgroup per query row: the keys go by in chunks of one per thread,
    /// each thread computing its key's score, and an online softmax
    /// rescales the running sums when a chunk raises the maximum. The
    /// threads are lanes of 64 output elements in groups that split a
    /// chunk's keys between them (each group sums its own keys' weighted
    /// values; the groups' sums are added at the end), so a decode step's
    /// few query rows do not walk their keys one by one; four threads share
    /// each key's dot product, so a warp's loads cover whole key rows. A
    /// software adapter runs one group of 64, a thread per key, where
    /// barriers cost more than threads gain.
    /// The scores are never stored: one kernel where the unfused form is
    /// two products and a softmax. The leading dims are walked as they lie
    /// (heads split from a projection do not flatten).
    ///
    /// With prologues (elementwise work over the queries, keys or values,
    /// such as RoPE of the queries or a KV cache's write of the new token),
    /// each element of that operand is computed where it would have been
    /// loaded.
    ///
    /// A few query rows over many keys (a decode step: 9 rows of SmolLM2,
    /// so 9 of the GPU's workgroups) split their keys over several
    /// workgroups each ([`attention_splits`]). Each stores its running
    /// maximum, weight sum and weighted sums; the last of a row to finish
    /// (a ticket from the device's counters, see `Shader::counters`) adds
    /// them, rescaled to the row's maximum, and resets the row's counter.
    fn attention(&self, p: &mut WgslProgram, scale: f64, args: &[View], prologues: &[Option<Prologue>]) -> Result<()> {
        let threads = if self.caps.software { LANES } else { attention_threads().min(self.caps.max_invocations as usize).max(LANES) };
        let kg = threads / LANES;
        let [q, k, v, mask] = args else { unreachable!("attention has four inputs") };
        let pro = |i: usize| prologues.get(i).and_then(Option::as_ref);
        let mut sh = self.shader();
        let mut read = vec![];
        for (i, a) in args.iter().enumerate() {
            match pro(i) {
                Some(p) => read.extend(p.all_stages().flat_map(|s| s.expr.loads.iter().map(|l| l.input))),
                None => read.push(a.input),
            }
        }
        read.sort_unstable();
        read.dedup();
        self.bind_inputs(&mut sh, &read);
        self.bind_out(&mut sh);
        // Each prologue's constants follow the earlier ones' (`KernelKind::exprs` order).
        let mut base = 0;
        for (i, name) in ATTENTION_PROLOGUES.into_iter().enumerate() {
            if let Some(p) = pro(i) {
                crate::backend::wgpu::quant::prologue_fns(&mut sh, p, base, name)?;
                base += p.all_stages().map(|s| s.expr.consts.len()).sum::<usize>();
            }
        }
        if pro(3).is_some() {
            bail!(Device, "realize", "a prologue before an attention kernel's mask");
        }
        // Element `at` of arg `i`: computed by its prologue, or loaded.
        let value = |i: usize, input: usize, at: String| match pro(i) {
            Some(_) => format!("{}({at})", ATTENTION_PROLOGUES[i]),
            None => format!("ld_in{input}({at})"),
        };
        let (qd, kd, vd) = (q.layout.dims(), k.layout.dims(), v.layout.dims());
        let r = qd.len();
        let lead_dims = &qd[..r - 2];
        let (m, d, n, e) = (qd[r - 2].max(1), qd[r - 1], kd[r - 2], vd[r - 1]);
        let rows = lead_dims.iter().product::<usize>() * qd[r - 2];
        // Output elements each thread owns: e = lane, lane + LANES, ...
        let per = e.div_ceil(LANES).max(1);
        // Splitting binds four buffers more (three of partials, the
        // counters) besides the output and constants.
        let fits = read.len() + 6 <= self.caps.max_storage_buffers as usize;
        let (splits, span_keys) = if self.caps.software || !fits { (1, n) } else { attention_splits(rows, n) };
        if splits > 1 {
            p.scratch.extend([(DType::F32, rows * splits), (DType::F32, rows * splits), (DType::F32, rows * splits * e)]);
            sh.array(Src::Scratch(0), "pm", DType::F32, rows * splits, true);
            sh.array(Src::Scratch(1), "pl", DType::F32, rows * splits, true);
            sh.array(Src::Scratch(2), "pa", DType::F32, rows * splits * e, true);
            sh.counters();
            sh.decl("var<workgroup> lastw: u32;");
        }
        // The keys this workgroup takes: [k0, k1).
        let (k0, k1) = if splits > 1 { ("k0".to_string(), "k1".to_string()) } else { ("0u".to_string(), format!("{n}u")) };
        sh.decl(&format!("var<workgroup> qs: array<f32, {}>;", d.max(1)));
        sh.decl(&format!("var<workgroup> red: array<f32, {threads}>;"));
        sh.decl(&format!("var<workgroup> wts: array<f32, {threads}>;"));
        // Slices of a key row that threads read side by side for the scores.
        let slices = if threads == LANES { 1 } else { 4 };
        if slices > 1 {
            sh.decl(&format!("var<workgroup> part: array<f32, {}>;", threads * slices));
        }
        let (qi, ki, vi, mi) = (q.input, k.input, v.input, mask.input);
        let mut b = String::new();
        // `row` is uniform across the workgroup, so the barriers below are too.
        if splits > 1 {
            let _ = writeln!(b, "    let row = group / {splits}u;\n    let k0 = (group % {splits}u) * {span_keys}u;\n    let k1 = min(k0 + {span_keys}u, {n}u);");
        } else {
            let _ = writeln!(b, "    let row = group;");
        }
        let _ = writeln!(b, "    if (row >= {rows}u) {{ return; }}\n    let bi = row / {m}u;\n    let mi = row % {m}u;");
        let _ = writeln!(b, "    let lane = lid % {LANES}u;\n    let kgi = lid / {LANES}u;");
        let lead = unravel(&mut b, &mut sh, "bi", lead_dims);
        let at = |l: &Layout, tail: [&str; 2]| at_lead(&lead, l, tail);
        let q_at = at(&q.layout, ["mi", "i"]);
        let q_value = value(0, qi, q_at);
        let _ = writeln!(b, "    for (var i = lid; i < {d}u; i = i + {threads}u) {{ qs[i] = {q_value}; }}");
        // The running maximum starts at -inf: a finite sentinel would sit
        // above scores masked with f32::MIN and zero their weights.
        let _ = writeln!(b, "    workgroupBarrier();\n    let ninf = bitcast<f32>(0xff800000u);\n    var mx = ninf;\n    var l = 0.0;");
        for r in 0..per {
            let _ = writeln!(b, "    var acc{r} = 0.0;");
        }
        let _ = writeln!(b, "    for (var c = {k0}; c < {k1}; c = c + {threads}u) {{\n    let p = c + lid;\n    var s = ninf;");
        if slices == 1 {
            let _ = writeln!(b, "    if (p < {k1}) {{\n        var dot = 0.0;\n        for (var i = 0u; i < {d}u; i = i + 1u) {{ dot = dot + qs[i] * {}; }}", value(1, ki, at(&k.layout, ["p", "i"])));
        } else {
            // Thread `lid` adds slice `lid % slices` of keys `lid / slices + j * (threads / slices)`:
            // the threads of a warp read whole key rows, not one element of 32 rows.
            let (span, per_slice) = (threads / slices, d.div_ceil(slices));
            let _ = writeln!(b, "    let sl = lid % {slices}u;\n    let i0 = sl * {per_slice}u;");
            // A constant trip count, so the slice's loads can all be in flight.
            let inside = if d % slices == 0 { String::new() } else { format!("if (i < {d}u) ") };
            for j in 0..slices {
                let _ = writeln!(b, "    {{\n        let kk = lid / {slices}u + {}u;\n        let pk = c + kk;\n        var dot = 0.0;", j * span);
                let _ = writeln!(
                    b,
                    "        if (pk < {k1}) {{ for (var ii = 0u; ii < {per_slice}u; ii = ii + 1u) {{ let i = i0 + ii; {inside}{{ dot = dot + qs[i] * {}; }} }} }}",
                    value(1, ki, at(&k.layout, ["pk", "i"]))
                );
                let _ = writeln!(b, "        part[kk * {slices}u + sl] = dot;\n    }}");
            }
            let _ = write!(b, "    workgroupBarrier();\n    if (p < {k1}) {{\n        let dot = ");
            let terms: Vec<String> = (0..slices).map(|x| format!("part[lid * {slices}u + {x}u]")).collect();
            let _ = writeln!(b, "{};", terms.join(" + "));
        }
        let _ = writeln!(b, "        s = dot * {} + ld_in{mi}({});\n    }}", literal(scale, DType::F32), at(&mask.layout, ["mi", "p"]));
        // The chunk's maximum score, in every thread: one group's threads
        // without subgroups read the scores in turn (a software adapter,
        // where each barrier costs a switch of every thread).
        if threads == LANES && sh.subgroup().is_none() {
            let _ = writeln!(b, "    red[lid] = s;\n    workgroupBarrier();");
            let _ = writeln!(b, "    var cm = ninf;\n    for (var j = 0u; j < {threads}u; j = j + 1u) {{ cm = max(cm, red[j]); }}");
        } else {
            let max = Reduction { op: ReduceOp::Max, adt: DType::F32, vdt: DType::F32, out: DType::F32 };
            let _ = writeln!(b, "    var cm = s;\n{}", max.workgroup_fold(&mut sh, "cm", threads as u32));
        }
        // While every score so far is -inf nothing is accumulated (weights 0, scale 1).
        let _ = writeln!(b, "    let nm = max(mx, cm);\n    let w = select(0.0, exp(s - nm), p < {k1} && nm > ninf);\n    let alpha = select(exp(mx - nm), 1.0, mx == nm);\n    wts[lid] = w;\n    workgroupBarrier();");
        let _ = write!(b, "    l = l * alpha;");
        for r in 0..per {
            let _ = write!(b, " acc{r} = acc{r} * alpha;");
        }
        let _ = writeln!(b, "\n    let cnt = min({threads}u, {k1} - c);\n    var j = kgi;");
        if kg > 1 {
            // Four of the group's keys a trip, their loads independent: a
            // loop of one load and one add per key waits on each load in turn.
            let _ = writeln!(b, "    while (j + {}u < cnt) {{", 3 * kg);
            let _ = writeln!(b, "        let w0 = wts[j];\n        let w1 = wts[j + {kg}u];\n        let w2 = wts[j + {}u];\n        let w3 = wts[j + {}u];\n        l = l + ((w0 + w1) + (w2 + w3));", 2 * kg, 3 * kg);
            let _ = writeln!(b, "        let p0 = c + j;\n        let p1 = p0 + {kg}u;\n        let p2 = p0 + {}u;\n        let p3 = p0 + {}u;", 2 * kg, 3 * kg);
            for r in 0..per {
                let vat = |pv: &str| value(2, vi, at(&v.layout, [pv, "ee"]));
                let add = format!("acc{r} = acc{r} + ((w0 * {} + w1 * {}) + (w2 * {} + w3 * {}));", vat("p0"), vat("p1"), vat("p2"), vat("p3"));
                let _ = writeln!(b, "        {}", lane_elem(r, e, &add));
            }
            let _ = writeln!(b, "        j = j + {}u;\n    }}", 4 * kg);
        }
        let _ = writeln!(b, "    while (j < cnt) {{\n        let wj = wts[j];\n        l = l + wj;\n        let pj = c + j;");
        for r in 0..per {
            let _ = writeln!(b, "        {}", lane_elem(r, e, &format!("acc{r} = acc{r} + wj * {};", value(2, vi, at(&v.layout, ["pj", "ee"])))));
        }
        // The next chunk overwrites the scores and weights.
        let _ = writeln!(b, "        j = j + {kg}u;\n    }}\n    mx = nm;\n    workgroupBarrier();\n    }}");
        if kg > 1 {
            // Each group's sums, added by the first group (its weight sum
            // is the same in all of its lanes).
            let _ = writeln!(b, "    wts[lid] = l;");
            for r in 0..per {
                let _ = writeln!(b, "    red[lid] = acc{r};\n    workgroupBarrier();\n    if (kgi == 0u) {{");
                let _ = writeln!(b, "        for (var g = 1u; g < {kg}u; g = g + 1u) {{ acc{r} = acc{r} + red[g * {LANES}u + lane]; }}\n    }}\n    workgroupBarrier();");
            }
            let sum_l = format!("for (var g = 1u; g < {kg}u; g = g + 1u) {{ l = l + wts[g * {LANES}u]; }}");
            // Only the first group goes on (a split kernel keeps the others for its barriers below).
            let _ = match splits {
                1 => writeln!(b, "    if (kgi != 0u) {{ return; }}\n    {sum_l}"),
                _ => writeln!(b, "    if (kgi == 0u) {{ {sum_l} }}"),
            };
        }
        if splits > 1 {
            attention_combine(&mut b, splits, e, per);
        } else {
            for r in 0..per {
                let _ = writeln!(b, "    {}", lane_elem(r, e, &format!("st_out(row * {e}u + ee, acc{r} / l);")));
            }
        }
        let mut label = match ["queries", "keys", "values"].iter().enumerate().filter(|&(i, _)| pro(i).is_some()).map(|(_, n)| *n).collect::<Vec<_>>() {
            none if none.is_empty() => "attention".to_string(),
            some => format!("attention computing its {}", some.join(" and ")),
        };
        if splits > 1 {
            let _ = write!(label, ", keys in {splits} splits");
        }
        p.dispatches.push(sh.finish(label, threads as u32, (rows * splits) as u64, &b));
        Ok(())
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


    /// Read an index element (i32 or u32) as i32 into `name`, reporting it and
    /// using 0 when it is outside `[0, size)`.
    /// An out-of-range index is reported with the op's code; a u32 index
    /// sets `UNSIGNED_INDEX` in it, so the host prints it as unsigned.
    pub(crate) fn checked_index(&self, b: &mut String, name: &str, v: &View, off: &str, size: usize, op: u32) {
        let raw = format!("ld_in{}({off})", v.input);
        if self.inputs[v.input].0 == DType::U32 {
            let code = op | UNSIGNED_INDEX;
            let _ = writeln!(
                b,
                "    let {name}_u = {raw};
    var {name} = i32({name}_u);
    if ({name}_u >= {size}u) {{ bad_index({code}u, bitcast<i32>({name}_u), {size}u); {name} = 0; }}"
            );
        } else {
            let _ = writeln!(
                b,
                "    var {name} = {raw};
    if ({name} < 0 || {name} >= {size}) {{ bad_index({op}u, {name}, {size}u); {name} = 0; }}"
            );
        }
    }

    fn gather(&self, dim: usize, input: &View, index: &View, code: u32) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input, index.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let n = index.layout.numel();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "i", index.layout.dims());
        let off = strided(&d, &index.layout);
        self.checked_index(&mut b, "x", index, &off, input.layout.dims()[dim], code);
        d[dim] = "u32(x)".into();
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", input.input, strided_all(&d, &input.layout));
        sh.finish("gather".into(), WG, groups(n, WG), &b)
    }

    fn index_select(&self, dim: usize, input: &View, index: &View, code: u32) -> Dispatch {
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
        self.checked_index(&mut b, "x", index, &off, input.layout.dims()[dim], code);
        d[dim] = "u32(x)".into();
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", input.input, strided_all(&d, &input.layout));
        sh.finish("index_select".into(), WG, groups(n, WG), &b)
    }

    /// `out[.., index[p], ..] += src[p]` for every position `p` of `index`.
    /// Short lines along `dim`: a thread per line adds in index order, as
    /// the CPU does. Longer ones: a thread per position, adding with an
    /// atomic compare-exchange loop (floats) or atomic add (integers), so
    /// long dims run in parallel (and within the 65,535 loop iterations
    /// llvmpipe allows a shader); float sums then depend on the order of
    /// the additions, as on PyTorch's GPUs.
    fn scatter_add(&self, dim: usize, input: &View, index: &View, src: &View, code: u32) -> Dispatch {
        let idims = index.layout.dims();
        let dt = self.out.0;
        let fits = (self.out.1 as u64) * super::super::codegen::elem_bytes(self.caps, dt) <= self.caps.chunk_bytes();
        if idims[dim] > 64 && fits {
            return self.scatter_add_atomic(dim, input, index, src, code);
        }
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[index.input, src.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let len = idims[dim];
        let mut line_dims = idims.to_vec();
        line_dims[dim] = 1;
        let lines: usize = line_dims.iter().product();
        let odims = input.layout.dims();
        let mut b = format!("    let t = group * {WG}u + lid;\n    if (t >= {lines}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "t", &line_dims);
        let _ = writeln!(b, "    for (var j = 0u; j < {len}u; j = j + 1u) {{");
        d[dim] = "j".into();
        let ioff = strided_all(&d, &index.layout);
        self.checked_index(&mut b, "x", index, &ioff, odims[dim], code);
        let soff = strided_all(&d, &src.layout);
        d[dim] = "u32(x)".into();
        let ooff = strided_all(&d, &Layout::contiguous(odims));
        let sum = if dt == DType::Bool {
            format!("ld_out(o) || ld_in{}({soff})", src.input)
        } else {
            round_to(dt, &format!("ld_out(o) + ld_in{}({soff})", src.input))
        };
        let _ = writeln!(b, "    let o = {ooff};\n    st_out(o, {sum});\n    }}");
        sh.finish("scatter_add".into(), WG, groups(lines, WG), &b)
    }

    /// `scatter_add` with a thread per index position and atomic additions.
    fn scatter_add_atomic(&self, dim: usize, input: &View, index: &View, src: &View, code: u32) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[index.input, src.input]);
        let dt = self.out.0;
        let word = if dt == DType::I32 { "i32" } else { "u32" };
        sh.bind_raw(Src::Output, "outa", &format!("array<atomic<{word}>>"), true);
        sh.index_errors();
        let idims = index.layout.dims();
        let n = index.layout.numel();
        let odims = input.layout.dims();
        let mut b = format!("    let p = group * {WG}u + lid;\n    if (p >= {n}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "p", idims);
        let ioff = strided_all(&d, &index.layout);
        self.checked_index(&mut b, "x", index, &ioff, odims[dim], code);
        let soff = strided_all(&d, &src.layout);
        d[dim] = "u32(x)".into();
        let ooff = strided_all(&d, &Layout::contiguous(odims));
        let _ = writeln!(b, "    let v = ld_in{}({soff});\n    let o = {ooff};", src.input);
        // Compare-exchange: `new(old)` is the word after adding v to the element in `old`.
        let cas = |b: &mut String, at: &str, new: &str| {
            let _ = writeln!(
                b,
                "    var old = atomicLoad(&outa[{at}]);
    loop {{
        let r = atomicCompareExchangeWeak(&outa[{at}], old, {new});
        if (r.exchanged) {{ break; }}
        old = r.old_value;
    }}"
            );
        };
        match dt {
            DType::I32 | DType::U32 => {
                let _ = writeln!(b, "    atomicAdd(&outa[o], v);");
            }
            DType::Bool => {
                let _ = writeln!(b, "    if (v) {{ atomicOr(&outa[o], 1u); }}");
            }
            DType::F32 => cas(&mut b, "o", "bitcast<u32>(bitcast<f32>(old) + v)"),
            DType::F16 | DType::BF16 => {
                // Packed halves: replace this element's half of the word
                // (native f16 too: WGSL has no 16-bit atomics).
                let _ = writeln!(b, "    let w = o / 2u;\n    let sh = (o % 2u) * 16u;");
                // On the bits: pack2x16float needs a capability WebGPU and GL
                // may lack, and naga mistypes a bitcast to vec2<f16>.
                let new = if dt == DType::BF16 {
                    "(old & ~(0xffffu << sh)) | ((bitcast<u32>(bf16r_(bitcast<f32>(((old >> sh) & 0xffffu) << 16u) + v)) >> 16u) << sh)"
                } else {
                    "(old & ~(0xffffu << sh)) | (f2h_(f16r_(h2f_((old >> sh) & 0xffffu) + v)) << sh)"
                };
                cas(&mut b, "w", new);
            }
            DType::F64 => unreachable!("f64 is refused on the GPU"),
        }
        sh.finish("scatter_add_atomic".into(), WG, groups(n, WG), &b)
    }

    /// Inclusive prefix sums along `dim`. Short lines: a thread per line.
    /// Longer ones: a blocked scan in up to three passes: each block of
    /// `SCAN` elements sums its part of a line, one workgroup per line scans
    /// those sums into block offsets, then each block scans its elements from
    /// its offset and writes them once (sums accumulate in the compute type,
    /// rounded when stored).
    fn cumsum(&self, p: &mut WgslProgram, dim: usize, input: &View) {
        let dims = input.layout.dims();
        let len = dims[dim];
        if len <= 64 {
            p.dispatches.push(self.cumsum_lines(dim, input));
            return;
        }
        let lines = input.layout.numel() / len;
        let blocks = len.div_ceil(SCAN);
        let ct = compute_ty(self.out.0);
        let acc = match ct {
            "i32" => DType::I32,
            "u32" => DType::U32,
            _ => DType::F32,
        };
        if blocks > 1 {
            p.scratch.push((acc, lines * blocks));
            p.dispatches.push(self.cumsum_block_sums(dim, input, blocks, acc));
            p.dispatches.push(self.cumsum_block_offsets(lines, blocks, acc));
        }
        p.dispatches.push(self.cumsum_blocks(dim, input, blocks, acc));
    }

    /// The WGSL that finds line `t`'s input base and output base (`base`, `obase`).
    fn scan_line(&self, b: &mut String, sh: &mut crate::backend::wgpu::codegen::Shader, dim: usize, input: &View) {
        let l = &input.layout;
        let dims = l.dims();
        let len = dims[dim];
        let mut line_dims = dims.to_vec();
        line_dims[dim] = 1;
        let inner: usize = dims[dim + 1..].iter().product();
        let d = unravel(b, sh, "t", &line_dims);
        let _ = writeln!(b, "    let base = {};\n    let obase = (t / {inner}u) * {}u + t % {inner}u;", strided(&d, l), len * inner);
    }

    fn cumsum_lines(&self, dim: usize, input: &View) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let len = l.dims()[dim];
        let lines = l.numel() / len;
        let inner: usize = l.dims()[dim + 1..].iter().product();
        let dt = self.out.0;
        let mut b = format!("    let t = group * {WG}u + lid;\n    if (t >= {lines}u) {{ return; }}\n");
        self.scan_line(&mut b, &mut sh, dim, input);
        let _ = writeln!(
            b,
            "    var acc: {} = {};
    for (var j = 0u; j < {len}u; j = j + 1u) {{
        acc = {};
        st_out(obase + j * {inner}u, acc);
    }}",
            compute_ty(dt),
            literal(0.0, dt),
            round_to(dt, &format!("acc + ld_in{}(base + j * {}u)", input.input, l.strides()[dim])),
        );
        sh.finish("cumsum".into(), WG, groups(lines, WG), &b)
    }

    /// Pass 1: the sum of each block of each line, into scratch.
    fn cumsum_block_sums(&self, dim: usize, input: &View, blocks: usize, acc: DType) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        let lines = input.layout.numel() / input.layout.dims()[dim];
        sh.array(Src::Scratch(0), "bsum", acc, lines * blocks, true);
        let at = compute_ty(acc);
        sh.decl(&format!("var<workgroup> part: array<{at}, {WG}>;"));
        let len = input.layout.dims()[dim];
        let stride = input.layout.strides()[dim];
        let mut b = format!("    if (group >= {}u) {{ return; }}\n    let t = group / {blocks}u;\n    let blk = group % {blocks}u;\n", lines * blocks);
        self.scan_line(&mut b, &mut sh, dim, input);
        let _ = writeln!(b, "    var s: {at} = {};", literal(0.0, acc));
        for u in 0..SCAN / WG as usize {
            let _ = writeln!(b, "    {{ let j = blk * {SCAN}u + lid * {}u + {u}u; if (j < {len}u) {{ s = s + {at}(ld_in{}(base + j * {stride}u)); }} }}", SCAN / WG as usize, input.input);
        }
        let _ = writeln!(
            b,
            "    part[lid] = s;
    workgroupBarrier();
    for (var w = {}u; w > 0u; w = w >> 1u) {{
        if (lid < w) {{ part[lid] = part[lid] + part[lid + w]; }}
        workgroupBarrier();
    }}
    if (lid == 0u) {{ st_bsum(group, part[0]); }}",
            WG / 2
        );
        sh.finish("cumsum_block_sums".into(), WG, (lines * blocks) as u64, &b)
    }

    /// Pass 2: each line's block sums, scanned in place into exclusive offsets.
    fn cumsum_block_offsets(&self, lines: usize, blocks: usize, acc: DType) -> Dispatch {
        let mut sh = self.shader();
        sh.array(Src::Scratch(0), "bsum", acc, lines * blocks, true);
        let at = compute_ty(acc);
        sh.decl(&format!("var<workgroup> part: array<{at}, {WG}>;"));
        let zero = literal(0.0, acc);
        let mut b = format!("    let t = group;\n    if (t >= {lines}u) {{ return; }}\n    var carry: {at} = {zero};\n");
        let _ = writeln!(
            b,
            "    for (var c = 0u; c < {blocks}u; c = c + {WG}u) {{
        let k = c + lid;
        var v: {at} = {zero};
        if (k < {blocks}u) {{ v = ld_bsum(t * {blocks}u + k); }}
        part[lid] = v;
        workgroupBarrier();
{}
        var before: {at} = {zero};
        if (lid > 0u) {{ before = part[lid - 1u]; }}
        if (k < {blocks}u) {{ st_bsum(t * {blocks}u + k, carry + before); }}
        let total = part[{}u];
        workgroupBarrier();
        carry = carry + total;
    }}",
            scan_shared("part", at, &zero),
            WG - 1
        );
        sh.finish("cumsum_block_offsets".into(), WG, lines as u64, &b)
    }

    /// Pass 3 (the only one for lines of one block): each block scans its
    /// elements from its offset and writes them.
    fn cumsum_blocks(&self, dim: usize, input: &View, blocks: usize, acc: DType) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let len = l.dims()[dim];
        let lines = l.numel() / len;
        let inner: usize = l.dims()[dim + 1..].iter().product();
        if blocks > 1 {
            sh.array(Src::Scratch(0), "bsum", acc, lines * blocks, false);
        }
        let at = compute_ty(acc);
        sh.decl(&format!("var<workgroup> part: array<{at}, {WG}>;"));
        let per = SCAN / WG as usize;
        let dt = self.out.0;
        let stride = l.strides()[dim];
        let mut b = format!("    if (group >= {}u) {{ return; }}\n    let t = group / {blocks}u;\n    let blk = group % {blocks}u;\n", lines * blocks);
        self.scan_line(&mut b, &mut sh, dim, input);
        let _ = writeln!(b, "    let j0 = blk * {SCAN}u + lid * {per}u;\n    var x: array<{at}, {per}>;\n    var s: {at} = {};", literal(0.0, acc));
        for u in 0..per {
            let _ = writeln!(b, "    if (j0 + {u}u < {len}u) {{ x[{u}] = {at}(ld_in{}(base + (j0 + {u}u) * {stride}u)); }} else {{ x[{u}] = {}; }}\n    s = s + x[{u}];", input.input, literal(0.0, acc));
        }
        let offset = if blocks > 1 { "ld_bsum(group)".to_string() } else { literal(0.0, acc) };
        let zero = literal(0.0, acc);
        let _ = writeln!(
            b,
            "    part[lid] = s;\n    workgroupBarrier();\n{}\n    var run = {offset};\n    if (lid > 0u) {{ run = run + part[lid - 1u]; }}",
            scan_shared("part", at, &zero)
        );
        for u in 0..per {
            let _ = writeln!(b, "    run = run + x[{u}];\n    if (j0 + {u}u < {len}u) {{ st_out(obase + (j0 + {u}u) * {inner}u, {}); }}", cast(acc, dt, "run"));
        }
        sh.finish(format!("cumsum_blocks {blocks}x{SCAN}"), WG, (lines * blocks) as u64, &b)
    }

    /// All parts of a cat in one dispatch: each part has a run of
    /// workgroups (a thread per element of the part), so the parts do not
    /// wait on each other's barriers as a dispatch per part did.
    fn cat(&self, dim: usize, parts: &[View]) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &parts.iter().map(|p| p.input).collect::<Vec<_>>());
        self.bind_out(&mut sh);
        let total: usize = parts.iter().map(|v| v.layout.dims()[dim]).sum();
        let (mut b, mut at, mut first) = (String::new(), 0, 0u64);
        for part in parts {
            let pd = part.layout.dims();
            let n = part.layout.numel();
            let mut od = pd.to_vec();
            od[dim] = total;
            let ostr = crate::shape::Shape::new(&od).contiguous_strides();
            let out_l = Layout { shape: crate::shape::Shape::new(&od), strides: ostr.clone(), offset: at * ostr[dim] };
            at += pd[dim];
            if n == 0 {
                continue;
            }
            let end = first + groups(n, WG);
            let _ = writeln!(b, "    if (group < {end}u) {{\n    let i = (group - {first}u) * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}");
            let d = unravel(&mut b, &mut sh, "i", pd);
            let _ = writeln!(b, "    st_out({}, ld_in{}({}));\n    return;\n    }}", strided_all(&d, &out_l), part.input, strided(&d, &part.layout));
            first = end;
        }
        sh.finish("cat".into(), WG, first, &b)
    }

    /// im2col (see `IndexOp::Unfold`): a thread per patch entry.
    fn unfold(&self, input: &View, p: &UnfoldParams, pad: f64, by_tap: bool) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let dd = l.dims();
        let (h, w) = (dd[2], dd[3]);
        let [oh, ow] = p.out_hw(h, w).unwrap_or([0, 0]);
        let [kh, kw] = p.kernel;
        let n = dd[0] * dd[1] * kh * kw * oh * ow;
        let dt = self.out.0;
        let st = l.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        // Digits in the output's order, named as in `[N, C, kh, kw, oh, ow]`.
        let d = if by_tap {
            let t = unravel(&mut b, &mut sh, "i", &[dd[1], kh, kw, dd[0], oh, ow]);
            vec![t[3].clone(), t[0].clone(), t[1].clone(), t[2].clone(), t[4].clone(), t[5].clone()]
        } else {
            unravel(&mut b, &mut sh, "i", &[dd[0], dd[1], kh, kw, oh, ow])
        };
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
            sum = round_to(
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

impl Gen<'_> {
    /// Declare `window_peak(base, oy, ox)`: the maximum of window `(oy, ox)`
    /// of the image plane at `base` of `image` and the position `iy * W +
    /// ix` of its first maximum, walking the taps in row-major order (a
    /// NaN is the maximum, the first one taken; padding is never chosen).
    /// Max pooling and its gradient share it, so both pick the same tap.
    fn window_peak(&self, sh: &mut Shader, image: &View, p: &UnfoldParams) {
        let l = &image.layout;
        let (h, w) = (l.dims()[2], l.dims()[3]);
        let st = l.strides();
        let idt = self.inputs[image.input].0;
        // Whether tap `v` replaces the running maximum `best`: a greater
        // value, or the first NaN (nothing replaces a NaN).
        let greater = match compute_ty(idt) {
            "f32" => "(!isnan_(best) && (v > best || isnan_(v)))",
            "bool" => "(v && !best)",
            _ => "(v > best)",
        };
        let mut consts = String::new();
        window_consts(&mut consts, p);
        sh.decl(&format!(
            "{consts}struct Peak {{ best: {ct}, at: i32 }}
fn window_peak(base: u32, oy: u32, ox: u32) -> Peak {{
    var best = {zero};
    var at = -1;
    for (var ki = 0u; ki < KH; ki = ki + 1u) {{
        let iy = i32(oy * SY + ki * DY) - PY;
        if (iy < 0 || iy >= {h}) {{ continue; }}
        for (var kj = 0u; kj < KW; kj = kj + 1u) {{
            let ix = i32(ox * SX + kj * DX) - PX;
            if (ix < 0 || ix >= {w}) {{ continue; }}
            let v = ld_in{inp}(base + u32(iy) * {s2}u + u32(ix) * {s3}u);
            if (at < 0 || {greater}) {{
                best = v;
                at = iy * {w} + ix;
            }}
        }}
    }}
    return Peak(best, at);
}}",
            ct = compute_ty(idt),
            zero = literal(0.0, idt),
            inp = image.input,
            s2 = st[2],
            s3 = st[3],
        ));
    }

    /// Max pooling (see `IndexOp::MaxPool`): a thread per window.
    fn max_pool(&self, input: &View, p: &UnfoldParams) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        self.window_peak(&mut sh, input, p);
        let l = &input.layout;
        let dd = l.dims();
        let [oh, ow] = p.out_hw(dd[2], dd[3]).unwrap_or([0, 0]);
        let n = dd[0] * dd[1] * oh * ow;
        let st = l.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", &[dd[0], dd[1], oh, ow]);
        let _ = writeln!(
            b,
            "    st_out(i, window_peak({off}u + {n0} * {s0}u + {c0} * {s1}u, {y}, {x}).best);",
            off = l.offset(),
            n0 = d[0],
            c0 = d[1],
            y = d[2],
            x = d[3],
            s0 = st[0],
            s1 = st[1],
        );
        sh.finish("max_pool".into(), WG, groups(n, WG), &b)
    }

    /// The gradient of max pooling (see `IndexOp::MaxPoolGrad`). Where the
    /// windows tile the image exactly, one kernel with a thread per window
    /// ([`Gen::max_pool_grad_tiled`]). Otherwise an element may be in
    /// several windows: a thread per window stores its first maximum's
    /// position in scratch, then a thread per image element sums the
    /// windows over it whose maximum it is, in window order as the CPU adds
    /// them (a deterministic gather, where a scatter would need atomics).
    /// Finding the maximum in the gather instead, once per window per
    /// element, took twice as long on the H200 even for 2x2 windows.
    fn max_pool_grad(&self, prog: &mut WgslProgram, g: &View, image: &View, p: &UnfoldParams) {
        let gd = g.layout.dims();
        let (h, w) = (image.layout.dims()[2], image.layout.dims()[3]);
        if p.tiles(h, w) {
            prog.dispatches.push(self.max_pool_grad_tiled(g, image, p));
            return;
        }
        let at = prog.scratch.len();
        prog.scratch.push((DType::I32, g.layout.numel()));
        prog.dispatches.push(self.max_pool_positions(image, p, gd, at));
        prog.dispatches.push(self.max_pool_grad_gather(g, [h, w], p, at));
    }

    /// The position of each window's first maximum, into scratch `at`
    /// (windows `[N, C, oh, ow]` in row-major order).
    fn max_pool_positions(&self, image: &View, p: &UnfoldParams, windows: &[usize], at: usize) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[image.input]);
        let n: usize = windows.iter().product();
        sh.array(Src::Scratch(at), "at", DType::I32, n, true);
        self.window_peak(&mut sh, image, p);
        let xs = image.layout.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", windows);
        let _ = writeln!(b, "    st_at(i, window_peak({}u + {} * {}u + {} * {}u, {}, {}).at);", image.layout.offset(), d[0], xs[0], d[1], xs[1], d[2], d[3]);
        sh.finish("max_pool_positions".into(), WG, groups(n, WG), &b)
    }

    /// The gather of the general gradient: a thread per element of the
    /// image (of spatial size `hw`) sums `g` over the windows whose stored
    /// position is its own.
    fn max_pool_grad_gather(&self, g: &View, [h, w]: [usize; 2], p: &UnfoldParams, at: usize) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[g.input]);
        self.bind_out(&mut sh);
        let gd = g.layout.dims();
        let (oh, ow) = (gd[2], gd[3]);
        sh.array(Src::Scratch(at), "at", DType::I32, g.layout.numel(), false);
        let n = gd[0] * gd[1] * h * w;
        let dt = self.out.0;
        let gs = g.layout.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", &[gd[0], gd[1], h, w]);
        window_consts(&mut b, p);
        // Windows oy over row iy have oy * sy + ki * dy - py == iy for a tap
        // row ki; walking ki down walks oy up.
        let _ = writeln!(
            b,
            "    let gbase = {goff}u + {n0} * {gs0}u + {c0} * {gs1}u;
    let abase = ({n0} * {c}u + {c0}) * {ohw}u;
    let here = i32({iy} * {w}u + {ix});
    var acc = {zero};
    for (var a = 0u; a < KH; a = a + 1u) {{
        let ty = i32({iy}) + PY - i32((KH - 1u - a) * DY);
        if (ty < 0 || ty % SY != 0 || ty / SY >= {oh}) {{ continue; }}
        let oy = u32(ty / SY);
        for (var c = 0u; c < KW; c = c + 1u) {{
            let tx = i32({ix}) + PX - i32((KW - 1u - c) * DX);
            if (tx < 0 || tx % SX != 0 || tx / SX >= {ow}) {{ continue; }}
            let ox = u32(tx / SX);
            if (ld_at(abase + oy * {ow}u + ox) == here) {{
                acc = {sum};
            }}
        }}
    }}
    st_out(i, acc);",
            goff = g.layout.offset(),
            n0 = d[0],
            c0 = d[1],
            iy = d[2],
            ix = d[3],
            gs0 = gs[0],
            gs1 = gs[1],
            c = gd[1],
            ohw = oh * ow,
            zero = literal(0.0, dt),
            sum = round_to(dt, &format!("acc + ld_in{}(gbase + oy * {}u + ox * {}u)", g.input, gs[2], gs[3])),
        );
        sh.finish("max_pool_grad".into(), WG, groups(n, WG), &b)
    }

    /// [`Gen::max_pool_grad`] where the windows tile the image exactly
    /// (stride = kernel, no padding, the image a whole number of windows):
    /// a thread per window finds its first maximum once and writes the
    /// window's every element, `g` there and zeros elsewhere: one kernel,
    /// no scratch. (A thread per element finding its window's maximum
    /// itself took twice the two kernels of the general path on the H200:
    /// 127 against 16 + 48 us for the CNN's first pooling at batch 256.)
    fn max_pool_grad_tiled(&self, g: &View, image: &View, p: &UnfoldParams) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[g.input, image.input]);
        self.bind_out(&mut sh);
        self.window_peak(&mut sh, image, p);
        let gd = g.layout.dims();
        let (h, w) = (image.layout.dims()[2], image.layout.dims()[3]);
        let n = gd[0] * gd[1] * gd[2] * gd[3];
        let dt = self.out.0;
        let (gs, xs) = (g.layout.strides(), image.layout.strides());
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", gd);
        let _ = writeln!(
            b,
            "    let at = window_peak({xoff}u + {n0} * {xs0}u + {c0} * {xs1}u, {y}, {x}).at;
    let v = {v};
    let plane = ({n0} * {c} + {c0}) * {hw}u;
    for (var ki = 0u; ki < KH; ki = ki + 1u) {{
        for (var kj = 0u; kj < KW; kj = kj + 1u) {{
            let here = ({y} * KH + ki) * {w}u + {x} * KW + kj;
            st_out(plane + here, select({zero}, v, i32(here) == at));
        }}
    }}",
            xoff = image.layout.offset(),
            n0 = d[0],
            c0 = d[1],
            y = d[2],
            x = d[3],
            xs0 = xs[0],
            xs1 = xs[1],
            c = gd[1],
            hw = h * w,
            zero = literal(0.0, dt),
            // As the per-element kernel adds it into zeros.
            v = round_to(dt, &format!("{} + ld_in{}({}u + {} * {}u + {} * {}u + {} * {}u + {} * {}u)", literal(0.0, dt), g.input, g.layout.offset(), d[0], gs[0], d[1], gs[1], d[2], gs[2], d[3], gs[3])),
        );
        sh.finish("max_pool_grad_tiled".into(), WG, groups(n, WG), &b)
    }
}

/// A pooling window's parameters as WGSL constants (`KH`, `KW`, `SY`, `SX`,
/// `DY`, `DX`, `PY`, `PX`), untyped so that they read as `u32` or `i32`
/// wherever they are used.
fn window_consts(b: &mut String, p: &UnfoldParams) {
    let ([kh, kw], [sy, sx], [dy, dx], [py, px]) = (p.kernel, p.stride, p.dilation, p.padding);
    let _ = writeln!(b, "    const KH = {kh}; const KW = {kw}; const SY = {sy}; const SX = {sx}; const DY = {dy}; const DX = {dx}; const PY = {py}; const PX = {px};");
}

/// Elements each workgroup of the blocked scan covers.
const SCAN: usize = 1024;

/// Flag in an index error's op code: the index tensor is u32.
pub(crate) const UNSIGNED_INDEX: u32 = 0x100;

/// WGSL that turns `arr[0..WG]` (workgroup memory, every thread holding one
/// entry at `lid`) into its inclusive prefix sums (Hillis-Steele, with barriers).
fn scan_shared(arr: &str, ty: &str, zero: &str) -> String {
    format!(
        "    for (var w = 1u; w < {WG}u; w = w << 1u) {{
        var add: {ty} = {zero};
        if (lid >= w) {{ add = {arr}[lid - w]; }}
        workgroupBarrier();
        {arr}[lid] = {arr}[lid] + add;
        workgroupBarrier();
    }}"
    )
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

/// The offset of element `tail` (two digits) of `l`, whose leading dims are
/// at the digits `lead`.
fn at_lead(lead: &[String], l: &Layout, tail: [&str; 2]) -> String {
    let mut digits = lead.to_vec();
    digits.extend(tail.map(String::from));
    strided(&digits, l)
}

/// Lanes of an attention kernel's thread group: each owns output elements
/// `lane`, `lane + LANES`, ... of its query row.
const LANES: usize = 64;

/// `body` for output element `ee = lane + r * LANES` of an attention
/// kernel's row of `e`, where it exists.
fn lane_elem(r: usize, e: usize, body: &str) -> String {
    format!("{{ let ee = lane + {}u; if (ee < {e}u) {{ {body} }} }}", r * LANES)
}

/// Threads of an attention kernel's workgroup on a hardware adapter (at
/// most the adapter's limit): 256, or `VOLTAIC_ATTENTION_THREADS` (64 to
/// 1,024, a power of two; a measuring knob).
fn attention_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        let n = std::env::var("VOLTAIC_ATTENTION_THREADS").ok().and_then(|v| v.parse::<usize>().ok());
        n.filter(|n| n.is_power_of_two() && (64..=1024).contains(n)).unwrap_or(256)
    })
}

/// Keys a workgroup takes when an attention kernel splits them
/// (`VOLTAIC_ATTENTION_SPLIT_KEYS`, a measuring knob: 0 never splits).
const SPLIT_KEYS: usize = 32;

/// Query rows up to which an attention kernel splits its keys (a decode
/// step's few); each row counts on one of the device's counters.
const MAX_SPLIT_ROWS: usize = 64;
const _: () = assert!(MAX_SPLIT_ROWS <= crate::backend::wgpu::codegen::COUNTERS);

/// How many workgroups share each query row's `n` keys, and how many keys
/// each takes: one for many rows or few keys; for a decode step's few
/// rows (at most [`MAX_SPLIT_ROWS`]), enough that each takes about
/// `SPLIT_KEYS`, at most 16.
fn attention_splits(rows: usize, n: usize) -> (usize, usize) {
    static KEYS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let per = *KEYS.get_or_init(|| std::env::var("VOLTAIC_ATTENTION_SPLIT_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(SPLIT_KEYS));
    if per == 0 || rows > MAX_SPLIT_ROWS || n < 2 * per {
        return (1, n);
    }
    let splits = n.div_ceil(per).min(16);
    let span = n.div_ceil(splits);
    (n.div_ceil(span), span)
}

/// The end of a split attention kernel: the first group's lanes store the
/// workgroup's partials, every workgroup takes a ticket, and the last of
/// the row combines the row's partials into its output.
fn attention_combine(b: &mut String, splits: usize, e: usize, per: usize) {
    let _ = writeln!(b, "    if (kgi == 0u) {{\n        if (lane == 0u) {{ st_pm(group, mx); st_pl(group, l); }}");
    for r in 0..per {
        let _ = writeln!(b, "        {}", lane_elem(r, e, &format!("st_pa(group * {e}u + ee, acc{r});")));
    }
    // The storage barriers make the partials visible before the ticket
    // is taken, and the others' visible to the last workgroup after it.
    let _ = writeln!(b, "    }}\n    storageBarrier();\n    if (lid == 0u) {{ lastw = u32(atomicAdd(&cnt[row], 1u) == {}u); }}", splits - 1);
    let _ = writeln!(b, "    if (workgroupUniformLoad(&lastw) == 0u) {{ return; }}\n    storageBarrier();\n    if (lid == 0u) {{ atomicStore(&cnt[row], 0u); }}\n    if (kgi != 0u) {{ return; }}");
    let _ = writeln!(b, "    var gm = ninf;\n    for (var s = 0u; s < {splits}u; s = s + 1u) {{ gm = max(gm, ld_pm(row * {splits}u + s)); }}\n    var gl = 0.0;");
    for r in 0..per {
        let _ = writeln!(b, "    var o{r} = 0.0;");
    }
    // A split whose scores were all -inf has weight 0 (and sums 0).
    let _ = writeln!(b, "    for (var s = 0u; s < {splits}u; s = s + 1u) {{\n        let ps = row * {splits}u + s;\n        let ms = ld_pm(ps);\n        let f = select(0.0, exp(ms - gm), ms > ninf);\n        gl = gl + ld_pl(ps) * f;");
    for r in 0..per {
        let _ = writeln!(b, "        {}", lane_elem(r, e, &format!("o{r} = o{r} + ld_pa(ps * {e}u + ee) * f;")));
    }
    let _ = writeln!(b, "    }}");
    for r in 0..per {
        let _ = writeln!(b, "    {}", lane_elem(r, e, &format!("st_out(row * {e}u + ee, o{r} / gl);")));
    }
}
