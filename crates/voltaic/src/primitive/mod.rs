//! The primitives: every op the graph records and the executors run, each
//! defined once.
//!
//! An elementwise primitive is one entry of a table in `table.rs`: its name,
//! the dtypes it accepts, its scalar kernel for every compute type (the CPU
//! executor turns these into vectorised loops), its WGSL fragment (the GPU
//! code generator splices it into a fused kernel), its gradient and the
//! `Tensor` method that records it. Each layer expands the table for what it
//! needs: this module generates the kernel types and the op enums, the CPU
//! executor its dispatch, `ops` the methods and gradients. A reduction is an
//! identity and a combining binary primitive ([`ReduceOp`]); index-like ops
//! share one kind ([`IndexOp`]). Composite ops (softmax, gelu, layer_norm, ...)
//! are built from these in `ops/`.

pub mod fastmath;
mod index;
mod reduce;
#[macro_use]
mod table;
mod wgsl;

pub use index::{Caller, IndexOp, UnfoldParams};
pub use reduce::ReduceOp;
pub(crate) use table::{binary_table, cmp_table, reduce_table, unary_table};
pub use wgsl::WGSL_HELPERS;

/// Which dtypes an elementwise op accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// Floats only; integer and bool inputs are promoted to f32 first (as PyTorch does).
    Float,
    /// Floats and integers, not bool.
    Numeric,
    /// Bool only.
    Bool,
}

/// A unary primitive: scalar kernels for each compute type plus its WGSL form.
pub trait UnaryKernel {
    /// Name used in errors and kernel names.
    const NAME: &'static str;
    /// WGSL expression over f32, `{x}` standing for the operand; helper
    /// functions it calls come from [`WGSL_HELPERS`].
    const WGSL: &'static str;
    /// WGSL expression over integers (`{T}` is `i32` or `u32`).
    const WGSL_INT: &'static str;
    /// Whether the result is always a value of its operand's float type
    /// (the op selects, negates or rounds to an integer), so that a half
    /// type's result needs no rounding.
    const EXACT: bool;
    /// Accepted dtypes.
    const DOMAIN: Domain;
    /// f32 kernel.
    fn f32(x: f32) -> f32;
    /// f64 kernel.
    fn f64(x: f64) -> f64;
    /// i32 kernel (numeric ops only).
    fn i32(x: i32) -> i32;
    /// u32 kernel (numeric ops only).
    fn u32(x: u32) -> u32;
    /// bool kernel (bool ops only).
    fn bool(x: bool) -> bool;
}

/// A binary primitive over two operands of one dtype.
pub trait BinaryKernel {
    /// Name used in errors and kernel names.
    const NAME: &'static str;
    /// WGSL expression over f32, `{a}` and `{b}` standing for the operands.
    const WGSL: &'static str;
    /// WGSL expression over integers (`{T}` is `i32` or `u32`).
    const WGSL_INT: &'static str;
    /// Whether the result is always one of the operands' values (see
    /// [`UnaryKernel::EXACT`]).
    const EXACT: bool;
    /// Accepted dtypes.
    const DOMAIN: Domain;
    /// f32 kernel.
    fn f32(a: f32, b: f32) -> f32;
    /// f64 kernel.
    fn f64(a: f64, b: f64) -> f64;
    /// i32 kernel.
    fn i32(a: i32, b: i32) -> i32;
    /// u32 kernel.
    fn u32(a: u32, b: u32) -> u32;
    /// bool kernel.
    fn bool(a: bool, b: bool) -> bool;
}

