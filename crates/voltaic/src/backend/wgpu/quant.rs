//! Kernels over block-quantized matrices (see `QTensor`), which
//! dequantize in registers: a GEMV for a few rows (decode: one token per
//! sequence), a tiled matmul for many (prefill), and the dequantizing row
//! gather (embedding lookups). Each quantization type is two WGSL
//! functions (see [`deq_fn`]): the scale of a run of elements of a block,
//! and each element's integer.

use super::codegen::{Dispatch, Shader, WgslProgram};
use super::kernels::{groups, Gen, WG};
use super::codegen::{cast, compute_ty, emit_expr_with, Indexer};
use super::kernels::{stage_values, Reduction};
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::ir::{Epilogue, Prologue, Strided as View};
use crate::quant::GgmlType;
use std::fmt::Write;

/// Rows of `x` up to which a product runs as a GEMV (each weight row is
/// read once for all of them); above, as tiles.
pub(crate) const GEMV_ROWS: usize = 8;

/// How the GEMV runs (`VOLTAIC_GEMV=threads,runs[,bytes][,unpack]` to
/// measure others: threads a power of two from 2 to 256, runs 1 to 8).
/// Measured on an H100 (SmolLM2 decode, kernels timed in their passes,
/// 2026-11-28): 64 threads a row and one run a trip are best (32 threads:
/// +3%, 128: +5%, 16: +12%, 8: +41%; two or four runs a trip, which keep
/// more loads in flight per thread, +25-60%, since fewer workgroups fit
/// each SM); a run's quants as two or three word loads instead of a load
/// per element: -2.7%. (Rows of over 1,024 elements on 128 threads: slower.)
#[derive(Clone, Copy, Debug)]
struct GemvShape {
    /// Threads that share one weight row.
    threads: usize,
    /// Runs of 8 elements each thread takes per trip.
    unroll: usize,
    /// Q8_0, Q4_0, Q4_1: a run's quants as two or three word loads, not
    /// a load per element (`bytes` turns it off).
    words: bool,
    /// Q4_1: the scale and offset by `unpack2x16float` (1-2% faster on the
    /// H100, off: Vulkan lets a driver flush f16 subnormals there, and
    /// these kernels multiply exactly what the dequantizer gives).
    unpack: bool,
    /// Threads a workgroup (`VOLTAIC_GEMV_WG`: 64 to 1024, a power of two
    /// of at least `threads`). On the H200 (SmolLM2 decode, 2026-11-28):
    /// 256 and 512 alike (490 and 492 us a pass), 1,024 slower (585 us).
    wg: u32,
}

/// Outputs above which a GEMV is "wide" (a language model's output head):
/// it has rows enough to fill the GPU many times over, so its shape is
/// chosen apart (`VOLTAIC_GEMV_WIDE`).
const WIDE_OUTPUTS: usize = 4096;

