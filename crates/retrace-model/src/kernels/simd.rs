//! Run-time choice of vector width for the kernels' inner loops. The crate is compiled for
//! baseline x86-64 (SSE2, no FMA), so `simd_fn!` compiles a loop body three times (for
//! AVX-512, for AVX2 + FMA, and as written) and calls the widest the CPU runs. The body is
//! generic over `Mac`, the multiply-add it uses: fused where the FMA unit exists (a libm call,
//! many times slower, where it does not). `RETRACE_SIMD` caps the width, to test the narrower
//! copies on a CPU that has the wider ones.

use std::sync::OnceLock;

/// A multiply-add: `a * b + c`, and the shape of the vector unit it runs on.
pub(crate) trait Mac {
    /// f32 lanes a row of a four-row register tile holds: four rows of it are the most
    /// accumulators that leave registers for the operands (sixteen of AVX-512's 32 registers
    /// of 16 lanes, eight of AVX2's 16 of 8, eight of SSE's 16 of 4). A kernel's inner loop of
    /// this many lanes is unrolled into whole registers: 64, 16 or 8, which kernels match on.
    const TILE: usize;
    fn mac(a: f32, b: f32, c: f32) -> f32;
}

/// One rounding, on the FMA unit; `TILE` lanes per tile row.
pub(crate) struct Fused<const TILE: usize = 64>;

/// Two roundings, for CPUs without FMA.
pub(crate) struct Plain;

impl<const T: usize> Mac for Fused<T> {
    const TILE: usize = T;
    #[inline(always)]
    fn mac(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

impl Mac for Plain {
    const TILE: usize = 8;
    #[inline(always)]
    fn mac(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// A vector unit `simd_fn!` compiles for, narrowest first (so `min` caps a level).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Base,
    Avx2,
    Avx512,
}

/// Names the widest level the kernels may use, so that the narrower copies, which a CPU with
/// AVX-512 never picks by itself, can be tested there: `avx512`, `avx2` or `base`.
const VAR: &str = "RETRACE_SIMD";

/// The level the kernels run, fixed on first use: the widest this CPU has, capped at what
/// `cap_simd` was given before. The crate reads no environment; the binary passes
/// `RETRACE_SIMD`'s value, and this crate's own tests read it (the CI loop over levels).
static LEVEL: OnceLock<Level> = OnceLock::new();

pub(crate) fn level() -> Level {
    *LEVEL.get_or_init(|| {
        #[cfg(test)]
        #[allow(clippy::disallowed_methods)]
        if let Ok(asked) = std::env::var(VAR) {
            return chosen(Some(&asked), detected()).unwrap_or_else(|e| panic!("{e}"));
        }
        detected()
    })
}

/// Caps the kernels at `value` (`avx512`, `avx2` or `base`; blank: the widest this CPU has),
/// to test the narrower copies where the CPU has a wider one; call it before the first
/// kernel runs. Returns the level the kernels run, by name. A value it cannot read, or a call
/// after the level was fixed to another, is refused, naming `RETRACE_SIMD`.
pub fn cap_simd(value: &str) -> Result<&'static str, String> {
    let want = chosen(Some(value), detected())?;
    match *LEVEL.get_or_init(|| want) {
        now if now == want => Ok(now.name()),
        now => Err(format!(
            "{VAR}={value:?} came after the kernels ran at {}",
            now.name()
        )),
    }
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Base => "base",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }
}

/// The level for `RETRACE_SIMD`'s value (`None`: unset) on a CPU whose widest is `cpu`: a
/// wider one than the CPU has falls back to the CPU's, so no copy runs instructions it lacks.
fn chosen(value: Option<&str>, cpu: Level) -> Result<Level, String> {
    let asked = match value.map(str::trim) {
        None | Some("") => return Ok(cpu),
        Some("avx512") => Level::Avx512,
        Some("avx2") => Level::Avx2,
        Some("base") => Level::Base,
        Some(other) => {
            return Err(format!(
                "{VAR}={other:?}: expected avx512, avx2 or base (or unset: the widest this CPU has)"
            ));
        }
    };
    Ok(asked.min(cpu))
}

/// The widest level this CPU runs: each copy's `target_feature`s all present.
fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        // std caches the CPUID answers: each check is an atomic load.
        let fma = std::arch::is_x86_feature_detected!("fma");
        let avx2 = fma && std::arch::is_x86_feature_detected!("avx2");
        if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
            return Level::Avx512;
        }
        if avx2 {
            return Level::Avx2;
        }
    }
    Level::Base
}

/// `simd_fn!(fn name<M>(args) { body })` defines `fn name(args)` that runs `body` (generic
/// over `M: Mac`) compiled for the vector unit `level()` chooses. `body` is inlined into
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
                    body::<$crate::kernels::simd::Fused<64>>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) {
                    body::<$crate::kernels::simd::Fused<16>>($($arg),*)
                }
                match $crate::kernels::simd::level() {
                    // SAFETY: `level` is never wider than what this CPU has.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retrace_simd_caps_the_level_at_what_the_cpu_has() {
        use Level::*;
        assert_eq!(chosen(None, Avx512), Ok(Avx512));
        assert_eq!(chosen(Some(""), Avx2), Ok(Avx2));
        assert_eq!(chosen(Some("avx2"), Avx512), Ok(Avx2));
        assert_eq!(chosen(Some(" base "), Avx512), Ok(Base));
        assert_eq!(chosen(Some("avx512"), Avx512), Ok(Avx512));
        // Wider than the CPU: the CPU's widest, never an instruction it lacks.
        assert_eq!(chosen(Some("avx512"), Avx2), Ok(Avx2));
        assert_eq!(chosen(Some("avx2"), Base), Ok(Base));
        for bad in ["AVX-2", "sse", "avx512f"] {
            let err = chosen(Some(bad), Avx512).unwrap_err();
            assert!(err.contains("RETRACE_SIMD") && err.contains(bad), "{err}");
        }
    }

    /// The binary's cap, given after the kernels ran: the level they run is kept, and a cap
    /// that would change it is refused by the variable's name.
    #[test]
    fn a_cap_that_comes_after_the_kernels_ran_cannot_change_their_level() {
        let now = level();
        assert_eq!(cap_simd(now.name()), Ok(now.name()));
        assert!(cap_simd("sse").unwrap_err().contains("RETRACE_SIMD"));
        if now != detected() {
            let err = cap_simd("").unwrap_err();
            assert!(err.contains("came after"), "{err}");
        }
    }

    /// What the kernels' tests in this process run: the CI loop over `RETRACE_SIMD` relies on it.
    #[test]
    #[allow(clippy::disallowed_methods)]
    fn the_kernels_run_the_level_retrace_simd_names() {
        let asked = std::env::var(VAR).ok();
        let want = chosen(asked.as_deref(), detected()).unwrap();
        assert_eq!(
            level(),
            want,
            "{VAR}={asked:?} on a CPU whose widest is {:?}",
            detected()
        );
    }
}
