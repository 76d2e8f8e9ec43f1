//! Choosing the next token from the logits, as OpenAI's and vLLM's sampling parameters say:
//! temperature (0: greedy), top-k, then top-p (nucleus sampling, Holtzman et al., "The Curious
//! Case of Neural Text Degeneration", 2020), drawn with a generator seeded per request so that a
//! sampled answer repeats.

use archipelago_dataflow::rng::SplitMix64;

/// A request's sampling parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampling {
    /// Divides the logits; 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keep the fewest most likely tokens whose probabilities reach `p` (`None` or 1: all).
    pub top_p: Option<f32>,
    /// The generator's seed.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }

    /// Refuses, naming the field and its range, what no sampler can do.
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature {} is not a finite number ≥ 0 (0 is greedy)",
                self.temperature
            ));
        }
        if self.top_k == Some(0) {
            return Err("top_k 0 keeps no token: give 1 or more, or leave it out".into());
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(format!("top_p {p} is outside (0, 1]"));
        }
        Ok(())
    }
}

/// The next tokens of one sequence under its [`Sampling`].
#[derive(Debug, Clone)]
pub struct Sampler {
    sampling: Sampling,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler whose draws follow from `sampling.seed` alone.
    pub fn new(sampling: Sampling) -> Sampler {
        Sampler {
            sampling,
            rng: SplitMix64::keyed(&[sampling.seed, 0x5a3b1e]),
        }
    }

    /// The next token from `logits` (one per vocabulary entry).
    pub fn next(&mut self, logits: &[f32]) -> u32 {
        let s = self.sampling;
        if s.temperature == 0.0 || s.top_k == Some(1) {
            return crate::generate::argmax(logits);
        }
        // Most likely first (ties by id, so the order does not depend on the sort).
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        order.truncate(s.top_k.unwrap_or(order.len()).min(order.len()));
        let max = f64::from(logits[order[0] as usize]);
        let t = f64::from(s.temperature);
        let mut probs: Vec<f64> = (order.iter())
            .map(|&i| ((f64::from(logits[i as usize]) - max) / t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if let Some(top_p) = s.top_p.filter(|&p| p < 1.0) {
            let mut kept = 0;
            let mut mass = 0.0;
            while kept < probs.len() && (kept == 0 || mass < f64::from(top_p)) {
                mass += probs[kept];
                kept += 1;
            }
            order.truncate(kept);
            probs.truncate(kept);
            probs.iter_mut().for_each(|p| *p /= mass);
        }
        let mut u = self.rng.uniform();
        for (&token, &p) in order.iter().zip(&probs) {
            if u < p {
                return token;
            }
            u -= p;
        }
        *order.last().expect("at least one token")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 5] = [2.0, 1.0, 0.5, 0.0, -1.0];

    fn sampled(sampling: Sampling, n: usize) -> Vec<u32> {
        let mut sampler = Sampler::new(sampling);
        (0..n).map(|_| sampler.next(&LOGITS)).collect()
    }

    fn at(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed,
        }
    }

    /// Temperature 0, top-k 1 and a tiny top-p are greedy; a seed repeats its draws and another
    /// seed draws others.
    #[test]
    fn greedy_forms_and_seeds() {
        assert!(sampled(Sampling::greedy(), 20).iter().all(|&t| t == 0));
        assert!(sampled(at(1.0, Some(1), None, 3), 20).iter().all(|&t| t == 0));
        assert!(sampled(at(1.0, None, Some(1e-3), 3), 20).iter().all(|&t| t == 0));
        let a = sampled(at(1.0, None, None, 7), 64);
        assert_eq!(a, sampled(at(1.0, None, None, 7), 64));
        assert_ne!(a, sampled(at(1.0, None, None, 8), 64));
    }

    /// Draws follow softmax(logits / T) (20,000 draws, each frequency within 0.01); top-k keeps
    /// the k most likely; top-p keeps the fewest whose mass reaches p (0.7 here: two tokens,
    /// 0.63 + 0.23), renormalised.
    #[test]
    fn draws_follow_the_truncated_softmax() {
        let n = 20_000;
        let freq = |draws: &[u32]| -> Vec<f64> {
            (0..5)
                .map(|t| draws.iter().filter(|&&d| d == t).count() as f64 / n as f64)
                .collect()
        };
        let softmax = |t: f64, keep: usize| -> Vec<f64> {
            let e: Vec<f64> = (LOGITS.iter().take(keep))
                .map(|&l| (f64::from(l) / t).exp())
                .collect();
            let s: f64 = e.iter().sum();
            (0..5).map(|i| e.get(i).map_or(0.0, |v| v / s)).collect()
        };
        for (sampling, want) in [
            (at(1.0, None, None, 1), softmax(1.0, 5)),
            (at(0.5, None, None, 2), softmax(0.5, 5)),
            (at(1.0, Some(3), None, 3), softmax(1.0, 3)),
            (at(1.0, None, Some(0.7), 4), softmax(1.0, 2)),
        ] {
            let got = freq(&sampled(sampling, n));
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 0.01, "{sampling:?}: {got:?} against {want:?}");
            }
        }
    }

    #[test]
    fn impossible_parameters_are_refused_by_name() {
        assert!(
            at(-0.1, None, None, 0)
                .check()
                .unwrap_err()
                .contains("temperature")
        );
        assert!(at(1.0, Some(0), None, 0).check().unwrap_err().contains("top_k"));
        assert!(at(1.0, None, Some(0.0), 0).check().unwrap_err().contains("top_p"));
        assert!(at(1.0, None, Some(1.5), 0).check().unwrap_err().contains("top_p"));
        at(0.0, Some(5), Some(1.0), 0).check().unwrap();
    }
}
