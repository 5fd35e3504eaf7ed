//! Matmul kernels: a register-blocked tiled kernel whose tile is chosen by
//! shape (or by the autotuner), and a split-K column kernel for products with
//! very few rows (gemv), which the tiled kernel would leave mostly idle.

use super::codegen::{cast, compute_ty, emit_expr_stored, literal, packed16, round_to, strided, unravel, Dispatch, Indexer, Shader, Src, WgslProgram};
use super::kernels::Gen;
use crate::dtype::DType;
use crate::error::Result;
use crate::ir::{Epilogue, Strided as View};
use crate::layout::Layout;
use std::fmt::Write;

/// A tiled kernel's shape: `bm` x `bn` outputs per workgroup, `bk` of the
/// inner dim per step, `tm` x `tn` outputs per thread; `double`: two shared
/// tiles, so the next step's tile is stored while this one is read and each
/// step needs one barrier instead of two; `warps`: the threads of a
/// subgroup of 32 cover 8 x 4 thread tiles (rather than a 16 x 2 strip), so
/// each of its shared-memory loads of a step touches 128 bytes of `b` and 64
/// of `a` instead of 256 and 32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Tile {
    pub bm: usize,
    pub bn: usize,
    pub bk: usize,
    pub tm: usize,
    pub tn: usize,
    pub double: bool,
    pub warps: bool,
}

impl Tile {
    pub(crate) const fn new(bm: usize, bn: usize, bk: usize, tm: usize, tn: usize) -> Tile {
        Tile { bm, bn, bk, tm, tn, double: false, warps: false }
    }
    pub(crate) const fn double(bm: usize, bn: usize, bk: usize, tm: usize, tn: usize) -> Tile {
        Tile { bm, bn, bk, tm, tn, double: true, warps: false }
    }
    pub(crate) const fn warps(bm: usize, bn: usize, bk: usize, tm: usize, tn: usize) -> Tile {
        Tile { bm, bn, bk, tm, tn, double: false, warps: true }
    }
    /// Bytes of workgroup memory the kernel declares.
    pub(crate) fn shared_bytes(&self) -> usize {
        self.bk * (self.bm + self.bn + 8) * 4 * if self.double { 2 } else { 1 }
    }
    fn threads(&self) -> usize {
        (self.bm / self.tm) * (self.bn / self.tn)
    }
}

/// Tiles the autotuner tries; the first that fits is the default.
pub(crate) const TILES: &[Tile] = &[
    Tile::new(128, 128, 16, 8, 8),
    Tile::new(128, 128, 8, 8, 8),
    Tile::new(128, 64, 16, 8, 4),
    Tile::new(64, 128, 16, 4, 8),
    Tile::new(64, 64, 16, 4, 4),
    Tile::new(64, 64, 8, 4, 4),
    Tile::new(32, 32, 16, 4, 4),
    Tile::double(128, 128, 8, 8, 8),
    Tile::double(128, 128, 16, 8, 8),
    Tile::double(64, 64, 16, 4, 4),
    // Fewer barriers per product, or more reuse per workgroup (512 threads).
    Tile::new(128, 128, 32, 8, 8),
    Tile::new(128, 256, 8, 8, 8),
    Tile::new(256, 128, 8, 8, 8),
    Tile::new(128, 256, 16, 8, 8),
    Tile::warps(128, 128, 16, 8, 8),
    Tile::warps(128, 128, 8, 8, 8),
    Tile::warps(128, 256, 16, 8, 8),
    Tile::warps(64, 64, 16, 4, 4),
    Tile::warps(128, 128, 32, 8, 8),
    Tile::warps(128, 64, 16, 8, 4),
];

/// The power of two that brings a largest magnitude (f32 bits) into
/// [2^14, 2^15), where f16 holds bf16's 8 significant bits exactly.
const BF16_SHIFT: &str = "fn bf16_shift(bits: u32) -> i32 {
    if (bits == 0u) { return 0; }
    return clamp(14 - (i32((bits >> 23u) & 0xffu) - 127), -126, 126);
}
// Undo the scaling `shift` (the sum of a row's and a column's, up to 252 in
// magnitude) in two halves: ldexp takes exponents up to 127 or so, and the
// value after the first half lies between the product and the result, so it
// cannot overflow or underflow where the result does not (scaling by one
// shift and then the other could: a huge row times a tiny column).
fn bf16_unscale(x: f32, shift: i32) -> f32 {
    let h = shift / 2;
    return ldexp(ldexp(x, -h), h - shift);
}";

/// Four bf16 values (two packed words, the even element in the low half)
/// as f16 after scaling by `s`, a power of two per value (`pow2i`, exact for
/// the shifts `bf16_shift` gives).
const BF16_WORDS: &str = "fn pow2i(e: i32) -> f32 { return bitcast<f32>(u32(e + 127) << 23u); }
fn bf16x4_scaled(w: vec2<u32>, s: vec4<f32>) -> vec4<f16> {
    let v = vec4<f32>(bitcast<f32>(w.x << 16u), bitcast<f32>(w.x & 0xffff0000u), bitcast<f32>(w.y << 16u), bitcast<f32>(w.y & 0xffff0000u));
    return vec4<f16>(v * s);
}";

/// A tensor-core tile: `bm` x `bn` outputs per workgroup, each subgroup
/// of 32 owning `fm` x `fn_` of its 16x16 matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct CoopTile {
    pub bm: usize,
    pub bn: usize,
    pub fm: usize,
    pub fn_: usize,
}

impl CoopTile {
    /// [`Variant::Coop`]'s tile: 8 subgroups of 64x32.
    pub(crate) const BASE: CoopTile = CoopTile { bm: 128, bn: 128, fm: 4, fn_: 2 };
    /// [`Variant::CoopWide`]'s tile: 8 subgroups of 64x64.
    pub(crate) const WIDE: CoopTile = CoopTile { bm: 256, bn: 128, fm: 4, fn_: 4 };
    /// For outputs under 64 wide (attention's heads of 32): 4 subgroups of 32x32.
    pub(crate) const TALL: CoopTile = CoopTile { bm: 128, bn: 32, fm: 2, fn_: 2 };
    /// For outputs under 64 high: 4 subgroups of 32x32.
    pub(crate) const FLAT: CoopTile = CoopTile { bm: 32, bn: 128, fm: 2, fn_: 2 };
    /// For outputs under 64 each way: 4 subgroups of 32x32.
    pub(crate) const SMALL: CoopTile = CoopTile { bm: 64, bn: 64, fm: 2, fn_: 2 };
    /// Subgroups per workgroup.
    pub(crate) fn warps(&self) -> usize {
        (self.bm / (self.fm * 16)) * (self.bn / (self.fn_ * 16))
    }
    /// Whether the subgroups cover the tile exactly, within 1024 threads.
    pub(crate) fn valid(&self) -> bool {
        self.fm > 0 && self.fn_ > 0 && self.bm.is_multiple_of(self.fm * 16) && self.bn.is_multiple_of(self.fn_ * 16) && (1..=32).contains(&self.warps())
    }
}

/// More tensor-core tiles the autotuner tries: smaller ones of 4
/// subgroups for mid-sized products (a 4096x384 output is only 96 tiles of
/// 128x128 for an H200's 132 SMs) and attention's per-head products (128 x
/// 32 heads, where most of a 128x128 tile would be padding); and the usual
/// tiles with 16 subgroups of 32x32 or 64x32, more subgroups per SM to hide
/// the latency of the loads where there are few tiles.
pub(crate) const COOP_TILES: &[CoopTile] = &[
    CoopTile::SMALL,
    CoopTile { bm: 128, bn: 64, fm: 4, fn_: 2 },
    CoopTile { bm: 64, bn: 128, fm: 2, fn_: 4 },
    CoopTile::TALL,
    CoopTile::FLAT,
    CoopTile { bm: 128, bn: 128, fm: 2, fn_: 2 },
    CoopTile { bm: 256, bn: 128, fm: 4, fn_: 2 },
];

/// Which kernel a matmul uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Variant {
    Tiled(Tile),
    /// Few rows: one thread per output column, the inner dim split `splits` ways.
    Columns { splits: usize },
    /// f16 on tensor cores: 128x128 tiles, 8 subgroups of 32 each computing
    /// 64x32 with 16x16x16 cooperative matrices, f32 accumulation.
    Coop,
    /// `Coop` on 256x128 tiles, each subgroup 64x64, for whole aligned
    /// tiles; else `Coop`.
    CoopWide,
    /// `Coop` with the inner dim cut into `splits` chunks, each its own
    /// workgroup, then a pass that adds the f32 partial products: weight
    /// gradients (a 384x384 output over 4096 tokens is 9 tiles, for 132
    /// SMs on an H100).
    CoopSplitK { splits: usize },
    /// Tensor cores on another tile (see [`COOP_TILES`]); partial tiles
    /// take the bounds-checked loads.
    CoopTiles(CoopTile),
    /// Tiles whose inner dim is cut into `splits` chunks, each its own
    /// workgroup, then a pass that adds the partial products: small outputs
    /// with a long inner dim (a Linear layer on a small batch) fill the GPU.
    SplitK { tile: Tile, splits: usize },
}

impl Variant {
    /// The tensor-core tile the plan runs on (`Coop` and its split-K on
    /// 128x128), or `None` for the shader-core kernels.
    pub(crate) fn coop_tile(&self) -> Option<CoopTile> {
        match self {
            Variant::Coop | Variant::CoopSplitK { .. } => Some(CoopTile::BASE),
            Variant::CoopWide => Some(CoopTile::WIDE),
            Variant::CoopTiles(t) => Some(*t),
            Variant::Tiled(_) | Variant::Columns { .. } | Variant::SplitK { .. } => None,
        }
    }
}

/// The kernel for a problem when nothing better is known: big tiles when
/// there are enough of them to fill a large GPU, smaller ones otherwise.
pub(crate) fn default_variant(batch: usize, m: usize, k: usize, n: usize, b_nfast: bool) -> Variant {
    if m <= 4 && b_nfast {
        let col_blocks = batch * n.div_ceil(256);
        let splits = (512 / col_blocks.max(1)).clamp(1, k.div_ceil(64).max(1));
        return Variant::Columns { splits };
    }
    let tiles = |t: &Tile| batch * m.div_ceil(t.bm) * n.div_ceil(t.bn);
    // The 128x128 tile in its subgroup-friendly layout (8% faster on the H100).
    for t in [Tile::warps(128, 128, 16, 8, 8), TILES[2], TILES[4]] {
        if tiles(&t) >= 264 {
            return Variant::Tiled(t);
        }
    }
    // Too few tiles to fill the GPU and a long inner dim (a weight gradient,
    // the batch folded into k): split k. Unsplit, the CNN's 64x50176x288
    // weight gradient took 4.5 ms of a 1.6 ms step on the H100 (in f16,
    // which has no shipped plan; the tuned f32 plan splits it 16 ways).
    let few = tiles(&TILES[6]);
    if few > 0 && few < 132 && k >= 2048 {
        let splits = 264usize.div_ceil(few).clamp(2, k / 1024);
        return Variant::SplitK { tile: TILES[6], splits };
    }
    Variant::Tiled(TILES[6])
}

/// A thread's 16 positions of its line in a tile of 16 lines x 256
/// positions (see [`Gen::line_tile_head`]), each running `body`.
fn line_tile_each(len: usize, body: &str) -> String {
    format!("    for (var r = 0u; r < 16u; r = r + 1u) {{\n        let q = pb * 256u + lj + r * 16u;\n        if (q < {len}u) {{ {body} }}\n    }}")
}

/// How many ways a tensor-core product splits its inner dim by default:
/// where its 128x128 output tiles are too few to fill a large GPU (under
/// half of an H100's 132 SMs) and the inner dim is long (a weight gradient
/// over a batch of tokens), enough chunks of at least 256 to reach about
/// one workgroup per SM; else 1.
pub(crate) fn coop_splits(batch: usize, m: usize, k: usize, n: usize) -> usize {
    let tiles = batch * m.div_ceil(128) * n.div_ceil(128);
    if tiles == 0 || tiles >= 66 || k < 1024 {
        return 1;
    }
    let mut s = (132 / tiles).next_power_of_two().clamp(2, 16);
    while s > 1 && k / s < 256 {
        s /= 2;
    }
    s
}

