//! Reductions: an identity and the binary primitive that folds two partial
//! results, from the reduction table. Both executors build their
//! accumulators from these, so a reduction's semantics (NaN propagation,
//! integer wrapping) are those of its combining primitive.

use super::BinaryOp;

/// Generates `ReduceOp` from the reduction table.
macro_rules! define_reduce {
    ($( $(#[$m:meta])* $V:ident $name:literal $identity:expr, $combine:ident, $arg:literal, |$x:ident, $y:ident, $g:ident, $axes:ident| $grad:expr; )*) => {
        /// Reductions over a set of axes.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum ReduceOp { $( $(#[$m])* $V ),* }
        impl ReduceOp {
            /// Every reduction.
            pub const ALL: &'static [ReduceOp] = &[$(ReduceOp::$V),*];
            /// Name used in errors and kernel names.
            pub fn name(self) -> &'static str {
                match self { $(ReduceOp::$V => $name),* }
            }
            /// The value of an empty reduction: folding it with any `x` gives `x`.
            pub fn identity(self) -> f64 {
                match self { $(ReduceOp::$V => $identity),* }
            }
            /// The binary primitive that folds two partial results.
            pub fn combine(self) -> BinaryOp {
                match self { $(ReduceOp::$V => BinaryOp::$combine),* }
            }
            /// Whether the result is the index of the winning element (i32).
            pub fn is_arg(self) -> bool {
                match self { $(ReduceOp::$V => $arg),* }
            }
        }
    };
}
super::reduce_table!(define_reduce);

impl ReduceOp {
    /// The identity as the dtype's compute type holds it: integers have no
    /// infinities, so max and min start from the type's extremes.
    pub fn identity_for(self, dtype: crate::dtype::DType) -> f64 {
        use crate::dtype::DType;
        let v = self.identity();
        match dtype.compute() {
            DType::I32 if v.is_infinite() => if v < 0.0 { i32::MIN as f64 } else { i32::MAX as f64 },
            DType::U32 if v.is_infinite() => if v < 0.0 { 0.0 } else { u32::MAX as f64 },
            DType::Bool if v.is_infinite() => if v < 0.0 { 0.0 } else { 1.0 },
            _ => v,
        }
    }
}
