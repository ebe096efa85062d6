//! Run-time choice of vector width for the kernels' inner loops. The crate is compiled for
//! baseline x86-64 (SSE2, no FMA), so `simd_fn!` compiles a loop body three times (for
//! AVX-512, for AVX2 + FMA, and as written) and calls the widest the CPU runs. The body is
//! generic over `Mac`, the multiply-add it uses: fused where the FMA unit exists (a libm call,
//! many times slower, where it does not).

/// A multiply-add: `a * b + c`.
pub(crate) trait Mac {
    fn mac(a: f32, b: f32, c: f32) -> f32;
}

/// One rounding, on the FMA unit.
pub(crate) struct Fused;

/// Two roundings, for CPUs without FMA.
pub(crate) struct Plain;

impl Mac for Fused {
    #[inline(always)]
    fn mac(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

impl Mac for Plain {
    #[inline(always)]
    fn mac(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// The widest vector unit this CPU has that `simd_fn!` compiles for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Level {
    Avx512,
    Avx2,
    Base,
}

pub(crate) fn level() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        // std caches the CPUID answers: each check is an atomic load.
        let fma = std::arch::is_x86_feature_detected!("fma");
        if fma && std::arch::is_x86_feature_detected!("avx512f") {
            return Level::Avx512;
        }
        if fma && std::arch::is_x86_feature_detected!("avx2") {
            return Level::Avx2;
        }
    }
    Level::Base
}

/// `simd_fn!(fn name<M>(args) { body })` defines `fn name(args)` that runs `body` (generic
/// over `M: Mac`) compiled for the widest vector unit `level()` finds. `body` is inlined into
/// each compiled copy, so everything it calls must be `#[inline(always)]` to be vectorized.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident<$M:ident>($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body<$M: $crate::kernels::simd::Mac>($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn wide($($arg: $ty),*) {
                    body::<$crate::kernels::simd::Fused>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) {
                    body::<$crate::kernels::simd::Fused>($($arg),*)
                }
                match $crate::kernels::simd::level() {
                    // SAFETY: `level` found these features on this CPU.
                    $crate::kernels::simd::Level::Avx512 => return unsafe { wide($($arg),*) },
                    // SAFETY: as above.
                    $crate::kernels::simd::Level::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::kernels::simd::Level::Base => {}
                }
            }
            body::<$crate::kernels::simd::Plain>($($arg),*)
        }
    };
}

pub(crate) use simd_fn;
