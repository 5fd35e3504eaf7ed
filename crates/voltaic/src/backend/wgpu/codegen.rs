//! WGSL generation: bindings, element types, index arithmetic through
//! layouts, and fused elementwise expressions.
//!
//! Shapes, strides and offsets are written into the source as constants, so
//! the compiler sees divisions by constants and drops dead dims; the source
//! text is the pipeline cache key. Every buffer is read and written through
//! accessor functions (`ld_x(i)`, `st_x(i, v)`) that convert between the
//! storage type and the compute type and, for buffers larger than one
//! binding allows, pick the chunk that holds element `i`.

use super::context::Caps;
use crate::dtype::DType;
use crate::error::{bail, Result};
use crate::ir::{Expr, Instr};
use crate::layout::Layout;
use crate::primitive::{BinaryOp, CmpOp, MapOp, UnaryOp, WGSL_HELPERS};
use std::fmt::Write;

/// The buffer a binding refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Src {
    /// The kernel's input with this index.
    Input(usize),
    /// The kernel's output.
    Output,
    /// The kernel's further output with this index (`Kernel::also`).
    Also(usize),
    /// A scratch buffer of the kernel's program.
    Scratch(usize),
    /// The device's index-error flags.
    IndexError,
    /// The device's counters (see [`Shader::counters`]).
    Counters,
    /// The kernel's constants (see `ir::KernelKind::consts`).
    Consts,
}

/// Atomic counters in the device's counter buffer (see [`Shader::counters`]).
pub(crate) const COUNTERS: usize = 1024;

/// One binding: a byte range (chunk) of a buffer.
#[derive(Clone, Debug)]
pub(crate) struct Bind {
    pub src: Src,
    pub chunk: usize,
    pub chunk_bytes: u64,
    pub read_only: bool,
}

/// One compute dispatch.
#[derive(Clone, Debug)]
pub(crate) struct Dispatch {
    pub source: String,
    pub binds: Vec<Bind>,
    /// Workgroups to launch (spread over x and y by the executor).
    pub groups: u64,
    pub label: String,
}

/// What a kernel needs run: dispatches in order, and the scratch buffers
/// (dtype, elements) they share.
#[derive(Default, Debug)]
pub(crate) struct WgslProgram {
    pub dispatches: Vec<Dispatch>,
    pub scratch: Vec<(DType, usize)>,
}

/// Bytes one element takes in a GPU buffer. bool takes a 32-bit word (WGSL
/// has no 8-bit storage); bf16, and f16 where the adapter lacks SHADER_F16
/// (GL, many browsers), are packed two to a word (see [`packed16`]); f16 is
/// WGSL's own `f16` where the adapter has it.
pub(crate) fn elem_bytes(_caps: &Caps, dt: DType) -> u64 {
    match dt {
        DType::F16 | DType::BF16 => 2,
        DType::F64 => 8,
        _ => 4,
    }
}

/// Whether `dt` is held as 16-bit halves of `u32` words: loads shift its
/// half out and widen it to f32 in registers; stores replace their half with
/// two atomic bit operations (`and` clears it, `or` sets it), which commute
/// with the neighbouring element's, so threads that share a word need no
/// other coordination.
pub(crate) fn packed16(caps: &Caps, dt: DType) -> bool {
    dt == DType::BF16 || (dt == DType::F16 && !caps.f16)
}

/// Fail for dtypes this adapter cannot hold.
pub(crate) fn check_dtype(_caps: &Caps, dt: DType, op: &'static str) -> Result<()> {
    match dt {
        DType::F64 => bail!(
            DType,
            op,
            "f64 is not supported on the GPU (WGSL has no portable f64); use f32, or keep f64 tensors on the CPU"
        ),
        _ => Ok(()),
    }
}

/// WGSL type of an element in storage.
pub(crate) fn storage_ty(caps: &Caps, dt: DType) -> &'static str {
    match dt {
        DType::F32 => "f32",
        DType::F16 if caps.f16 => "f16",
        DType::I32 => "i32",
        DType::U32 | DType::Bool | DType::BF16 | DType::F16 => "u32",
        DType::F64 => "f64",
    }
}

