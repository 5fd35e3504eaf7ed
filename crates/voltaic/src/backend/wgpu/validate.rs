//! Every kernel family's generated WGSL, checked by naga's parser and
//! validator without a GPU: a broken template fails `cargo test` on any
//! machine, not only on the driver that happens to compile it.
//!
//! Kernels come from the scheduler (real plans of real graphs, on a spread
//! of shapes and dtypes), rendered for two adapter profiles: one like
//! lavapipe (no f16, small bindings, no tensor cores) and one like the H100
//! (f16, cooperative matrices, 48 KiB of workgroup memory). Matmuls are
//! rendered in every variant the autotuner may pick.

use super::context::Caps;
use super::kernels::program;
use super::matmul::{Tile, Variant, TILES};
use crate::backend::Capabilities;
use crate::ir::{Kernel, KernelKind};
use crate::{DType, Device, Tensor};

fn lavapipe() -> Caps {
    Caps {
        f16: false,
        half_store: false,
        half_math: false,
        timestamps: false,
        max_binding: 128 << 20,
        max_buffer: 1 << 31,
        max_storage_buffers: 8,
        offset_align: 16,
        max_groups: 65535,
        workgroup_storage: 32 << 10,
        max_invocations: 1024,
        coop_f16: false,
        software: true,
        subgroup: Some(8),
    }
}

fn h100() -> Caps {
    Caps {
        f16: true,
        half_store: true,
        half_math: true,
        timestamps: true,
        max_binding: (2 << 30) - 4,
        max_buffer: 4 << 30,
        max_storage_buffers: 16,
        offset_align: 16,
        max_groups: 65535,
        workgroup_storage: 48 << 10,
        max_invocations: 1024,
        coop_f16: true,
        software: false,
        subgroup: Some(32),
    }
}

