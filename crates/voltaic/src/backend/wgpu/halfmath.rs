//! Whether a device's own f16 arithmetic may stand in for the software
//! rounding of half-precision results (`Caps::half_math`).
//!
//! The generated kernels compute in f32 and round each half-precision
//! result to f16 with integer operations (`f16r_`), because some compilers
//! drop an f32 -> f16 -> f32 round trip as a no-op. That costs about a
//! dozen instructions per op, so a fused f16 chain ran at about half the
//! speed of its f32 twin on an H200. Vulkan and WGSL leave the rounding mode
//! of f16 arithmetic and conversions to the implementation, and some GPUs
//! flush subnormals; where a device rounds to nearest even, keeps
//! subnormals and overflows to infinity, its `f16` additions, subtractions
//! and multiplications give the very bits the CPU gives (each rounds once),
//! and so does the conversion when a result is stored to an f16 buffer.
//! This module checks exactly that once per device, with the forms the code
//! generator emits, on edge cases (ties, subnormals, overflow, the largest
//! finite half) and on a spread of ordinary values; any difference keeps
//! the software rounding. `VOLTAIC_HALF_MATH=0` keeps it too (to measure).

// A browser does not run the probe (it answers only through promises).
#[cfg(not(target_arch = "wasm32"))]
use half::f16;

/// The probe's kernel: per case `(a, b)`, the forms `codegen` emits for a
/// native sum, a difference that depends on the sum having been rounded,
/// a product, and stores of f32 values (scalar and through a vec4).
#[cfg(not(target_arch = "wasm32"))]
const PROBE: &str = "enable f16;
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> h: array<f16>;
@group(0) @binding(2) var<storage, read_write> h4: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> xh: array<f16>;
@group(0) @binding(4) var<storage, read_write> ht: array<f16>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&x) / 2u) { return; }
    let a = x[2u * i];
    let b = x[2u * i + 1u];
    let s: f32 = f32(f16(a) + f16(b));
    let d: f32 = f32(f16(s) - f16(a));
    let p: f32 = f32(f16(a) * f16(b));
    h[4u * i] = f16(s);
    h[4u * i + 1u] = f16(d);
    h[4u * i + 2u] = f16(p);
    h[4u * i + 3u] = f16(a * b);
    var r: vec4<f16>;
    r[0] = f16(a);
    r[1] = f16(a + b);
    r[2] = f16(a - b);
    r[3] = f16(b);
    h4[i] = r;
    // The same sum, difference and product on f16 values throughout (for
    // the report only: the kernels' values are f32s holding halves).
    let ah = xh[2u * i];
    let bh = xh[2u * i + 1u];
    let sh = ah + bh;
    ht[3u * i] = sh;
    ht[3u * i + 1u] = sh - ah;
    ht[3u * i + 2u] = ah * bh;
}
";

/// The cases: edge values, then pairs spread over the exponent range.
#[cfg(not(target_arch = "wasm32"))]
fn cases() -> Vec<(f32, f32)> {
    let p = |e: i32| 2f32.powi(e);
    let mut c = vec![
        // Ties to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
        (1.0, p(-11)),
        (1.0 + p(-10), p(-11)),
        (1.0, p(-11) + p(-20)),
        (1.0 + p(-10), 1.0 + p(-10)),
        (-1.5, p(-12)),
        // Subnormals: 2^-25 is halfway between 0 and the smallest one.
        (p(-12), p(-12)),
        (p(-13), p(-12)),
        (3.0 * p(-13), p(-13)),
        (p(-24), p(-25)),
        (3.0 * p(-25), p(-14)),
        (-p(-20), p(-8)),
        (6.0e-5, -6.1e-5),
        // Overflow: 65520 is halfway between 65504 and 65536 (infinity).
        (65504.0, 2.0),
        (65504.0, 16.0),
        (65519.0, 1.0),
        (65520.0, 1.0),
        (-70000.0, 1.0),
        (1.0e6, -1.0e6),
        (f32::INFINITY, 1.0),
    ];
    // Ordinary values of every magnitude a half holds, from a fixed sequence.
    let mut s = 0x2545_f491u32;
    for _ in 0..192 {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        let v = |bits: u32| {
            let m = (bits & 0xffff) as f32 / 65536.0 + 1.0;
            let e = ((bits >> 16) % 40) as i32 - 26;
            let sign = if bits & (1 << 30) != 0 { -1.0 } else { 1.0 };
            sign * m * p(e)
        };
        c.push((v(s), v(s.rotate_left(11))));
    }
    c
}

