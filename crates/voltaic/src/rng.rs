//! A counter-based random generator (Philox4x32-10).
//!
//! Element `i` of a draw depends only on the seed and the generator's offset
//! plus `i`, so every device can produce the same numbers independently and in
//! parallel: same seed, same numbers, on CPU and GPU alike.

use std::sync::Mutex;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds.
pub fn philox4x32(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// A seeded stream of random numbers.
#[derive(Clone, Debug)]
pub struct Generator {
    seed: u64,
    offset: u64,
}

impl Generator {
    /// A generator at the start of the stream of `seed`.
    pub fn new(seed: u64) -> Generator {
        Generator { seed, offset: 0 }
    }

    /// A generator `offset` numbers into the stream of `seed`: with
    /// [`Generator::seed`] and [`Generator::offset`], how a checkpoint
    /// saves and restores one.
    pub fn at(seed: u64, offset: u64) -> Generator {
        Generator { seed, offset }
    }

    /// The seed of this stream.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// How many numbers of the stream have been used.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    fn bits(&self, i: u64) -> [u32; 4] {
        let c = self.offset.wrapping_add(i);
        philox4x32([c as u32, (c >> 32) as u32, 0, 0], [self.seed as u32, (self.seed >> 32) as u32])
    }

    /// `n` uniform numbers in `[0, 1)` (24 random bits each, as f32 holds).
    pub fn uniform(&mut self, n: usize) -> Vec<f64> {
        let v = (0..n as u64).map(|i| (self.bits(i)[0] >> 8) as f64 * (1.0 / (1u64 << 24) as f64)).collect();
        self.offset = self.offset.wrapping_add(n as u64);
        v
    }

    /// `n` uniform numbers in `[0, 1)` with 53 random bits each (for f64 tensors).
    pub fn uniform53(&mut self, n: usize) -> Vec<f64> {
        let v = (0..n as u64)
            .map(|i| {
                let b = self.bits(i);
                let x = ((b[0] as u64) << 21) ^ (b[1] as u64 >> 11);
                (x & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
            })
            .collect();
        self.offset = self.offset.wrapping_add(n as u64);
        v
    }

    /// `n` standard normal numbers (Box-Muller on two words of each counter).
    pub fn normal(&mut self, n: usize) -> Vec<f64> {
        let v = (0..n as u64)
            .map(|i| {
                let b = self.bits(i);
                let u1 = ((b[0] as f64) + 1.0) / 4294967297.0; // (0, 1]
                let u2 = (b[1] as f64) / 4294967296.0;
                (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
            })
            .collect();
        self.offset = self.offset.wrapping_add(n as u64);
        v
    }
}

static DEFAULT: Mutex<Option<Generator>> = Mutex::new(None);

/// Default seed, used until [`manual_seed`] is called.
pub const DEFAULT_SEED: u64 = 0x0005_EED0_F701_7A1C;

/// Reset the default generator to the start of `seed`'s stream (PyTorch's `torch.manual_seed`).
pub fn manual_seed(seed: u64) {
    *DEFAULT.lock().unwrap_or_else(|e| e.into_inner()) = Some(Generator::new(seed));
}

/// The default generator's state (PyTorch's `torch.get_rng_state`).
pub fn rng_state() -> Generator {
    with_default(|g| g.clone())
}

/// Restore the default generator's state (PyTorch's `torch.set_rng_state`).
pub fn set_rng_state(g: Generator) {
    *DEFAULT.lock().unwrap_or_else(|e| e.into_inner()) = Some(g);
}

thread_local! {
    /// The thread's own generator while [`with_own_generator`] runs.
    static OWN: std::cell::RefCell<Option<Generator>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` with draws from the default generator going to a generator of
/// this thread's own (from [`DEFAULT_SEED`]) instead: a dry run compiling a
/// step ahead on another thread must not move the run's random stream (its
/// initialisation, dropout). Nested calls share the outermost's.
pub(crate) fn with_own_generator<R>(f: impl FnOnce() -> R) -> R {
    if OWN.with(|g| g.borrow().is_some()) {
        return f();
    }
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            OWN.with(|g| g.borrow_mut().take());
        }
    }
    OWN.with(|g| *g.borrow_mut() = Some(Generator::new(DEFAULT_SEED)));
    let _restore = Restore;
    f()
}

/// Run `f` with the default generator (or the thread's own, see
/// [`with_own_generator`]).
pub(crate) fn with_default<T>(f: impl FnOnce(&mut Generator) -> T) -> T {
    if OWN.with(|g| g.borrow().is_some()) {
        return OWN.with(|g| f(g.borrow_mut().as_mut().expect("checked just above")));
    }
    let mut g = DEFAULT.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(|| Generator::new(DEFAULT_SEED)))
}