/// Per-batch offset of a `[..., r, c]` layout for batch index `z` (a WGSL expression).
fn batch_offset(digits: &[String], l: &Layout) -> String {
    let r = l.dims().len();
    let mut bl = l.clone();
    bl.shape.0.truncate(r - 2);
    bl.strides.truncate(r - 2);
    strided(digits, &bl)
}

impl Gen<'_> {
    /// The program for `a @ b` with `a` `[..., m, k]` and `b` `[..., k, n]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(&self, p: &mut WgslProgram, a: &View, b: &View, m: usize, k: usize, n: usize, plan: Variant, epi: Option<&Epilogue>) -> Result<()> {
        match plan {
            Variant::Tiled(t) => self.matmul_tiled(p, a, b, m, k, n, t, 1, epi)?,
            Variant::SplitK { tile, splits } => self.matmul_tiled(p, a, b, m, k, n, tile, splits, epi)?,
            Variant::Columns { splits } => self.matmul_columns(p, a, b, m, k, n, splits, epi)?,
            // The inner dim in chunks, then a pass adding them (f16 operands only).
            Variant::CoopSplitK { splits } if splits > 1 && self.both_f16(a, b) => {
                let batch: usize = a.layout.dims()[..a.layout.dims().len() - 2].iter().product();
                p.scratch.push((DType::F32, batch * splits * m * n));
                let part = p.scratch.len() - 1;
                p.dispatches.push(self.matmul_coop(a, b, m, k, n, None, CoopTile::BASE, None, false, Some((splits, part)))?);
                p.dispatches.push(self.split_sum(part, batch, m, n, splits, epi)?);
            }
            Variant::Coop | Variant::CoopWide | Variant::CoopSplitK { .. } | Variant::CoopTiles(_) => {
                let tile = plan.coop_tile().unwrap_or(CoopTile::BASE);
                if self.both_f16(a, b) {
                    p.dispatches.push(self.matmul_coop(a, b, m, k, n, epi, tile, None, false, None)?);
                } else if self.bf16_on_tensor_cores(a, b, epi) {
                    // The plan follows the output's dtype; the tensor cores need f16
                    // operands, or bf16 ones scaled into f16 (a fused cast can make
                    // an f32 product's output 16-bit).
                    self.matmul_bf16_coop(p, a, b, m, k, n, epi, tile)?
                } else {
                    // A plain conversion to f16 would lose range: the shader cores.
                    let r = b.layout.dims().len();
                    let (sbk, sbn) = (b.layout.strides()[r - 2], b.layout.strides()[r - 1]);
                    let batch = b.layout.dims()[..r - 2].iter().product();
                    self.matmul(p, a, b, m, k, n, default_variant(batch, m, k, n, sbn == 1 || sbk != 1), epi)?
                }
            }
        }
        Ok(())
    }

    /// Whether both operands are f16, as the tensor cores take them.
    fn both_f16(&self, a: &View, b: &View) -> bool {
        self.inputs[a.input].0 == DType::F16 && self.inputs[b.input].0 == DType::F16
    }

    /// f16 x f16 -> f32 on cooperative matrices. Tiles of A and B go through
    /// shared memory as f16; each subgroup owns `tile.fm` x `tile.fn_`
    /// matrices of 16x16 of C: 4x2 of a 128x128 tile ([`CoopTile::BASE`]),
    /// 4x4 of a 256x128 one ([`CoopTile::WIDE`]: 8 loads from shared memory
    /// per 16 products, not 6 per 8; partial tiles take the 128x128 kernel),
    /// or one of [`COOP_TILES`]. Results leave through per-subgroup 16x16 f32
    /// staging tiles so the epilogue sees single values: as many of a
    /// subgroup's matrices at a time as the workgroup memory left over holds,
    /// each round costing two workgroup barriers.
    ///
    /// `scales`: scratch buffers of the largest magnitudes of A's rows and
    /// B's columns (see [`Gen::matmul_bf16_coop`]); each product is scaled
    /// back by their shifts before the epilogue. With `fused_bf16` the
    /// operands are the bf16 tensors themselves, scaled into f16 as their
    /// tiles load (whole tiles only, see [`Gen::coop_whole_tiles`]). With
    /// `split` (`(splits, scratch)`, [`Variant::CoopSplitK`]'s first pass)
    /// the inner dim is cut into `splits` chunks and each chunk's f32 partial
    /// product goes to the scratch (`[batch, splits, m, n]`) for
    /// [`Gen::split_sum`], with no epilogue.
    #[allow(clippy::too_many_arguments)]
    fn matmul_coop(
        &self,
        a: &View,
        bv: &View,
        m: usize,
        k: usize,
        n: usize,
        epi: Option<&Epilogue>,
        tile: CoopTile,
        scales: Option<(usize, usize)>,
        fused_bf16: bool,
        split: Option<(usize, usize)>,
    ) -> Result<Dispatch> {
        if !tile.valid() {
            return Err(crate::error::Error::Backend(format!("internal: tensor-core tile {tile:?} is not covered by subgroups of 16x16 matrices")));
        }
        // Subgroups and the 16x16 matrices of C each owns (fm x fn_).
        let (warps, fm, fn_) = (tile.warps(), tile.fm, tile.fn_);
        let threads = warps * 32;
        let mut sh = Shader::new(self.caps);
        self.bind_inputs(&mut sh, &[a.input, bv.input]);
        let (la, lb) = (&a.layout, &bv.layout);
        let r = la.dims().len();
        let bdims = &la.dims()[..r - 2];
        let batch: usize = bdims.iter().product();
        let splits = split.map_or(1, |s| s.0);
        match split {
            None => {
                self.bind_out(&mut sh);
                self.epilogue(&mut sh, epi)?;
            }
            Some((_, part)) => sh.array(Src::Scratch(part), "part", DType::F32, batch * splits * m * n, true),
        }
        let (bm, bn) = (tile.bm, tile.bn);
        let (tiles_m, tiles_n) = (m.div_ceil(bm), n.div_ceil(bn));
        let total = batch * splits * tiles_m * tiles_n;
        let (sam, sak) = (la.strides()[r - 2], la.strides()[r - 1]);
        let (sbk, sbn) = (lb.strides()[r - 2], lb.strides()[r - 1]);
        // Whole tiles of plain row-major operands, 16-byte aligned: each thread
        // moves 4 halves per load and per shared store with no bounds checks
        // (the scalar path spends more instructions on addresses, checks and
        // single-half stores than the tensor cores take to multiply), and
        // takes 64 of k per step where the shared tiles fit (half the
        // barriers of 32).
        // Operands whose other dim is the contiguous one (A = x^T of a
        // weight gradient, B = W^T of a Linear layer) are read four halves at
        // a time along that dim and kept in shared memory as they lie, and
        // the tensor cores load those tiles column-major.
        let fast = self.coop_whole_tiles(a, bv, m, k, n, bm, bn);
        if tile == CoopTile::WIDE && !fast {
            // Not whole 256-row tiles: 128x128 tiles.
            return self.matmul_coop(a, bv, m, k, n, epi, CoopTile::BASE, scales, fused_bf16, split);
        }
        if fused_bf16 && !fast {
            return Err(crate::error::Error::Backend(format!("internal: bf16 tiles scaled as they load need whole {bm}x{bn} tiles, got {m}x{k}x{n}")));
        }
        let a_t = fast && sam == 1 && sak % 8 == 0 && sak != 1;
        let b_t = fast && sbk == 1 && sbn % 8 == 0 && sbn != 1;
        // Bytes of the shared tiles of A and B, then with one staging tile per subgroup.
        let tiles_bytes = |bk: usize| {
            let a_tile = if a_t { bk * (bm + 8) } else { bm * (bk + 8) };
            let b_tile = if b_t { bn * (bk + 8) } else { bk * (bn + 8) };
            (a_tile + b_tile) * 2
        };
        let shared = |bk: usize| tiles_bytes(bk) + warps * 256 * 4;
        // Each thread moves a whole number of vec4s (fast) or of halves per step.
        let even = |bk: usize| {
            let unit = if fast { 4 } else { 1 };
            (bm * bk / unit).is_multiple_of(threads) && (bk * bn / unit).is_multiple_of(threads) && bm * bk / unit >= threads && bk * bn / unit >= threads
        };
        let bk = if fast && k.is_multiple_of(64) && even(64) && shared(64) as u32 <= self.caps.workgroup_storage { 64 } else { 32 };
        if !even(bk) || shared(bk) as u32 > self.caps.workgroup_storage {
            return Err(crate::error::Error::Backend(format!(
                "internal: tensor-core tile {tile:?} does not spread its loads evenly over {threads} threads or needs more than {} bytes of workgroup memory",
                self.caps.workgroup_storage
            )));
        }
        // Staging tiles per subgroup: as many of its matrices as fit beside
        // the shared tiles (each round of staging costs two barriers).
        let room = (self.caps.workgroup_storage as usize).saturating_sub(tiles_bytes(bk)) / (warps * 1024);
        let slots = room.clamp(1, fm * fn_);
        // Row strides of the shared tiles (padded by 8 halves against bank conflicts).
        let lda = if a_t { bm + 8 } else { bk + 8 };
        let ldb = if b_t { bk + 8 } else { bn + 8 };
        let (a_rows, b_rows) = (if a_t { bk } else { bm }, if b_t { bn } else { bk });
        sh.enable("wgpu_cooperative_matrix");
        // Whole tiles: shared tiles of vec4<f16> (cooperative loads read them
        // with strides in vec4s: the pointer may be to a vector of the
        // matrix's element type); packed u32 tiles are refused by NVIDIA's
        // compiler, and one half per store cost 20% of the kernel's time.
        let (elem, unit) = if fast { ("vec4<f16>", 4) } else { ("f16", 1) };
        sh.decl(&format!(
            "var<workgroup> As: array<{elem}, {}>;\nvar<workgroup> Bs: array<{elem}, {}>;\nvar<workgroup> Cs: array<f32, {}>;",
            a_rows * lda / unit,
            b_rows * ldb / unit,
            warps * slots * 256
        ));
        // Each split covers a whole number of k-steps (of 64 at most).
        let chunk = k.div_ceil(splits).div_ceil(64) * 64;
        let mut s = format!("    if (group >= {total}u) {{ return; }}\n");
        let _ = writeln!(s, "    let z = group / {}u;\n    let rest = group % {}u;", splits * tiles_m * tiles_n, tiles_m * tiles_n);
        let _ = writeln!(s, "    let ks = (group / {}u) % {splits}u;", tiles_m * tiles_n);
        let _ = writeln!(s, "    let k0 = ks * {chunk}u;\n    let k1 = min(k0 + {chunk}u, {k}u);");
        let _ = writeln!(s, "    let row0 = (rest / {tiles_n}u) * {bm}u;\n    let col0 = (rest % {tiles_n}u) * {bn}u;");
        let zd = unravel(&mut s, &mut sh, "z", bdims);
        let _ = writeln!(s, "    let abase = {};\n    let bbase = {};", batch_offset(&zd, la), batch_offset(&zd, lb));
        let _ = writeln!(s, "    let warp = lid / 32u;\n    let wr = (warp / {wcols}u) * {}u;\n    let wc = (warp % {wcols}u) * {}u;", fm * 16, fn_ * 16, wcols = bn / (fn_ * 16));
        for i in 0..fm {
            for j in 0..fn_ {
                let _ = writeln!(s, "    var c{i}{j} = coop_mat16x16<f32, C>();");
            }
        }
        // A k-step's product from the shared tiles, in a block of its own.
        let compute = |s: &mut String| {
            s.push_str("    {\n");
            for kk in (0..bk).step_by(16) {
                for i in 0..fm {
                    // naga wants the offset bound to a name, not written inside coopLoad.
                    // coopLoadT reads a row-major tile, coopLoad a column-major one.
                    let (off, load) = if a_t { (format!("({kk}u * {lda}u + wr + {}u)", i * 16), "coopLoad") } else { (format!("((wr + {}u) * {lda}u + {kk}u)", i * 16), "coopLoadT") };
                    let _ = writeln!(s, "    let ao{kk}_{i} = {off} / {unit}u;\n    let a{kk}_{i} = {load}<coop_mat16x16<f16, A>>(&As[ao{kk}_{i}], {}u);", lda / unit);
                }
                for j in 0..fn_ {
                    let (off, load) = if b_t { (format!("((wc + {}u) * {ldb}u + {kk}u)", j * 16), "coopLoad") } else { (format!("({kk}u * {ldb}u + wc + {}u)", j * 16), "coopLoadT") };
                    let _ = writeln!(s, "    let bo{kk}_{j} = {off} / {unit}u;\n    let b{kk}_{j} = {load}<coop_mat16x16<f16, B>>(&Bs[bo{kk}_{j}], {}u);", ldb / unit);
                }
                for i in 0..fm {
                    for j in 0..fn_ {
                        let _ = writeln!(s, "    c{i}{j} = coopMultiplyAdd(a{kk}_{i}, b{kk}_{j}, c{i}{j});");
                    }
                }
            }
            s.push_str("    }\n");
        };
        let a_kfast = sak == 1;
        let b_nfast = sbn == 1 || sbk != 1;
        if fast {
            // bf16 operands: four halves are two words, widened, scaled by
            // their line's power of two and rounded to f16 on the way in.
            // The raw words wait in registers while the tensor cores work
            // (converting them as they arrive would stall on the load).
            let (ty, reg) = if fused_bf16 { ("array<vec2<u32>>", "vec2<u32>") } else { ("array<vec4<f16>>", "vec4<f16>") };
            sh.bind_raw(Src::Input(a.input), "a4", ty, false);
            sh.bind_raw(Src::Input(bv.input), "b4", ty, false);
            if fused_bf16 {
                sh.enable("f16");
                sh.decl(BF16_WORDS);
            }
            // A: bm rows of bk / 4 vec4s (or bk rows of bm / 4 where m is
            // contiguous); B: bk rows of bn / 4 vec4s (or bn rows of bk / 4).
            let (per_a, per_b) = (bm * bk / 4 / threads, bk * bn / 4 / threads);
            let (a_run, b_run) = (if a_t { bm / 4 } else { bk / 4 }, if b_t { bk / 4 } else { bn / 4 });
            // Thread q's (row, column) in the tile as it lies in shared memory.
            for q in 0..per_a {
                let e = format!("(lid + {}u)", q * threads);
                let _ = writeln!(s, "    let ar{q} = {e} / {a_run}u;\n    let ak{q} = ({e} % {a_run}u) * 4u;\n    var ra{q}: {reg};");
            }
            for q in 0..per_b {
                let e = format!("(lid + {}u)", q * threads);
                let _ = writeln!(s, "    let bk{q} = {e} / {b_run}u;\n    let bc{q} = ({e} % {b_run}u) * 4u;\n    var rb{q}: {reg};");
            }
            if fused_bf16 {
                // A thread's lines stay the same for the whole inner dim: their
                // scale factors are read once. A's vec4 runs along m where A
                // is transposed (four rows), else along one row's k; B's along
                // n (four columns) unless B is transposed.
                let four = |arr: &str, base: &str, first: &str| {
                    let f = |i: usize| format!("pow2i(bf16_shift(ld_{arr}({base} + {first} + {i}u)))");
                    format!("vec4<f32>({}, {}, {}, {})", f(0), f(1), f(2), f(3))
                };
                // One line's factor is kept as a scalar (a register, not four).
                let one = |arr: &str, base: &str, line: &str| format!("pow2i(bf16_shift(ld_{arr}({base} + {line})))");
                let (abase_l, bbase_l) = (format!("z * {m}u"), format!("z * {n}u"));
                for q in 0..per_a {
                    let v = if a_t { four("max_a", &abase_l, &format!("row0 + ak{q}")) } else { one("max_a", &abase_l, &format!("row0 + ar{q}")) };
                    let _ = writeln!(s, "    let sa{q} = {v};");
                }
                for q in 0..per_b {
                    let v = if b_t { one("max_b", &bbase_l, &format!("col0 + bk{q}")) } else { four("max_b", &bbase_l, &format!("col0 + bc{q}")) };
                    let _ = writeln!(s, "    let sb{q} = {v};");
                }
            }
            let load = |s: &mut String, kt: &str| {
                for q in 0..per_a {
                    // Shared row ar is k (a_t) or m; the vec4 runs along the other.
                    let ix = if a_t { format!("({kt} + ar{q}) * {sak}u + row0 + ak{q}") } else { format!("(row0 + ar{q}) * {sam}u + {kt} + ak{q}") };
                    let _ = writeln!(s, "    ra{q} = a4[(abase + {ix}) / 4u];");
                }
                for q in 0..per_b {
                    let ix = if b_t { format!("(col0 + bk{q}) * {sbn}u + {kt} + bc{q}") } else { format!("({kt} + bk{q}) * {sbk}u + col0 + bc{q}") };
                    let _ = writeln!(s, "    rb{q} = b4[(bbase + {ix}) / 4u];");
                }
            };
            // Store, wait, load the next step (it lands while the tensor
            // cores work), multiply, wait. Two shared stages of 32 (one
            // wait a step) and registers two steps ahead were both measured
            // slower or no faster on an H200 (2026-12-02).
            let _ = writeln!(s, "    if (k0 < k1) {{");
            load(&mut s, "k0");
            let _ = writeln!(s, "    }}\n    for (var kt = k0; kt < k1; kt = kt + {bk}u) {{");
            for q in 0..per_a {
                let v = if fused_bf16 { format!("bf16x4_scaled(ra{q}, {})", if a_t { format!("sa{q}") } else { format!("vec4<f32>(sa{q})") }) } else { format!("ra{q}") };
                let _ = writeln!(s, "    As[(ar{q} * {lda}u + ak{q}) / 4u] = {v};");
            }
            for q in 0..per_b {
                let v = if fused_bf16 { format!("bf16x4_scaled(rb{q}, {})", if b_t { format!("vec4<f32>(sb{q})") } else { format!("sb{q}") }) } else { format!("rb{q}") };
                let _ = writeln!(s, "    Bs[(bk{q} * {ldb}u + bc{q}) / 4u] = {v};");
            }
            let _ = writeln!(s, "    workgroupBarrier();\n    if (kt + {bk}u < k1) {{");
            load(&mut s, &format!("(kt + {bk}u)"));
            let _ = writeln!(s, "    }}");
            compute(&mut s);
            let _ = writeln!(s, "    workgroupBarrier();\n    }}");
        } else {
            // bm x 32 of A and 32 x bn of B (16 elements of each per thread
            // on 128x128 tiles), loaded into registers one step ahead so
            // their latency hides behind the tensor-core work of the current
            // step.
            let (per_a, per_b) = (bm * bk / threads, bk * bn / threads);
            let mut coords = String::new();
            for q in 0..per_a {
                let e = format!("(lid + {}u)", q * threads);
                let (ar, ak) = if a_kfast { (format!("({e} / {bk}u)"), format!("({e} % {bk}u)")) } else { (format!("({e} % {bm}u)"), format!("({e} / {bm}u)")) };
                let _ = writeln!(coords, "    let ar{q} = {ar};\n    let ak{q} = {ak};\n    var ra{q} = f16(0.0);");
            }
            for q in 0..per_b {
                let e = format!("(lid + {}u)", q * threads);
                let (bc, bkk) = if b_nfast { (format!("({e} % {bn}u)"), format!("({e} / {bn}u)")) } else { (format!("({e} / {bk}u)"), format!("({e} % {bk}u)")) };
                let _ = writeln!(coords, "    let bc{q} = {bc};\n    let bk{q} = {bkk};\n    var rb{q} = f16(0.0);");
            }
            s.push_str(&coords);
            let load = |s: &mut String, kt: &str| {
                for q in 0..per_a {
                    let _ = writeln!(
                        s,
                        "    ra{q} = f16(0.0);\n    if (row0 + ar{q} < {m}u && {kt} + ak{q} < k1) {{ ra{q} = f16(ld_in{ai}(abase + (row0 + ar{q}) * {sam}u + ({kt} + ak{q}) * {sak}u)); }}",
                        ai = a.input
                    );
                }
                for q in 0..per_b {
                    let _ = writeln!(
                        s,
                        "    rb{q} = f16(0.0);\n    if ({kt} + bk{q} < k1 && col0 + bc{q} < {n}u) {{ rb{q} = f16(ld_in{bi}(bbase + ({kt} + bk{q}) * {sbk}u + (col0 + bc{q}) * {sbn}u)); }}",
                        bi = bv.input
                    );
                }
            };
            load(&mut s, "k0");
            let _ = writeln!(s, "    for (var kt = k0; kt < k1; kt = kt + {bk}u) {{");
            for q in 0..per_a {
                let _ = writeln!(s, "    As[ar{q} * {lda}u + ak{q}] = ra{q};");
            }
            for q in 0..per_b {
                let _ = writeln!(s, "    Bs[bk{q} * {ldb}u + bc{q}] = rb{q};");
            }
            let _ = writeln!(s, "    workgroupBarrier();\n    if (kt + {bk}u < k1) {{");
            load(&mut s, &format!("(kt + {bk}u)"));
            let _ = writeln!(s, "    }}");
            compute(&mut s);
            let _ = writeln!(s, "    workgroupBarrier();\n    }}");
        }
        // Each subgroup stages `slots` 16x16 results at a time and its 32 threads store them.
        let _ = writeln!(s, "    let lane = lid % 32u;\n    let cbase = warp * {}u;", slots * 256);
        // The product at staged element `e` of column `gj`.
        let product_at = |e: &str, gi: &str, gj: &str| match scales {
            None => format!("Cs[cbase + {e}]"),
            Some(_) => format!("bf16_unscale(Cs[cbase + {e}], bf16_shift(ld_max_a(z * {m}u + {gi})) + bf16_shift(ld_max_b(z * {n}u + {gj})))"),
        };
        let product = |e: &str, gj: &str| product_at(e, "gi", gj);
        if let Some((sa, sb)) = scales {
            sh.array(Src::Scratch(sa), "max_a", DType::U32, batch * m, false);
            sh.array(Src::Scratch(sb), "max_b", DType::U32, batch * n, false);
            sh.decl(BF16_SHIFT);
        }
        // Packed 16-bit outputs (bf16) store two neighbours per thread as one
        // word: one plain store where single elements take two atomics.
        let pairs = split.is_none() && packed16(self.caps, self.out.0) && n.is_multiple_of(2);
        // Where output element (gi, gj) goes; a split's partial product goes
        // to its own slice of the scratch.
        let out_at = |gi: &str, gj: &str| format!("z * {}u + {gi} * {n}u + {gj}", m * n);
        let part_at = |gi: &str, gj: &str| format!("(z * {splits}u + ks) * {}u + {gi} * {n}u + {gj}", m * n);
        let store = |p: &str| match split {
            None => format!("let o = {}; st_out(o, epi(o, {p}));", out_at("gi", "gj")),
            Some(_) => format!("st_part({}, {p});", part_at("gi", "gj")),
        };
        // Whole tiles, no bounds to check: each thread reads GATHER staged
        // values and what the epilogue loads for them, then stores them.
        // Stored one by one, each store waited on its own loads: on an H200
        // a 4096x1536x384 product whose epilogue adds a gradient took 85 us
        // against 71 (2026-12-02), and the f16 encoder's step went from
        // 7.9 to 7.4 ms. Not where the epilogue broadcasts a smaller tensor
        // (a bias): those products got slower (76 -> 96 us for the
        // feed-forward's 4096x384x1536), by batches of 2, 4 or 8 alike;
        // nor for bf16 scaled into f16, whose unscaling reads each row's
        // and column's scale, as a bias is read (its encoder step measured
        // 11.0 ms with gathered stores, 10.3 in an earlier call).
        const GATHER: usize = 4;
        let broadcasts = epi.is_some_and(|e| e.expr.loads.iter().enumerate().any(|(i, l)| i != e.acc && self.inputs[l.input].1 < batch * m * n));
        let gathered = fast && !broadcasts && scales.is_none();
        let mats: Vec<(usize, usize)> = (0..fm).flat_map(|i| (0..fn_).map(move |j| (i, j))).collect();
        for (round, group) in mats.chunks(slots).enumerate() {
            if round > 0 {
                // The previous round's staging tiles are read by now.
                let _ = writeln!(s, "    workgroupBarrier();");
            }
            for (slot, (i, j)) in group.iter().enumerate() {
                let _ = writeln!(s, "    coopStoreT(c{i}{j}, &Cs[cbase + {}u], 16u);", slot * 256);
            }
            let _ = writeln!(s, "    workgroupBarrier();");
            if gathered {
                let (mut gather, mut put) = (String::new(), String::new());
                let mut held = 0;
                for (slot, (i, j)) in group.iter().enumerate() {
                    let per = if pairs { 4 } else { 8 };
                    for q in 0..per {
                        if held >= GATHER {
                            let _ = write!(s, "    {{\n{gather}{put}    }}\n");
                            gather.clear();
                            put.clear();
                            held = 0;
                        }
                        held += if pairs { 2 } else { 1 };
                        let v = format!("{slot}_{q}");
                        let e = if pairs { format!("(lane + {}u) * 2u", q * 32) } else { format!("lane + {}u", q * 32) };
                        let _ = writeln!(gather, "    let e{v} = {e};\n    let gi{v} = row0 + wr + {}u + e{v} / 16u;\n    let gj{v} = col0 + wc + {}u + e{v} % 16u;", i * 16, j * 16);
                        let at = |off: &str| format!("{}u + e{v}{off}", slot * 256);
                        match split {
                            Some(_) => {
                                let _ = writeln!(gather, "    let v{v} = {};", product_at(&at(""), &format!("gi{v}"), &format!("gj{v}")));
                                let _ = writeln!(put, "    st_part({}, v{v});", part_at(&format!("gi{v}"), &format!("gj{v}")));
                            }
                            None => {
                                let _ = writeln!(gather, "    let o{v} = {};", out_at(&format!("gi{v}"), &format!("gj{v}")));
                                let _ = writeln!(gather, "    let v{v} = epi(o{v}, {});", product_at(&at(""), &format!("gi{v}"), &format!("gj{v}")));
                                if pairs {
                                    let _ = writeln!(gather, "    let w{v} = epi(o{v} + 1u, {});", product_at(&at(" + 1u"), &format!("gi{v}"), &format!("gj{v} + 1u")));
                                    let _ = writeln!(put, "    st2_out(o{v}, v{v}, w{v});");
                                } else {
                                    let _ = writeln!(put, "    st_out(o{v}, v{v});");
                                }
                            }
                        }
                    }
                }
                let _ = write!(s, "    {{\n{gather}{put}    }}\n");
                continue;
            }
            for (slot, (i, j)) in group.iter().enumerate() {
                let at = |e: &str| format!("{}u + {e}", slot * 256);
                if pairs {
                    let _ = writeln!(
                        s,
                        "    for (var q = 0u; q < 4u; q = q + 1u) {{
        let e = (lane + q * 32u) * 2u;
        let gi = row0 + wr + {}u + e / 16u;
        let gj = col0 + wc + {}u + e % 16u;
        if (gi < {m}u && gj < {n}u) {{ let o = {}; st2_out(o, epi(o, {}), epi(o + 1u, {})); }}
    }}",
                        i * 16,
                        j * 16,
                        out_at("gi", "gj"),
                        product(&at("e"), "gj"),
                        product(&at("e + 1u"), "gj + 1u")
                    );
                } else {
                    let _ = writeln!(
                        s,
                        "    for (var q = 0u; q < 8u; q = q + 1u) {{
        let e = lane + q * 32u;
        let gi = row0 + wr + {}u + e / 16u;
        let gj = col0 + wc + {}u + e % 16u;
        if (gi < {m}u && gj < {n}u) {{ {} }}
    }}",
                        i * 16,
                        j * 16,
                        store(&product(&at("e"), "gj"))
                    );
                }
            }
        }
        let name = match tile {
            CoopTile::BASE => String::new(),
            CoopTile::WIDE => " wide".into(),
            t => format!(" {}x{}", t.bm, t.bn),
        };
        Ok(sh.finish(format!("matmul_coop{name} {batch}x{m}x{k}x{n}"), threads as u32, total as u64, &s))
    }

    /// Whether the tensor-core kernel on `bm x bn` tiles takes its fast
    /// path: whole tiles, 16-byte aligned rows of plain row-major or
    /// transposed operands that each fit one binding.
    #[allow(clippy::too_many_arguments)]
    fn coop_whole_tiles(&self, a: &View, bv: &View, m: usize, k: usize, n: usize, bm: usize, bn: usize) -> bool {
        let (la, lb) = (&a.layout, &bv.layout);
        let r = la.dims().len();
        let (sam, sak) = (la.strides()[r - 2], la.strides()[r - 1]);
        let (sbk, sbn) = (lb.strides()[r - 2], lb.strides()[r - 1]);
        let batch_aligned = |l: &Layout| l.offset().is_multiple_of(8) && l.strides()[..r - 2].iter().all(|s| s % 8 == 0);
        let fits = |v: &View| (self.inputs[v.input].1 as u64) * 2 <= self.caps.chunk_bytes();
        let a_ok = (sak == 1 && sam % 8 == 0) || (sam == 1 && sak % 8 == 0 && sak != 1);
        let b_ok = (sbn == 1 && sbk % 8 == 0) || (sbk == 1 && sbn % 8 == 0 && sbn != 1);
        m.is_multiple_of(bm) && n.is_multiple_of(bn) && k.is_multiple_of(32) && a_ok && b_ok && batch_aligned(la) && batch_aligned(lb) && fits(a) && fits(bv)
    }

    /// Whether a bf16 product runs on the f16 tensor cores: both operands
    /// bf16, distinct buffers that the epilogue does not read (the scaled
    /// copies replace them in the product's bindings).
    fn bf16_on_tensor_cores(&self, a: &View, b: &View, epi: Option<&Epilogue>) -> bool {
        let reads = |i: usize| epi.is_some_and(|e| e.expr.loads.iter().enumerate().any(|(j, l)| j != e.acc && l.input == i));
        self.caps.coop_f16 && self.inputs[a.input].0 == DType::BF16 && self.inputs[b.input].0 == DType::BF16 && a.input != b.input && !reads(a.input) && !reads(b.input)
    }

    /// bf16 on the tensor cores, which take f16 only (through Vulkan's
    /// cooperative matrices): every row of A and column of B is scaled by a
    /// power of two that brings its largest magnitude into [2^14, 2^15) and
    /// written as f16 (exact: bf16's 8-bit significand fits f16's 11 bits
    /// wherever the scaled value is an f16 normal, so only values 2^28 times
    /// smaller than their row's or column's largest lose bits); the f16
    /// product, accumulated in f32, is scaled back before the epilogue. Any
    /// bf16 range works, where a plain conversion to f16 would overflow
    /// beyond 65504 and flush below 2^-24.
    #[allow(clippy::too_many_arguments)]
    fn matmul_bf16_coop(&self, p: &mut WgslProgram, a: &View, b: &View, m: usize, k: usize, n: usize, epi: Option<&Epilogue>, tile: CoopTile) -> Result<()> {
        let r = a.layout.dims().len();
        let bdims = a.layout.dims()[..r - 2].to_vec();
        let batch: usize = bdims.iter().product();
        let scratch = |p: &mut WgslProgram, dt: DType, len: usize| {
            p.scratch.push((dt, len));
            p.scratch.len() - 1
        };
        let (sa, sb) = (scratch(p, DType::U32, batch * m), scratch(p, DType::U32, batch * n));
        let (la, lb) = (&a.layout, &b.layout);
        // A's lines are its rows (along k), B's its columns (along k).
        let (a_lines, a_len) = ((m, la.strides()[r - 2]), (k, la.strides()[r - 1]));
        let (b_lines, b_len) = ((n, lb.strides()[r - 1]), (k, lb.strides()[r - 2]));
        // Whole tiles: the product reads the bf16 operands and scales them
        // as its tiles go to shared memory; no f16 copies (on the H100,
        // 4096^3: 0.844 ms against 0.865 with the copies, in one call).
        // Wide tiles that are not whole take 128x128 ones, whole or not.
        let whole = |t: CoopTile| self.coop_whole_tiles(a, b, m, k, n, t.bm, t.bn);
        let fused = if tile == CoopTile::WIDE && !whole(tile) { CoopTile::BASE } else { tile };
        if whole(fused) {
            self.line_maxima(p, a, a_lines, a_len, sa, "rows of A");
            self.line_maxima(p, b, b_lines, b_len, sb, "columns of B");
            let mut d = self.matmul_coop(a, b, m, k, n, epi, fused, Some((sa, sb)), true, None)?;
            d.label = format!("bf16 {}", d.label);
            p.dispatches.push(d);
            return Ok(());
        }
        let (a16, b16) = (scratch(p, DType::F16, batch * m * k), scratch(p, DType::F16, batch * k * n));
        self.scale_to_f16(p, a, a_lines, a_len, (a16, sa), (k, 1), "rows of A");
        self.scale_to_f16(p, b, b_lines, b_len, (b16, sb), (1, n), "columns of B");
        let mut inputs = self.inputs.to_vec();
        inputs[a.input] = (DType::F16, batch * m * k);
        inputs[b.input] = (DType::F16, batch * k * n);
        let g = Gen { caps: self.caps, inputs: &inputs, out: self.out };
        let dims = |x: usize, y: usize| bdims.iter().copied().chain([x, y]).collect::<Vec<_>>();
        let a2 = View { input: a.input, layout: Layout::contiguous(&dims(m, k)) };
        let b2 = View { input: b.input, layout: Layout::contiguous(&dims(k, n)) };
        let mut d = g.matmul_coop(&a2, &b2, m, k, n, epi, tile, Some((sa, sb)), false, None)?;
        for bind in &mut d.binds {
            if bind.src == Src::Input(a.input) {
                bind.src = Src::Scratch(a16);
            } else if bind.src == Src::Input(b.input) {
                bind.src = Src::Scratch(b16);
            }
        }
        d.label = format!("bf16 {}", d.label);
        p.dispatches.push(d);
        Ok(())
    }

    /// Scale `lines` (count, stride) of `len` (count, stride) elements of
    /// bf16 input `v`, per batch, into f16 scratch `dst` at `line *
    /// dst_strides.0 + position * dst_strides.1` (plus the batch's `lines *
    /// len`), and leave each line's largest magnitude (as f32 bits) in
    /// scratch `maxes`. Three passes: clear the maxima; an atomic max per
    /// line from each tile of 16 lines x 256 positions; the conversion, tile
    /// by tile. The 16 threads of a line read it side by side where it is
    /// contiguous, else 16 neighbouring lines are read side by side, so loads
    /// stay coalesced either way.
    #[allow(clippy::too_many_arguments)]
    fn scale_to_f16(&self, p: &mut WgslProgram, v: &View, lines: (usize, usize), len: (usize, usize), (dst, maxes): (usize, usize), dst_strides: (usize, usize), what: &str) {
        self.line_maxima(p, v, lines, len, maxes, what);
        let total = self.bf16_lines(v, lines);
        let groups = (total.div_ceil(16) * len.0.div_ceil(256)) as u64;
        let mut sh = Shader::new(self.caps);
        self.bind_inputs(&mut sh, &[v.input]);
        sh.array(Src::Scratch(dst), "dst", DType::F16, total * len.0, true);
        sh.array(Src::Scratch(maxes), "mx", DType::U32, total, false);
        sh.decl(BF16_SHIFT);
        let (mut s, in_ix) = self.line_tile_head(&mut sh, v, lines, len);
        let out_ix = format!("z * {}u + w * {}u + q * {}u", lines.0 * len.0, dst_strides.0, dst_strides.1);
        let _ = writeln!(
            s,
            "    if (live) {{\n    let sft = bf16_shift(ld_mx(line));\n{}\n    }}",
            line_tile_each(len.0, &format!("st_dst({out_ix}, ldexp(ld_in{}({in_ix}), sft));", v.input))
        );
        p.dispatches.push(sh.finish(format!("bf16 to scaled f16, {what} {}x{}", total, len.0), 256, groups, &s));
    }

    /// Lines of a bf16 operand over all its batches.
    fn bf16_lines(&self, v: &View, lines: (usize, usize)) -> usize {
        let r = v.layout.dims().len();
        v.layout.dims()[..r - 2].iter().product::<usize>() * lines.0
    }

    /// The start of a kernel over tiles of 16 lines x 256 positions: each
    /// thread's line (`line`, batch `z`, line in batch `w`, `live`) and
    /// position block `pb`; and the input index of position `q` of it.
    fn line_tile_head(&self, sh: &mut Shader, v: &View, lines: (usize, usize), len: (usize, usize)) -> (String, String) {
        let r = v.layout.dims().len();
        let bdims = &v.layout.dims()[..r - 2];
        let total = self.bf16_lines(v, lines);
        let npos = len.0.div_ceil(256);
        // Where each thread is: its line, and positions `pb * 256 + lj + 16 * r`.
        let (li, lj) = if len.1 == 1 { ("lid / 16u", "lid % 16u") } else { ("lid % 16u", "lid / 16u") };
        let mut s = format!("    let li = {li};\n    let lj = {lj};\n    let line = (group / {npos}u) * 16u + li;\n    let pb = group % {npos}u;\n    let live = line < {total}u;\n");
        let _ = writeln!(s, "    let z = min(line, {}u) / {}u;\n    let w = line % {}u;", total - 1, lines.0, lines.0);
        let zd = unravel(&mut s, sh, "z", bdims);
        let in_ix = format!("{} + w * {}u + q * {}u", batch_offset(&zd, &v.layout), lines.1, len.1);
        (s, in_ix)
    }

    /// Each line's largest magnitude of bf16 operand `v` (as f32 bits) into
    /// scratch `maxes`: a pass that clears them, then an atomic max per
    /// line from each tile of 16 lines x 256 positions.
    fn line_maxima(&self, p: &mut WgslProgram, v: &View, lines: (usize, usize), len: (usize, usize), maxes: usize, what: &str) {
        let total = self.bf16_lines(v, lines);
        let groups = (total.div_ceil(16) * len.0.div_ceil(256)) as u64;
        let mut sh = Shader::new(self.caps);
        sh.array(Src::Scratch(maxes), "mx", DType::U32, total, true);
        p.dispatches.push(sh.finish(format!("bf16 maxima, {what}"), 256, total.div_ceil(256) as u64, &format!("    let i = group * 256u + lid;\n    if (i < {total}u) {{ st_mx(i, 0u); }}\n")));
        let mut sh = Shader::new(self.caps);
        self.bind_inputs(&mut sh, &[v.input]);
        sh.bind_raw(Src::Scratch(maxes), "mxa", "array<atomic<u32>>", true);
        sh.decl("var<workgroup> part: array<f32, 256>;");
        let (mut s, in_ix) = self.line_tile_head(&mut sh, v, lines, len);
        let _ = writeln!(
            s,
            "    var m = 0.0;\n    if (live) {{\n{}\n    }}
    part[li * 16u + lj] = m;
    workgroupBarrier();
    if (lj == 0u && live) {{
        var top = 0.0;
        for (var t = 0u; t < 16u; t = t + 1u) {{ top = max(top, part[li * 16u + t]); }}
        atomicMax(&mxa[line], bitcast<u32>(top));
    }}",
            line_tile_each(len.0, &format!("m = max(m, abs(ld_in{}({in_ix})));", v.input))
        );
        p.dispatches.push(sh.finish(format!("bf16 maxima, {what} {}x{}", total, len.0), 256, groups, &s));
    }

    /// Bind what the epilogue reads and define `fn epi(lin, acc)`, which gives
    /// the value to store for the product `acc` at linear index `lin`.
    /// Without an epilogue, `epi` only rounds to the output dtype.
    pub(crate) fn epilogue(&self, sh: &mut Shader, epi: Option<&Epilogue>) -> Result<()> {
        let out_ty = compute_ty(self.out.0);
        let Some(e) = epi else {
            // The accumulator is in the output's compute type (exact for integers).
            // An f16 store rounds by itself where the probe shows it rounds as
            // the CPU does (`Caps::half_store`), and a packed one always
            // (on its bits); rounding on the bits first cost the tensor-core
            // kernel a sixth of its instructions.
            let store_rounds = self.out.0 == DType::F16 && (self.caps.half_store || !self.caps.f16);
            let rounded = if store_rounds { "acc".to_string() } else { round_to(self.out.0, "acc") };
            sh.decl(&format!("fn epi(lin: u32, acc: {out_ty}) -> {out_ty} {{ return {rounded}; }}"));
            return Ok(());
        };
        let used: Vec<usize> = e.expr.loads.iter().enumerate().filter(|&(i, _)| i != e.acc).map(|(_, l)| l.input).collect();
        let mut used_unique = used.clone();
        used_unique.sort_unstable();
        used_unique.dedup();
        self.bind_inputs(sh, &used_unique);
        let mut body = String::new();
        let mut ix = Indexer::new(&e.shape, "lin");
        let acc = round_to(e.acc_dtype, "acc");
        // `epi`'s value is only stored, to the output.
        let last = e.expr.instrs.len().saturating_sub(1);
        let stored: &[usize] = if e.expr.dtype() == self.out.0 { &[last] } else { &[] };
        let v = emit_expr_stored(&mut body, sh, &mut ix, &e.expr, &[(e.acc, acc)], stored)?;
        sh.decl(&format!("fn epi(lin: u32, acc: f32) -> {out_ty} {{\n{body}    return {};\n}}", cast(e.expr.dtype(), self.out.0, &v)));
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    fn matmul_tiled(&self, p: &mut WgslProgram, a: &View, bv: &View, m: usize, k: usize, n: usize, t: Tile, splits: usize, epi: Option<&Epilogue>) -> Result<()> {
        let mut sh = Shader::new(self.caps);
        self.bind_inputs(&mut sh, &[a.input, bv.input]);
        let ct = compute_ty(self.out.0);
        let acc_dt = if ct == "f32" { DType::F32 } else { self.out.0 };
        let zero = literal(0.0, self.out.0);
        let (la, lb) = (&a.layout, &bv.layout);
        let r = la.dims().len();
        let bdims = &la.dims()[..r - 2];
        let batch: usize = bdims.iter().product();
        let Tile { bm, bn, bk, tm, tn, double, warps } = t;
        let threads = t.threads();
        let (tiles_m, tiles_n) = (m.div_ceil(bm), n.div_ceil(bn));
        // Each split covers a whole number of k-steps.
        let chunk = k.div_ceil(splits).div_ceil(bk) * bk;
        let total = batch * splits * tiles_m * tiles_n;
        let direct = splits == 1;
        if direct {
            self.bind_out(&mut sh);
            self.epilogue(&mut sh, epi)?;
        } else {
            sh.array(Src::Scratch(p.scratch.len()), "part", acc_dt, batch * splits * m * n, true);
            p.scratch.push((acc_dt, batch * splits * m * n));
        }
        let (sam, sak) = (la.strides()[r - 2], la.strides()[r - 1]);
        let (sbk, sbn) = (lb.strides()[r - 2], lb.strides()[r - 1]);
        // Which global loads are coalesced: walk the contiguous dim fastest.
        let a_kfast = sak == 1 && sam != 1;
        let b_nfast = sbn == 1 || sbk != 1;
        // Shared tiles hold vec4s along m (A) and n (B); rows are padded by one
        // vec4 when the stores walk k fastest, against bank conflicts.
        let sa = bm / 4 + a_kfast as usize;
        let sb = bn / 4 + (!b_nfast) as usize;
        let bufs = if double { 2 } else { 1 };
        sh.decl(&format!(
            "var<workgroup> As: array<vec4<{ct}>, {}>;\nvar<workgroup> Bs: array<vec4<{ct}>, {}>;",
            bufs * bk * sa,
            bufs * bk * sb
        ));
        let (na, nb) = (bm * bk / threads, bn * bk / threads);
        // Whole tiles of 16-byte aligned f32 rows along the contiguous dim
        // load as vec4s with no bounds checks: a quarter of the load
        // instructions, and none of the address and range arithmetic.
        // Natively stored f16 loads as vec4<f16> the same way (the attention's
        // batched products of a mixed-precision step ran at half the speed
        // of their f32 twins with a bounds-checked load per element).
        let vec_ty = |v: &View| match self.inputs[v.input] {
            (DType::F32, n) if n as u64 * 4 <= self.caps.chunk_bytes() => Some("f32"),
            (DType::F16, n) if self.caps.f16 && n as u64 * 2 <= self.caps.chunk_bytes() => Some("f16"),
            _ => None,
        };
        let vec_in = |v: &View| vec_ty(v).is_some();
        let aligned = |l: &Layout, row: usize| row.is_multiple_of(4) && l.offset().is_multiple_of(4) && l.strides()[..r - 2].iter().all(|s| s % 4 == 0);
        let whole_k = k.is_multiple_of(bk);
        let a4 = ct == "f32" && vec_in(a) && a_kfast && whole_k && m.is_multiple_of(bm) && na % 4 == 0 && aligned(la, sam);
        let b4 = ct == "f32" && vec_in(bv) && sbn == 1 && whole_k && n.is_multiple_of(bn) && nb % 4 == 0 && aligned(lb, sbk);
        // The same along the other dim: `a` with m contiguous (a weight
        // gradient's `dY^T`) and `b` with k contiguous (a Linear layer's
        // `W^T`), four elements of a line of the tile per load; without
        // them a Linear layer's weight loaded one bounds-checked element at
        // a time.
        let a4m = ct == "f32" && vec_in(a) && sam == 1 && sak != 1 && whole_k && m.is_multiple_of(bm) && na % 4 == 0 && aligned(la, sak);
        let b4k = ct == "f32" && vec_in(bv) && sbk == 1 && sbn != 1 && whole_k && n.is_multiple_of(bn) && nb % 4 == 0 && aligned(lb, sbn);
        let (a_vec, b_vec) = (a4 || a4m, b4 || b4k);
        if a_vec {
            sh.bind_raw(Src::Input(a.input), "a4", &format!("array<vec4<{}>>", vec_ty(a).expect("a vec4 operand")), false);
        }
        if b_vec {
            sh.bind_raw(Src::Input(bv.input), "b4", &format!("array<vec4<{}>>", vec_ty(bv).expect("a vec4 operand")), false);
        }
        let tx_n = bn / tn;
        let (rg, cg) = (tm / 4, tn / 4);
        let mut s = format!("    if (group >= {total}u) {{ return; }}\n");
        let _ = writeln!(s, "    let z = group / {}u;\n    let rest = group % {}u;", splits * tiles_m * tiles_n, tiles_m * tiles_n);
        let _ = writeln!(s, "    let ks = (group / {}u) % {splits}u;", tiles_m * tiles_n);
        let _ = writeln!(s, "    let k0 = ks * {chunk}u;\n    let k1 = min(k0 + {chunk}u, {k}u);");
        let _ = writeln!(s, "    let row0 = (rest / {tiles_n}u) * {bm}u;\n    let col0 = (rest % {tiles_n}u) * {bn}u;");
        let zd = unravel(&mut s, &mut sh, "z", bdims);
        let _ = writeln!(s, "    let abase = {};\n    let bbase = {};", batch_offset(&zd, la), batch_offset(&zd, lb));
        if warps && tx_n % 8 == 0 && (threads / tx_n).is_multiple_of(4) {
            let _ = writeln!(s, "    let lane = lid % 32u;\n    let sg = lid / 32u;");
            let _ = writeln!(s, "    let tx = (sg % {}u) * 8u + lane % 8u;\n    let ty = (sg / {}u) * 4u + lane / 8u;", tx_n / 8, tx_n / 8);
        } else {
            let _ = writeln!(s, "    let tx = lid % {tx_n}u;\n    let ty = lid / {tx_n}u;");
        }
        // Where each of this thread's global loads lands in the tiles.
        for i in 0..na / 4 {
            let e = format!("(lid + {}u)", i * threads);
            if a4 {
                let _ = writeln!(s, "    let ar4_{i} = {e} / {}u;\n    let ak4_{i} = ({e} % {}u) * 4u;", bk / 4, bk / 4);
            } else if a4m {
                let _ = writeln!(s, "    let ar4_{i} = ({e} % {}u) * 4u;\n    let ak4_{i} = {e} / {}u;", bm / 4, bm / 4);
            }
        }
        for i in 0..nb / 4 {
            let e = format!("(lid + {}u)", i * threads);
            if b4 {
                let _ = writeln!(s, "    let bk4_{i} = {e} / {}u;\n    let bc4_{i} = ({e} % {}u) * 4u;", bn / 4, bn / 4);
            } else if b4k {
                let _ = writeln!(s, "    let bc4_{i} = {e} / {}u;\n    let bk4_{i} = ({e} % {}u) * 4u;", bk / 4, bk / 4);
            }
        }
        for i in 0..if a_vec { 0 } else { na } {
            let e = format!("(lid + {}u)", i * threads);
            let (ar, ak) = if a_kfast { (format!("({e} / {bk}u)"), format!("({e} % {bk}u)")) } else { (format!("({e} % {bm}u)"), format!("({e} / {bm}u)")) };
            let _ = writeln!(s, "    let ar{i} = {ar};\n    let ak{i} = {ak};\n    let arok{i} = row0 + ar{i} < {m}u;");
        }
        for i in 0..if b_vec { 0 } else { nb } {
            let e = format!("(lid + {}u)", i * threads);
            let (bc, bkk) = if b_nfast { (format!("({e} % {bn}u)"), format!("({e} / {bn}u)")) } else { (format!("({e} / {bk}u)"), format!("({e} % {bk}u)")) };
            let _ = writeln!(s, "    let bc{i} = {bc};\n    let bk{i} = {bkk};\n    let bcok{i} = col0 + bc{i} < {n}u;");
        }
        for g in 0..rg {
            for rr in 0..4 {
                for h in 0..cg {
                    let _ = writeln!(s, "    var c{g}_{rr}_{h} = vec4<{ct}>({zero});");
                }
            }
        }
        // Global loads of step `kt` into registers.
        let load = |s: &mut String, kt: &str| {
            for i in 0..if a_vec { na / 4 } else { 0 } {
                let at = if a4 { format!("(row0 + ar4_{i}) * {sam}u + {kt} + ak4_{i}") } else { format!("({kt} + ak4_{i}) * {sak}u + row0 + ar4_{i}") };
                let _ = writeln!(s, "    ra4_{i} = vec4<f32>(a4[(abase + {at}) / 4u]);");
            }
            for i in 0..if b_vec { nb / 4 } else { 0 } {
                let at = if b4 { format!("({kt} + bk4_{i}) * {sbk}u + col0 + bc4_{i}") } else { format!("(col0 + bc4_{i}) * {sbn}u + {kt} + bk4_{i}") };
                let _ = writeln!(s, "    rb4_{i} = vec4<f32>(b4[(bbase + {at}) / 4u]);");
            }
            for i in 0..if a_vec { 0 } else { na } {
                let _ = writeln!(
                    s,
                    "    ra{i} = {zero};\n    if (arok{i} && {kt} + ak{i} < k1) {{ ra{i} = ld_in{ai}(abase + (row0 + ar{i}) * {sam}u + ({kt} + ak{i}) * {sak}u); }}",
                    ai = a.input
                );
            }
            for i in 0..if b_vec { 0 } else { nb } {
                let _ = writeln!(
                    s,
                    "    rb{i} = {zero};\n    if (bcok{i} && {kt} + bk{i} < k1) {{ rb{i} = ld_in{bi}(bbase + ({kt} + bk{i}) * {sbk}u + (col0 + bc{i}) * {sbn}u); }}",
                    bi = bv.input
                );
            }
        };
        for i in 0..na {
            if !a_vec {
                let _ = writeln!(s, "    var ra{i}: {ct};");
            } else if i % 4 == 0 {
                let _ = writeln!(s, "    var ra4_{}: vec4<f32>;", i / 4);
            }
        }
        for i in 0..nb {
            if !b_vec {
                let _ = writeln!(s, "    var rb{i}: {ct};");
            } else if i % 4 == 0 {
                let _ = writeln!(s, "    var rb4_{}: vec4<f32>;", i / 4);
            }
        }
        let _ = writeln!(s, "    if (k0 < k1) {{");
        load(&mut s, "k0");
        let _ = writeln!(s, "    }}");
        // Register tiles into shared tile `base` (a WGSL expression).
        let store = |s: &mut String, base_a: &str, base_b: &str| {
            if a4 {
                for i in 0..na / 4 {
                    for j in 0..4 {
                        let _ = writeln!(s, "    As[{base_a} + (ak4_{i} + {j}u) * {sa}u + ar4_{i} / 4u][ar4_{i} % 4u] = ra4_{i}[{j}];");
                    }
                }
            } else if a4m {
                for i in 0..na / 4 {
                    let _ = writeln!(s, "    As[{base_a} + ak4_{i} * {sa}u + ar4_{i} / 4u] = ra4_{i};");
                }
            } else {
                for i in 0..na {
                    let _ = writeln!(s, "    As[{base_a} + ak{i} * {sa}u + ar{i} / 4u][ar{i} % 4u] = ra{i};");
                }
            }
            if b4 {
                for i in 0..nb / 4 {
                    let _ = writeln!(s, "    Bs[{base_b} + bk4_{i} * {sb}u + bc4_{i} / 4u] = rb4_{i};");
                }
            } else if b4k {
                for i in 0..nb / 4 {
                    for j in 0..4 {
                        let _ = writeln!(s, "    Bs[{base_b} + (bk4_{i} + {j}u) * {sb}u + bc4_{i} / 4u][bc4_{i} % 4u] = rb4_{i}[{j}];");
                    }
                }
            } else {
                for i in 0..nb {
                    let _ = writeln!(s, "    Bs[{base_b} + bk{i} * {sb}u + bc{i} / 4u][bc{i} % 4u] = rb{i};");
                }
            }
        };
        // One step's products from shared tile `base`.
        let compute = |s: &mut String, base_a: &str, base_b: &str| {
            for kk in 0..bk {
                for g in 0..rg {
                    let _ = writeln!(s, "    let a{kk}_{g} = As[{base_a} + {}u + ty];", kk * sa + g * (bm / rg) / 4);
                }
                for h in 0..cg {
                    let _ = writeln!(s, "    let b{kk}_{h} = Bs[{base_b} + {}u + tx];", kk * sb + h * (bn / cg) / 4);
                }
                for g in 0..rg {
                    for rr in 0..4 {
                        for h in 0..cg {
                            let _ = writeln!(s, "    c{g}_{rr}_{h} = c{g}_{rr}_{h} + a{kk}_{g}[{rr}] * b{kk}_{h};");
                        }
                    }
                }
            }
        };
        if double {
            store(&mut s, "0u", "0u");
            let _ = writeln!(s, "    workgroupBarrier();\n    var cur = 0u;");
            let _ = writeln!(s, "    for (var kt = k0; kt < k1; kt = kt + {bk}u) {{\n    let more = kt + {bk}u < k1;\n    if (more) {{");
            load(&mut s, &format!("(kt + {bk}u)"));
            let _ = writeln!(s, "    }}\n    let oa = cur * {}u;\n    let ob = cur * {}u;", bk * sa, bk * sb);
            compute(&mut s, "oa", "ob");
            // The other tile was last read before the previous barrier: safe to fill.
            let _ = writeln!(s, "    if (more) {{");
            store(&mut s, &format!("({}u - oa)", bk * sa), &format!("({}u - ob)", bk * sb));
            let _ = writeln!(s, "    }}\n    workgroupBarrier();\n    cur = 1u - cur;\n    }}");
        } else {
            let _ = writeln!(s, "    for (var kt = k0; kt < k1; kt = kt + {bk}u) {{");
            store(&mut s, "0u", "0u");
            let _ = writeln!(s, "    workgroupBarrier();\n    if (kt + {bk}u < k1) {{");
            load(&mut s, &format!("(kt + {bk}u)"));
            let _ = writeln!(s, "    }}");
            compute(&mut s, "0u", "0u");
            let _ = writeln!(s, "    workgroupBarrier();\n    }}");
        }
        // Epilogue: bounds-checked stores, rounded to the output dtype.
        for g in 0..rg {
            for rr in 0..4 {
                let _ = writeln!(s, "    {{\n    let gi = row0 + {}u + ty * 4u;", g * (bm / rg) + rr);
                let _ = writeln!(s, "    if (gi < {m}u) {{");
                for h in 0..cg {
                    for q in 0..4 {
                        let _ = writeln!(
                            s,
                            "    {{ let gj = col0 + {}u + tx * 4u; if (gj < {n}u) {{ let o = z * {}u + gi * {n}u + gj; {} }} }}",
                            h * (bn / cg) + q,
                            m * n,
                            if direct {
                                format!("st_out(o, epi(o, c{g}_{rr}_{h}[{q}]));")
                            } else {
                                format!("st_part((z * {splits}u + ks) * {}u + o % {}u, c{g}_{rr}_{h}[{q}]);", m * n, m * n)
                            }
                        );
                    }
                }
                let _ = writeln!(s, "    }}\n    }}");
            }
        }
        let split = if direct { String::new() } else { format!(" in {splits} splits") };
        let vec = match (a_vec, b_vec) {
            (true, true) => " vec4 a b",
            (true, false) => " vec4 a",
            (false, true) => " vec4 b",
            _ => "",
        };
        p.dispatches.push(sh.finish(format!("matmul {batch}x{m}x{k}x{n} tile {bm}x{bn}x{bk}/{tm}x{tn}{}{}{split}{vec}", if double { " double" } else { "" }, if warps { " warps" } else { "" }), threads as u32, total as u64, &s));
        if !direct {
            p.dispatches.push(self.split_sum(p.scratch.len() - 1, batch, m, n, splits, epi)?);
        }
        Ok(())
    }

    /// Few rows: a thread per output column, the inner dim cut into `splits`
    /// chunks whose partial sums a second pass adds up.
    #[allow(clippy::too_many_arguments)]
    fn matmul_columns(&self, p: &mut WgslProgram, a: &View, bv: &View, m: usize, k: usize, n: usize, splits: usize, epi: Option<&Epilogue>) -> Result<()> {
        let ct = compute_ty(self.out.0);
        let acc_dt = if ct == "f32" { DType::F32 } else { self.out.0 };
        let (la, lb) = (&a.layout, &bv.layout);
        let r = la.dims().len();
        let bdims = &la.dims()[..r - 2];
        let batch: usize = bdims.iter().product();
        let (sam, sak) = (la.strides()[r - 2], la.strides()[r - 1]);
        let (sbk, sbn) = (lb.strides()[r - 2], lb.strides()[r - 1]);
        // f32 with `b` row-major and 16-byte aligned: a thread takes four
        // adjacent columns and loads them as one vec4, which moves four times
        // the bytes per load instruction (gemv is bound by memory).
        let f32s = self.out.0 == DType::F32 && self.inputs[a.input].0 == DType::F32 && self.inputs[bv.input].0 == DType::F32;
        let b_aligned = lb.offset() % 4 == 0 && lb.strides()[..r - 2].iter().all(|s| s % 4 == 0);
        let fits = (self.inputs[bv.input].1 as u64) * 4 <= self.caps.chunk_bytes();
        let lanes = if f32s && sbn == 1 && sbk % 4 == 0 && n.is_multiple_of(4) && b_aligned && fits { 4 } else { 1 };
        let cols = (n / lanes).div_ceil(256);
        let chunk = k.div_ceil(splits);
        let total = batch * splits * cols;
        let mut sh = Shader::new(self.caps);
        self.bind_inputs(&mut sh, &[a.input, bv.input]);
        // `ldb(e)`: the value (or vec4) of b at row expression `e` for this thread's column(s).
        type LoadB = Box<dyn Fn(&str) -> String>;
        let (acc_ty, zero, ldb): (String, String, LoadB) = if lanes == 4 {
            sh.bind_raw(Src::Input(bv.input), "b4", "array<vec4<f32>>", false);
            ("vec4<f32>".into(), "vec4<f32>(0.0)".into(), Box::new(move |e: &str| format!("b4[bbase + ({e}) * {}u]", sbk / 4)))
        } else {
            let bi = bv.input;
            (ct.to_string(), literal(0.0, self.out.0), Box::new(move |e: &str| format!("ld_in{bi}(bbase + ({e}) * {sbk}u)")))
        };
        let direct = splits == 1;
        if direct {
            self.bind_out(&mut sh);
            self.epilogue(&mut sh, epi)?;
        } else {
            sh.array(Src::Scratch(0), "part", acc_dt, batch * splits * m * n, true);
            p.scratch.push((acc_dt, batch * splits * m * n));
        }
        let mut s = format!("    if (group >= {total}u) {{ return; }}\n");
        let _ = writeln!(s, "    let z = group / {}u;\n    let ks = (group / {cols}u) % {splits}u;", splits * cols);
        let _ = writeln!(s, "    let t = (group % {cols}u) * 256u + lid;\n    if (t >= {}u) {{ return; }}\n    let col = t * {lanes}u;", n / lanes);
        let zd = unravel(&mut s, &mut sh, "z", bdims);
        let bbase = if lanes == 4 { format!("({}) / 4u + t", batch_offset(&zd, lb)) } else { format!("{} + col * {sbn}u", batch_offset(&zd, lb)) };
        let _ = writeln!(s, "    let abase = {};\n    let bbase = {bbase};", batch_offset(&zd, la));
        let _ = writeln!(s, "    let k0 = ks * {chunk}u;\n    let k1 = min(k0 + {chunk}u, {k}u);");
        for i in 0..m {
            let _ = writeln!(s, "    var acc{i}: {acc_ty} = {zero};");
        }
        // Four steps of k per trip, their loads issued together: a thread per
        // column has no other way to keep enough bytes in flight (gemv is
        // bound by memory). Then the remainder, one step at a time.
        let _ = writeln!(s, "    var q = k0;\n    for (; q + 4u <= k1; q = q + 4u) {{");
        for u in 0..4 {
            let _ = writeln!(s, "    let b{u} = {};", ldb(&format!("q + {u}u")));
        }
        for i in 0..m {
            for u in 0..4 {
                let _ = writeln!(s, "    acc{i} = acc{i} + ld_in{}(abase + {}u + (q + {u}u) * {sak}u) * b{u};", a.input, i * sam);
            }
        }
        let _ = writeln!(s, "    }}");
        let _ = writeln!(s, "    for (; q < k1; q = q + 1u) {{\n    let bq = {};", ldb("q"));
        for i in 0..m {
            let _ = writeln!(s, "    acc{i} = acc{i} + ld_in{}(abase + {}u + q * {sak}u) * bq;", a.input, i * sam);
        }
        let _ = writeln!(s, "    }}");
        for i in 0..m {
            for lane in 0..lanes {
                let v = if lanes == 4 { format!("acc{i}[{lane}]") } else { format!("acc{i}") };
                if direct {
                    let _ = writeln!(s, "    {{ let o = z * {}u + {}u + col + {lane}u; st_out(o, epi(o, {v})); }}", m * n, i * n);
                } else {
                    let _ = writeln!(s, "    st_part(((z * {splits}u + ks) * {m}u + {i}u) * {n}u + col + {lane}u, {v});");
                }
            }
        }
        let vec = if lanes == 4 { "_vec4" } else { "" };
        p.dispatches.push(sh.finish(format!("matmul_columns{vec} {batch}x{m}x{k}x{n} in {splits} splits"), 256, total as u64, &s));
        if !direct {
            p.dispatches.push(self.split_sum(p.scratch.len() - 1, batch, m, n, splits, epi)?);
        }
        Ok(())
    }

    /// Second pass of a split product: add the partial sums in scratch buffer
    /// `scratch` (`[batch, splits, m, n]`) in split order, then the epilogue.
    fn split_sum(&self, scratch: usize, batch: usize, m: usize, n: usize, splits: usize, epi: Option<&Epilogue>) -> Result<Dispatch> {
        let ct = compute_ty(self.out.0);
        let acc_dt = if ct == "f32" { DType::F32 } else { self.out.0 };
        let zero = literal(0.0, self.out.0);
        let mut sh = Shader::new(self.caps);
        sh.array(Src::Scratch(scratch), "part", acc_dt, batch * splits * m * n, false);
        self.bind_out(&mut sh);
        self.epilogue(&mut sh, epi)?;
        let outs = batch * m * n;
        let mut s = format!("    let o = group * 256u + lid;\n    if (o >= {outs}u) {{ return; }}\n");
        let _ = writeln!(s, "    let z = o / {}u;\n    let rest = o % {}u;\n    var acc: {ct} = {zero};", m * n, m * n);
        let _ = writeln!(s, "    for (var ks = 0u; ks < {splits}u; ks = ks + 1u) {{ acc = acc + ld_part((z * {splits}u + ks) * {}u + rest); }}", m * n);
        let _ = writeln!(s, "    st_out(o, epi(o, acc));");
        Ok(sh.finish("matmul_split_sum".into(), 256, (outs as u64).div_ceil(256), &s))
    }
}