/// Parse and validate one WGSL module; the error names the kernel.
fn validate(label: &str, source: &str, caps: &Caps) {
    use naga::valid::{Capabilities as C, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(source).unwrap_or_else(|e| panic!("{label}: WGSL does not parse: {}\n{source}", e.emit_to_string(source)));
    let mut allowed = C::empty();
    if caps.f16 {
        allowed |= C::SHADER_FLOAT16;
    }
    if caps.coop_f16 {
        allowed |= C::COOPERATIVE_MATRIX;
    }
    if caps.subgroup.is_some() {
        allowed |= C::SUBGROUP;
    }
    Validator::new(ValidationFlags::all(), allowed)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{label}: WGSL does not validate: {}\n{source}", e.emit_to_string(source)));
}

/// The kernels of the plan that would realize `t` on a GPU.
fn kernels(t: &Tensor) -> Vec<(Kernel, Vec<(DType, usize)>)> {
    let s = crate::schedule::schedule(&[&t.value], Capabilities { row_kernels: true, strided_reads: false, dense_wide_qmatmul: true, multi_output: true, max_inputs: lavapipe().max_inputs(), prologue_rows: super::quant::GEMV_ROWS, index_epilogues: false });
    s.plan
        .kernels
        .iter()
        .map(|k| (k.clone(), k.inputs.iter().map(|&i| (s.plan.slots[i].dtype, s.plan.slots[i].numel)).collect()))
        .collect()
}

/// Render and validate every kernel of `t`'s plan; matmuls in every variant
/// that applies. Returns how many modules were checked and the kernel kinds.
fn check(t: &Tensor, caps: &Caps, seen: &mut Vec<&'static str>) -> usize {
    let mut n = 0;
    for (k, inputs) in kernels(t) {
        seen.push(k.kind.name());
        if matches!(k.kind, KernelKind::Matmul { prologue: Some(_), .. }) {
            seen.push("gemv with a prologue");
        }
        let mut variants = vec![None];
        if let KernelKind::Matmul { m, k: kk, quant: None, .. } = &k.kind {
            variants.extend(TILES.iter().map(|&t| Some(Variant::Tiled(t))));
            variants.push(Some(Variant::SplitK { tile: TILES[6], splits: 3 }));
            variants.push(Some(Variant::SplitK { tile: Tile::warps(64, 64, 16, 4, 4), splits: 2 }));
            if *m <= 4 {
                variants.push(Some(Variant::Columns { splits: 1 }));
                variants.push(Some(Variant::Columns { splits: (*kk / 64).max(2) }));
            }
            if matches!(k.dtype, DType::F16 | DType::BF16) && caps.coop_f16 {
                variants.push(Some(Variant::Coop));
                variants.push(Some(Variant::CoopWide));
                variants.push(Some(Variant::CoopSplitK { splits: 3 }));
                variants.extend(super::matmul::COOP_TILES.iter().map(|&t| Some(Variant::CoopTiles(t))));
            }
        }
        for v in variants {
            if let Some(Variant::Tiled(t) | Variant::SplitK { tile: t, .. }) = v {
                if t.shared_bytes() > caps.workgroup_storage as usize {
                    continue;
                }
            }
            let p = program(caps, &k, &inputs, v).unwrap_or_else(|e| panic!("{} {v:?}: {e}", k.kind.name()));
            for d in &p.dispatches {
                if d.label.starts_with("attention") && d.label.contains("splits") {
                    seen.push("attention with split keys");
                }
                validate(&format!("{} ({:?}) {}", d.label, v, k.ops.join(" ")), &d.source, caps);
                n += 1;
            }
        }
    }
    n
}

/// A realized input of `dt` (so kernels load that storage type).
fn randn(dims: &[usize], dt: DType) -> Tensor {
    let t = Tensor::randn(dims, DType::F32, Device::Cpu).unwrap().to_dtype(dt).unwrap();
    t.realize().unwrap();
    t
}

fn ints(dims: &[usize], hi: f64, dt: DType) -> Tensor {
    let t = Tensor::rand(dims, DType::F32, Device::Cpu).unwrap().mul(hi).unwrap().floor().unwrap().to_dtype(dt).unwrap();
    t.realize().unwrap();
    t
}

/// Graphs covering every kernel family for one float dtype.
fn graphs(dt: DType) -> Vec<Tensor> {
    let mut out = vec![];
    let x = randn(&[6, 37], dt);
    let big = randn(&[1 << 17], dt);
    // Elementwise: every unary and binary primitive, comparisons, where, casts, broadcasting, views.
    for &u in crate::primitive::UnaryOp::ALL {
        if u != crate::primitive::UnaryOp::Not {
            out.push(x.unary(u).unwrap());
        }
    }
    for &b in crate::primitive::BinaryOp::ALL {
        if !matches!(b, crate::primitive::BinaryOp::And | crate::primitive::BinaryOp::Or) {
            out.push(x.binary(b, x.t().unwrap().t().unwrap()).unwrap());
        }
    }
    out.push(x.gt(0.5).unwrap().logical_and(x.lt(1.0).unwrap()).unwrap().where_cond(&x, 2.0).unwrap());
    out.push(x.t().unwrap().mul(randn(&[37, 1], dt)).unwrap().to_dtype(DType::I32).unwrap());
    out.push(big.mul(2.0).unwrap().add(&big).unwrap());
    out.push(big.sqrt().unwrap().sub(1.0).unwrap().relu().unwrap());
    // Reductions: short and long rows, strided, arg, split over workgroups.
    out.push(x.sum(&[1], false).unwrap());
    out.push(x.max(&[0], false).unwrap());
    out.push(x.argmax(Some(1), false).unwrap());
    out.push(x.argmin(None, false).unwrap());
    out.push(big.sum_all().unwrap());
    out.push(big.exp().unwrap().prod(&[0], true).unwrap());
    out.push(randn(&[3, 40000], dt).min(&[1], false).unwrap());
    out.push(ints(&[5, 9], 7.0, DType::I32).sum(&[0], false).unwrap());
    out.push(x.gt(0.0).unwrap().argmax(Some(0), false).unwrap());
    // Rows: softmax, log_softmax, layer norm; threaded (short) and workgroup rows.
    out.push(x.softmax(-1).unwrap());
    out.push(randn(&[4, 3000], dt).log_softmax(-1).unwrap());
    out.push(randn(&[64, 20], dt).softmax(1).unwrap());
    out.push(randn(&[8, 384], dt).layer_norm(&[384], Some(&randn(&[384], dt)), Some(&randn(&[384], dt)), 1e-5).unwrap());
    // Index-like kernels.
    let idx = ints(&[6, 5], 37.0, DType::I32);
    out.push(x.gather(1, &idx).unwrap());
    out.push(x.index_select(0, &ints(&[4], 6.0, DType::U32)).unwrap());
    out.push(x.zeros_like().unwrap().scatter_add(1, &idx, &randn(&[6, 5], dt)).unwrap());
    out.push(x.cumsum(1).unwrap());
    out.push(randn(&[3, 5000], dt).cumsum(1).unwrap());
    out.push(ints(&[700, 2], 9.0, DType::I32).cumsum(0).unwrap());
    let long_idx = ints(&[1, 300], 37.0, DType::U32);
    out.push(x.narrow(0, 0, 1).unwrap().scatter_add(1, &long_idx, &randn(&[1, 300], dt)).unwrap());
    out.push(ints(&[1, 37], 5.0, DType::I32).scatter_add(1, &long_idx, &ints(&[1, 300], 5.0, DType::I32)).unwrap());
    out.push(Tensor::from_vec(Vec::<f32>::new(), &[4, 0], Device::Cpu).unwrap().to_dtype(dt).unwrap().sum(&[1], false).unwrap());
    out.push(Tensor::cat(&[&x, &x.mul(2.0).unwrap()], 0).unwrap());
    let img = randn(&[2, 3, 9, 9], dt);
    out.push(img.conv2d(&randn(&[4, 3, 3, 3], dt), Some(&randn(&[4], dt)), crate::Conv2dOpts { padding: [1, 1], stride: [2, 2], ..Default::default() }).unwrap());
    out.push(img.max_pool2d([3, 3], Some([2, 2]), [1, 1]).unwrap());
    // Matmul: plain, transposed, batched, few rows, with epilogues (bias, GELU).
    let (a, b) = (randn(&[128, 64], dt), randn(&[64, 128], dt));
    out.push(a.matmul(&b).unwrap());
    out.push(a.t().unwrap().matmul(&a).unwrap().add(1.0).unwrap().gelu().unwrap());
    out.push(randn(&[3, 33, 17], dt).matmul(&randn(&[3, 17, 20], dt)).unwrap());
    out.push(randn(&[2, 300], dt).matmul(&randn(&[300, 516], dt)).unwrap().add(randn(&[516], dt)).unwrap().relu().unwrap());
    out.push(randn(&[256, 256], dt).matmul(&randn(&[256, 128], dt)).unwrap());
    // Whole tiles of transposed operands (x @ W^T, and x^T @ g of a weight gradient).
    out.push(randn(&[256, 64], dt).matmul(&randn(&[128, 64], dt).t().unwrap()).unwrap());
    out.push(randn(&[64, 256], dt).t().unwrap().matmul(&randn(&[64, 128], dt)).unwrap());
    // Quantized: GEMV (one and three rows, with an epilogue), tiles, the row gather.
    use crate::quant::GgmlType;
    for q in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
        let (per, bytes) = q.block();
        let blocks: Vec<u8> = (0..40 * (512 / per) * bytes).map(|i| (i * 7 % 251) as u8).collect();
        let w = crate::QTensor::from_blocks(&blocks, q, &[40, 512], Device::Cpu).unwrap();
        for m in [1, 3, 20] {
            out.push(randn(&[m, 512], dt).matmul(&w.t()).unwrap().add(randn(&[40], DType::F32)).unwrap().silu().unwrap());
        }
        // GEMVs with prologues: an RMS norm (a sum), a softmax (a max and a sum), SwiGLU.
        for m in [1, 3] {
            let x = randn(&[m, 512], dt);
            // Each product gets a norm of its own (a shared one would be kept, not fused).
            let rms = || x.mul(x.sqr().unwrap().mean(&[-1], true).unwrap().add(1e-5).unwrap().rsqrt().unwrap()).unwrap().mul(randn(&[512], dt)).unwrap();
            // With the residual the norm stays apart under lavapipe's binding limit; without it, a prologue.
            out.push(rms().matmul(&w.t()).unwrap().add(randn(&[m, 40], DType::F32)).unwrap());
            out.push(rms().matmul(&w.t()).unwrap().mul(0.5).unwrap());
            out.push(x.softmax(-1).unwrap().matmul(&w.t()).unwrap());
            let gu = randn(&[m, 1024], dt);
            out.push(gu.narrow(1, 0, 512).unwrap().silu().unwrap().mul(gu.narrow(1, 512, 512).unwrap()).unwrap().matmul(&w.t()).unwrap());
        }
        out.push(w.embedding(&ints(&[5], 40.0, DType::I32)).unwrap());
    }
    // Attention: a decode step's few rows (their keys split over workgroups
    // on a hardware adapter) and a prompt's many.
    for (g, n, d) in [(3, 100, 64), (128, 128, 32)] {
        let mask = randn(&[g, n], dt);
        out.push(randn(&[3, g, d], dt).scaled_dot_product_attention(&randn(&[3, n, d], dt), &randn(&[3, n, d], dt), Some(&mask), None).unwrap());
    }
    out
}