/// WGSL type arithmetic on an element happens in.
pub(crate) fn compute_ty(dt: DType) -> &'static str {
    match dt {
        DType::F32 | DType::F16 | DType::BF16 => "f32",
        DType::I32 => "i32",
        DType::U32 => "u32",
        DType::Bool => "bool",
        DType::F64 => "f64",
    }
}

/// The compute value of a stored element (`packed16` types are read by
/// [`Shader::array`] itself).
pub(crate) fn from_storage(caps: &Caps, dt: DType, e: &str) -> String {
    match dt {
        DType::F16 if caps.f16 => format!("f32({e})"),
        DType::Bool => format!("({e} != 0u)"),
        _ => e.to_string(),
    }
}

/// A compute value of `dt` as the stored element (see [`from_storage`]).
pub(crate) fn to_storage(caps: &Caps, dt: DType, e: &str) -> String {
    match dt {
        DType::F16 if caps.f16 => format!("f16({e})"),
        DType::Bool => format!("select(0u, 1u, {e})"),
        _ => e.to_string(),
    }
}

/// The 16 bits of f32 value `v` rounded to packed half type `dt`.
fn half_bits(dt: DType, v: &str) -> String {
    if dt == DType::BF16 {
        format!("(bitcast<u32>(bf16r_({v})) >> 16u)")
    } else {
        format!("f2h_(f16r_({v}))")
    }
}

/// Round an f32 compute value to what `dt` can hold (a no-op but for half types).
pub(crate) fn round_to(dt: DType, e: &str) -> String {
    match dt {
        DType::F16 => format!("f16r_({e})"),
        DType::BF16 => format!("bf16r_({e})"),
        _ => e.to_string(),
    }
}

/// The WGSL of binary primitive `op` on compute values `a` and `b` of dtype `dt`.
pub(crate) fn binary_expr(op: BinaryOp, dt: DType, a: &str, b: &str) -> String {
    let v = binary_unrounded(op, dt, a, b);
    if op.exact() {
        v
    } else {
        round_to(dt, &v)
    }
}

/// [`binary_expr`] before rounding to a half type.
fn binary_unrounded(op: BinaryOp, dt: DType, a: &str, b: &str) -> String {
    let ty = compute_ty(dt);
    let t = if ty == "f32" { op.wgsl() } else { op.wgsl_int() };
    t.replace("{T}", ty).replace("{a}", a).replace("{b}", b)
}

/// The binary primitives a GPU computes correctly rounded in f16 (Vulkan's
/// and WGSL's precision rules), so that with `Caps::half_math` a device's
/// own f16 arithmetic gives the CPU's bits.
fn native_half(op: BinaryOp) -> bool {
    matches!(op, BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul)
}

/// A WGSL literal of `v` in the compute type of `dt` (exact, infinities and NaN included).
pub(crate) fn literal(v: f64, dt: DType) -> String {
    match compute_ty(dt) {
        "f32" if (v as f32).is_finite() => format!("bitcast<f32>(0x{:08x}u)", (v as f32).to_bits()),
        // Not a constant expression: see `f32_bits_`.
        "f32" => format!("f32_bits_(0x{:08x}u)", (v as f32).to_bits()),
        "i32" => format!("bitcast<i32>(0x{:08x}u)", v as i32 as u32),
        "u32" => format!("{}u", v as u32),
        "bool" => (v != 0.0).to_string(),
        _ => "0.0".into(),
    }
}

/// Convert a compute value of dtype `from` to dtype `to`, with Rust `as`
/// semantics. A value is already what its dtype holds (every op rounds its
/// result), so a cast to the same dtype is the value itself.
pub(crate) fn cast(from: DType, to: DType, e: &str) -> String {
    if from == to {
        return e.to_string();
    }
    round_to(to, &convert(from, to, e))
}

