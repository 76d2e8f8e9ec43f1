//! Sparse logistic regression with L1, the parameter server's workload in Li et al. (OSDI 2014,
//! §5.1): a synthetic click-through data set generated from a seed, and the worker that trains
//! it. Features follow a power law (feature of rank `k` drawn with probability ∝ `1/(k+1)`: a
//! few are in nearly every example, most are rare); a known sparse weight vector `w*` on some
//! frequent features decides the labels (`P(click) = σ(w*·x)`). Weights are keys of width 1,
//! created at 0 on first touch; the servers' proximal L1 update makes the model sparse.
//!
//! Nothing is stored: example `i` is a pure function of `(seed, i)`, so a worker generates its
//! rows of clock `c` (examples `c·N + r·B ..`, as a dense worker takes its rows) wherever it runs.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::client::{ClientFigures, PsClient};
use super::ring::ring_position;
use super::update::ServerUpdate;
use super::worker::{LoopSettings, Train, WorkerRun, WorkerStep};
use crate::runtime::{Actor, Context, Handler};

/// The synthetic click-through data set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CtrSpec {
    /// Seed of the examples and of `w*`.
    pub seed: u64,
    /// Features (keys `0 .. features`).
    pub features: u64,
    /// Feature draws per example (duplicates merge, so a few less features).
    pub draws: usize,
    /// Non-zero weights of `w*`, on features among the `4 × support` most frequent.
    pub support: usize,
}

/// A uniform `f64` in `[0, 1)` from `(seed, a, b)`.
fn uniform(seed: u64, a: u64, b: u64) -> f64 {
    let bits = ring_position(ring_position(seed ^ ring_position(a)) ^ b.wrapping_mul(0xA24B_AED4_963E_E407));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// `1 / (1 + e^−z)`.
pub fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// One example: its features (each with value 1) and its label.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// Distinct features, ascending.
    pub features: Vec<u64>,
    /// Clicked (1) or not (0).
    pub label: f32,
}

impl CtrSpec {
    /// Checks the sizes, naming the fix.
    pub fn check(&self) -> Result<(), String> {
        if self.features < 2 || self.draws == 0 || self.support == 0 {
            return Err("sparse-lr needs at least 2 features, 1 draw per example and 1 true weight".into());
        }
        if 4 * self.support as u64 > self.features {
            return Err(format!(
                "{} true weights need at least {} features (they sit among the 4× most frequent)",
                self.support,
                4 * self.support
            ));
        }
        Ok(())
    }

    /// The true weight vector `w*`: feature → weight (`±(1..2)`).
    pub fn true_weights(&self) -> HashMap<u64, f32> {
        let pool = 4 * self.support as u64;
        let mut ranked: Vec<(u64, u64)> = (0..pool)
            .map(|k| (ring_position(self.seed ^ 0x7E11 ^ ring_position(k)), k))
            .collect();
        ranked.sort_unstable();
        ranked
            .into_iter()
            .take(self.support)
            .map(|(_, k)| {
                let u = uniform(self.seed, 0xB0, k);
                let sign = if u < 0.5 { -1.0 } else { 1.0 };
                (k, (sign * (1.0 + 2.0 * (u - 0.5).abs())) as f32)
            })
            .collect()
    }

    /// Example `i`, given `w*`.
    pub fn example(&self, i: u64, truth: &HashMap<u64, f32>) -> Example {
        let ln = (self.features as f64).ln();
        let mut features: Vec<u64> = (0..self.draws as u64)
            .map(|d| {
                // Inverse CDF of P(k) ∝ 1/(k+1) on 0..F (continuous approximation).
                let k = (uniform(self.seed, i, d) * ln).exp() as u64 - 1;
                k.min(self.features - 1)
            })
            .collect();
        features.sort_unstable();
        features.dedup();
        let margin: f64 = features
            .iter()
            .filter_map(|f| truth.get(f))
            .map(|&w| w as f64)
            .sum();
        let clicked = uniform(self.seed, i, u64::MAX) < sigmoid(margin);
        Example {
            features,
            label: if clicked { 1.0 } else { 0.0 },
        }
    }

