//! The index-like kernels: gather, index_select, scatter_add, cumsum, cat,
//! unfold and fold. Index tensors are checked in the kernel; an index out of
//! range is flagged in the device's index-error buffer and reported by the
//! next read.

use super::{groups, Gen, WG};
use crate::backend::wgpu::codegen::{literal, round_to, strided, unravel, compute_ty, Dispatch, WgslProgram};
use crate::dtype::DType;
use crate::ir::Strided as View;
use crate::layout::Layout;
use crate::primitive::{IndexOp, UnfoldParams};
use std::fmt::Write;

impl Gen<'_> {
    /// The dispatches of an index-like kernel.
    pub(crate) fn index(&self, p: &mut WgslProgram, op: &IndexOp, args: &[View]) {
        match *op {
            IndexOp::Gather { dim } => p.dispatches.push(self.gather(dim, &args[0], &args[1], op.error_code())),
            IndexOp::IndexSelect { dim } => p.dispatches.push(self.index_select(dim, &args[0], &args[1], op.error_code())),
            IndexOp::ScatterAdd { dim } => {
                p.dispatches.push(self.copy(&args[0], "scatter_add_copy"));
                if args[1].layout.numel() > 0 {
                    p.dispatches.push(self.scatter_add(dim, &args[0], &args[1], &args[2], op.error_code()));
                }
            }
            IndexOp::Cumsum { dim } => p.dispatches.push(self.cumsum(dim, &args[0])),
            IndexOp::Cat { dim } => {
                let total: usize = args.iter().map(|v| v.layout.dims()[dim]).sum();
                let mut at = 0;
                for part in args {
                    if part.layout.numel() > 0 {
                        p.dispatches.push(self.cat_part(dim, part, at, total));
                    }
                    at += part.layout.dims()[dim];
                }
            }
            IndexOp::Unfold { params, pad } => p.dispatches.push(self.unfold(&args[0], &params, pad)),
            IndexOp::Fold { params, hw } => p.dispatches.push(self.fold(&args[0], &params, hw)),
        }
    }

    /// Copy a strided view into the (contiguous) output.
    fn copy(&self, v: &View, label: &str) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[v.input]);
        self.bind_out(&mut sh);
        let n = v.layout.numel();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", v.layout.dims());
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", v.input, strided(&d, &v.layout));
        sh.finish(label.to_string(), WG, groups(n, WG), &b)
    }


    /// Read an index element (i32 or u32) as i32 into `name`, reporting it and
    /// using 0 when it is outside `[0, size)`.
    fn checked_index(&self, b: &mut String, name: &str, v: &View, off: &str, size: usize, op: u32) {
        let raw = format!("ld_in{}({off})", v.input);
        let as_i32 = if self.inputs[v.input].0 == DType::U32 { format!("bitcast<i32>({raw})") } else { raw };
        let _ = writeln!(
            b,
            "    var {name} = {as_i32};
    if ({name} < 0 || {name} >= {size}) {{ bad_index({op}u, {name}, {size}u); {name} = 0; }}"
        );
    }

    fn gather(&self, dim: usize, input: &View, index: &View, code: u32) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input, index.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let n = index.layout.numel();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "i", index.layout.dims());
        let off = strided(&d, &index.layout);
        self.checked_index(&mut b, "x", index, &off, input.layout.dims()[dim], code);
        d[dim] = "u32(x)".into();
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", input.input, strided_all(&d, &input.layout));
        sh.finish("gather".into(), WG, groups(n, WG), &b)
    }

    fn index_select(&self, dim: usize, input: &View, index: &View, code: u32) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input, index.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let mut dims = input.layout.dims().to_vec();
        dims[dim] = index.layout.numel();
        let n: usize = dims.iter().product();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "i", &dims);
        let off = strided(&[d[dim].clone()], &index.layout);
        self.checked_index(&mut b, "x", index, &off, input.layout.dims()[dim], code);
        d[dim] = "u32(x)".into();
        let _ = writeln!(b, "    st_out(i, ld_in{}({}));", input.input, strided_all(&d, &input.layout));
        sh.finish("index_select".into(), WG, groups(n, WG), &b)
    }

    /// `out[.., index[p], ..] += src[p]`: one thread per line along `dim` of
    /// `index`, so no two threads touch the same output element and the
    /// additions happen in index order, as on the CPU.
    fn scatter_add(&self, dim: usize, input: &View, index: &View, src: &View, code: u32) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[index.input, src.input]);
        self.bind_out(&mut sh);
        sh.index_errors();
        let idims = index.layout.dims();
        let len = idims[dim];
        let mut line_dims = idims.to_vec();
        line_dims[dim] = 1;
        let lines: usize = line_dims.iter().product();
        let odims = input.layout.dims();
        let ostrides = crate::shape::Shape::new(odims).contiguous_strides();
        let mut b = format!("    let t = group * {WG}u + lid;\n    if (t >= {lines}u) {{ return; }}\n");
        let mut d = unravel(&mut b, &mut sh, "t", &line_dims);
        let _ = writeln!(b, "    for (var j = 0u; j < {len}u; j = j + 1u) {{");
        d[dim] = "j".into();
        let ioff = strided_all(&d, &index.layout);
        self.checked_index(&mut b, "x", index, &ioff, odims[dim], code);
        let soff = strided_all(&d, &src.layout);
        d[dim] = "u32(x)".into();
        let out_l = Layout { shape: crate::shape::Shape::new(odims), strides: ostrides, offset: 0 };
        let ooff = strided_all(&d, &out_l);
        let dt = self.out.0;
        let sum = if dt == DType::Bool {
            format!("ld_out(o) || ld_in{}({soff})", src.input)
        } else {
            round_to(dt, &format!("ld_out(o) + ld_in{}({soff})", src.input))
        };
        let _ = writeln!(b, "    let o = {ooff};\n    st_out(o, {sum});\n    }}");
        sh.finish("scatter_add".into(), WG, groups(lines, WG), &b)
    }

    fn cumsum(&self, dim: usize, input: &View) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let dims = l.dims();
        let len = dims[dim];
        let mut line_dims = dims.to_vec();
        line_dims[dim] = 1;
        let lines: usize = line_dims.iter().product();
        let inner: usize = dims[dim + 1..].iter().product();
        let dt = self.out.0;
        let ct = compute_ty(dt);
        let mut b = format!("    let t = group * {WG}u + lid;\n    if (t >= {lines}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "t", &line_dims);
        let base = strided(&d, l);
        let outer_i = format!("(t / {inner}u)");
        let _ = writeln!(
            b,
            "    let base = {base};
    let obase = {outer_i} * {} + t % {inner}u;
    var acc: {ct} = {};
    for (var j = 0u; j < {len}u; j = j + 1u) {{
        acc = {};
        st_out(obase + j * {inner}u, acc);
    }}",
            format_args!("{}u", len * inner),
            literal(0.0, dt),
            round_to(dt, &format!("acc + ld_in{}(base + j * {}u)", input.input, l.strides()[dim])),
        );
        sh.finish("cumsum".into(), WG, groups(lines, WG), &b)
    }

    fn cat_part(&self, dim: usize, part: &View, at: usize, total: usize) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[part.input]);
        self.bind_out(&mut sh);
        let pd = part.layout.dims();
        let n = part.layout.numel();
        let mut od = pd.to_vec();
        od[dim] = total;
        let ostr = crate::shape::Shape::new(&od).contiguous_strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", pd);
        let out_l = Layout { shape: crate::shape::Shape::new(&od), strides: ostr.clone(), offset: at * ostr[dim] };
        let _ = writeln!(b, "    st_out({}, ld_in{}({}));", strided_all(&d, &out_l), part.input, strided(&d, &part.layout));
        sh.finish("cat".into(), WG, groups(n, WG), &b)
    }

    fn unfold(&self, input: &View, p: &UnfoldParams, pad: f64) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let dd = l.dims();
        let (h, w) = (dd[2], dd[3]);
        let [oh, ow] = p.out_hw(h, w).unwrap_or([0, 0]);
        let dims = [dd[0], dd[1], p.kernel[0], p.kernel[1], oh, ow];
        let n: usize = dims.iter().product();
        let dt = self.out.0;
        let st = l.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", &dims);
        let _ = writeln!(
            b,
            "    let iy = i32({y} * {sy}u + {ki} * {dy}u) - {py};
    let ix = i32({x} * {sx}u + {kj} * {dx}u) - {px};
    var v = {pad};
    if (iy >= 0 && iy < {h} && ix >= 0 && ix < {w}) {{
        v = ld_in{inp}({off}u + {n0} * {s0}u + {c0} * {s1}u + u32(iy) * {s2}u + u32(ix) * {s3}u);
    }}
    st_out(i, v);",
            y = d[4],
            x = d[5],
            ki = d[2],
            kj = d[3],
            n0 = d[0],
            c0 = d[1],
            sy = p.stride[0],
            sx = p.stride[1],
            dy = p.dilation[0],
            dx = p.dilation[1],
            py = p.padding[0],
            px = p.padding[1],
            pad = literal(pad, dt),
            inp = input.input,
            off = l.offset(),
            s0 = st[0],
            s1 = st[1],
            s2 = st[2],
            s3 = st[3],
        );
        sh.finish("unfold".into(), WG, groups(n, WG), &b)
    }

    /// col2im: one thread per image element, summing the patch entries that
    /// read it (a deterministic gather, where a scatter would need atomics).
    fn fold(&self, input: &View, p: &UnfoldParams, hw: [usize; 2]) -> Dispatch {
        let mut sh = self.shader();
        self.bind_inputs(&mut sh, &[input.input]);
        self.bind_out(&mut sh);
        let l = &input.layout;
        let dd = l.dims();
        let (kh, kw, oh, ow) = (dd[2], dd[3], dd[4], dd[5]);
        let [h, w] = hw;
        let n: usize = dd[0] * dd[1] * h * w;
        let dt = self.out.0;
        let st = l.strides();
        let mut b = format!("    let i = group * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n");
        let d = unravel(&mut b, &mut sh, "i", &[dd[0], dd[1], h, w]);
        let _ = writeln!(
            b,
            "    let base = {off}u + {n0} * {s0}u + {c0} * {s1}u;
    var acc = {zero};
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
        let ty = i32({iy}) + {py} - i32(ki * {dy}u);
        if (ty < 0 || ty % {sy} != 0 || ty / {sy} >= {oh}) {{ continue; }}
        for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
            let tx = i32({ix}) + {px} - i32(kj * {dx}u);
            if (tx < 0 || tx % {sx} != 0 || tx / {sx} >= {ow}) {{ continue; }}
            acc = {sum};
        }}
    }}
    st_out(i, acc);",
            off = l.offset(),
            n0 = d[0],
            c0 = d[1],
            iy = d[2],
            ix = d[3],
            s0 = st[0],
            s1 = st[1],
            py = p.padding[0],
            px = p.padding[1],
            dy = p.dilation[0],
            dx = p.dilation[1],
            sy = p.stride[0],
            sx = p.stride[1],
            zero = literal(0.0, dt),
            sum = round_to(
                dt,
                &format!(
                    "acc + ld_in{}(base + ki * {}u + kj * {}u + u32(ty / {}) * {}u + u32(tx / {}) * {}u)",
                    input.input, st[2], st[3], p.stride[0], st[4], p.stride[1], st[5]
                )
            ),
        );
        sh.finish("fold".into(), WG, groups(n, WG), &b)
    }
}

/// Like `strided`, but keeps every digit (they may be runtime values that
/// replace a size-1 dim).
fn strided_all(digits: &[String], l: &Layout) -> String {
    let mut terms = vec![format!("{}u", l.offset())];
    for (d, &s) in digits.iter().zip(l.strides()) {
        if s != 0 && d != "0u" {
            terms.push(format!("{d} * {s}u"));
        }
    }
    format!("({})", terms.join(" + "))
}