/// What the probe must give for each case, in the kernel's order: the bits
/// of `[s, d, p, round(a*b)]` and of the vec4 `[a, a+b, a-b, b]`, each
/// rounded once to nearest even, as the CPU computes them.
#[cfg(not(target_arch = "wasm32"))]
fn expected(cases: &[(f32, f32)]) -> (Vec<u16>, Vec<u16>) {
    let r = |v: f32| f16::from_f32(v);
    let (mut h, mut h4) = (vec![], vec![]);
    for &(a, b) in cases {
        let (ha, hb) = (r(a).to_f32(), r(b).to_f32());
        let s = r(ha + hb);
        let d = r(s.to_f32() - ha);
        let p = r(ha * hb);
        h.extend([s, d, p, r(a * b)].map(f16::to_bits));
        h4.extend([r(a), r(a + b), r(a - b), r(b)].map(f16::to_bits));
    }
    (h, h4)
}

/// What the probe found: whether the device's f16 stores round as the CPU
/// does (`Caps::half_store`), and whether its f16 additions, subtractions
/// and multiplications on halves held in f32 values do (`Caps::half_math`);
/// each `Err` says why not.
pub(crate) struct HalfProbe {
    pub stores: std::result::Result<(), String>,
    pub math: std::result::Result<(), String>,
}

impl HalfProbe {
    /// Both refused, for the same reason.
    pub(crate) fn refused(why: &str) -> HalfProbe {
        HalfProbe { stores: Err(why.to_string()), math: Err(why.to_string()) }
    }
}

/// Run the probe on a device with SHADER_F16.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn probe(device: &wgpu::Device, queue: &wgpu::Queue) -> HalfProbe {
    if std::env::var("VOLTAIC_HALF_MATH").is_ok_and(|v| v == "0") {
        return HalfProbe::refused("VOLTAIC_HALF_MATH=0");
    }
    let cases = cases();
    match run(device, queue, &cases) {
        Err(why) => HalfProbe::refused(&why),
        Ok(got) => {
            let n = cases.len();
            let (forms, typed) = got.split_at(8 * n);
            let (h, h4) = forms.split_at(4 * n);
            HalfProbe {
                stores: compare_stores(&cases, h, h4),
                math: compare_math(&cases, h).map_err(|why| match compare_typed(&cases, &typed[..3 * n]) {
                    Ok(()) => format!("{why}; on f16 values throughout it rounds as the CPU does"),
                    Err(e) => format!("{why}; on f16 values throughout too: {e}"),
                }),
            }
        }
    }
}

