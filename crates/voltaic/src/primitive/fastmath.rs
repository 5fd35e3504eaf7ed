//! Scalar math with a WGSL twin: branch-free `exp` that the compiler can
//! vectorise (libm's `expf` cannot be), and an `erf` whose every step the GPU
//! helper `erf_` repeats, so both devices agree to an ulp.

/// `e^x` for f32, within 2 ulp of the correctly rounded result over the whole
/// range (Cephes polynomial, split scaling so results reach the subnormals).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest with the 1.5 * 2^23 trick: `round()` would call libm
    // and stop the loop from vectorising.
    const MAGIC: f32 = 12_582_912.0;
    // Not `clamp`: with it inlined here this test panicked at an unrelated
    // assert whose condition held (rustc 1.95, opt-level 1, x86-64-v3).
    #[allow(clippy::manual_clamp, reason = "f32::clamp miscompiled here; max/min is branch-free and lets NaN through")]
    let xc = x.max(-104.0).min(88.8);
    let n = (xc * LOG2E + MAGIC) - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5e-1;
    let y = p * r * r + r + 1.0;
    // 2^n as two factors so that neither overflows nor underflows on its own.
    // SAFETY: n is a whole number in [-151, 129], so it fits an i32.
    let ni = unsafe { n.to_int_unchecked::<i32>() };
    let n1 = ni >> 1;
    let n2 = ni - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    let v = y * s1 * s2;
    let v = if x > 88.722_84 { f32::INFINITY } else { v };
    let v = if x < -103.972_08 { 0.0 } else { v };
    if x.is_nan() {
        x
    } else {
        v
    }
}

/// The error function for f32, within 1 ulp of the correctly rounded result.
///
/// Written for agreement across devices: the WGSL helper `erf_` (see
/// `WGSL_HELPERS`) runs the same steps with the same coefficients, so the
/// only difference is whether a compiler fuses a multiply-add, which moves
/// the result by at most one ulp (checked in `tests/gpu.rs`). For `|x| < 1`,
/// `erf(x) = x + x * P(x^2)`; up to 3.92, `1 - exp(R(|x|) - x^2)` where `R`
/// fits `log(erfc(x)) + x^2`, a slowly varying function, so no cancellation;
/// beyond, `erf` rounds to 1. The coefficients are least-squares fits in
/// f64 (relative error 2e-10 for `P`, absolute 1e-9 for `R`).
#[inline]
pub fn erf_f32(x: f32) -> f32 {
    let a = x.abs();
    if a < 1.0 {
        let t = x * x;
        let mut y = -9.770091e-6f32;
        for c in ERF_P {
            y = y * t + c;
        }
        return x + x * y;
    }
    if a.is_nan() {
        return x;
    }
    if a >= 3.92 {
        return 1f32.copysign(x);
    }
    let s = a - 2.46;
    let mut r = 1.6585618e-6f32;
    for c in ERF_R {
        r = r * s + c;
    }
    let v = 1.0 - exp_f32(r - a * a);
    v.copysign(x)
}

/// `erf(x) / x - 1` as a polynomial in `x^2` on `[0, 1)`, highest degree
/// first, leading coefficient in `erf_f32`.
const ERF_P: [f32; 7] = [0.00011299809, -0.00084884226, 0.005221306, -0.02686552, 0.112837836, -0.37612638, 0.12837917];
/// `log(erfc(x)) + x^2` as a polynomial in `x - 2.46` on `[1, 3.92)`, highest
/// degree first, leading coefficient in `erf_f32`.
const ERF_R: [f32; 8] = [-1.3793861e-5, 8.1019854e-5, -0.00043927957, 0.0022512842, -0.011211665, 0.05743036, -0.3572219, -1.5426176];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_reference() {
        let mut worst = 0.0f64;
        let mut x = -103.9f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            if want > 1e-37 {
                worst = worst.max(((got - want) / want).abs());
            }
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    }

    /// Distance in units in the last place between two finite f32.
    fn ulps(a: f32, b: f32) -> u32 {
        let key = |v: f32| {
            let i = v.to_bits() as i32;
            if i < 0 { i32::MIN - i } else { i }
        };
        key(a).abs_diff(key(b))
    }

    #[test]
    fn erf_is_within_one_ulp_of_the_correctly_rounded_value() {
        let mut worst = (0, 0.0f32);
        let mut x = -4.5f32;
        while x < 4.5 {
            let want = libm::erf(x as f64) as f32;
            let d = ulps(erf_f32(x), want);
            if d > worst.0 {
                worst = (d, x);
            }
            x += 1.3e-4;
        }
        assert!(worst.0 <= 1, "erf_f32 is {} ulp off at {}", worst.0, worst.1);
        assert_eq!(erf_f32(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(erf_f32(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(erf_f32(f32::INFINITY), 1.0);
        assert_eq!(erf_f32(f32::NEG_INFINITY), -1.0);
        assert!(erf_f32(f32::NAN).is_nan());
    }
}