/// [`cast`] before rounding to a half type.
fn convert(from: DType, to: DType, e: &str) -> String {
    let (f, t) = (compute_ty(from), compute_ty(to));
    match (f, t) {
        _ if f == t => e.to_string(),
        ("f32", "i32") => format!("f2i_({e})"),
        ("f32", "u32") => format!("f2u_({e})"),
        // NaN is true, as in Rust (`!=` is unordered, but not every driver keeps that).
        ("f32", "bool") => format!("({e} != 0.0 || isnan_({e}))"),
        ("i32", "bool") => format!("({e} != 0)"),
        ("u32", "bool") => format!("({e} != 0u)"),
        ("bool", _) => format!("select({t}(0), {t}(1), {e})"),
        _ => format!("{t}({e})"),
    }
}

/// A shader under construction: bindings with their accessors, and the body.
pub(crate) struct Shader<'c> {
    caps: &'c Caps,
    decls: String,
    binds: Vec<Bind>,
    f16: bool,
    tmp: usize,
    consts: bool,
    /// Index in the kernel's constants of the next expression's first constant.
    const_base: usize,
    enables: Vec<&'static str>,
    /// The arrays bound so far, by name.
    arrays: Vec<String>,
    /// F32s of the folds' workgroup array `sv` (0: none), declared by `finish`.
    scratch: u32,
}

