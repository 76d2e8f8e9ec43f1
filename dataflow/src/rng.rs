//! A small deterministic random number generator (SplitMix64) for initialisation and data.
//!
//! Every stream is keyed by explicit seeds, so any actor can regenerate exactly the same numbers
//! for any block or batch without communication (Steele, Lea & Flood, "Fast splittable
//! pseudorandom number generators", OOPSLA 2014).

/// SplitMix64 with helpers for uniform and Gaussian draws.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
    spare_gaussian: Option<f64>,
}

impl SplitMix64 {
    /// A generator keyed by a list of integers (e.g. `[seed, block]`).
    pub fn keyed(keys: &[u64]) -> SplitMix64 {
        let mut state = 0x243F_6A88_85A3_08D3_u64;
        for &k in keys {
            state = mix(state ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        SplitMix64 {
            state,
            spare_gaussian: None,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.state)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform_in(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Standard normal (Box–Muller).
    pub fn gaussian(&mut self) -> f64 {
        if let Some(z) = self.spare_gaussian.take() {
            return z;
        }
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        self.spare_gaussian = Some(r * theta.sin());
        r * theta.cos()
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| SplitMix64::keyed(&[1, 2]).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(
            SplitMix64::keyed(&[1, 2]).next_u64(),
            SplitMix64::keyed(&[2, 1]).next_u64()
        );
        let mut r = SplitMix64::keyed(&[7]);
        let n = 20_000;
        let mean: f64 = (0..n).map(|_| r.gaussian()).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        assert!((0..1000).all(|_| r.below(10) < 10));
    }
}
