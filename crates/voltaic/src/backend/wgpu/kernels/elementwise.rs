//! Fused elementwise kernels: a thread per element, or four vec4s per thread
//! for large contiguous work over 32-bit types and native f16.

use super::{groups, Gen, PER, WG};
use crate::backend::wgpu::codegen::{cast, emit_expr_stored, from_storage, storage_ty, to_storage, Dispatch, Indexer, Src};
use crate::dtype::DType;
use crate::error::Result;
use crate::ir::Expr;
use std::fmt::Write;

impl Gen<'_> {
    /// The outputs of a kernel that stores instructions `stores` of `expr`:
    /// (binding, name, dtype) each, the kernel's own output first.
    fn outputs(&self, expr: &Expr, stores: &[usize]) -> Vec<(Src, String, DType)> {
        stores
            .iter()
            .enumerate()
            .map(|(j, &ins)| match j {
                0 => (Src::Output, "out".to_string(), self.out.0),
                _ => (Src::Also(j - 1), format!("also{}", j - 1), expr.instrs[ins].1),
            })
            .collect()
    }

    /// The instructions of `stores` written only to outputs of their own
    /// dtype, whose rounding a store may do (see `emit_expr_stored`).
    fn stored_as_is(expr: &Expr, stores: &[usize], outs: &[(Src, String, DType)]) -> Vec<usize> {
        stores.iter().copied().filter(|&i| stores.iter().zip(outs).all(|(&s, o)| s != i || o.2 == expr.instrs[i].1)).collect()
    }

    /// Large elementwise kernels whose loads are contiguous (or single
    /// broadcast values) move four elements per thread as a vec4, which
    /// reaches the memory bandwidth where scalar accesses fall short: 32-bit
    /// types, and f16 where the adapter stores it natively (a mixed-precision
    /// step's activations and gradients; a thread per 2-byte element issued
    /// twice the loads of f32's vec4 path for half the bytes). Packed halves
    /// (bf16, f16 elsewhere) keep the scalar path.
    fn elementwise_vec4(&self, expr: &Expr, stores: &[usize]) -> Result<Option<Dispatch>> {
        let n = self.out.1;
        let bytes = |dt: DType| match dt {
            DType::F32 | DType::I32 | DType::U32 => Some(4u64),
            DType::F16 if self.caps.f16 => Some(2),
            _ => None,
        };
        let fits = |numel: usize, dt: DType| bytes(dt).is_some_and(|b| numel as u64 * b <= self.caps.chunk_bytes());
        let outs = self.outputs(expr, stores);
        if !n.is_multiple_of(4) || n < 1 << 16 || !outs.iter().all(|o| fits(n, o.2)) {
            return Ok(None);
        }
        let as_is = Self::stored_as_is(expr, stores, &outs);
        enum Src4 {
            Vec(usize),
            Scalar(usize),
        }
        let mut kinds = Vec::with_capacity(expr.loads.len());
        for l in &expr.loads {
            let (dt, numel) = self.inputs[l.input];
            if !fits(numel, dt) || l.path.len() != 1 {
                return Ok(None);
            }
            let p = &l.path[0];
            kinds.push(if p.is_contiguous() && p.offset() % 4 == 0 {
                Src4::Vec(p.offset() / 4)
            } else if p.strides().iter().all(|&s| s == 0) {
                Src4::Scalar(p.offset())
            } else {
                return Ok(None);
            });
        }
        // Large kernels give each thread four vec4s a workgroup apart, all
        // loaded (at clamped indices) before any is used: more bytes in
        // flight per thread, a quarter of the workgroups.
        let n4 = n / 4;
        let per = if n4 >= 16 * 1024 { 4 } else { 1 };
        let mut sh = self.shader();
        let mut b = format!("    let i0 = group * {}u + lid;\n    if (i0 >= {n4}u) {{ return; }}\n", WG as usize * per);
        let mut values = vec![];
        for (li, (l, k)) in expr.loads.iter().zip(&kinds).enumerate() {
            let ty = storage_ty(self.caps, self.inputs[l.input].0);
            match k {
                Src4::Vec(off) => {
                    sh.bind_raw(Src::Input(l.input), &format!("vl{li}"), &format!("array<vec4<{ty}>>"), false);
                    for u in 0..per {
                        let _ = writeln!(b, "    let x{li}_{u} = vl{li}[min(i0 + {}u, {}u) + {off}u];", u * WG as usize, n4 - 1);
                    }
                }
                Src4::Scalar(off) => {
                    sh.bind_raw(Src::Input(l.input), &format!("sl{li}"), &format!("array<{ty}>"), false);
                    let _ = writeln!(b, "    let x{li} = {};", from_storage(self.caps, self.inputs[l.input].0, &format!("sl{li}[{off}u]")));
                }
            }
            values.push(li);
        }
        for (src, name, dt) in &outs {
            sh.bind_raw(*src, &format!("{name}v"), &format!("array<vec4<{}>>", storage_ty(self.caps, *dt)), true);
        }
        for u in 0..per {
            let _ = writeln!(b, "    {{\n    let i = i0 + {}u;\n    if (i < {n4}u) {{", u * WG as usize);
            for (j, (_, _, dt)) in outs.iter().enumerate() {
                let _ = writeln!(b, "    var r{j}: vec4<{}>;", storage_ty(self.caps, *dt));
            }
            for lane in 0..4 {
                let overrides: Vec<(usize, String)> = values
                    .iter()
                    .map(|&li| {
                        let dt = self.inputs[expr.loads[li].input].0;
                        (li, if matches!(kinds[li], Src4::Vec(_)) { from_storage(self.caps, dt, &format!("x{li}_{u}[{lane}]")) } else { format!("x{li}") })
                    })
                    .collect();
                let _ = writeln!(b, "    {{");
                let mut ix = Indexer::new(&[n], "i");
                emit_expr_stored(&mut b, &mut sh, &mut ix, expr, &overrides, &as_is)?;
                for (j, &ins) in stores.iter().enumerate() {
                    let _ = writeln!(b, "    r{j}[{lane}] = {};", to_storage(self.caps, outs[j].2, &cast(expr.instrs[ins].1, outs[j].2, &format!("v{ins}"))));
                }
                let _ = writeln!(b, "    }}");
            }
            for (j, (_, name, _)) in outs.iter().enumerate() {
                let _ = writeln!(b, "    {name}v[i] = r{j};");
            }
            let _ = writeln!(b, "    }}\n    }}");
        }
        let label = if outs.len() > 1 { format!("elementwise_vec4 [{n}] x{}", outs.len()) } else { format!("elementwise_vec4 [{n}]") };
        Ok(Some(sh.finish(label, WG, groups(n4, WG * per as u32), &b)))
    }

    /// `out[i] = expr(i)` over `shape`; with several `stores`, output `j`
    /// gets instruction `stores[j]` (see `KernelKind::Multi`).
    pub(crate) fn elementwise(&self, expr: &Expr, shape: &[usize], stores: &[usize]) -> Result<Dispatch> {
        if let Some(d) = self.elementwise_vec4(expr, stores)? {
            return Ok(d);
        }
        let mut sh = self.shader();
        let used: Vec<usize> = (0..self.inputs.len()).collect();
        self.bind_inputs(&mut sh, &used);
        let outs = self.outputs(expr, stores);
        let as_is = Self::stored_as_is(expr, stores, &outs);
        for (src, name, dt) in &outs {
            sh.array(*src, name, *dt, self.out.1, true);
        }
        let n = self.out.1;
        // Each thread takes PER elements, WG apart: loads stay coalesced and
        // more of them are in flight.
        // Small tensors take one element per thread: their latency is the
        // chain of ops, not memory.
        let per = if n >= 1 << 20 { PER } else { 1 };
        let mut b = String::new();
        for k in 0..per {
            let _ = writeln!(b, "    {{\n    let i = group * {}u + {}u + lid;\n    if (i < {n}u) {{", WG * per, WG * k);
            let mut ix = Indexer::new(shape, "i");
            emit_expr_stored(&mut b, &mut sh, &mut ix, expr, &[], &as_is)?;
            for (&ins, (_, name, dt)) in stores.iter().zip(&outs) {
                let _ = writeln!(b, "    st_{name}(i, {});", cast(expr.instrs[ins].1, *dt, &format!("v{ins}")));
            }
            let _ = writeln!(b, "    }}\n    }}");
        }
        let label = if stores.len() > 1 { format!("elementwise {shape:?} x{}", stores.len()) } else { format!("elementwise {shape:?}") };
        Ok(sh.finish(label, WG, groups(n, WG * per), &b))
    }
}