#[test]
fn every_kernel_family_generates_valid_wgsl() {
    let mut seen = vec![];
    let mut modules = 0;
    // f16 on an adapter without SHADER_F16 is held in 32-bit words: its
    // kernels must not need the f16 capability.
    // Folds with and without subgroup shuffles (8 and 32 lanes; none).
    let all = || vec![DType::F32, DType::F16, DType::BF16];
    // And f16 by the device's own arithmetic (`half_math`) or rounded on its bits.
    for (caps, dtypes) in [(lavapipe(), all()), (h100(), all()), (Caps { subgroup: None, half_math: false, half_store: false, ..h100() }, all())] {
        for dt in dtypes {
            for t in graphs(dt) {
                modules += check(&t, &caps, &mut seen);
            }
        }
    }
    // f32: both adapter profiles, five types, two row counts, three prologues
    // (a norm with a constant in the epilogue, a softmax, SwiGLU).
    let prologues = seen.iter().filter(|k| **k == "gemv with a prologue").count();
    assert!(prologues >= 2 * 5 * 2 * 3, "only {prologues} GEMVs with a prologue were generated");
    seen.sort_unstable();
    seen.dedup();
    for kind in ["elementwise", "reduce", "rows", "matmul", "gather", "index_select", "scatter_add", "cumsum", "cat", "unfold", "dequantize", "gemv with a prologue", "attention", "attention with split keys"] {
        assert!(seen.contains(&kind), "no {kind} kernel was generated: {seen:?}");
    }
    assert!(modules > 200, "only {modules} WGSL modules were checked");
}

