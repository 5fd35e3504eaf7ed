//! `Display` for tensors, formatted like PyTorch: `tensor([[1., 2.], ...])`,
//! summarised with `...` beyond 1000 elements.

use crate::device::Device;
use crate::dtype::DType;
use crate::tensor::Tensor;
use std::fmt;

const THRESHOLD: usize = 1000;
const EDGE: usize = 3;

enum Style {
    Int,
    Bool,
    /// Floats whose finite values are all whole numbers: `1.`
    Whole,
    Fixed,
    Sci,
}

fn style(dtype: DType, vals: &[f64]) -> Style {
    if dtype == DType::Bool {
        return Style::Bool;
    }
    if !dtype.is_float() {
        return Style::Int;
    }
    let finite: Vec<f64> = vals.iter().copied().filter(|v| v.is_finite()).collect();
    // PyTorch's rules, over the nonzero finite magnitudes: whole numbers too
    // switch to scientific notation beyond 1e8 or a range of 1000.
    let nz: Vec<f64> = finite.iter().map(|v| v.abs()).filter(|&v| v > 0.0).collect();
    let (mx, mn) = nz.iter().fold((0f64, f64::INFINITY), |(a, b), &v| (a.max(v), b.min(v)));
    let wide = mx > 1e8 || (mn.is_finite() && mx / mn > 1000.0);
    if finite.iter().all(|v| v.fract() == 0.0) {
        return if wide { Style::Sci } else { Style::Whole };
    }
    if wide || (mn < 1e-4 && mn.is_finite()) {
        Style::Sci
    } else {
        Style::Fixed
    }
}

fn fmt_one(v: f64, s: &Style) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    match s {
        Style::Bool => if v != 0.0 { "True" } else { "False" }.into(),
        Style::Int => format!("{}", v as i64),
        Style::Whole => format!("{}.", v as i64),
        Style::Fixed => format!("{v:.4}"),
        Style::Sci => {
            let s = format!("{v:.4e}");
            // Rust writes 1.0000e0; PyTorch writes 1.0000e+00.
            match s.split_once('e') {
                Some((m, e)) => {
                    let (sign, digits) = if let Some(d) = e.strip_prefix('-') { ('-', d) } else { ('+', e) };
                    format!("{m}e{sign}{digits:0>2}")
                }
                None => s,
            }
        }
    }
}

/// Positions shown along a dim of size `n`: all, or the edges around a gap (`None`).
fn shown(n: usize, summarise: bool) -> Vec<Option<usize>> {
    if summarise && n > 2 * EDGE {
        (0..EDGE).map(Some).chain([None]).chain((n - EDGE..n).map(Some)).collect()
    } else {
        (0..n).map(Some).collect()
    }
}

fn render(out: &mut String, dims: &[usize], strides: &[usize], base: usize, cells: &dyn Fn(usize) -> String, width: usize, indent: usize, summarise: bool) {
    if dims.is_empty() {
        out.push_str(&format!("{:>width$}", cells(base)));
        return;
    }
    out.push('[');
    let idx = shown(dims[0], summarise);
    for (k, i) in idx.iter().enumerate() {
        if k > 0 {
            if dims.len() == 1 {
                out.push_str(", ");
            } else {
                out.push(',');
                out.push_str(&"\n".repeat(dims.len() - 1));
                out.push_str(&" ".repeat(indent + 1));
            }
        }
        match i {
            Some(i) => render(out, &dims[1..], &strides[1..], base + i * strides[0], cells, width, indent + 1, summarise),
            // PyTorch pads the ellipsis inside a row: `2.,  ..., 7.`
            None => out.push_str(if dims.len() == 1 { " ..." } else { "..." }),
        }
    }
    out.push(']');
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let vals = match self.to_f64_vec() {
            Ok(v) => v,
            Err(e) => return write!(f, "tensor(<error: {e}>)"),
        };
        let dims = self.dims().to_vec();
        let summarise = vals.len() > THRESHOLD;
        let strides = crate::shape::Shape::new(&dims).contiguous_strides();
        // Only the shown values decide the style and the width.
        let mut shown_vals = vec![];
        crate::layout::Layout::contiguous(&dims).for_each_offset(|o| {
            let mut rem = o;
            let visible = dims.iter().zip(&strides).all(|(&d, &s)| {
                let i = rem / s.max(1);
                rem %= s.max(1);
                !summarise || d <= 2 * EDGE || i < EDGE || i >= d - EDGE
            });
            if visible {
                shown_vals.push(vals[o]);
            }
        });
        let st = style(self.dtype(), &shown_vals);
        // As PyTorch, non-finite floats (nan, inf) do not widen the columns.
        let width = shown_vals.iter().filter(|v| v.is_finite()).map(|&v| fmt_one(v, &st).len()).max().unwrap_or(0);
        let cells = |o: usize| fmt_one(vals[o], &st);
        let mut s = String::from("tensor(");
        if dims.is_empty() {
            s.push_str(&cells(0));
        } else {
            render(&mut s, &dims, &strides, 0, &cells, width, 7, summarise);
        }
        if vals.is_empty() {
            s.push_str(&format!(", size={dims:?}"));
        }
        if !matches!(self.dtype(), DType::F32 | DType::Bool) {
            s.push_str(&format!(", dtype={}", self.dtype()));
        }
        if self.device() != Device::Cpu {
            s.push_str(&format!(", device={}", self.device()));
        }
        s.push(')');
        f.write_str(&s)
    }
}