/// The probe kernel's results: `h`, `h4`, then `ht`, as f16 bits.
#[cfg(not(target_arch = "wasm32"))]
fn run(device: &wgpu::Device, queue: &wgpu::Queue, cases: &[(f32, f32)]) -> std::result::Result<Vec<u16>, String> {
    use wgpu::util::DeviceExt;
    let n = cases.len();
    let input: Vec<f32> = cases.iter().flat_map(|&(a, b)| [a, b]).collect();
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor { label: Some("voltaic half probe"), source: wgpu::ShaderSource::Wgsl(PROBE.into()) });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("voltaic half probe"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let storage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
    let x = device.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::cast_slice(&input), usage: wgpu::BufferUsages::STORAGE });
    let halves: Vec<u16> = input.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let xh = device.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents: bytemuck::cast_slice(&halves), usage: wgpu::BufferUsages::STORAGE });
    let out = |bytes: u64| device.create_buffer(&wgpu::BufferDescriptor { label: None, size: bytes, usage: storage, mapped_at_creation: false });
    // ht's 6 bytes a case, rounded up to whole words.
    let ht_bytes = (6 * n as u64).div_ceil(4) * 4;
    let (h, h4, ht) = (out(8 * n as u64), out(8 * n as u64), out(ht_bytes));
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 16 * n as u64 + ht_bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry { binding: 0, resource: x.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 1, resource: h.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 2, resource: h4.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 3, resource: xh.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 4, resource: ht.as_entire_binding() },
        ],
    });
    let mut enc = device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind, &[]);
        pass.dispatch_workgroups(n.div_ceil(64) as u32, 1, 1);
    }
    enc.copy_buffer_to_buffer(&h, 0, &staging, 0, 8 * n as u64);
    enc.copy_buffer_to_buffer(&h4, 0, &staging, 8 * n as u64, 8 * n as u64);
    enc.copy_buffer_to_buffer(&ht, 0, &staging, 16 * n as u64, ht_bytes);
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(format!("the probe kernel was refused: {e}"));
    }
    queue.submit([enc.finish()]);
    let (tx, rx) = std::sync::mpsc::channel();
    staging.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = tx.send(r);
    });
    device.poll(wgpu::PollType::Wait { submission_index: None, timeout: None }).map_err(|e| format!("the probe did not finish: {e}"))?;
    rx.recv().map_err(|e| e.to_string())?.map_err(|e| format!("the probe's results could not be read: {e}"))?;
    let got: Vec<u16> = {
        let view = staging.get_mapped_range(..).map_err(|e| format!("the probe's results could not be mapped: {e:?}"))?;
        view.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
    };
    staging.unmap();
    if got.len() < 11 * n {
        return Err(format!("the probe gave {} results, not {}", got.len(), 11 * n));
    }
    Ok(got)
}

/// Equal bits, or both NaN (NaN's payload is the hardware's choice: inf - inf).
#[cfg(not(target_arch = "wasm32"))]
fn same(w: u16, g: u16) -> bool {
    let nan = |b: u16| b & 0x7fff > 0x7c00;
    w == g || (nan(w) && nan(g))
}

/// The first of `forms` (name, expected bits, got bits) per case that differs.
#[cfg(not(target_arch = "wasm32"))]
fn first_difference(cases: &[(f32, f32)], forms: &[(&str, Vec<u16>, &[u16])]) -> std::result::Result<(), String> {
    for (c, &(a, b)) in cases.iter().enumerate() {
        for (name, want, got) in forms {
            let per = want.len() / cases.len();
            for j in 0..per {
                let (w, g) = (want[per * c + j], got[per * c + j]);
                if !same(w, g) {
                    let name = name.split('|').nth(j).unwrap_or(name);
                    return Err(format!("{name} with a = {a:e}, b = {b:e} gave f16 bits {g:#06x}, not {w:#06x}"));
                }
            }
        }
    }
    Ok(())
}

/// `Ok` when the stores of f32 values (`h`'s fourth of each case, all of
/// `h4`) have the expected bits.
#[cfg(not(target_arch = "wasm32"))]
fn compare_stores(cases: &[(f32, f32)], h: &[u16], h4: &[u16]) -> std::result::Result<(), String> {
    let (wh, wh4) = expected(cases);
    let pick = |v: &[u16]| v.chunks(4).map(|c| c[3]).collect::<Vec<u16>>();
    let (want_ab, got_ab) = (pick(&wh), pick(h));
    first_difference(cases, &[("a * b stored", want_ab, &got_ab), ("a stored in a vec4|a + b stored in a vec4|a - b stored in a vec4|b stored in a vec4", wh4, h4)])
}

