//! WGSL helper functions the primitives' templates call, by name.

/// WGSL helper functions that the primitives' templates call, by name. A kernel
/// includes the ones its body mentions. They exist where WGSL's built-in is
/// missing (erf, log1p, expm1), not precise enough on every driver (sin, cos
/// need range reduction; tanh overflows to NaN on some), or not defined where
/// PyTorch is (pow of a negative base, remainder's sign).
///
/// NaN is tested on the bits (`isnan_`), never as `x != x`: some drivers
/// (Mesa's NIR among them) fold `x != x` to false and `x - x` to 0.
///
/// Infinities and NaN are made by `f32_bits_`, a function call: WGSL makes
/// a constant expression that evaluates to one a shader-creation error
/// (browsers' Tint enforces it; naga lets `bitcast<f32>(0x7f800000u)` pass).
pub const WGSL_HELPERS: &[(&str, &str)] = &[
    ("f32_bits_", "fn f32_bits_(b: u32) -> f32 { return bitcast<f32>(b); }"),
    ("isnan_", "fn isnan_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }"),
    ("isinf_", "fn isinf_(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u; }"),
    ("log1p_", "fn log1p_(x: f32) -> f32 {
    if (abs(x) < 0.5) {
        let s = x / (2.0 + x);
        let s2 = s * s;
        return 2.0 * s * (1.0 + s2 * (1.0 / 3.0 + s2 * (0.2 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0 + s2 * (1.0 / 11.0))))));
    }
    return log(1.0 + x);
}"),
    ("expm1_", "fn expm1_(x: f32) -> f32 {
    if (abs(x) < 1.0) {
        return x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (1.0 / 720.0
            + x * (1.0 / 5040.0 + x * (1.0 / 40320.0 + x * (1.0 / 362880.0 + x * (1.0 / 3628800.0))))))))));
    }
    return exp(x) - 1.0;
}"),
    ("tanh_", "fn tanh_(x: f32) -> f32 {
    let a = abs(x);
    var t: f32;
    if (a < 0.5) {
        let e = expm1_(2.0 * a);
        t = e / (e + 2.0);
    } else {
        t = 1.0 - 2.0 / (exp(2.0 * min(a, 20.0)) + 1.0);
    }
    return select(select(t, -t, x < 0.0), x, isnan_(x));
}"),
    ("sincos_", "fn sincos_(x: f32, want_cos: bool) -> f32 {
    // Reduce to [-pi/4, pi/4] and a quadrant, then the cephes polynomials.
    // Cody-Waite below 2^10 (the error of k * 4.8375e-4 grows with k); Payne-Hanek above.
    var q: i32;
    var r: f32;
    let a = abs(x);
    if (a < 1024.0) {
        let k = round(x * 0.63661977236758134);
        r = ((x - k * 1.5703125) - k * 4.837512969970703125e-4) - k * 7.54978995489188216e-8;
        q = i32(k - 4.0 * floor(k * 0.25));
    } else {
        let red = trig_reduce_(a);
        q = i32(red.x);
        r = red.y;
        if (x < 0.0) { q = -q; r = -r; }
    }
    let z = r * r;
    let s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    if (want_cos) { q = q + 1; }
    var v: f32;
    switch (q & 3) {
        case 0: { v = s; }
        case 1: { v = c; }
        case 2: { v = -s; }
        default: { v = -c; }
    }
    // NaN and infinities give NaN.
    return select(v, f32_bits_(0x7fc00000u), isnan_(x) || isinf_(x));
}"),
    ("trig_reduce_", "// The bits of 2/pi, 32 at a time.
var<private> tpi_: array<u32, 8> = array<u32, 8>(0xa2f9836eu, 0x4e441529u, 0xfc2757d1u, 0xf534ddc0u, 0xdb629599u, 0x3c439041u, 0xfe5163abu, 0xdebbc561u);
fn mul32_(a: u32, b: u32) -> vec2<u32> {
    // The 64-bit product of two u32 as (low, high), in 16-bit halves.
    let al = a & 0xffffu;
    let ah = a >> 16u;
    let bl = b & 0xffffu;
    let bh = b >> 16u;
    let ll = al * bl;
    let lh = al * bh;
    let hl = ah * bl;
    let mid = (ll >> 16u) + (lh & 0xffffu) + (hl & 0xffffu);
    return vec2<u32>(((mid & 0xffffu) << 16u) | (ll & 0xffffu), ah * bh + (lh >> 16u) + (hl >> 16u) + (mid >> 16u));
}
fn tpi_bit_(j: i32) -> u32 {
    let o = u32(j - 1);
    return (tpi_[o / 32u] >> (31u - o % 32u)) & 1u;
}
fn tpi_word_(o: u32) -> u32 {
    let w = o / 32u;
    let sh = o % 32u;
    var v = tpi_[w] << sh;
    if (sh != 0u) { v = v | (tpi_[w + 1u] >> (32u - sh)); }
    return v;
}
fn ext32_(p0: u32, p1: u32, p2: u32, start: u32) -> u32 {
    var l = array<u32, 5>(p0, p1, p2, 0u, 0u);
    let w = start / 32u;
    let b = start % 32u;
    var v = l[w] >> b;
    if (b != 0u) { v = v | (l[w + 1u] << (32u - b)); }
    return v;
}
fn trig_reduce_(a: f32) -> vec2<f32> {
    // Payne-Hanek for finite a >= 2^10: a = M * 2^p exactly, and a * 2/pi
    // modulo 4 needs only 64 bits of 2/pi from bit p on (earlier ones give
    // multiples of 4; bits p-1 and p the integer part). Returns (quadrant, r).
    let u = bitcast<u32>(a);
    let m = (u & 0x7fffffu) | 0x800000u;
    let p = i32(u >> 23u) - 150;
    var j0 = 1;
    var s = u32(64 - p);
    var qx = 0u;
    if (p >= 1) {
        j0 = p + 1;
        s = 64u;
        var b2 = 0u;
        if (p >= 2) { b2 = tpi_bit_(p - 1); }
        qx = (m * (tpi_bit_(p) + 2u * b2)) & 3u;
    }
    let wh = tpi_word_(u32(j0 - 1));
    let wl = tpi_word_(u32(j0 + 31));
    let lo = mul32_(m, wl);
    let hi = mul32_(m, wh);
    let p1 = hi.x + lo.y;
    let p2 = hi.y + select(0u, 1u, p1 < hi.x);
    var q = (ext32_(lo.x, p1, p2, s) + qx) & 3u;
    let fh = ext32_(lo.x, p1, p2, s - 32u);
    let fl = ext32_(lo.x, p1, p2, s - 64u);
    // A fraction of 1/2 or more rounds the quadrant up; read as signed, it is the fraction minus 1.
    if ((fh & 0x80000000u) != 0u) { q = (q + 1u) & 3u; }
    let r = f32(bitcast<i32>(fh)) * bitcast<f32>(0x2fc90fdbu) + f32(fl) * bitcast<f32>(0x1fc90fdbu);
    return vec2<f32>(f32(q), r);
}"),
    ("sin_", "fn sin_(x: f32) -> f32 { return sincos_(x, false); }"),
    ("cos_", "fn cos_(x: f32) -> f32 { return sincos_(x, true); }"),
    ("expc_", "fn expc_(x: f32) -> f32 {
    // e^x for moderate finite x, by the steps of the CPU's `fastmath::exp_f32`.
    let n = round(x * 1.44269504);
    let r = (x - n * 0.6933594) - n * -2.1219444e-4;
    var p = 1.9875691e-4;
    p = p * r + 1.3981999e-3;
    p = p * r + 8.333452e-3;
    p = p * r + 4.1665796e-2;
    p = p * r + 1.6666665e-1;
    p = p * r + 5.0000001e-1;
    let y = p * r * r + r + 1.0;
    return y * bitcast<f32>(u32(i32(n) + 127) << 23u);
}"),
    ("erf_", "fn erf_(x: f32) -> f32 {
    // The steps and coefficients of the CPU's `fastmath::erf_f32`, so the two agree to an ulp.
    let a = abs(x);
    if (a < 1.0) {
        let t = x * x;
        var y = -9.770091e-6;
        y = y * t + 0.00011299809;
        y = y * t + -0.00084884226;
        y = y * t + 0.005221306;
        y = y * t + -0.02686552;
        y = y * t + 0.112837836;
        y = y * t + -0.37612638;
        y = y * t + 0.12837917;
        return x + x * y;
    }
    if (isnan_(x)) { return x; }
    if (a >= 3.92) { return select(1.0, -1.0, x < 0.0); }
    let s = a - 2.46;
    var r = 1.6585618e-6;
    r = r * s + -1.3793861e-5;
    r = r * s + 8.1019854e-5;
    r = r * s + -0.00043927957;
    r = r * s + 0.0022512842;
    r = r * s + -0.011211665;
    r = r * s + 0.05743036;
    r = r * s + -0.3572219;
    r = r * s + -1.5426176;
    let v = 1.0 - expc_(r - a * a);
    return select(v, -v, x < 0.0);
}"),
    ("pow_", "fn pow_(a: f32, b: f32) -> f32 {
    // IEEE pow (C's powf, what the CPU kernel calls), special cases first.
    if (b == 0.0 || a == 1.0) { return 1.0; }
    if (isnan_(a) || isnan_(b)) { return f32_bits_(0x7fc00000u); }
    let inf = f32_bits_(0x7f800000u);
    let m = abs(a);
    if (isinf_(b)) {
        if (m == 1.0) { return 1.0; }
        return select(0.0, inf, (m > 1.0) == (b > 0.0));
    }
    let whole = floor(b) == b;
    if (a < 0.0 && !isinf_(a) && !whole) { return f32_bits_(0x7fc00000u); }
    // Odd integer exponents keep the base's sign (floats of 2^24 and more are even).
    let odd = whole && abs(b) < 16777216.0 && abs(b - 2.0 * floor(b * 0.5)) == 1.0;
    var r: f32;
    if (m == 0.0) {
        r = select(0.0, inf, b < 0.0);
    } else if (isinf_(m)) {
        r = select(inf, 0.0, b < 0.0);
    } else if (b == 1.0) {
        r = m;
    } else if (b == 2.0) {
        r = m * m;
    } else {
        r = exp2(b * log2(m));
    }
    if (odd && (bitcast<u32>(a) & 0x80000000u) != 0u) { r = -r; }
    return r;
}"),
    ("fmod_", "fn fmod_(x: f32, y: f32) -> f32 {
    // Exact fmod (the CPU's `%`), by long division of the significands:
    // `x - y * trunc(x / y)` rounds for large quotients, and is NaN for y = inf.
    let ux = bitcast<u32>(x);
    let uy = bitcast<u32>(y);
    let sign = ux & 0x80000000u;
    let ax = ux & 0x7fffffffu;
    let ay = uy & 0x7fffffffu;
    if (ay == 0u || ax >= 0x7f800000u || ay > 0x7f800000u) { return f32_bits_(0x7fc00000u); }
    if (ax < ay) { return x; }
    if (ax == ay) { return bitcast<f32>(sign); }
    // Significands with the implicit bit, and their exponents (subnormals normalised).
    var ex = i32(ax >> 23u);
    var ey = i32(ay >> 23u);
    var mx = ax & 0x7fffffu;
    var my = ay & 0x7fffffu;
    if (ex == 0) { ex = 1; while ((mx & 0x800000u) == 0u) { mx = mx << 1u; ex = ex - 1; } } else { mx = mx | 0x800000u; }
    if (ey == 0) { ey = 1; while ((my & 0x800000u) == 0u) { my = my << 1u; ey = ey - 1; } } else { my = my | 0x800000u; }
    // One bit of the quotient per step: subtract where it fits, then shift.
    for (var e = ex; e > ey; e = e - 1) {
        if (mx >= my) { mx = mx - my; }
        if (mx == 0u) { return bitcast<f32>(sign); }
        mx = mx << 1u;
    }
    if (mx >= my) { mx = mx - my; }
    if (mx == 0u) { return bitcast<f32>(sign); }
    // Renormalise to the exponent of y and rebuild the float.
    var e = ey;
    while ((mx & 0x800000u) == 0u) { mx = mx << 1u; e = e - 1; }
    if (e > 0) { return bitcast<f32>(sign | (u32(e) << 23u) | (mx & 0x7fffffu)); }
    return bitcast<f32>(sign | (mx >> u32(1 - e)));
}"),
    ("rem_f32", "fn rem_f32(a: f32, b: f32) -> f32 {
    // Python's remainder: fmod, then moved to the divisor's sign.
    // Zero and the signs tested on the bits: GPUs that flush subnormals
    // (NVIDIA) would call a subnormal remainder 0.
    let r = fmod_(a, b);
    let rb = bitcast<u32>(r);
    if ((rb & 0x7fffffffu) != 0u && (rb >> 31u) != (bitcast<u32>(b) >> 31u)) { return r + b; }
    return r;
}"),
    ("pow_i32", "fn pow_i32(a: i32, b: i32) -> i32 {
    if (b < 0) {
        if (a == 1) { return 1; }
        if (a == -1) { return select(-1, 1, (b & 1) == 0); }
        return 0;
    }
    var r = 1;
    var x = a;
    var e = u32(b);
    while (e > 0u) {
        if ((e & 1u) == 1u) { r = r * x; }
        x = x * x;
        e = e >> 1u;
    }
    return r;
}"),
    ("pow_u32", "fn pow_u32(a: u32, b: u32) -> u32 {
    var r = 1u;
    var x = a;
    var e = b;
    while (e > 0u) {
        if ((e & 1u) == 1u) { r = r * x; }
        x = x * x;
        e = e >> 1u;
    }
    return r;
}"),
    ("rem_i32", "fn rem_i32(a: i32, b: i32) -> i32 {
    if (b == 0) { return 0; }
    // On magnitudes: `%` of negative operands is undefined in GLSL, which
    // wgpu's GL backend translates this to (i32::MIN wraps to 2^31 here).
    let ua = select(u32(a), 0u - u32(a), a < 0);
    let ub = select(u32(b), 0u - u32(b), b < 0);
    var r = i32(ua % ub);
    if (a < 0) { r = -r; }
    if (r != 0 && ((r < 0) != (b < 0))) { return r + b; }
    return r;
}"),
    ("rem_u32", "fn rem_u32(a: u32, b: u32) -> u32 {
    if (b == 0u) { return 0u; }
    return a % b;
}"),
    ("bf16r_", "fn bf16r_(x: f32) -> f32 {
    // Round to bfloat16, nearest even, as `half` does; NaN stays a quiet NaN.
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) { return bitcast<f32>(b | 0x00400000u); }
    return bitcast<f32>((b + 0x7fffu + ((b >> 16u) & 1u)) & 0xffff0000u);
}"),
    ("f16r_", "fn f16r_(x: f32) -> f32 {
    // Round to IEEE half, nearest even, on the bits: some drivers drop an
    // f32 -> f16 -> f32 round trip as a no-op, which changes fused results.
    let b = bitcast<u32>(x);
    let a = b & 0x7fffffffu;
    let sign = b & 0x80000000u;
    if (a >= 0x7f800000u) { return x; }
    let e = a >> 23u;
    if (e >= 113u) {
        let r = (a + 0xfffu + ((a >> 13u) & 1u)) & 0xffffe000u;
        if (r > 0x477fe000u) { return bitcast<f32>(sign | 0x7f800000u); }
        return bitcast<f32>(sign | r);
    }
    // Below 2^-14 the half spacing is 2^-24: round m * 2^(e - 126) to an integer.
    if (e < 101u) { return bitcast<f32>(sign); }
    let m = (a & 0x7fffffu) | 0x800000u;
    let s = 126u - e;
    var q = m >> s;
    let rest = m & ((1u << s) - 1u);
    let half = 1u << (s - 1u);
    if (rest > half || (rest == half && (q & 1u) == 1u)) { q = q + 1u; }
    return bitcast<f32>(sign | bitcast<u32>(f32(q) * 5.9604644775390625e-8));
}"),
    ("h2f_", "fn h2f_(h: u32) -> f32 {
    // The f32 value of IEEE half bits.
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) { return bitcast<f32>(sign | bitcast<u32>(f32(m) * 5.9604644775390625e-8)); }
    if (e == 31u) { return bitcast<f32>(sign | 0x7f800000u | (m << 13u)); }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}"),
    ("f2h_", "fn f2h_(x: f32) -> u32 {
    // The half bits of an f32 that already holds a half value (see f16r_).
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a > 0x7f800000u) { return sign | 0x7e00u; }
    if (a == 0x7f800000u) { return sign | 0x7c00u; }
    let e = a >> 23u;
    if (e >= 113u) { return sign | ((e - 112u) << 10u) | ((a >> 13u) & 0x3ffu); }
    return sign | u32(bitcast<f32>(a) * 16777216.0);
}"),
    ("f2i_", "fn f2i_(x: f32) -> i32 {
    // Rust `as`: saturate, NaN to 0.
    if (isnan_(x)) { return 0; }
    if (x >= 2147483648.0) { return 2147483647; }
    if (x <= -2147483648.0) { return -2147483647 - 1; }
    return i32(x);
}"),
    ("f2u_", "fn f2u_(x: f32) -> u32 {
    if (isnan_(x) || x <= 0.0) { return 0u; }
    if (x >= 4294967296.0) { return 4294967295u; }
    return u32(x);
}"),
];