    /// Examples `range` (an evaluation set: use indices no clock trains on, e.g. from `u64::MAX / 2`).
    pub fn examples(&self, range: std::ops::Range<u64>) -> Vec<Example> {
        let truth = self.true_weights();
        range.map(|i| self.example(i, &truth)).collect()
    }
}

/// The L1-regularised objective of `weights` on `examples`: mean log-loss + `l1 · ‖w‖₁`.
pub fn objective(weights: &HashMap<u64, f32>, examples: &[Example], l1: f32) -> f64 {
    let loss: f64 = examples
        .iter()
        .map(|e| {
            let z: f64 = e
                .features
                .iter()
                .filter_map(|f| weights.get(f))
                .map(|&w| w as f64)
                .sum();
            log_loss(z, e.label)
        })
        .sum();
    let norm: f64 = weights.values().map(|w| w.abs() as f64).sum();
    loss / examples.len().max(1) as f64 + l1 as f64 * norm
}

/// `−log p(label)` for margin `z`, computed stably.
fn log_loss(z: f64, label: f32) -> f64 {
    let softplus = |x: f64| {
        if x > 0.0 {
            x + (-x).exp().ln_1p()
        } else {
            x.exp().ln_1p()
        }
    };
    if label > 0.5 { softplus(-z) } else { softplus(z) }
}

/// How well `weights` recover `w*`'s support.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Recovery {
    /// Non-zero weights learned.
    pub nonzero: usize,
    /// True features among them.
    pub true_found: usize,
    /// Features of `w*`.
    pub support: usize,
    /// Learned non-zero weights whose sign matches `w*`'s.
    pub sign_agree: usize,
}

/// Compares the non-zero `weights` with `w*`.
pub fn recovery(weights: &HashMap<u64, f32>, truth: &HashMap<u64, f32>) -> Recovery {
    let nonzero: Vec<(&u64, &f32)> = weights.iter().filter(|(_, w)| **w != 0.0).collect();
    let found: Vec<_> = nonzero.iter().filter(|(k, _)| truth.contains_key(k)).collect();
    Recovery {
        nonzero: nonzero.len(),
        true_found: found.len(),
        support: truth.len(),
        sign_agree: found
            .iter()
            .filter(|(k, w)| truth[k].signum() == w.signum())
            .count(),
    }
}

/// What a sparse-LR worker is built from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SparseLrParams {
    /// The data set.
    pub data: CtrSpec,
    /// Its loop.
    pub settings: LoopSettings,
}

/// A worker of sparse logistic regression.
pub struct SparseLrWorker<U: ServerUpdate> {
    params: SparseLrParams,
    truth: HashMap<u64, f32>,
    _rule: std::marker::PhantomData<fn() -> U>,
}

impl<U: ServerUpdate> Actor for SparseLrWorker<U> {
    type Params = SparseLrParams;

    async fn new(params: SparseLrParams, _ctx: &Context<Self>) -> Result<Self, String> {
        params.data.check()?;
        if params.settings.local_batch == 0 {
            return Err("a sparse-lr worker needs at least one example per clock".into());
        }
        Ok(SparseLrWorker {
            truth: params.data.true_weights(),
            params,
            _rule: std::marker::PhantomData,
        })
    }
}

impl<U: ServerUpdate> SparseLrWorker<U> {
    /// This worker's examples of `clock` and the distinct features they touch.
    fn batch(&self, clock: u64) -> (Vec<Example>, Vec<u64>) {
        let s = &self.params.settings;
        let first = clock * s.global_batch() as u64 + (s.rank * s.local_batch) as u64;
        let examples: Vec<Example> = (first..first + s.local_batch as u64)
            .map(|i| self.params.data.example(i, &self.truth))
            .collect();
        let mut keys: Vec<u64> = examples.iter().flat_map(|e| e.features.iter().copied()).collect();
        keys.sort_unstable();
        keys.dedup();
        (examples, keys)
    }