/// The sum, difference and product of each case: the first three of each
/// four in `h`'s order.
#[cfg(not(target_arch = "wasm32"))]
fn arithmetic(h: &[u16]) -> Vec<u16> {
    h.chunks(4).flat_map(|c| c[..3].to_vec()).collect()
}

/// `Ok` when the arithmetic forms (`h`'s first three of each case) have the
/// expected bits.
#[cfg(not(target_arch = "wasm32"))]
fn compare_math(cases: &[(f32, f32)], h: &[u16]) -> std::result::Result<(), String> {
    first_difference(cases, &[("f16(a) + f16(b)|f16(sum) - f16(a)|f16(a) * f16(b)", arithmetic(&expected(cases).0), &arithmetic(h))])
}

/// `Ok` when the sums, differences and products on f16 values throughout
/// (`ht`, three a case) have the expected bits.
#[cfg(not(target_arch = "wasm32"))]
fn compare_typed(cases: &[(f32, f32)], got: &[u16]) -> std::result::Result<(), String> {
    first_difference(cases, &[("a + b|(a + b) - a|a * b", arithmetic(&expected(cases).0), got)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expected_bits_round_once_to_nearest_even() {
        let cases = cases();
        let (h, h4) = expected(&cases);
        let at = |i: usize, j: usize| f16::from_bits(h[4 * i + j]).to_f64();
        // 1 + 2^-11 ties to 1; 1 + 3 * 2^-11 ties up to 1 + 2^-9.
        assert_eq!(at(0, 0), 1.0);
        assert_eq!(at(1, 0), 1.0 + 2f64.powi(-9));
        // The sum rounded first: (1 + 2^-11 + 2^-20) - 1 is 2^-10, not b.
        assert_eq!(at(2, 1), 2f64.powi(-10));
        // 2^-25, half the smallest subnormal, ties to 0; 3 * 2^-26 rounds
        // up to 2^-24.
        assert_eq!(at(6, 2), 0.0);
        assert_eq!(at(7, 2), 2f64.powi(-24));
        // 65504 * 2 overflows; 65519 stays finite, 65520 does not.
        assert!(at(12, 2).is_infinite());
        assert_eq!(f16::from_bits(h4[4 * 14]).to_f64(), 65504.0);
        assert!(f16::from_bits(h4[4 * 15]).to_f64().is_infinite());
    }

    #[test]
    fn each_check_names_the_first_difference_in_its_own_forms() {
        let cases = cases();
        let (h, h4) = expected(&cases);
        assert_eq!(compare_stores(&cases, &h, &h4), Ok(()));
        assert_eq!(compare_math(&cases, &h), Ok(()));
        // A product off by one ulp fails the arithmetic, not the stores.
        let mut bad = h.clone();
        bad[4 * 6 + 2] = 0x0001;
        assert_eq!(compare_stores(&cases, &bad, &h4), Ok(()));
        let e = compare_math(&cases, &bad).unwrap_err();
        assert!(e.contains("f16(a) * f16(b)") && e.contains("0x0001"), "{e}");
        // A vec4 store clamped to 65504 fails the stores, not the arithmetic.
        let mut bad4 = h4.clone();
        bad4[4 * 15] = 0x7bff;
        assert_eq!(compare_math(&cases, &h), Ok(()));
        let e = compare_stores(&cases, &h, &bad4).unwrap_err();
        assert!(e.contains("a stored in a vec4") && e.contains("6.552e4"), "{e}");
        // NaN payloads may differ.
        let mut nan = h.clone();
        let k = nan.iter().position(|&b| b & 0x7fff > 0x7c00).expect("inf - inf is a NaN");
        nan[k] ^= 0x0100;
        assert_eq!(compare_math(&cases, &nan), Ok(()));
        // The f16-throughout forms: three a case, the first three of `h`'s.
        let mut typed = arithmetic(&h);
        assert_eq!(compare_typed(&cases, &typed), Ok(()));
        typed[3 * 2 + 1] = 0x1000;
        assert!(compare_typed(&cases, &typed).unwrap_err().contains("(a + b) - a"));
    }
}
