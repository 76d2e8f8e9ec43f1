//! Trial search on the runtime API: N trial actors train gpt variants in parallel, each on its
//! own device, and the program stops the worst ones early — successive halving (Jamieson &
//! Talwalkar 2016; the synchronous form of Ray Tune's ASHA, Li et al. 2020): every surviving
//! trial trains to the next rung, the program waits for all of them, keeps the better half and
//! stops the rest. A second mode trains a ladder of model sizes in parallel and fits their final
//! losses to L(N) = (N_c / N)^α (Kaplan et al. 2020), printing α and the fit's R².
//!
//! A trial is an actor that owns a checkpoint directory: `TrainTo(steps)` runs the library's
//! own training (`Controller::local` on the trial's device) from its last checkpoint up to
//! `steps` and checkpoints again, so a promoted trial continues where it stopped.
//!
//! The same code runs on this process or on a cluster: trial `i` goes to slot `i` (modulo the
//! slots) of the runtime — this process's devices, or the devices of the hosts running the
//! program's binary, where it trains on its host and keeps its checkpoints in its directory
//! there. Only configs and results (names, steps, losses) cross processes; a trial on a host
//! computes exactly what it computes here (`examples/tests/cluster.rs` compares the two).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use archipelago_controller::prelude::*;
use archipelago_controller::{Controller, TrainOptions};
use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program};

/// What one trial trains.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrialConfig {
    /// Its name.
    pub name: String,
    /// The model, e.g. `gpt:vocab=64,ctx=16,d=32,layers=1,heads=2`.
    pub model: String,
    /// Adam's learning rate.
    pub lr: f32,
    /// Global batch (sequences per step).
    pub batch: usize,
    /// Seed of the initial weights and data.
    pub seed: u64,
    /// Where the trial keeps its checkpoints.
    pub dir: PathBuf,
}

/// One trial: trains its model step range by step range.
pub struct Trial {
    config: TrialConfig,
    trained: u64,
}

impl Actor for Trial {
    type Params = TrialConfig;
    async fn new(config: TrialConfig, _ctx: &Context<Self>) -> Result<Self, String> {
        ModelSpec::parse(&config.model).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&config.dir).map_err(|e| format!("{}: {e}", config.dir.display()))?;
        Ok(Trial { config, trained: 0 })
    }
}

/// Where a trial stands after training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialResult {
    /// The trial.
    pub name: String,
    /// Steps trained so far.
    pub steps: u64,
    /// Its loss at the last step.
    pub loss: f32,
    /// The mean loss of the last tenth of the steps this call trained (at least one): a steadier
    /// figure than one batch's loss, which the scaling ladder fits.
    pub tail_loss: f32,
    /// Its model's parameter count.
    pub params: u64,
}

/// Train up to `0` steps in all (from the trial's last checkpoint).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainTo(pub u64);

impl Message for TrainTo {
    type Reply = Result<TrialResult, String>;
}