impl<'c> Shader<'c> {
    pub(crate) fn new(caps: &'c Caps) -> Shader<'c> {
        Shader { caps, decls: String::new(), binds: vec![], f16: false, tmp: 0, consts: false, const_base: 0, enables: vec![], arrays: vec![], scratch: 0 }
    }

    /// Where the constants of the expressions emitted next start among the
    /// kernel's (a kernel with several expressions numbers them in
    /// `KernelKind::exprs` order).
    pub(crate) fn set_const_base(&mut self, base: usize) {
        self.const_base = base;
    }

    /// A fresh temporary name.
    pub(crate) fn tmp(&mut self) -> String {
        self.tmp += 1;
        format!("t{}", self.tmp)
    }

    /// Bind an array of `numel` elements of `dt` as `name`, with accessor
    /// `ld_{name}(i)` and, when writable, `st_{name}(i, v)`.
    /// Binding the same array again (one buffer read through two views,
    /// e.g. a matmul operand and an epilogue operand that are slices of one
    /// flat buffer) reuses the first binding.
    pub(crate) fn array(&mut self, src: Src, name: &str, dt: DType, numel: usize, writable: bool) {
        if self.arrays.iter().any(|a| a == name) {
            return;
        }
        self.arrays.push(name.to_string());
        let eb = elem_bytes(self.caps, dt);
        let chunk_bytes = self.caps.chunk_bytes();
        let per = (chunk_bytes / eb) as usize;
        let chunks = numel.div_ceil(per).max(1);
        self.f16 |= dt == DType::F16 && self.caps.f16;
        let (st, ct) = (storage_ty(self.caps, dt), compute_ty(dt));
        let st = if writable && packed16(self.caps, dt) { "atomic<u32>" } else { st };
        let mode = if writable { "read_write" } else { "read" };
        let caps = self.caps;
        let d = &mut self.decls;
        for c in 0..chunks {
            let b = self.binds.len();
            let _ = writeln!(d, "@group(0) @binding({b}) var<storage, {mode}> {name}_{c}: array<{st}>;");
            self.binds.push(Bind { src, chunk: c, chunk_bytes, read_only: !writable });
        }
        // Chunk c holds elements [c * per, (c + 1) * per).
        let pick = |d: &mut String, each: &dyn Fn(&mut String, usize)| {
            if chunks == 1 {
                let _ = writeln!(d, "    let j = i;");
                each(d, 0);
            } else {
                let _ = writeln!(d, "    let c = i / {per}u;\n    let j = i - c * {per}u;");
                for c in 0..chunks - 1 {
                    let _ = write!(d, "    if (c == {c}u) {{ ");
                    each(d, c);
                    let _ = writeln!(d, " }}");
                }
                each(d, chunks - 1);
            }
        };
        let packed = packed16(caps, dt);
        // A packed element's word, and its half's bit shift.
        let word = |c: usize| if writable { format!("atomicLoad(&{name}_{c}[j >> 1u])") } else { format!("{name}_{c}[j >> 1u]") };
        let _ = writeln!(d, "fn ld_{name}(i: u32) -> {ct} {{");
        pick(d, &|d, c| {
            if !packed {
                let _ = write!(d, "    return {};", from_storage(caps, dt, &format!("{name}_{c}[j]")));
            } else {
                let h = format!("(({} >> ((j & 1u) * 16u)) & 0xffffu)", word(c));
                let _ = write!(d, "    return {};", if dt == DType::BF16 { format!("bitcast<f32>({h} << 16u)") } else { format!("h2f_({h})") });
            }
        });
        let _ = writeln!(d, "\n}}");
        if writable {
            let _ = writeln!(d, "fn st_{name}(i: u32, v: {ct}) {{");
            pick(d, &|d, c| {
                if !packed {
                    let _ = write!(d, "    {name}_{c}[j] = {}; return;", to_storage(caps, dt, "v"));
                } else {
                    let _ = write!(
                        d,
                        "    let s = (j & 1u) * 16u; atomicAnd(&{name}_{c}[j >> 1u], ~(0xffffu << s)); atomicOr(&{name}_{c}[j >> 1u], {} << s); return;",
                        half_bits(dt, "v")
                    );
                }
            });
            let _ = writeln!(d, "\n}}");
            if packed {
                // `st2_x(i, a, b)`: elements i and i + 1 (i even) as one word.
                let _ = writeln!(d, "fn st2_{name}(i: u32, a: {ct}, b: {ct}) {{");
                pick(d, &|d, c| {
                    let _ = write!(d, "    atomicStore(&{name}_{c}[j >> 1u], {} | ({} << 16u)); return;", half_bits(dt, "a"), half_bits(dt, "b"));
                });
                let _ = writeln!(d, "\n}}");
            }
        }
    }

    /// Bind a whole buffer (one chunk) as `var name: ty` with no accessor,
    /// for kernels that read it in their own way (vec4 loads).
    pub(crate) fn bind_raw(&mut self, src: Src, name: &str, ty: &str, writable: bool) {
        self.f16 |= ty.contains("f16");
        let b = self.binds.len();
        let mode = if writable { "read_write" } else { "read" };
        let _ = writeln!(self.decls, "@group(0) @binding({b}) var<storage, {mode}> {name}: {ty};");
        self.binds.push(Bind { src, chunk: 0, chunk_bytes: self.caps.chunk_bytes(), read_only: !writable });
    }

    /// Bind the kernel's constants as `kconst` (32-bit words), once.
    fn use_consts(&mut self) {
        if !self.consts {
            self.consts = true;
            let b = self.binds.len();
            let _ = writeln!(self.decls, "@group(0) @binding({b}) var<storage, read> kconst: array<u32>;");
            self.binds.push(Bind { src: Src::Consts, chunk: 0, chunk_bytes: self.caps.chunk_bytes(), read_only: true });
        }
    }

    /// Bind the device's [`COUNTERS`] atomic counters as `cnt`: zero when
    /// the device is made, and zero again after every kernel that uses
    /// them (each resets those it counted on), so a kernel may count its
    /// workgroups' arrivals without clearing them first. Dispatches that
    /// bind them are ordered by the barrier between writers of one buffer.
    pub(crate) fn counters(&mut self) {
        let b = self.binds.len();
        let _ = writeln!(self.decls, "@group(0) @binding({b}) var<storage, read_write> cnt: array<atomic<u32>, {COUNTERS}>;");
        self.binds.push(Bind { src: Src::Counters, chunk: 0, chunk_bytes: 4 * COUNTERS as u64, read_only: false });
    }

    /// Bind the device's index-error flags as `ierr`, with
    /// `bad_index(op, index, size)` to report an out-of-range index.
    pub(crate) fn index_errors(&mut self) {
        let b = self.binds.len();
        let _ = writeln!(
            self.decls,
            "@group(0) @binding({b}) var<storage, read_write> ierr: array<atomic<u32>, 4>;
fn bad_index(op: u32, index: i32, size: u32) {{
    atomicStore(&ierr[1], bitcast<u32>(index));
    atomicStore(&ierr[2], size);
    atomicStore(&ierr[3], op);
    atomicMax(&ierr[0], 1u);
}}"
        );
        self.binds.push(Bind { src: Src::IndexError, chunk: 0, chunk_bytes: 16, read_only: false });
    }

    /// A WGSL extension the kernel needs (`enable ...;` at the top).
    pub(crate) fn enable(&mut self, ext: &'static str) {
        if !self.enables.contains(&ext) {
            self.enables.push(ext);
        }
    }

    /// The subgroup size folds may shuffle across ([`Caps::subgroup`]).
    /// (Naga takes subgroup built-ins where the device has the feature,
    /// and does not yet parse WGSL's `enable subgroups;`.)
    pub(crate) fn subgroup(&self) -> Option<u32> {
        self.caps.subgroup
    }

    /// Declare `sv`, the workgroup array of at least `n` f32s that folds
    /// combine through (one array: the kernel's folds take turns with it).
    pub(crate) fn fold_scratch(&mut self, n: u32) {
        self.scratch = self.scratch.max(n);
    }

    /// Extra module-scope declarations (workgroup arrays, helper functions).
    pub(crate) fn decl(&mut self, s: &str) {
        self.decls.push_str(s);
        self.decls.push('\n');
    }

    /// The finished dispatch: `body` runs with `group` (the linear workgroup
    /// index) and `lid` (the invocation index inside it) in scope.
    pub(crate) fn finish(self, label: String, wg: u32, groups: u64, body: &str) -> Dispatch {
        let mut src = String::new();
        if self.f16 || body.contains("f16(") {
            src.push_str("enable f16;\n");
        }
        for e in &self.enables {
            src.push_str(&format!("enable {e};\n"));
        }
        src.push_str(&self.decls);
        if self.scratch > 0 {
            src.push_str(&format!("var<workgroup> sv: array<f32, {}>;\n", self.scratch));
        }
        let main = format!(
            "@compute @workgroup_size({wg})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
    let group = wid.x + wid.y * nwg.x;
{body}}}
"
        );
        // Helpers the text calls, and those they call in turn.
        let mut text = format!("{src}{main}");
        let mut helpers = String::new();
        loop {
            let before = helpers.len();
            for (name, code) in WGSL_HELPERS {
                let used = text.contains(&format!("{name}(")) || helpers.contains(&format!("{name}("));
                if used && !helpers.contains(&format!("fn {name}(")) {
                    helpers.push_str(code);
                    helpers.push('\n');
                }
            }
            if helpers.len() == before {
                break;
            }
        }
        text = format!("{src}{helpers}{main}");
        if text.contains("f16(") && !text.starts_with("enable f16;") {
            text = format!("enable f16;\n{text}");
        }
        Dispatch { source: text, binds: self.binds, groups, label }
    }
}