/// The GEMV shape for `n` outputs: `VOLTAIC_GEMV=threads,runs[,bytes][,unpack]`
/// for all (a measuring knob), `VOLTAIC_GEMV_WIDE=threads,runs` for wide
/// ones over it.
fn gemv_shape(n: usize) -> GemvShape {
    static SHAPES: std::sync::OnceLock<(GemvShape, GemvShape)> = std::sync::OnceLock::new();
    let (narrow, wide) = *SHAPES.get_or_init(|| {
        fn parse<'a>(g: &mut GemvShape, v: &'a str) -> Vec<&'a str> {
            let parts: Vec<&str> = v.split(',').map(str::trim).collect();
            if let (Some(t), Some(u)) = (parts.first().and_then(|t| t.parse::<usize>().ok()), parts.get(1).and_then(|u| u.parse::<usize>().ok())) {
                if (2..=WG as usize).contains(&t) && t.is_power_of_two() && (1..=8).contains(&u) {
                    (g.threads, g.unroll) = (t, u);
                }
            }
            parts
        }
        let mut g = GemvShape { threads: 64, unroll: 1, words: true, unpack: false, wg: WG };
        if let Ok(v) = std::env::var("VOLTAIC_GEMV") {
            let parts = parse(&mut g, &v);
            g.words = !parts.contains(&"bytes");
            g.unpack = parts.contains(&"unpack");
        }
        // Wide products take 8 threads a row, 32 rows a workgroup: SmolLM2's
        // head (49,152 x 576, Q8_0) took 25.5-26.0 us on the H200 against
        // 49.8 with 64 threads a row (4: 26.6, 16: 29.4, 32: 44.0; two or
        // four runs a trip 25.2-44): a row's 72 runs need no more threads,
        // and 12,288 workgroups of 4 rows paid their starts and barriers
        // many waves over.
        let mut w = GemvShape { threads: 8, unroll: 1, ..g };
        if let Ok(v) = std::env::var("VOLTAIC_GEMV_WIDE") {
            parse(&mut w, &v);
        }
        if let Some(n) = std::env::var("VOLTAIC_GEMV_WG").ok().and_then(|v| v.parse::<u32>().ok()) {
            for s in [&mut g, &mut w] {
                if (64..=1024).contains(&n) && n.is_power_of_two() && n as usize >= s.threads {
                    s.wg = n;
                }
            }
        }
        (g, w)
    });
    if n > WIDE_OUTPUTS {
        wide
    } else {
        narrow
    }
}

/// The WGSL that reads blocks of `q` from the words `ld_{w}(i)`. Element
/// `e` of the block at word `base` is `s.x * qv(base, e) + s.y` with
/// `s = qscale(base, e)`: `qv` is the element's integer (as f32) and
/// `qscale` its (sub-)block's scale and offset, the same for every run of 8
/// elements that starts at a multiple of 8, so kernels compute it once per
/// run and the per-element code has no branches (which also keeps
/// lavapipe's LLVM compile of these kernels short). The arithmetic follows
/// the CPU's dequantizers (`quant.rs`): every product below is exact in
/// f32, and the one rounding is the final multiply or add, as there.
fn deq_fn(q: GgmlType, w: &str) -> String {
    let helpers = format!(
        "fn qbyte(base: u32, off: u32) -> u32 {{ return (ld_{w}(base + off / 4u) >> ((off % 4u) * 8u)) & 255u; }}
fn qhalf(base: u32, off: u32) -> f32 {{ return h2f_((ld_{w}(base + off / 4u) >> ((off % 4u) * 8u)) & 0xffffu); }}
fn qi8(b: u32) -> f32 {{ return f32(bitcast<i32>(b << 24u) >> 24u); }}
"
    );
    let (scale, value) = match q {
        GgmlType::Q8_0 => ("    return vec2<f32>(qhalf(base, 0u), 0.0);", "    return qi8(qbyte(base, 2u + e));"),
        GgmlType::Q4_0 => (
            "    return vec2<f32>(qhalf(base, 0u), 0.0);",
            "    let b = qbyte(base, 2u + e % 16u);
    return f32(i32(select(b & 15u, b >> 4u, e >= 16u)) - 8);",
        ),
        GgmlType::Q4_1 => (
            "    return vec2<f32>(qhalf(base, 0u), qhalf(base, 2u));",
            "    let b = qbyte(base, 4u + e % 16u);
    return f32(select(b & 15u, b >> 4u, e >= 16u));",
        ),
        GgmlType::Q4K => (
            "    let s = e / 32u;
    var sc: u32;
    var mn: u32;
    if (s < 4u) {
        sc = qbyte(base, 4u + s) & 63u;
        mn = qbyte(base, 8u + s) & 63u;
    } else {
        let hi = qbyte(base, 8u + s);
        sc = (hi & 15u) | ((qbyte(base, s) >> 6u) << 4u);
        mn = (hi >> 4u) | ((qbyte(base, 4u + s) >> 6u) << 4u);
    }
    return vec2<f32>(qhalf(base, 0u) * f32(sc), -(qhalf(base, 2u) * f32(mn)));",
            "    return f32((qbyte(base, 16u + 32u * (e / 64u) + e % 32u) >> (4u * ((e / 32u) % 2u))) & 15u);",
        ),
        GgmlType::Q6K => (
            "    return vec2<f32>(qhalf(base, 208u) * qi8(qbyte(base, 192u + e / 16u)), 0.0);",
            "    let h = e / 128u;
    let k = (e / 32u) % 4u;
    let l = e % 32u;
    let lo = qbyte(base, 64u * h + 32u * (k % 2u) + l);
    let nib = select(lo & 15u, lo >> 4u, k >= 2u);
    let hi = (qbyte(base, 128u + 32u * h + l) >> (2u * k)) & 3u;
    return f32(i32(nib | (hi << 4u)) - 32);",
        ),
        _ => unreachable!("QTensor holds block types only"),
    };
    format!("{helpers}fn qscale(base: u32, e: u32) -> vec2<f32> {{\n{scale}\n}}\nfn qv(base: u32, e: u32) -> f32 {{\n{value}\n}}")
}

