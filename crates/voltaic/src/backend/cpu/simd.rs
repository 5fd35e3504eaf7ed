//! Instruction sets chosen at run time, so a binary built for baseline
//! x86-64 (what a crate depending on Voltaic gets) still runs its hot loops
//! with AVX2 where the CPU has it, and never executes an instruction the
//! CPU lacks (no `target-cpu` flag, no SIGILL).
//!
//! [`simd_fn!`] wraps a leaf loop: the body is compiled twice, once for the
//! baseline and once with `avx,avx2,fma` enabled, and the call picks one by
//! a cached CPU check. The bodies only call `#[inline]` code (the primitive
//! kernels, `fastmath`), which is inlined into both copies and so compiled
//! for each instruction set. `fma` never changes results: Rust does not
//! contract `a * b + c`, so only explicit `mul_add` would use it.

/// Whether this CPU has AVX2 and FMA (checked once, then a cached load).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// Define a function whose body runs compiled for AVX2/FMA when the CPU has
/// them and for the baseline otherwise (see the module docs). Generic
/// parameters are `Name: Bound`; arguments are `name: Type`.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<$($g:ident : $b:path),*>)? ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx,avx2,fma")]
                unsafe fn avx2 $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? {
                    body $(::<$($g),*>)? ($($arg),*)
                }
                if $crate::backend::cpu::simd::has_avx2() {
                    // SAFETY: the CPU was just checked to have every feature `avx2` enables.
                    return unsafe { avx2 $(::<$($g),*>)? ($($arg),*) };
                }
            }
            body $(::<$($g),*>)? ($($arg),*)
        }
    };
}
pub(crate) use simd_fn;
