//! The significantly-modified filter (Li et al., OSDI 2014, §3.4 "User-defined Filters"): a
//! worker pushes a key only once what it has to say about it has grown past a threshold; below
//! it, the gradient is held back and added to the key's next one (nothing is lost, only
//! delayed), so small, noisy entries stop costing bytes every clock.

use std::collections::HashMap;

/// The held-back remainders of one worker, per key.
#[derive(Debug, Clone, Default)]
pub struct SignificanceFilter {
    /// A key is pushed when the largest magnitude of its accumulated gradient exceeds this.
    pub threshold: f32,
    held: HashMap<u64, Vec<f32>>,
}

impl SignificanceFilter {
    /// A filter pushing keys whose accumulated gradient exceeds `threshold` in magnitude.
    pub fn new(threshold: f32) -> SignificanceFilter {
        SignificanceFilter {
            threshold,
            held: HashMap::new(),
        }
    }

    /// The keys (and their accumulated gradients, `width` each) to push now out of `keys` and
    /// `grads`; the rest is held back for the next clock.
    pub fn apply(&mut self, keys: &[u64], grads: &[f32], width: usize) -> (Vec<u64>, Vec<f32>) {
        let (mut sent_keys, mut sent) = (Vec::new(), Vec::new());
        for (key, grad) in keys.iter().zip(grads.chunks_exact(width)) {
            let mut total = self.held.remove(key).unwrap_or_else(|| vec![0.0; width]);
            total.iter_mut().zip(grad).for_each(|(t, g)| *t += g);
            if total.iter().any(|v| v.abs() > self.threshold) {
                sent_keys.push(*key);
                sent.extend_from_slice(&total);
            } else {
                self.held.insert(*key, total);
            }
        }
        (sent_keys, sent)
    }

    /// Keys with something held back.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_gradients_wait_and_add_up_until_they_matter() {
        let mut filter = SignificanceFilter::new(0.5);
        let (keys, grads) = filter.apply(&[1, 2, 3], &[0.3, 0.9, -0.2], 1);
        assert_eq!((keys, grads), (vec![2], vec![0.9]));
        assert_eq!(filter.held(), 2);
        // Key 1 accumulates 0.3 + 0.3 = 0.6 > 0.5: sent whole; key 3 reaches -0.4: held.
        let (keys, grads) = filter.apply(&[1, 3], &[0.3, -0.2], 1);
        assert_eq!(keys, vec![1]);
        assert!((grads[0] - 0.6).abs() < 1e-6);
        assert_eq!(filter.held(), 1);
        // Threshold 0: everything non-zero goes at once.
        let mut all = SignificanceFilter::new(0.0);
        assert_eq!(all.apply(&[7, 8], &[1e-9, 0.0, 0.0, 2.0], 2).0, vec![7, 8]);
    }
}