#[test]
fn the_backward_pass_generates_valid_wgsl() {
    // fold (col2im) and the gradient kernels appear only in backward passes.
    for dt in [DType::F32, DType::F16] {
        let img = randn(&[2, 3, 8, 8], dt).requires_grad().unwrap();
        let w = randn(&[4, 3, 3, 3], dt).requires_grad().unwrap();
        let y = img.conv2d(&w, None, crate::Conv2dOpts { padding: [1, 1], ..Default::default() }).unwrap();
        let loss = y.max_pool2d([2, 2], None, [0, 0]).unwrap().softmax(1).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
        let mut seen = vec![];
        for g in [img.grad().unwrap(), w.grad().unwrap()] {
            assert!(check(&g, &h100(), &mut seen) > 0);
        }
        assert!(seen.contains(&"fold"), "{seen:?}");
    }
}

#[test]
fn a_broken_template_is_caught() {
    let caps = lavapipe();
    let bad = "@compute @workgroup_size(64) fn main() { let x: f32 = 1u; }";
    assert!(std::panic::catch_unwind(|| validate("bad", bad, &caps)).is_err());
}

/// The one elementwise kernel of `t`, rendered for `caps`: its `main`.
fn elementwise_main(t: &Tensor, caps: &Caps) -> String {
    let ks = kernels(t);
    assert_eq!(ks.len(), 1, "one kernel expected: {:?}", ks.iter().map(|(k, _)| k.ops.join(" ")).collect::<Vec<_>>());
    let (k, inputs) = &ks[0];
    let p = program(caps, k, inputs, None).unwrap();
    let src = &p.dispatches[0].source;
    src[src.find("fn main").expect("a main")..].to_string()
}

#[test]
fn half_results_round_once_each_by_the_device_or_on_the_bits() {
    let (a, b, c) = (randn(&[300], DType::F16), randn(&[300], DType::F16), randn(&[300], DType::F16));
    // A product an addition reads, the sum, a maximum (exact) and the store
    // (three inputs: the most `kernels` fuses).
    let chain = a.mul(&b).unwrap().add(&c).unwrap().maximum(&a).unwrap();
    let rounds = |s: &str| s.matches("f16r_(").count();
    let native = elementwise_main(&chain, &h100());
    // Under half_math only the product rounds on its bits (a compiler may
    // contract a product an addition reads into one fused multiply-add);
    // the sum is the device's f16 addition; the maximum needs no rounding.
    assert_eq!(rounds(&native), 1, "{native}");
    assert!(native.contains("f16r_((v0 * v1))") && native.contains("f32((f16(v2) + f16(v3)))"), "{native}");
    let software = elementwise_main(&chain, &Caps { half_math: false, ..h100() });
    assert_eq!(rounds(&software), 2, "the product and the sum, not the maximum nor the store: {software}");
    // A product nothing adds to is the device's own; so is a sum.
    let alone = elementwise_main(&a.mul(&b).unwrap().mul(&c).unwrap(), &h100());
    assert_eq!(rounds(&alone), 0, "{alone}");
    // An f32 result cast to f16 and only stored is rounded by the store.
    let x = randn(&[300], DType::F32);
    let stored = elementwise_main(&x.exp().unwrap().to_dtype(DType::F16).unwrap(), &h100());
    assert_eq!(rounds(&stored), 0, "{stored}");
    let kept = elementwise_main(&x.exp().unwrap().to_dtype(DType::F16).unwrap().exp().unwrap(), &h100());
    assert_eq!(rounds(&kept), 1, "a cast another op reads is rounded on its bits, the exp of it by the store: {kept}");
}