impl Handler<TrainTo> for Trial {
    async fn handle(&mut self, TrainTo(steps): TrainTo, ctx: &Context<Self>) -> Result<TrialResult, String> {
        let config = self.config.clone();
        let (device, resume) = (ctx.device(), self.trained > 0);
        // The library's training runs its own actors; this actor's thread only waits for it.
        let report = tokio::task::spawn_blocking(move || {
            let spec = ModelSpec::parse(&config.model).map_err(|e| e.to_string())?;
            let program = Program::new(spec)
                .with_plan(ParallelPlan {
                    batch: config.batch,
                    ..ParallelPlan::default()
                })
                .with_optimizer(OptimizerSpec::adam(config.lr))
                .with_seed(config.seed);
            let options = TrainOptions {
                steps,
                job: config.name.clone(),
                checkpoint_dir: Some(config.dir.clone()),
                checkpoint_every: steps,
                resume,
                // A promoted trial goes on past the steps it was first given.
                resume_override: if resume { vec!["steps".into()] } else { Vec::new() },
                ..TrainOptions::default()
            };
            Controller::local(vec![device])
                .train(&program, &options)
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())??;
        self.trained = steps;
        let tail = report.steps.len().div_ceil(10).max(1);
        let tail_losses = &report.steps[report.steps.len().saturating_sub(tail)..];
        Ok(TrialResult {
            name: self.config.name.clone(),
            steps,
            loss: report.final_loss,
            tail_loss: tail_losses.iter().map(|s| s.loss).sum::<f32>() / tail_losses.len().max(1) as f32,
            params: report.params,
        })
    }
}

/// The types that cross processes.
pub fn registry() -> Registry {
    Registry::new().actor::<Trial>().handles::<Trial, TrainTo>()
}

/// What successive halving did.
#[derive(Debug, Clone)]
pub struct Halving {
    /// Each rung: the results of every trial that reached it, best first.
    pub rungs: Vec<Vec<TrialResult>>,
    /// The trials stopped early, in the order they were stopped.
    pub stopped: Vec<String>,
    /// The winner.
    pub best: TrialResult,
    /// Where each trial ran, in the order of the configs: `(host, device)`.
    pub placement: Vec<(String, DeviceSpec)>,
}

/// Successive halving over `configs`: rung `k` trains the survivors to `first_rung · 2^k`
/// steps; after each rung the worse half is stopped, until one trial is left.
pub fn successive_halving(
    runtime: &Runtime,
    configs: Vec<TrialConfig>,
    first_rung: u64,
) -> anyhow::Result<Halving> {
    let slots = runtime.slots().len();
    let mut trials = Vec::new();
    for (i, config) in configs.into_iter().enumerate() {
        let options = SpawnOptions::named(config.name.clone());
        trials.push(runtime.spawn_at::<Trial>(i % slots, config, options).get()?);
    }
    let placement = trials
        .iter()
        .map(|t| (t.info().host.clone(), t.info().device))
        .collect();
    let (mut rungs, mut stopped) = (Vec::new(), Vec::new());
    let mut steps = first_rung;
    loop {
        let calls: Vec<_> = trials.iter().map(|t| t.call(TrainTo(steps))).collect();
        let done = runtime.wait(calls, trials.len(), None);
        let mut results = Vec::new();
        for (i, result) in done.ready {
            let result = result?.map_err(anyhow::Error::msg)?;
            results.push((i, result));
        }
        results.sort_by(|a, b| a.1.loss.total_cmp(&b.1.loss));
        rungs.push(results.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>());
        if results.len() == 1 {
            let best = results.remove(0).1;
            return Ok(Halving {
                rungs,
                stopped,
                best,
                placement,
            });
        }
        let keep = results.len().div_ceil(2);
        let survivors: Vec<usize> = results[..keep].iter().map(|(i, _)| *i).collect();
        for (i, result) in &results[keep..] {
            trials[*i].stop("stopped early by successive halving");
            stopped.push(result.name.clone());
        }
        trials = survivors.into_iter().map(|i| trials[i].clone()).collect();
        steps *= 2;
    }
}

/// A power law `L(N) = (N_c / N)^α` fitted to `(N, L)` points by least squares on
/// `log L = α log N_c − α log N`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerLaw {
    /// The exponent α.
    pub alpha: f64,
    /// The scale N_c.
    pub n_c: f64,
    /// The fit's coefficient of determination (in log space).
    pub r2: f64,
}

impl PowerLaw {
    /// The law in words, or — when the losses did not fall with size (α ≤ 0) — why no law is
    /// given: a fit with a negative exponent says the ladder trained too little, not that bigger
    /// models are worse.
    pub fn describe(&self) -> String {
        if self.alpha > 0.0 {
            format!(
                "L(N) = (N_c / N)^alpha: alpha {:.4}, N_c {:.3e}, R^2 {:.4}",
                self.alpha, self.n_c, self.r2
            )
        } else {
            format!(
                "no scaling seen (the fit's alpha is {:.4}: bigger models did not reach lower loss): train longer, \
                 or tune the learning rate per size",
                self.alpha
            )
        }
    }
}

/// Fits [`PowerLaw`] to `points` (`(parameters, loss)`, at least two distinct sizes).
pub fn fit_power_law(points: &[(f64, f64)]) -> PowerLaw {
    let xs: Vec<f64> = points.iter().map(|(n, _)| n.ln()).collect();
    let ys: Vec<f64> = points.iter().map(|(_, l)| l.ln()).collect();
    let count = xs.len() as f64;
    let (mx, my) = (xs.iter().sum::<f64>() / count, ys.iter().sum::<f64>() / count);
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
    let slope = sxy / sxx;
    let intercept = my - slope * mx;
    let ss_res: f64 = xs
        .iter()
        .zip(&ys)
        .map(|(x, y)| (y - intercept - slope * x).powi(2))
        .sum();
    let ss_tot: f64 = ys.iter().map(|y| (y - my).powi(2)).sum();
    let alpha = -slope;
    PowerLaw {
        alpha,
        n_c: (intercept / alpha).exp(),
        r2: 1.0 - ss_res / ss_tot,
    }
}

/// Trains every config of a ladder of model sizes for `steps` steps in parallel and fits their
/// tail losses (the mean of each run's last tenth) to a power law of the parameter count.
pub fn scaling_ladder(
    runtime: &Runtime,
    configs: Vec<TrialConfig>,
    steps: u64,
) -> anyhow::Result<(Vec<TrialResult>, PowerLaw)> {
    let slots = runtime.slots().len();
    let mut trials = Vec::new();
    for (i, config) in configs.into_iter().enumerate() {
        trials.push(
            runtime
                .spawn_at::<Trial>(i % slots, config, SpawnOptions::default())
                .get()?,
        );
    }
    let calls: Vec<_> = trials.iter().map(|t| t.call(TrainTo(steps))).collect();
    let mut results = Vec::new();
    for call in calls {
        results.push(call.get()?.map_err(anyhow::Error::msg)?);
    }
    let points: Vec<(f64, f64)> = (results.iter())
        .map(|r| (r.params as f64, r.tail_loss as f64))
        .collect();
    Ok((results, fit_power_law(&points)))
}
