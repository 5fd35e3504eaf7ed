//! Max pooling's most common case, 2x2 windows at stride 2 tiling an image
//! of even height and width stored contiguously, and its gradient. The
//! image is then rows of windows, each a pair of image rows one after the
//! other through every plane, so a kernel runs over pairs of rows with no
//! offset table and no per-window index arithmetic.
//!
//! Taps are compared in row-major order, each image row's pair first, then
//! the two rows' winners: a tie or a NaN is settled as the general kernel
//! settles it (the first maximum, the first NaN), which the tests check
//! against it and against f64 references.

use super::index::{replaces, MaxKey};
use super::simd::simd_fn;
use crate::layout::Layout;
use crate::primitive::UnfoldParams;

/// The image's first element, where max pooling `p` over `l` is the case
/// this module serves.
pub(crate) fn pairs_of_rows(p: &UnfoldParams, l: &Layout) -> Option<usize> {
    let d = l.dims();
    (p.kernel == [2, 2] && d.len() == 4 && p.tiles(d[2], d[3]) && l.is_contiguous()).then_some(l.offset())
}

/// Which of two taps, `a` then `b`, is the running maximum after both
/// (`b` where it [`replaces`] `a`), and whether it is `b`.
#[inline(always)]
fn later_wins<K: PartialOrd + Copy>(a: K, b: K) -> (K, bool) {
    let t = replaces(b, a);
    (if t { b } else { a }, t)
}

simd_fn! {
    /// The maxima: `src` holds pairs of image rows `w` wide, `dst` a row of
    /// `w / 2` maxima per pair. A row of windows is one loop without bounds
    /// checks or branches, which the compiler vectorizes (the general
    /// kernel gathers each tap through a table: 0.9-1.0 -> 0.2-0.4 ms for
    /// the CNN's first pooling at batch 64 on 2 cores).
    pub(crate) fn pool_rows<T: MaxKey>(src: &[T], w: usize, dst: &mut [T]) {
        for (pair, out) in src.chunks_exact(2 * w).zip(dst.chunks_exact_mut(w / 2)) {
            let (top, bot) = pair.split_at(w);
            for ((t, b), o) in top.chunks_exact(2).zip(bot.chunks_exact(2)).zip(out.iter_mut()) {
                let (t, _) = later_wins(t[0].key(), t[1].key());
                let (b, _) = later_wins(b[0].key(), b[1].key());
                *o = T::from_key(later_wins(t, b).0);
            }
        }
    }
}

/// The gradient in f32: `dst` (pairs of image rows `w` wide, as `src`)
/// gets each window's entry of `g` (a row of `w / 2` per pair) at the
/// window's first maximum, plus zero as the general kernel adds it, and
/// zeros elsewhere. Every element is written, so nothing is zeroed first.
///
/// With AVX, four or eight windows at a time in vector registers, every
/// choice a bit mask. Written as scalar selects, the compiler branched on
/// each, and on random data half the branches were mispredicted: 6.8 ms
/// for the CNN's first pooling at batch 64 on one core, against 0.37.
pub(crate) fn grad_rows(src: &[f32], g: &[f32], w: usize, dst: &mut [f32]) {
    let ow = w / 2;
    assert!(ow > 0 && src.len() == dst.len() && src.len() == g.len() * 4 && g.len().is_multiple_of(ow), "maxpool2x2: pairs of rows {w} wide");
    #[cfg(target_arch = "x86_64")]
    if ow >= 4 && super::simd::has_avx2() {
        // SAFETY: AVX2 was just detected; the lengths were checked above.
        return unsafe { x86::grad_rows(src, g, w, dst) };
    }
    grad_rows_scalar(src, g, w, dst);
}