    /// Its share of the mean log-loss of the global batch and the gradient for `keys`.
    fn gradient(&self, examples: &[Example], keys: &[u64], weights: &[f32]) -> (f32, Vec<f32>) {
        let scale = 1.0 / self.params.settings.global_batch() as f64;
        let at = |f: &u64| keys.binary_search(f).expect("a key of the batch");
        let mut grad = vec![0.0f64; keys.len()];
        let mut loss = 0.0;
        for e in examples {
            let z: f64 = e.features.iter().map(|f| weights[at(f)] as f64).sum();
            loss += log_loss(z, e.label);
            let residual = (sigmoid(z) - e.label as f64) * scale;
            e.features.iter().for_each(|f| grad[at(f)] += residual);
        }
        (
            (loss * scale) as f32,
            grad.into_iter().map(|g| g as f32).collect(),
        )
    }
}

impl<U: ServerUpdate> Handler<Train<U>> for SparseLrWorker<U> {
    async fn handle(&mut self, train: Train<U>, _ctx: &Context<Self>) -> Result<WorkerRun, String> {
        let settings = self.params.settings.clone();
        let mut client = PsClient::new(settings.rank, 1, train.ring, train.servers)?
            .replicated(train.replicas)?
            .logging_acked(settings.log_acked)
            .caching_keys(settings.key_caching)
            .filtering(settings.filter);
        let mut steps = Vec::new();
        let wire_at_start = crate::runtime::remote::wire_bytes_out();
        for clock in train.first_clock..train.first_clock + train.clocks {
            let began = std::time::Instant::now();
            let (examples, keys) = self.batch(clock);
            let pulled = client.pull(clock, &keys).await?;
            settings.before_compute(clock).await?;
            let (loss, grad) = self.gradient(&examples, &keys, &pulled.values);
            client.push(clock, &keys, &grad).await?;
            steps.push(WorkerStep {
                clock,
                applied: pulled.applied,
                loss,
                refused: pulled.refused,
                time_s: began.elapsed().as_secs_f64(),
            });
        }
        Ok(WorkerRun {
            steps,
            figures: ClientFigures {
                wire_bytes_out: crate::runtime::remote::wire_bytes_out() - wire_at_start,
                ..client.figures()
            },
            acked: client.acked(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_follow_a_power_law_and_labels_follow_the_true_weights() {
        let spec = CtrSpec {
            seed: 1,
            features: 100_000,
            draws: 20,
            support: 50,
        };
        let truth = spec.true_weights();
        assert_eq!(truth.len(), 50);
        assert!(truth.keys().all(|&k| k < 200));
        let examples = spec.examples(0..2000);
        let mut counts: HashMap<u64, usize> = HashMap::new();
        examples
            .iter()
            .flat_map(|e| &e.features)
            .for_each(|f| *counts.entry(*f).or_default() += 1);
        // The most frequent feature is in most examples; most features seen are rare.
        assert!(counts[&0] > 1000, "{}", counts[&0]);
        let rare = counts.values().filter(|&&c| c <= 2).count();
        assert!(rare * 2 > counts.len(), "{rare} of {}", counts.len());
        // w* explains the labels better than w = 0.
        let zero = objective(&HashMap::new(), &examples, 0.0);
        let best = objective(&truth, &examples, 0.0);
        assert!((zero - 2f64.ln()).abs() < 1e-9 && best < zero, "{best} vs {zero}");
        assert_eq!(spec.example(7, &truth), spec.example(7, &truth));
        let r = recovery(&truth, &truth);
        assert_eq!((r.nonzero, r.true_found, r.sign_agree), (50, 50, 50));
    }
}