/// Index arithmetic of one kernel: the digits of a linear index over the
/// kernel's iteration dims, computed once and shared by every load.
pub(crate) struct Indexer {
    dims: Vec<usize>,
    lin: String,
    digits: Option<Vec<String>>,
}

impl Indexer {
    pub(crate) fn new(dims: &[usize], lin: &str) -> Indexer {
        Indexer { dims: dims.to_vec(), lin: lin.to_string(), digits: None }
    }

    fn digits(&mut self, out: &mut String, sh: &mut Shader) -> Vec<String> {
        if self.digits.is_none() {
            self.digits = Some(unravel(out, sh, &self.lin, &self.dims));
        }
        self.digits.clone().expect("set above")
    }

    /// Offset (a WGSL u32 expression) that `path` gives for the current index.
    pub(crate) fn offset(&mut self, out: &mut String, sh: &mut Shader, path: &[Layout]) -> String {
        let first = &path[0];
        let mut cur = if first.is_contiguous() {
            plus(&self.lin, first.offset())
        } else {
            let d = self.digits(out, sh);
            strided(&d, first)
        };
        for l in &path[1..] {
            let v = sh.tmp();
            let _ = writeln!(out, "    let {v} = {cur};");
            cur = if l.is_contiguous() {
                plus(&v, l.offset())
            } else {
                let d = unravel(out, sh, &v, l.dims());
                strided(&d, l)
            };
        }
        cur
    }
}