/// [`grad_rows`] one window at a time: the fallback, and the reference
/// its vector path is tested against.
pub(crate) fn grad_rows_scalar(src: &[f32], g: &[f32], w: usize, dst: &mut [f32]) {
    for ((pair, gr), out) in src.chunks_exact(2 * w).zip(g.chunks_exact(w / 2)).zip(dst.chunks_exact_mut(2 * w)) {
        let (top, bot) = pair.split_at(w);
        let (otop, obot) = out.split_at_mut(w);
        let taps = top.chunks_exact(2).zip(bot.chunks_exact(2));
        let outs = otop.chunks_exact_mut(2).zip(obot.chunks_exact_mut(2));
        for (((t, b), &gv), (ot, ob)) in taps.zip(gr).zip(outs) {
            let (tv, right_top) = later_wins(t[0], t[1]);
            let (bv, right_bot) = later_wins(b[0], b[1]);
            let lower = later_wins(tv, bv).1;
            let v = 0.0 + gv;
            let pick = |here: bool| if here { v } else { 0.0 };
            ot[0] = pick(!lower & !right_top);
            ot[1] = pick(!lower & right_top);
            ob[0] = pick(lower & !right_bot);
            ob[1] = pick(lower & right_bot);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Lanes where `k` replaces `best` (see `index::replaces`).
    macro_rules! replaces {
        ($cmp:ident, $or:ident, $and:ident, $k:expr, $best:expr) => {{
            let (k, best) = ($k, $best);
            let gt = $cmp::<_CMP_GT_OQ>(k, best);
            let first_nan = $and($cmp::<_CMP_UNORD_Q>(k, k), $cmp::<_CMP_ORD_Q>(best, best));
            $or(gt, first_nan)
        }};
    }

    /// Four windows: taps from rows `t` and `b` (8 each), gradients `g`
    /// (4), results to rows `ot` and `ob` (8 each).
    #[target_feature(enable = "avx,avx2,fma")]
    unsafe fn four(t: *const f32, b: *const f32, g: *const f32, ot: *mut f32, ob: *mut f32) {
        // SAFETY (all below): the caller's pointers reach the counts above.
        unsafe {
            let (tl, th, bl, bh) = (_mm_loadu_ps(t), _mm_loadu_ps(t.add(4)), _mm_loadu_ps(b), _mm_loadu_ps(b.add(4)));
            // Left and right taps of each window, in window order.
            let (te, to) = (_mm_shuffle_ps::<0x88>(tl, th), _mm_shuffle_ps::<0xDD>(tl, th));
            let (be, bo) = (_mm_shuffle_ps::<0x88>(bl, bh), _mm_shuffle_ps::<0xDD>(bl, bh));
            let tr = replaces!(_mm_cmp_ps, _mm_or_ps, _mm_and_ps, to, te);
            let br = replaces!(_mm_cmp_ps, _mm_or_ps, _mm_and_ps, bo, be);
            let lower = replaces!(_mm_cmp_ps, _mm_or_ps, _mm_and_ps, _mm_blendv_ps(be, bo, br), _mm_blendv_ps(te, to, tr));
            let v = _mm_add_ps(_mm_setzero_ps(), _mm_loadu_ps(g));
            let (up, down) = (_mm_andnot_ps(lower, v), _mm_and_ps(lower, v));
            let (a, c) = (_mm_andnot_ps(tr, up), _mm_and_ps(tr, up));
            let (d, e) = (_mm_andnot_ps(br, down), _mm_and_ps(br, down));
            _mm_storeu_ps(ot, _mm_unpacklo_ps(a, c));
            _mm_storeu_ps(ot.add(4), _mm_unpackhi_ps(a, c));
            _mm_storeu_ps(ob, _mm_unpacklo_ps(d, e));
            _mm_storeu_ps(ob.add(4), _mm_unpackhi_ps(d, e));
        }
    }

    /// [`four`] for eight windows (16 taps per row, 8 gradients).
    #[target_feature(enable = "avx,avx2,fma")]
    unsafe fn eight(t: *const f32, b: *const f32, g: *const f32, ot: *mut f32, ob: *mut f32) {
        // SAFETY (all below): the caller's pointers reach the counts above.
        unsafe {
            let (tl, th, bl, bh) = (_mm256_loadu_ps(t), _mm256_loadu_ps(t.add(8)), _mm256_loadu_ps(b), _mm256_loadu_ps(b.add(8)));
            // Shuffles work within 128-bit halves: the windows sit in lanes
            // as 0 1 4 5 | 2 3 6 7, so the gradients are put so too, and the
            // unpacks at the end restore the order.
            let (te, to) = (_mm256_shuffle_ps::<0x88>(tl, th), _mm256_shuffle_ps::<0xDD>(tl, th));
            let (be, bo) = (_mm256_shuffle_ps::<0x88>(bl, bh), _mm256_shuffle_ps::<0xDD>(bl, bh));
            let gv = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(_mm256_loadu_ps(g))));
            let tr = replaces!(_mm256_cmp_ps, _mm256_or_ps, _mm256_and_ps, to, te);
            let br = replaces!(_mm256_cmp_ps, _mm256_or_ps, _mm256_and_ps, bo, be);
            let lower = replaces!(_mm256_cmp_ps, _mm256_or_ps, _mm256_and_ps, _mm256_blendv_ps(be, bo, br), _mm256_blendv_ps(te, to, tr));
            let v = _mm256_add_ps(_mm256_setzero_ps(), gv);
            let (up, down) = (_mm256_andnot_ps(lower, v), _mm256_and_ps(lower, v));
            let (a, c) = (_mm256_andnot_ps(tr, up), _mm256_and_ps(tr, up));
            let (d, e) = (_mm256_andnot_ps(br, down), _mm256_and_ps(br, down));
            _mm256_storeu_ps(ot, _mm256_unpacklo_ps(a, c));
            _mm256_storeu_ps(ot.add(8), _mm256_unpackhi_ps(a, c));
            _mm256_storeu_ps(ob, _mm256_unpacklo_ps(d, e));
            _mm256_storeu_ps(ob.add(8), _mm256_unpackhi_ps(d, e));
        }
    }

    /// `super::grad_rows` for rows of at least four windows. A row's last
    /// group ends at the row's end, overlapping the group before: windows
    /// made twice come out the same, and no lane reads or writes past the
    /// row (masked stores, the alternative, are slow on AMD: 2.2 against
    /// 0.37 ms).
    ///
    /// # Safety
    /// The CPU has AVX2; the lengths are as `super::grad_rows` checks, with
    /// at least four windows a row.
    #[target_feature(enable = "avx,avx2,fma")]
    pub(super) unsafe fn grad_rows(src: &[f32], g: &[f32], w: usize, dst: &mut [f32]) {
        let ow = w / 2;
        let (lanes, f): (usize, unsafe fn(_, _, _, _, _)) = if ow >= 8 { (8, eight) } else { (4, four) };
        for ((pair, gr), out) in src.chunks_exact(2 * w).zip(g.chunks_exact(ow)).zip(dst.chunks_exact_mut(2 * w)) {
            let (top, bot) = pair.split_at(w);
            let (otop, obot) = out.split_at_mut(w);
            let mut x = 0;
            while x < ow {
                let x0 = x.min(ow - lanes);
                // SAFETY: x0 + lanes <= ow, so each row's 2 * lanes taps from 2 * x0 are inside it.
                unsafe { f(top.as_ptr().add(2 * x0), bot.as_ptr().add(2 * x0), gr.as_ptr().add(x0), otop.as_mut_ptr().add(2 * x0), obot.as_mut_ptr().add(2 * x0)) };
                x += lanes;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vector_gradient_matches_the_scalar_one_bit_for_bit() {
        // Few distinct values, so that ties are common, and NaNs: the cases
        // where the order of comparison decides.
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for w in [8, 10, 14, 16, 18, 28, 34] {
            let rows = 5;
            let n = rows * 2 * w;
            let src: Vec<f32> = (0..n).map(|_| match next() % 11 { 0 => f32::NAN, 1 => -0.0, v => (v % 4) as f32 - 1.5 }).collect();
            let g: Vec<f32> = (0..n / 4).map(|_| next() as f32 / 1e9 - 2.0).collect();
            let (mut a, mut b) = (vec![f32::NAN; n], vec![7.0; n]);
            grad_rows(&src, &g, w, &mut a);
            grad_rows_scalar(&src, &g, w, &mut b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "width {w}");
            // Each window passes its gradient on once.
            let total: f64 = a.iter().map(|&v| v as f64).sum();
            let want: f64 = g.iter().map(|&v| v as f64).sum();
            assert!((total - want).abs() < 1e-3, "width {w}: {total} against {want}");
        }
    }
}