/// Where a block's quants start (bytes) and whether they are nibbles (the
/// low ones first, then the high ones), for the types whose runs of 8
/// elements are 8 consecutive bytes; `None` for the K-quants.
fn run_bytes(q: GgmlType) -> Option<(usize, bool)> {
    match q {
        GgmlType::Q8_0 => Some((2, false)),
        GgmlType::Q4_0 => Some((2, true)),
        GgmlType::Q4_1 => Some((4, true)),
        _ => None,
    }
}

/// Words per block and per row of a quantized matrix of `k` columns.
fn words(q: GgmlType, k: usize) -> (usize, usize) {
    let wpb = q.padded_block_bytes() / 4;
    (wpb, k / q.block().0 * wpb)
}

impl Gen<'_> {
    /// The program for `a [m, k] @ w.t()`, `w` a quantized `[n, k]`; with a
    /// prologue (GEMVs only), `a` is what the prologue computes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qmatmul(&self, p: &mut WgslProgram, a: &View, w: &View, q: GgmlType, mkn: (usize, usize, usize), epi: Option<&Epilogue>, pro: Option<&Prologue>) -> Result<()> {
        let (m, k, n) = mkn;
        p.dispatches.push(match pro {
            _ if m <= GEMV_ROWS => self.qgemv(a, w, q, m, k, n, epi, pro)?,
            None => self.qtiled(a, w, q, m, k, n, epi)?,
            Some(_) => bail!(Device, "realize", "a prologue before a quantized product of {m} rows (GEMVs of at most {GEMV_ROWS} take one)"),
        });
        Ok(())
    }

    /// The element of `a` at row `r`, column `c` (WGSL expressions).
    fn a_at(a: &View, r: &str, c: &str) -> String {
        let s = a.layout.strides();
        format!("ld_in{}({}u + ({r}) * {}u + ({c}) * {}u)", a.input, a.layout.offset, s[0], s[1])
    }

    /// A shader with `a` (or the prologue's inputs), the blocks of `w` and
    /// the output bound, the epilogue defined, and `w`'s `qscale`/`qv` functions.
    fn qshader(&self, a: &View, w: &View, q: GgmlType, epi: Option<&Epilogue>, pro: Option<&Prologue>) -> Result<Shader<'_>> {
        let mut sh = self.shader();
        let mut read = match pro {
            Some(p) => p.all_stages().flat_map(|st| st.expr.loads.iter().enumerate().filter(|&(i, _)| !st.reads_stage(i)).map(|(_, l)| l.input)).collect(),
            None => vec![a.input],
        };
        read.push(w.input);
        self.bind_inputs(&mut sh, &read);
        self.bind_out(&mut sh);
        self.epilogue(&mut sh, epi)?;
        if let Some(p) = pro {
            // The prologue's constants follow the epilogue's (`KernelKind::exprs` order).
            prologue_fns(&mut sh, p, epi.map_or(0, |e| e.expr.consts.len()), "pro_a")?;
        }
        sh.decl(&deq_fn(q, &format!("in{}", w.input)));
        Ok(sh)
    }

    /// `gemv_shape(n)` threads per weight row (one on a software adapter,
    /// where a barrier costs more than the threads gain: see
    /// `Caps::software`), `WG / threads` rows per workgroup; each thread
    /// takes runs of 8 elements of the row (one block's worth of loads),
    /// keeps one sum per row of `a`, and the threads of a row add their
    /// sums in workgroup memory.
    ///
    /// With a prologue, each workgroup first computes the stages of each
    /// row of `a` (its threads share each reduction through workgroup
    /// memory), then evaluates `a`'s elements where it would have loaded
    /// them. A factored prologue (an RMS norm, see `Factored`) instead adds
    /// up its reductions in the loop over the weights, beside the products,
    /// and each row's sum is multiplied by its factor at the end: on the
    /// H200 the attention and feed-forward projections of SmolLM2 went from
    /// 7.77 to 7.25 us and 10.48 to 9.90 us (each kernel timed in a pass of
    /// its own).
    #[allow(clippy::too_many_arguments)]
    fn qgemv(&self, a: &View, w: &View, q: GgmlType, m: usize, k: usize, n: usize, epi: Option<&Epilogue>, pro: Option<&Prologue>) -> Result<Dispatch> {
        let mut sh = self.qshader(a, w, q, epi, pro)?;
        let (wpb, wpr) = words(q, k);
        let per = q.block().0;
        let shape = gemv_shape(n);
        let (threads, unroll) = if self.caps.software { (1, 1) } else { (shape.threads, shape.unroll) };
        let runs_by_words = run_bytes(q).filter(|_| !self.caps.software && shape.words);
        let q41 = q == GgmlType::Q4_1 && !self.caps.software;
        // A software adapter runs a thread per row (see above) in the usual workgroups.
        let wg = if self.caps.software { WG } else { shape.wg };
        let rows_per_wg = wg as usize / threads;
        let mut s = String::new();
        let factored = pro.and_then(Prologue::factored);
        if let Some(p) = pro.filter(|_| factored.is_none()) {
            prologue_stages(&mut sh, &mut s, p, m, k, wg);
        }
        let a_at = |i: usize, c: &str| match (pro, &factored) {
            // The operand without its row's factor (given as 1).
            (Some(p), Some(d)) => format!("pro_a({i}u * {k}u + {c}{})", d.args(p.stages.len(), Some(d.factor))),
            (Some(p), None) => format!("pro_a({i}u * {k}u + {c}{})", stage_args(p.stages.len(), i)),
            (None, _) => Self::a_at(a, &i.to_string(), c),
        };
        // A factored prologue's reductions of row `i` take the element at
        // column `c` (counted only while `ok` holds).
        let fold_stages = |s: &mut String, i: usize, c: &str, ok: &str| {
            for (d, r) in factored.iter().flat_map(|d| d.reduced.iter().map(move |&r| (d, r))) {
                let v = format!("pro_s{r}({i}u * {k}u + {c}{})", d.args(r, None));
                let v = if ok.is_empty() { v } else { format!("select(0.0, {v}, {ok})") };
                let _ = writeln!(s, "            ps{r}_{i} = ps{r}_{i} + {v};");
            }
        };
        let _ = writeln!(s, "    let t = lid % {threads}u;\n    let j = group * {rows_per_wg}u + lid / {threads}u;");
        let _ = writeln!(s, "    let row = {}u + min(j, {}u) * {wpr}u;", w.layout.offset, n.saturating_sub(1));
        for i in 0..m {
            let _ = writeln!(s, "    var acc{i} = 0.0;");
            for r in factored.iter().flat_map(|d| &d.reduced) {
                let _ = writeln!(s, "    var ps{r}_{i} = 0.0;");
            }
        }
        // `unroll` runs of 8 a trip, their loads unconditional (a run past
        // the row's end reads its last run again and counts for nothing),
        // so a thread's loads for the whole trip are in flight together.
        let runs = k / 8;
        let _ = writeln!(s, "    for (var u0 = t * {unroll}u; u0 < {runs}u; u0 = u0 + {}u) {{", threads * unroll);
        for x in 0..unroll {
            let _ = writeln!(s, "        {{\n        let u = min(u0 + {x}u, {}u);", runs.saturating_sub(1));
            let _ = writeln!(s, "        let c0 = u * 8u;\n        let base = row + (c0 / {per}u) * {wpb}u;\n        let e0 = c0 % {per}u;");
            // A run past the end gets a zero scale and offset.
            let counts = if x == 0 { String::new() } else { format!("u0 + {x}u < {runs}u") };
            let ok = if x == 0 { String::new() } else { format!(" * select(0.0, 1.0, {counts})") };
            let scale = if q41 && shape.unpack { format!("unpack2x16float(ld_in{}(base))", w.input) } else { "qscale(base, e0)".to_string() };
            let _ = writeln!(s, "        let sc = {scale}{ok};");
            if let Some((qoff, nibbles)) = runs_by_words {
                // The run's 8 quant bytes start at a byte `qoff % 4` into a
                // word (runs start at multiples of 8): two or three word
                // loads, each byte at a constant word and shift.
                let first = if nibbles { format!("({qoff}u + e0 % 16u) / 4u") } else { format!("({qoff}u + e0) / 4u") };
                let lead = qoff % 4;
                let _ = writeln!(s, "        let qw = base + {first};");
                for wi in 0..=(lead + 7) / 4 {
                    let _ = writeln!(s, "        let q{wi} = ld_in{}(qw + {wi}u);", w.input);
                }
                if nibbles {
                    let _ = writeln!(s, "        let qs = select(0u, 4u, e0 >= 16u);");
                }
                for l in 0..8 {
                    let (wi, sh) = ((lead + l) / 4, 8 * ((lead + l) % 4));
                    let int = match q {
                        GgmlType::Q4_1 => format!("f32((q{wi} >> ({sh}u + qs)) & 15u)"),
                        GgmlType::Q4_0 => format!("f32(i32((q{wi} >> ({sh}u + qs)) & 15u) - 8)"),
                        _ => format!("f32(bitcast<i32>(q{wi} << {}u) >> 24u)", 24 - sh),
                    };
                    let _ = writeln!(s, "        {{ let v = sc.x * {int} + sc.y;");
                    for i in 0..m {
                        let _ = writeln!(s, "            acc{i} = acc{i} + v * {};", a_at(i, &format!("c0 + {l}u")));
                        fold_stages(&mut s, i, &format!("c0 + {l}u"), &counts);
                    }
                    let _ = writeln!(s, "        }}");
                }
                let _ = writeln!(s, "        }}");
            } else {
                let _ = writeln!(s, "        for (var l = 0u; l < 8u; l = l + 1u) {{\n            let v = sc.x * qv(base, e0 + l) + sc.y;");
                for i in 0..m {
                    let _ = writeln!(s, "            acc{i} = acc{i} + v * {};", a_at(i, "c0 + l"));
                    fold_stages(&mut s, i, "c0 + l", &counts);
                }
                let _ = writeln!(s, "        }}\n        }}");
            }
        }
        let _ = writeln!(s, "    }}");
        // What each row's threads add together: the products' sums, then,
        // for a factored prologue (see `Factored`), each row's reductions.
        let mut sums: Vec<String> = (0..m).map(|i| format!("acc{i}")).collect();
        if let Some(d) = &factored {
            sums.extend((0..m).flat_map(|i| d.reduced.iter().map(move |r| format!("ps{r}_{i}"))));
        }
        let mut gather = String::new();
        if threads == 1 {
            // A thread holds its row's whole sums.
        } else if let Some(sg) = sh.subgroup().map(|s| s as usize) {
            // A row's threads add their sums by shuffles within a subgroup;
            // rows wider than one add their subgroups' sums after one barrier.
            for mask in super::kernels::butterfly(threads.min(sg) as u32) {
                for a in &sums {
                    let _ = writeln!(s, "    {a} = {a} + subgroupShuffleXor({a}, {mask}u);");
                }
            }
            let per = wg as usize / sg;
            if threads > sg {
                sh.decl(&format!("var<workgroup> part: array<f32, {}>;", per * sums.len().max(1)));
                for (v, a) in sums.iter().enumerate() {
                    let _ = writeln!(s, "    if (lid % {sg}u == 0u) {{ part[{}u + lid / {sg}u] = {a}; }}", v * per);
                    let _ = writeln!(gather, "        for (var g = 1u; g < {}u; g = g + 1u) {{ {a} = {a} + part[{}u + lid / {sg}u + g]; }}", threads / sg, v * per);
                }
                let _ = writeln!(s, "    workgroupBarrier();");
            }
        } else {
            let wg = wg as usize;
            sh.decl(&format!("var<workgroup> part: array<f32, {}>;", wg * sums.len().max(1)));
            for (v, a) in sums.iter().enumerate() {
                let _ = writeln!(s, "    part[{}u + lid] = {a};", v * wg);
                let _ = writeln!(gather, "        {a} = part[{}u + lid];", v * wg);
            }
            let _ = writeln!(s, "    workgroupBarrier();");
            let _ = writeln!(s, "    for (var h = {}u; h > 0u; h = h / 2u) {{\n        if (t < h) {{", threads / 2);
            for v in 0..sums.len() {
                let o = v * wg;
                let _ = writeln!(s, "            part[{o}u + lid] = part[{o}u + lid] + part[{o}u + lid + h];");
            }
            let _ = writeln!(s, "        }}\n        workgroupBarrier();\n    }}");
        }
        let _ = writeln!(s, "    if (t == 0u && j < {n}u) {{\n{gather}");
        for i in 0..m {
            if let (Some(d), Some(p)) = (&factored, pro) {
                // The row's stages from its sums, then its factor.
                for (st, stage) in p.stages.iter().enumerate() {
                    let v = match stage.op {
                        Some(op) => Reduction { op, adt: DType::F32, vdt: DType::F32, out: stage.dtype }.finish(&format!("ps{st}_{i}"), "0u"),
                        None => format!("pro_s{st}({i}u{})", stage_args(st, i)),
                    };
                    let _ = writeln!(s, "        let st{st}_{i} = {v};");
                }
                let _ = writeln!(s, "        acc{i} = acc{i} * st{}_{i};", d.factor);
            }
            let _ = writeln!(s, "        {{ let o = {}u + j; st_out(o, epi(o, acc{i})); }}", i * n);
        }
        let _ = writeln!(s, "    }}");
        let mut trips = if unroll > 1 { format!(", {unroll} runs a trip") } else { String::new() };
        if runs_by_words.is_some() {
            trips.push_str(", word loads");
        }
        if q41 && shape.unpack {
            trips.push_str(", unpacked scales");
        }
        Ok(sh.finish(format!("qmatmul_gemv {} {m}x{k}x{n} ({threads} threads a row{trips})", q.name()), wg, n.div_ceil(rows_per_wg) as u64, &s))
    }

    /// 4 x 4 outputs per thread, 8 x 8 threads per workgroup, and no
    /// workgroup memory: each thread dequantizes its four weight rows a run
    /// of 8 elements at a time in registers and reads its four rows of `a`
    /// through the cache. (Without barriers, lavapipe need not turn the
    /// kernel into coroutines, which took LLVM minutes for a tiled kernel
    /// with shared tiles; on a real GPU the repeated dequantization is
    /// cheap next to the multiply-adds.)
    #[allow(clippy::too_many_arguments)]
    fn qtiled(&self, a: &View, w: &View, q: GgmlType, m: usize, k: usize, n: usize, epi: Option<&Epilogue>) -> Result<Dispatch> {
        let sh = self.qshader(a, w, q, epi, None)?;
        let (wpb, wpr) = words(q, k);
        let per = q.block().0;
        let (tiles_m, tiles_n) = (m.div_ceil(32), n.div_ceil(32));
        let mut s = String::new();
        let _ = writeln!(s, "    let tm = group / {tiles_n}u;\n    let tn = group % {tiles_n}u;");
        let _ = writeln!(s, "    let r0 = tm * 32u + (lid / 8u) * 4u;\n    let j0 = tn * 32u + (lid % 8u) * 4u;");
        for i in 0..4 {
            let _ = writeln!(s, "    let xr{i} = min(r0 + {i}u, {}u);", m - 1);
            let _ = writeln!(s, "    let wrow{i} = {}u + min(j0 + {i}u, {}u) * {wpr}u;", w.layout.offset, n - 1);
            for j in 0..4 {
                let _ = writeln!(s, "    var acc{i}{j} = 0.0;");
            }
        }
        let _ = writeln!(s, "    for (var c0 = 0u; c0 < {k}u; c0 = c0 + 8u) {{");
        let _ = writeln!(s, "        let blk = (c0 / {per}u) * {wpb}u;\n        let e0 = c0 % {per}u;");
        for j in 0..4 {
            let _ = writeln!(s, "        let sc{j} = qscale(wrow{j} + blk, e0);");
        }
        let _ = writeln!(s, "        for (var l = 0u; l < 8u; l = l + 1u) {{");
        for j in 0..4 {
            let _ = writeln!(s, "            let w{j} = sc{j}.x * qv(wrow{j} + blk, e0 + l) + sc{j}.y;");
        }
        for i in 0..4 {
            let _ = writeln!(s, "            let x{i} = {};", Self::a_at(a, &format!("xr{i}"), "c0 + l"));
            for j in 0..4 {
                let _ = writeln!(s, "            acc{i}{j} = acc{i}{j} + x{i} * w{j};");
            }
        }
        let _ = writeln!(s, "        }}\n    }}");
        for i in 0..4 {
            for j in 0..4 {
                let _ = writeln!(s, "    if (r0 + {i}u < {m}u && j0 + {j}u < {n}u) {{ let o = (r0 + {i}u) * {n}u + j0 + {j}u; st_out(o, epi(o, acc{i}{j})); }}");
            }
        }
        Ok(sh.finish(format!("qmatmul_tiled {} {m}x{k}x{n}", q.name()), 64, (tiles_m * tiles_n) as u64, &s))
    }

    /// Rows `index[i]` of a quantized `[rows, cols]` matrix in f32: a thread per element.
    pub(crate) fn dequantize_rows(&self, q: GgmlType, cols: usize, blocks: &View, index: &View, code: u32) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[blocks.input, index.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        sh.decl(&deq_fn(q, &format!("in{}", blocks.input)));
        let (wpb, wpr) = words(q, cols);
        let per = q.block().0;
        let rows = blocks.layout.dims()[0];
        let total = index.layout.numel() * cols;
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {total}u) {{ return; }}\n    let r = i / {cols}u;\n    let c = i % {cols}u;\n");
        let off = super::codegen::strided(&["r".to_string()], &index.layout);
        self.checked_index(&mut b, "x", index, &off, rows, code);
        let _ = writeln!(
            b,
            "    let base = {}u + u32(x) * {wpr}u + (c / {per}u) * {wpb}u;\n    let e = c % {per}u;\n    let sc = qscale(base, e);\n    st_out(i, sc.x * qv(base, e) + sc.y);",
            blocks.layout.offset
        );
        sh.finish(format!("dequantize {}", q.name()), WG, groups(total, WG), &b)
    }
}