thread_local! {
    /// A plan to use instead of the default, for tests and the autotuner.
    pub(crate) static FORCE: std::cell::Cell<Option<Variant>> = const { std::cell::Cell::new(None) };
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Device, Tensor};

    fn check(plan: Variant, da: &[usize], db: &[usize], transpose_a: bool, transpose_b: bool, dt: DType) {
        // The operand on the CPU and on the GPU; a transposed one is a view
        // on both (a copy to the device would make it contiguous).
        let make = |d: &[usize], t: bool| {
            let mut dims = d.to_vec();
            let r = dims.len();
            if t {
                dims.swap(r - 2, r - 1);
            }
            let x = Tensor::randn(&dims, DType::F32, Device::Cpu).unwrap().mul(2.0).unwrap().round().unwrap().to_dtype(dt).unwrap();
            let g = x.to_device(Device::Gpu(0)).unwrap();
            if t { (x.transpose(-1, -2).unwrap(), g.transpose(-1, -2).unwrap()) } else { (x, g) }
        };
        let ((a, ga), (b, gb)) = (make(da, transpose_a), make(db, transpose_b));
        let want = a.matmul(&b).unwrap().to_f64_vec().unwrap();
        FORCE.with(|f| f.set(Some(plan)));
        let got = ga.matmul(&gb).and_then(|c| c.to_f64_vec());
        FORCE.with(|f| f.set(None));
        let got = got.unwrap_or_else(|e| panic!("{plan:?} {da:?}@{db:?}: {e}"));
        // Small integers: every product and sum is exact in f32.
        assert_eq!(got, want, "{plan:?} {da:?} @ {db:?} transposed {transpose_a}/{transpose_b} {dt}");
    }

    #[test]
    fn tensor_core_products_split_only_few_tiles_over_a_long_inner_dim() {
        // MiniLM's weight gradients over 4096 tokens: 9 and 36 output tiles.
        assert_eq!(coop_splits(1, 384, 4096, 384), 16);
        assert_eq!(coop_splits(1, 1536, 4096, 384), 4);
        // Enough tiles, a short inner dim, or chunks that would fall under 256.
        assert_eq!(coop_splits(1, 4096, 384, 1536), 1);
        assert_eq!(coop_splits(1, 384, 512, 384), 1);
        assert_eq!(coop_splits(1, 128, 1024, 128), 4);
        assert_eq!(coop_splits(0, 128, 4096, 128), 1);
    }

    #[test]
    fn every_plan_matches_the_cpu() {
        assert!(!crate::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
        let shapes: &[(&[usize], &[usize])] = &[(&[3, 5], &[5, 7]), (&[2, 33, 17], &[2, 17, 70]), (&[130, 40], &[40, 129])];
        for &tile in TILES {
            for &(da, db) in shapes {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    check(Variant::Tiled(tile), da, db, ta, tb, DType::F32);
                }
            }
            check(Variant::Tiled(tile), &[9, 20], &[20, 11], false, false, DType::I32);
            // Whole tiles: vec4 loads of both operands, of `a` only (n = 130),
            // and batched with a view of `a` offset by one row.
            check(Variant::Tiled(tile), &[2, 256, 32], &[2, 32, 256], false, false, DType::F32);
            // Whole tiles of transposed operands: `a` with m contiguous, `b`
            // with k contiguous (a Linear layer's weight), each as vec4s.
            for (ta, tb) in [(true, false), (false, true), (true, true)] {
                check(Variant::Tiled(tile), &[2, 256, 32], &[2, 32, 256], ta, tb, DType::F32);
            }
            // Natively stored f16 takes the same vec4 loads (four halves each).
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                check(Variant::Tiled(tile), &[2, 256, 32], &[2, 32, 256], ta, tb, DType::F16);
            }
        }
        for tile in [TILES[0], TILES[6], TILES[7]] {
            check(Variant::Tiled(tile), &[256, 32], &[32, 130], false, false, DType::F32);
            check(Variant::Tiled(tile), &[128, 32], &[32, 128], true, false, DType::F32);
        }
        let a = Tensor::randn(&[257, 32], DType::F32, Device::Cpu).unwrap().mul(2.0).unwrap().round().unwrap();
        let b = Tensor::randn(&[32, 128], DType::F32, Device::Cpu).unwrap().mul(2.0).unwrap().round().unwrap();
        let want = a.narrow(0, 1, 256).unwrap().matmul(&b).unwrap().to_f64_vec().unwrap();
        let (ga, gb) = (a.to_device(Device::Gpu(0)).unwrap(), b.to_device(Device::Gpu(0)).unwrap());
        FORCE.with(|f| f.set(Some(Variant::Tiled(TILES[0]))));
        let got = ga.narrow(0, 1, 256).and_then(|a| a.matmul(&gb)).and_then(|c| c.to_f64_vec());
        FORCE.with(|f| f.set(None));
        assert_eq!(got.unwrap(), want, "a view of a at an offset of 32 elements");
        for (tile, splits) in [(TILES[6], 2), (TILES[4], 3), (TILES[0], 5), (TILES[TILES.len() - 1], 3)] {
            let plan = Variant::SplitK { tile, splits };
            check(plan, &[130, 300], &[300, 70], false, false, DType::F32);
            check(plan, &[2, 33, 170], &[2, 170, 40], true, true, DType::F32);
            check(plan, &[9, 100], &[100, 11], false, false, DType::I32);
            check(plan, &[128, 512], &[512, 128], false, false, DType::F32);
        }
        // Split products apply the epilogue in their second pass.
        for (plan, n) in [(Variant::SplitK { tile: TILES[6], splits: 3 }, 37), (Variant::Columns { splits: 4 }, 37), (Variant::Columns { splits: 4 }, 36), (Variant::Columns { splits: 1 }, 36)] {
            let a = Tensor::randn(&[3, 150], DType::F32, Device::Cpu).unwrap();
            let b = Tensor::randn(&[150, n], DType::F32, Device::Cpu).unwrap();
            let f = |a: &Tensor, b: &Tensor| a.matmul(b).unwrap().add(0.25).unwrap().gelu().unwrap();
            let want = f(&a, &b).to_f64_vec().unwrap();
            FORCE.with(|c| c.set(Some(plan)));
            let got = f(&a.to_device(Device::Gpu(0)).unwrap(), &b.to_device(Device::Gpu(0)).unwrap()).to_f64_vec();
            FORCE.with(|c| c.set(None));
            for (g, w) in got.unwrap().iter().zip(&want) {
                assert!((g - w).abs() < 1e-4 * (1.0 + w.abs()), "{plan:?} with an epilogue: {g} vs {w}");
            }
        }
        for splits in [1, 3, 8] {
            check(Variant::Columns { splits }, &[1, 300], &[300, 517], false, false, DType::F32);
            check(Variant::Columns { splits }, &[4, 2, 3, 70], &[4, 2, 70, 9], true, false, DType::F32);
            check(Variant::Columns { splits }, &[3, 33], &[33, 5], false, false, DType::U32);
            // f32 with n % 4 == 0 takes the vec4 path; k = 37 leaves a remainder.
            check(Variant::Columns { splits }, &[1, 300], &[300, 516], false, false, DType::F32);
            check(Variant::Columns { splits }, &[4, 2, 3, 37], &[4, 2, 37, 12], true, false, DType::F32);
            check(Variant::Columns { splits }, &[2, 37], &[37, 8], false, true, DType::F32);
        }
        // Column views of a wider `b`: offset 4 keeps the vec4 path, offset 1 does not.
        for (off, splits) in [(4, 1), (4, 5), (1, 1), (1, 5)] {
            let a = Tensor::randn(&[2, 45], DType::F32, Device::Cpu).unwrap().mul(2.0).unwrap().round().unwrap();
            let wide = Tensor::randn(&[45, 28], DType::F32, Device::Cpu).unwrap().mul(2.0).unwrap().round().unwrap();
            let want = a.matmul(&wide.narrow(1, off, 16).unwrap()).unwrap().to_f64_vec().unwrap();
            let (ga, gw) = (a.to_device(Device::Gpu(0)).unwrap(), wide.to_device(Device::Gpu(0)).unwrap());
            FORCE.with(|c| c.set(Some(Variant::Columns { splits })));
            let got = gw.narrow(1, off, 16).and_then(|b| ga.matmul(&b)).and_then(|c| c.to_f64_vec());
            FORCE.with(|c| c.set(None));
            assert_eq!(got.unwrap(), want, "columns of a view at offset {off}, {splits} splits");
        }
    }

    /// Tensor cores where the adapter has them (not lavapipe: there this
    /// only checks that an adapter is found).
    #[test]
    fn every_tensor_core_plan_matches_the_cpu() {
        assert!(!crate::backend::adapters().is_empty(), "no GPU adapter found: the GPU tests need one");
        let shapes: &[(&[usize], &[usize])] = &[(&[3, 5], &[5, 7]), (&[2, 33, 17], &[2, 17, 70]), (&[130, 40], &[40, 129])];
        if crate::backend::wgpu::context(0).unwrap().caps.coop_f16 {
            for &(da, db) in shapes {
                for (ta, tb) in [(false, false), (true, true)] {
                    check(Variant::Coop, da, db, ta, tb, DType::F16);
                }
            }
            check(Variant::Coop, &[2, 130, 70], &[70, 200], false, true, DType::F16);
            // Whole aligned tiles take the vector-load path.
            check(Variant::Coop, &[128, 64], &[64, 256], false, false, DType::F16);
            check(Variant::Coop, &[2, 256, 96], &[2, 96, 128], false, false, DType::F16);
            check(Variant::Coop, &[256, 96], &[96, 128], true, false, DType::F16);
            // ...with B = W^T (k contiguous) and both transposed, batched too.
            check(Variant::Coop, &[128, 64], &[64, 256], false, true, DType::F16);
            check(Variant::Coop, &[256, 96], &[96, 128], true, true, DType::F16);
            check(Variant::Coop, &[2, 128, 64], &[2, 64, 128], true, true, DType::F16);
            check(Variant::CoopWide, &[256, 64], &[64, 128], false, true, DType::F16);
            check(Variant::CoopWide, &[512, 128], &[128, 256], true, true, DType::F16);
            // 256x128 tiles where whole, else the 128x128 kernel.
            for (da, db) in [(&[128usize, 64][..], &[64usize, 256][..]), (&[2, 256, 96], &[2, 96, 128]), (&[130, 40], &[40, 129]), (&[512, 64], &[64, 128])] {
                check(Variant::CoopWide, da, db, false, false, DType::F16);
            }
            // The smaller tiles: partial ones (bounds-checked loads), whole
            // ones plain and transposed, attention's per-head shapes batched
            // (several staging rounds where 128x64 holds 5 of its 8
            // matrices at a time), bf16 scaled as it loads and through copies.
            for &t in COOP_TILES {
                let plan = Variant::CoopTiles(t);
                check(plan, &[2, 130, 70], &[70, 200], false, true, DType::F16);
                check(plan, &[3, 5], &[5, 7], true, true, DType::F16);
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    check(plan, &[2, 128, 64], &[2, 64, 128], ta, tb, DType::F16);
                }
                check(plan, &[3, 128, 32], &[3, 32, 128], false, true, DType::F16);
                check(plan, &[3, 128, 128], &[3, 128, 32], true, false, DType::F16);
                check(plan, &[3, 32, 128], &[3, 128, 128], true, false, DType::F16);
                check(plan, &[2, 128, 64], &[2, 64, 128], false, true, DType::BF16);
                check(plan, &[130, 70], &[70, 129], false, false, DType::BF16);
                bf16_wide_range(plan, 128, 64, 128, (-40, 40), (-40, 40));
            }
            // The inner dim in chunks: ragged (k = 300), whole tiles with
            // A = x^T (a weight gradient), and more splits than chunks.
            check(Variant::CoopSplitK { splits: 3 }, &[130, 300], &[300, 129], false, false, DType::F16);
            check(Variant::CoopSplitK { splits: 4 }, &[128, 512], &[512, 128], true, false, DType::F16);
            check(Variant::CoopSplitK { splits: 16 }, &[2, 128, 256], &[2, 256, 128], false, true, DType::F16);
            // ...the epilogue runs once, in the pass that adds the chunks.
            let x = Tensor::randn(&[130, 300], DType::F32, Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
            let w = Tensor::randn(&[300, 129], DType::F32, Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
            let f = |a: &Tensor, b: &Tensor| a.matmul(b).unwrap().add(0.25).unwrap().gelu().unwrap();
            let want = f(&x, &w).to_f64_vec().unwrap();
            FORCE.with(|c| c.set(Some(Variant::CoopSplitK { splits: 3 })));
            let got = f(&x.to_device(Device::Gpu(0)).unwrap(), &w.to_device(Device::Gpu(0)).unwrap()).to_f64_vec();
            FORCE.with(|c| c.set(None));
            for (g, w) in got.unwrap().iter().zip(&want) {
                assert!((g - w).abs() < 2e-2 * (1.0 + w.abs()), "split tensor-core product with an epilogue: {g} vs {w}");
            }
            // ...and on every tile, each staged result read by the epilogue once.
            let (x, w) = (x.narrow(0, 0, 128).unwrap().narrow(1, 0, 256).unwrap().contiguous().unwrap(), w.narrow(0, 0, 256).unwrap().narrow(1, 0, 128).unwrap().contiguous().unwrap());
            let want = f(&x, &w).to_f64_vec().unwrap();
            for plan in [Variant::Coop, Variant::CoopWide].into_iter().chain(COOP_TILES.iter().map(|&t| Variant::CoopTiles(t))) {
                FORCE.with(|c| c.set(Some(plan)));
                let got = f(&x.to_device(Device::Gpu(0)).unwrap(), &w.to_device(Device::Gpu(0)).unwrap()).to_f64_vec();
                FORCE.with(|c| c.set(None));
                for (g, w) in got.unwrap().iter().zip(&want) {
                    assert!((g - w).abs() < 2e-2 * (1.0 + w.abs()), "{plan:?} with an epilogue: {g} vs {w}");
                }
            }
            // ...epilogues that read a tensor of the product's size (its
            // values gathered a few at a time before they are stored) or
            // broadcast a bias (stored one by one), into f16 (stored in
            // pairs) and f32, on the tiles that take whole-tile stores.
            let r = Tensor::randn(&[128, 128], DType::F32, Device::Cpu).unwrap();
            let bias = Tensor::randn(&[128], DType::F32, Device::Cpu).unwrap().to_dtype(DType::F16).unwrap();
            let gpu = |t: &Tensor| t.to_device(Device::Gpu(0)).unwrap();
            for plan in [Variant::Coop, Variant::CoopTiles(CoopTile::SMALL), Variant::CoopSplitK { splits: 2 }] {
                for out in [DType::F16, DType::F32] {
                    let residual = |a: &Tensor, b: &Tensor, r: &Tensor| a.matmul(b).unwrap().to_dtype(out).unwrap().add(r.to_dtype(out).unwrap()).unwrap().mul(0.5).unwrap();
                    let biased = |a: &Tensor, b: &Tensor, c: &Tensor| a.matmul(b).unwrap().add(c).unwrap().to_dtype(out).unwrap();
                    let want = [residual(&x, &w, &r).to_f64_vec().unwrap(), biased(&x, &w, &bias).to_f64_vec().unwrap()];
                    FORCE.with(|c| c.set(Some(plan)));
                    let got = [residual(&gpu(&x), &gpu(&w), &gpu(&r)).to_f64_vec(), biased(&gpu(&x), &gpu(&w), &gpu(&bias)).to_f64_vec()];
                    FORCE.with(|c| c.set(None));
                    for ((what, want), got) in ["residual", "bias"].iter().zip(want).zip(got) {
                        for (g, w) in got.unwrap().iter().zip(want) {
                            assert!((g - w).abs() < 2e-2 * (1.0 + w.abs()), "{plan:?} with a {what} epilogue into {out:?}: {g} vs {w}");
                        }
                    }
                }
            }
            // bf16, scaled into f16 for the tensor cores: exact on small integers...
            for &(da, db) in shapes {
                for (ta, tb) in [(false, false), (true, true), (false, true)] {
                    check(Variant::Coop, da, db, ta, tb, DType::BF16);
                }
            }
            check(Variant::CoopWide, &[2, 256, 96], &[2, 96, 128], false, false, DType::BF16);
            check(Variant::Coop, &[256, 96], &[96, 128], true, false, DType::BF16);
            // Whole tiles read the bf16 operands themselves, scaled as they
            // load: B = W^T, and both transposed and batched.
            check(Variant::Coop, &[128, 64], &[64, 256], false, true, DType::BF16);
            check(Variant::Coop, &[2, 128, 64], &[2, 64, 128], true, true, DType::BF16);
            check(Variant::CoopWide, &[512, 128], &[128, 256], true, true, DType::BF16);
            // ...and within bf16's rounding on rows and columns far outside f16's range.
            for plan in [Variant::Coop, Variant::CoopWide] {
                bf16_wide_range(plan, 130, 70, 129, (-40, 40), (-40, 40));
                bf16_wide_range(plan, 256, 128, 256, (-40, 40), (-40, 40));
                // Huge rows times tiny columns and back: the products are
                // ordinary numbers, but undoing the row's scaling first took
                // the first case past 2^128. (Not below 2^-110: NVIDIA
                // flushes f32 subnormals, which the CPU reference keeps.)
                bf16_wide_range(plan, 130, 70, 129, (110, 120), (-110, -100));
                bf16_wide_range(plan, 130, 70, 129, (-110, -100), (110, 120));
            }
        }
    }

    /// Rows of A scaled by powers of two from `2^row_exp.0` to `2^row_exp.1`,
    /// columns of B likewise (in reverse order).
    fn bf16_wide_range(plan: Variant, m: usize, k: usize, n: usize, row_exp: (i32, i32), col_exp: (i32, i32)) {
        let pow = |i: usize, len: usize, (lo, hi): (i32, i32)| 2f32.powi(lo + (i * (hi - lo + 1) as usize / len) as i32);
        let rows = Tensor::from_vec((0..m).map(|i| pow(i, m, row_exp)).collect::<Vec<_>>(), &[m, 1], Device::Cpu).unwrap();
        let cols = Tensor::from_vec((0..n).map(|j| pow(n - 1 - j, n, col_exp)).collect::<Vec<_>>(), &[1, n], Device::Cpu).unwrap();
        let a = Tensor::randn(&[m, k], DType::F32, Device::Cpu).unwrap().mul(&rows).unwrap().to_dtype(DType::BF16).unwrap();
        let b = Tensor::randn(&[k, n], DType::F32, Device::Cpu).unwrap().mul(&cols).unwrap().to_dtype(DType::BF16).unwrap();
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let want = f32_of(&a).matmul(&f32_of(&b)).unwrap().to_f64_vec().unwrap();
        let size = f32_of(&a).abs().unwrap().matmul(&f32_of(&b).abs().unwrap()).unwrap().to_f64_vec().unwrap();
        FORCE.with(|f| f.set(Some(plan)));
        let got = a.to_device(Device::Gpu(0)).unwrap().matmul(&b.to_device(Device::Gpu(0)).unwrap()).and_then(|c| c.to_f64_vec());
        FORCE.with(|f| f.set(None));
        for (i, ((g, w), s)) in got.unwrap().iter().zip(&want).zip(&size).enumerate() {
            assert!((g - w).abs() <= (2f64.powi(-8) * w.abs()).max(1e-4 * s), "{plan:?} bf16 [{m}, {k}] @ [{k}, {n}] at {i}: {g:e} vs {w:e} (terms {s:e})");
        }
    }
}