fn plus(e: &str, off: usize) -> String {
    if off == 0 {
        e.to_string()
    } else {
        format!("({e} + {off}u)")
    }
}

/// Emit the digits of linear index `lin` over `dims` (row-major); returns
/// their WGSL names ("0u" for size-1 dims).
pub(crate) fn unravel(out: &mut String, sh: &mut Shader, lin: &str, dims: &[usize]) -> Vec<String> {
    let mut names = vec!["0u".to_string(); dims.len()];
    let mut inner = 1usize;
    let first_big = dims.iter().position(|&d| d != 1);
    for k in (0..dims.len()).rev() {
        if dims[k] != 1 {
            let v = sh.tmp();
            let q = if inner == 1 { lin.to_string() } else { format!("({lin} / {inner}u)") };
            // The outermost non-trivial digit needs no modulo: the index is in range.
            let e = if Some(k) == first_big { q } else { format!("({q} % {}u)", dims[k]) };
            let _ = writeln!(out, "    let {v} = {e};");
            names[k] = v;
        }
        inner = inner.saturating_mul(dims[k]);
    }
    names
}

/// `offset + sum(digit * stride)` for a layout over the given digits.
pub(crate) fn strided(digits: &[String], l: &Layout) -> String {
    let mut terms = vec![format!("{}u", l.offset())];
    for ((d, &s), &n) in digits.iter().zip(l.strides()).zip(l.dims()) {
        if s != 0 && n != 1 {
            terms.push(if s == 1 { d.clone() } else { format!("{d} * {s}u") });
        }
    }
    format!("({})", terms.join(" + "))
}

/// Emit the fused expression at the indexer's current index; returns the
/// WGSL name of its value (in the compute type of `expr.dtype()`). Loads
/// read `ld_in{k}` for kernel input `k`.
pub(crate) fn emit_expr(out: &mut String, sh: &mut Shader, ix: &mut Indexer, expr: &Expr) -> Result<String> {
    emit_expr_with(out, sh, ix, expr, &[])
}

/// [`emit_expr`] with some loads replaced by given WGSL values (a matmul
/// epilogue's product).
pub(crate) fn emit_expr_with(out: &mut String, sh: &mut Shader, ix: &mut Indexer, expr: &Expr, values: &[(usize, String)]) -> Result<String> {
    emit_expr_stored(out, sh, ix, expr, values, &[])
}