/// `, st0_{i}, st1_{i}, ...`: the values of row `i`'s first `stages` stages, as arguments.
fn stage_args(stages: usize, i: usize) -> String {
    (0..stages).map(|s| format!(", st{s}_{i}")).collect()
}

/// Declare the prologue's functions: `pro_s{s}(l, st0, ...)`, stage `s`'s
/// value at element `l` of the operand (a reduced stage) or at row `l` (a
/// per-row stage), and `name(l, st0, ...)` (`pro_a` before a GEMV), the
/// operand's element `l`, each given the earlier stages' values of its row.
/// Their constants start at `base` among the kernel's. (An attention
/// kernel's several prologues are elementwise, without stages, so their
/// names are all they need to differ in.)
pub(crate) fn prologue_fns(sh: &mut Shader, p: &Prologue, base: usize, name: &str) -> Result<()> {
    let params = |n: usize| -> String { p.stages[..n].iter().enumerate().map(|(s, st)| format!(", st{s}: {}", compute_ty(st.dtype))).collect() };
    let mut base = base;
    for (s, st) in p.all_stages().enumerate() {
        sh.set_const_base(base);
        base += st.expr.consts.len();
        // A reduced stage's elements and the operand are f32; a per-row value is in its stage's type.
        let (name, ty) = match st.op {
            _ if s == p.stages.len() => (name.to_string(), DType::F32),
            Some(_) => (format!("pro_s{s}"), DType::F32),
            None => (format!("pro_s{s}"), st.dtype),
        };
        let mut body = String::new();
        let mut ix = Indexer::new(&st.shape, "l");
        let v = emit_expr_with(&mut body, sh, &mut ix, &st.expr, &stage_values(st))?;
        sh.decl(&format!("fn {name}(l: u32{}) -> {} {{\n{body}    return {};\n}}", params(s), compute_ty(ty), cast(st.expr.dtype(), ty, &v)));
    }
    Ok(())
}

