//! Branch-free math that the compiler can vectorise (libm's `expf` cannot be).

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
    let xc = x.max(-104.0).min(88.8);
    let n = (xc * LOG2E + MAGIC) - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
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
}
