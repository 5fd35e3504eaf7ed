//! Arithmetic operators, so that chains read like the math, as in candle:
//! `+ - * / %` and unary `-` between tensors (owned or borrowed), with a
//! scalar on the right (`f64`, `f32`, `i32`, `u32`, `bool`) or on the left
//! (`f64`, `i32`). Every operator
//! returns `Result<Tensor>`: a shape or dtype mismatch is an `Err`, never a
//! panic. A `Result<Tensor>` may stand on the right of any operator and on
//! the left of one whose right side is a tensor, and an `Err` passes
//! through. Rust's orphan rule forbids the rest (`Result<Tensor>` with a
//! scalar, or two results): there, apply `?` first.
//!
//! ```
//! use voltaic::{DType, Device, Tensor};
//! let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], Device::Cpu)?;
//! let b = Tensor::ones(&[3], DType::F32, Device::Cpu)?;
//! let y = (((&a * 2.0 + &b)? / 3.0)? - (1.0 - &a))?; // (2a + b) / 3 - (1 - a)
//! let want = [1.0f32, 8.0 / 3.0, 13.0 / 3.0];
//! assert!(y.to_vec::<f32>()?.iter().zip(want).all(|(y, w)| (y - w).abs() < 1e-6));
//! let z = (-&a * &b)?;
//! assert_eq!(z.to_vec::<f32>()?, [-1.0, -2.0, -3.0]);
//! assert!((&a + &Tensor::ones(&[2], DType::F32, Device::Cpu)?).is_err()); // shapes [3] and [2]
//! # Ok::<(), voltaic::Error>(())
//! ```

use super::IntoOperand;
use crate::error::Result;
use crate::tensor::Tensor;

/// A `Result<Tensor>` stands on the right of an op as its tensor (or its error).
impl IntoOperand for Result<Tensor> {
    fn operand(self, _: &Tensor) -> Result<Tensor> {
        self
    }
}

macro_rules! tensor_ops {
    ($Trait:ident, $fn:ident, $method:ident) => {
        impl<R: IntoOperand> std::ops::$Trait<R> for &Tensor {
            type Output = Result<Tensor>;
            fn $fn(self, rhs: R) -> Result<Tensor> {
                self.$method(rhs)
            }
        }
        impl<R: IntoOperand> std::ops::$Trait<R> for Tensor {
            type Output = Result<Tensor>;
            fn $fn(self, rhs: R) -> Result<Tensor> {
                Tensor::$method(&self, rhs)
            }
        }
        // `Result<Tensor>` on the left: with a tensor, a result or a scalar on the right.
        impl std::ops::$Trait<Tensor> for Result<Tensor> {
            type Output = Result<Tensor>;
            fn $fn(self, rhs: Tensor) -> Result<Tensor> {
                self?.$method(rhs)
            }
        }
        impl std::ops::$Trait<&Tensor> for Result<Tensor> {
            type Output = Result<Tensor>;
            fn $fn(self, rhs: &Tensor) -> Result<Tensor> {
                self?.$method(rhs)
            }
        }
        // Only f64 and i32 on the left: with more, a literal (`2.0 - &a`) would be ambiguous.
        tensor_ops!(@scalars $Trait, $fn, $method, f64, i32);
    };
    (@scalars $Trait:ident, $fn:ident, $method:ident, $($s:ty),*) => {$(
        // A scalar on the left takes the dtype the same scalar would on the right.
        impl std::ops::$Trait<&Tensor> for $s {
            type Output = Result<Tensor>;
            fn $fn(self, rhs: &Tensor) -> Result<Tensor> {
                self.operand(rhs)?.$method(rhs)
            }
        }
        impl std::ops::$Trait<Tensor> for $s {
            type Output = Result<Tensor>;
            fn $fn(self, rhs: Tensor) -> Result<Tensor> {
                self.operand(&rhs)?.$method(&rhs)
            }
        }
    )*};
}
tensor_ops!(Add, add, add);
tensor_ops!(Sub, sub, sub);
tensor_ops!(Mul, mul, mul);
tensor_ops!(Div, div, div);
tensor_ops!(Rem, rem, rem);

impl std::ops::Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}
impl std::ops::Neg for Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(&self)
    }
}