/// The GEMV body's opening: `st{s}_{i}`, stage `s` of each of the `m` rows
/// of `k` elements, reduced by the workgroup's threads together through
/// workgroup memory. (On a software adapter, where the GEMV runs a thread
/// per weight row without barriers, each thread reducing the rows alone
/// was no faster: lavapipe decoded SmolLM2 at 1.10 tokens/s either way,
/// 1.6-1.7 without prologues, which is why they are off there by default.)
fn prologue_stages(sh: &mut Shader, b: &mut String, p: &Prologue, m: usize, k: usize, wg: u32) {
    for i in 0..m {
        for (s, st) in p.stages.iter().enumerate() {
            let Some(op) = st.op else {
                let _ = writeln!(b, "    let st{s}_{i} = pro_s{s}({i}u{});", stage_args(s, i));
                continue;
            };
            let r = Reduction { op, adt: DType::F32, vdt: DType::F32, out: st.dtype };
            let _ = writeln!(b, "    var st{s}_{i}: {};\n    {{\n    var pacc: f32 = {};", compute_ty(st.dtype), r.identity());
            let each = r.fold("pacc", "0u", &format!("pro_s{s}({i}u * {k}u + j{})", stage_args(s, i)), "0u");
            let _ = writeln!(b, "    for (var j = lid; j < {k}u; j = j + {wg}u) {{\n        {each}\n    }}");
            let _ = writeln!(b, "{}", r.workgroup_fold(sh, "pacc", wg));
            let _ = writeln!(b, "    st{s}_{i} = {};\n    }}", r.finish("pacc", "0u"));
        }
    }
}