/// Generates, from the unary table, a zero-sized kernel type per op and the
/// `UnaryOp` enum over them.
macro_rules! define_unary {
    ($( $(#[$m:meta])* $T:ident $method:ident $name:literal $dom:ident |$gx:tt, $gy:tt, $gg:ident| $grad:expr; { $($kernel:tt)* } )*) => {
        $( unary_kernel!($(#[$m])* $T $name $dom { $($kernel)* }); )*
        op_enum!(
            /// The unary primitives.
            UnaryOp: UnaryKernel { $($T),* }
        );
    };
}

/// One unary kernel type from its table entry.
macro_rules! unary_kernel {
    ($(#[$m:meta])* $T:ident $name:literal $dom:ident {
        wgsl: $wgsl:literal $(| $wgsl_int:literal)?, $(exact: $exact:literal,)?
        f32: |$x:ident| $f32:expr, f64: |$y:ident| $f64:expr
        $(, int: |$i:ident| $int:expr)? $(, bool: |$b:ident| $bool:expr)? $(,)?
    }) => {
        $(#[$m])*
        pub struct $T;
        #[allow(unused_variables)]
        impl UnaryKernel for $T {
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
            const WGSL_INT: &'static str = first_literal!($($wgsl_int,)? $wgsl);
            const EXACT: bool = first_literal!($($exact,)? false);
            const DOMAIN: Domain = Domain::$dom;
            #[inline(always)]
            fn f32($x: f32) -> f32 { $f32 }
            #[inline(always)]
            fn f64($y: f64) -> f64 { $f64 }
            #[inline(always)]
            #[allow(unreachable_code)]
            fn i32(x: i32) -> i32 { $( let $i = x; return $int; )? x }
            #[inline(always)]
            #[allow(unreachable_code)]
            fn u32(x: u32) -> u32 { $( let $i = x; return $int; )? x }
            #[inline(always)]
            #[allow(unreachable_code)]
            fn bool(x: bool) -> bool { $( let $b = x; return $bool; )? x }
        }
    };
}

/// Generates a kernel type per binary op and the `BinaryOp` enum.
macro_rules! define_binary {
    ($( $(#[$m:meta])* $T:ident $method:ident $name:literal $dom:ident |$ga:tt, $gb:tt, $gy:tt, $gg:ident| $grad:expr; { $($kernel:tt)* } )*) => {
        $( binary_kernel!($(#[$m])* $T $name $dom { $($kernel)* }); )*
        op_enum!(
            /// The binary primitives.
            BinaryOp: BinaryKernel { $($T),* }
        );
    };
}

/// One binary kernel type from its table entry.
macro_rules! binary_kernel {
    ($(#[$m:meta])* $T:ident $name:literal $dom:ident {
        wgsl: $wgsl:literal $(| $wgsl_int:literal)?, $(exact: $exact:literal,)?
        float: |$a:ident, $b:ident| $float:expr
        $(, int: |$ia:ident, $ib:ident| $int:expr)? $(, bool: |$ba:ident, $bb:ident| $bool:expr)? $(,)?
    }) => {
        $(#[$m])*
        pub struct $T;
        #[allow(unused_variables)]
        impl BinaryKernel for $T {
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
            const WGSL_INT: &'static str = first_literal!($($wgsl_int,)? $wgsl);
            const EXACT: bool = first_literal!($($exact,)? false);
            const DOMAIN: Domain = Domain::$dom;
            #[inline(always)]
            fn f32($a: f32, $b: f32) -> f32 { $float }
            #[inline(always)]
            fn f64($a: f64, $b: f64) -> f64 { $float }
            #[inline(always)]
            #[allow(unreachable_code)]
            fn i32(a: i32, b: i32) -> i32 { $( let ($ia, $ib) = (a, b); return $int; )? a }
            #[inline(always)]
            #[allow(unreachable_code)]
            fn u32(a: u32, b: u32) -> u32 { $( let ($ia, $ib) = (a, b); return $int; )? a }
            #[inline(always)]
            #[allow(unreachable_code)]
            fn bool(a: bool, b: bool) -> bool { $( let ($ba, $bb) = (a, b); return $bool; )? a }
        }
    };
}

/// The first of some literals (an optional one, then a default).
macro_rules! first_literal {
    ($first:literal $(, $rest:literal)*) => {
        $first
    };
}

/// An enum over kernel types, with their table's properties.
macro_rules! op_enum {
    ($(#[$m:meta])* $Enum:ident : $Trait:ident { $($V:ident),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $Enum { $(
            #[doc = concat!("See [`", stringify!($V), "`].")]
            $V
        ),* }
        impl $Enum {
            /// Every op of this kind.
            pub const ALL: &'static [$Enum] = &[$($Enum::$V),*];
            /// Name used in errors and kernel names.
            pub fn name(self) -> &'static str {
                match self { $($Enum::$V => <$V as $Trait>::NAME),* }
            }
            /// WGSL expression template over f32.
            pub fn wgsl(self) -> &'static str {
                match self { $($Enum::$V => <$V as $Trait>::WGSL),* }
            }
            /// WGSL expression template over integers (`{T}`: `i32` or `u32`).
            pub fn wgsl_int(self) -> &'static str {
                match self { $($Enum::$V => <$V as $Trait>::WGSL_INT),* }
            }
            /// Accepted dtypes.
            pub fn domain(self) -> Domain {
                match self { $($Enum::$V => <$V as $Trait>::DOMAIN),* }
            }
            /// Whether a float result needs no rounding to its dtype (the
            /// table's `exact`: the op selects, negates or rounds to an integer).
            pub fn exact(self) -> bool {
                match self { $($Enum::$V => <$V as $Trait>::EXACT),* }
            }
        }
    };
}

unary_table!(define_unary);
binary_table!(define_binary);

/// Generates the `CmpOp` enum from the comparison table.
macro_rules! define_cmp {
    ($( $(#[$m:meta])* $V:ident $method:ident $name:literal $wgsl:literal; )*) => {
        /// Comparisons; each gives a bool tensor. NaN compares as IEEE says.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum CmpOp { $( $(#[$m])* $V ),* }
        impl CmpOp {
            /// Every comparison.
            pub const ALL: &'static [CmpOp] = &[$(CmpOp::$V),*];
            /// Name used in errors and kernel names.
            pub fn name(self) -> &'static str {
                match self { $(CmpOp::$V => $name),* }
            }
            /// WGSL operator.
            pub fn wgsl(self) -> &'static str {
                match self { $(CmpOp::$V => $wgsl),* }
            }
        }
    };
}
cmp_table!(define_cmp);

impl CmpOp {
    /// Apply to two values.
    #[inline(always)]
    pub fn apply<T: PartialOrd>(self, a: T, b: T) -> bool {
        match self {
            CmpOp::Eq => a == b,
            CmpOp::Ne => a != b,
            CmpOp::Lt => a < b,
            CmpOp::Le => a <= b,
            CmpOp::Gt => a > b,
            CmpOp::Ge => a >= b,
        }
    }
}

/// An elementwise primitive as recorded in the graph and run in fused
/// kernels: element `i` of its output depends only on element `i` of each
/// input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MapOp {
    /// A unary primitive.
    Unary(UnaryOp),
    /// A binary primitive.
    Binary(BinaryOp),
    /// A comparison, giving bool.
    Cmp(CmpOp),
    /// `cond ? a : b` over (cond, a, b).
    Where,
    /// Conversion to the node's dtype (Rust `as` semantics).
    Cast,
}

impl MapOp {
    /// Number of operands.
    pub fn arity(self) -> usize {
        match self {
            MapOp::Unary(_) | MapOp::Cast => 1,
            MapOp::Binary(_) | MapOp::Cmp(_) => 2,
            MapOp::Where => 3,
        }
    }

    /// Name used in errors, schedules and profiles.
    pub fn name(self) -> &'static str {
        match self {
            MapOp::Unary(u) => u.name(),
            MapOp::Binary(b) => b.name(),
            MapOp::Cmp(c) => c.name(),
            MapOp::Where => "where",
            MapOp::Cast => "cast",
        }
    }
}

/// Integer helpers shared by the i32 and u32 kernels.
pub(crate) trait IntOps: Copy + PartialOrd + Default {
    fn neg_(self) -> Self;
    fn abs_(self) -> Self;
    fn sign_(self) -> Self;
    /// Python-style remainder (the sign of the divisor); division by zero gives 0.
    fn rem_(self, b: Self) -> Self;
    /// `self ^ b`, wrapping; a negative exponent gives 0 but for bases 1 and -1.
    fn pow_(self, b: Self) -> Self;
}

/// `a ^ e` by squaring, wrapping, for a non-negative exponent.
fn wrapping_pow<T: Copy>(mut a: T, mut e: u32, one: T, mul: impl Fn(T, T) -> T) -> T {
    let mut r = one;
    while e > 0 {
        if e & 1 == 1 {
            r = mul(r, a);
        }
        a = mul(a, a);
        e >>= 1;
    }
    r
}
impl IntOps for i32 {
    fn neg_(self) -> i32 {
        self.wrapping_neg()
    }
    fn abs_(self) -> i32 {
        self.wrapping_abs()
    }
    fn sign_(self) -> i32 {
        self.signum()
    }
    fn pow_(self, b: i32) -> i32 {
        match (self, b) {
            (_, 0..) => wrapping_pow(self, b as u32, 1, i32::wrapping_mul),
            (1, _) => 1,
            (-1, _) => if b % 2 == 0 { 1 } else { -1 },
            _ => 0,
        }
    }
    fn rem_(self, b: i32) -> i32 {
        if b == 0 {
            return 0;
        }
        let r = self.wrapping_rem(b);
        if r != 0 && ((r < 0) != (b < 0)) {
            r + b
        } else {
            r
        }
    }
}
impl IntOps for u32 {
    fn neg_(self) -> u32 {
        self.wrapping_neg()
    }
    fn abs_(self) -> u32 {
        self
    }
    fn sign_(self) -> u32 {
        (self != 0) as u32
    }
    fn pow_(self, b: u32) -> u32 {
        wrapping_pow(self, b, 1, u32::wrapping_mul)
    }
    fn rem_(self, b: u32) -> u32 {
        if b == 0 {
            0
        } else {
            self % b
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_give_every_op_a_distinct_name() {
        let mut names: Vec<&str> = UnaryOp::ALL.iter().map(|o| o.name()).collect();
        names.extend(BinaryOp::ALL.iter().map(|o| o.name()));
        names.extend(CmpOp::ALL.iter().map(|o| o.name()));
        names.extend(ReduceOp::ALL.iter().map(|o| o.name()));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "two primitives share a name");
    }

    #[test]
    fn optional_kernels_default_to_identity_and_given_ones_are_used() {
        assert_eq!(Neg::i32(5), -5);
        assert_eq!(Neg::u32(1), u32::MAX);
        assert_eq!(Exp::i32(7), 7, "a float-only op passes integers through (never called)");
        assert!(Not::bool(false));
        assert_eq!(Rem::i32(-7, 3), 2);
        assert_eq!(Rem::u32(7, 0), 0);
        assert_eq!(<Neg as UnaryKernel>::WGSL_INT, "({T}(0) - {x})");
        assert_eq!(<Exp as UnaryKernel>::WGSL_INT, <Exp as UnaryKernel>::WGSL);
        assert_eq!(MapOp::Where.arity(), 3);
    }
}