/// [`emit_expr_with`] for a kernel that writes instructions `stored` to
/// buffers of their own dtype and nothing else: where the device's f16
/// stores round as the CPU does (`Caps::half_store`), an f16 result that no
/// other instruction reads is left to the store's conversion.
///
/// Half-precision results are otherwise rounded as each op makes them, so
/// a fused chain gives the bits of the same ops run one by one: on the bits
/// in software (`f16r_`, `bf16r_`), or, for f16 additions, subtractions and
/// multiplications under `half_math`, by the device's own f16 arithmetic.
/// A product that an addition reads keeps the software rounding: a
/// compiler may contract the two into one fused multiply-add, which rounds
/// once instead of twice. Ops whose result is always one of the values of
/// their dtype (`exact` in the op table: max, neg, floor, ...) need no
/// rounding.
pub(crate) fn emit_expr_stored(out: &mut String, sh: &mut Shader, ix: &mut Indexer, expr: &Expr, values: &[(usize, String)], stored: &[usize]) -> Result<String> {
    let (half_math, half_store) = (sh.caps.half_math, sh.caps.half_store);
    // Which values other instructions read, and which an addition may
    // contract with (a negation or a cast may stand between them).
    let mut read = vec![false; expr.instrs.len()];
    let mut feeds_add = vec![false; expr.instrs.len()];
    for (ins, _) in &expr.instrs {
        let adds = matches!(ins, Instr::Map(MapOp::Binary(BinaryOp::Add | BinaryOp::Sub) | MapOp::Unary(UnaryOp::Neg) | MapOp::Cast, _));
        for &a in ins.operands() {
            read[a] = true;
            feeds_add[a] |= adds;
        }
    }
    let mut names: Vec<String> = Vec::with_capacity(expr.instrs.len());
    for (i, (ins, dt)) in expr.instrs.iter().enumerate() {
        let name = format!("v{i}");
        let ty = compute_ty(*dt);
        let operand_dt = |a: usize| expr.instrs[a].1;
        let left_to_store = half_store && *dt == DType::F16 && !read[i] && stored.contains(&i);
        let round = |e: String| if left_to_store { e } else { round_to(*dt, &e) };
        let val = match ins {
            Instr::Load(l) if values.iter().any(|(i, _)| i == l) => values.iter().find(|(i, _)| i == l).map(|(_, v)| v.clone()).expect("found"),
            Instr::Load(l) => {
                let load = &expr.loads[*l];
                let off = ix.offset(out, sh, &load.path);
                format!("ld_in{}({off})", load.input)
            }
            // Constants are read from a small buffer: kernels that differ only
            // in constants (a learning rate that changes every step) share one pipeline.
            Instr::Const(c) => {
                sh.use_consts();
                let k = sh.const_base + *c;
                match ty {
                    "f32" => format!("bitcast<f32>(kconst[{k}])"),
                    "i32" => format!("bitcast<i32>(kconst[{k}])"),
                    "u32" => format!("kconst[{k}]"),
                    _ => format!("(kconst[{k}] != 0u)"),
                }
            }
            Instr::Map(op, args) => {
                let arg = |k: usize| &names[args[k]];
                match op {
                    // `abs` of a u32 is itself; wgpu's GL backend turns WGSL's
                    // `abs(u32)` into a signed one (abs(0xffffffffu) gave 1 on llvmpipe).
                    MapOp::Unary(crate::primitive::UnaryOp::Abs) if ty == "u32" => arg(0).to_string(),
                    MapOp::Unary(op) => {
                        let t = if ty == "f32" { op.wgsl() } else { op.wgsl_int() };
                        let v = t.replace("{T}", ty).replace("{x}", arg(0));
                        if op.exact() {
                            v
                        } else {
                            round(v)
                        }
                    }
                    MapOp::Binary(op) if op.exact() => binary_unrounded(*op, *dt, arg(0), arg(1)),
                    MapOp::Binary(op) if half_math && *dt == DType::F16 && native_half(*op) && !(*op == BinaryOp::Mul && feeds_add[i]) => {
                        // The operands hold f16 values: their conversions are exact.
                        format!("f32({})", binary_unrounded(*op, *dt, &format!("f16({})", arg(0)), &format!("f16({})", arg(1))))
                    }
                    MapOp::Binary(op) => round(binary_unrounded(*op, *dt, arg(0), arg(1))),
                    MapOp::Cmp(op) => {
                        let (x, y) = (arg(0), arg(1));
                        let odt = operand_dt(args[0]);
                        if odt == DType::Bool && !matches!(op, CmpOp::Eq | CmpOp::Ne) {
                            format!("(u32({x}) {} u32({y}))", op.wgsl())
                        } else if compute_ty(odt) == "f32" && *op == CmpOp::Ne {
                            format!("({x} != {y} || isnan_({x}) || isnan_({y}))")
                        } else {
                            format!("({x} {} {y})", op.wgsl())
                        }
                    }
                    MapOp::Where => format!("select({}, {}, {})", arg(2), arg(1), arg(0)),
                    MapOp::Cast if left_to_store => convert(operand_dt(args[0]), *dt, arg(0)),
                    MapOp::Cast => cast(operand_dt(args[0]), *dt, arg(0)),
                }
            }
        };
        let _ = writeln!(out, "    let {name}: {ty} = {val};");
        names.push(name);
    }
    Ok(names.pop().unwrap_or_else(|| "0".into()))
}
