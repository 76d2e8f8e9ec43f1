//! What `archipelago ps --report` writes: the shape of `train`'s report (every step's loss,
//! `param_l2`, `block_l2` for dense models) plus the parameter server's own figures — per server
//! pushes, pulls, refusals, bytes and keys, per worker its client's traffic, the ring's shares,
//! the largest lead a worker had over the slowest, and for sparse logistic regression the
//! objective and the recovered support.

use serde::{Deserialize, Serialize};

use archipelago_actors::ps::sparse_lr::{Recovery, objective, recovery};
use archipelago_actors::ps::{ClientFigures, CtrSpec, ServerFigures};

use super::{FailoverEvent, FinalModel, PsOutcome, Replication};
use crate::report::StepRecord;

/// One server's place on the ring.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RingShare {
    /// The server.
    pub server: usize,
    /// Its share of the key space.
    pub share: f64,
    /// Keys it holds at the end.
    pub keys: u64,
}

/// Sparse logistic regression's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SparseSummary {
    /// Examples of the held-out evaluation set.
    pub eval_examples: usize,
    /// The L1 weight of the objective.
    pub l1: f32,
    /// Mean log-loss + L1 at the start (all weights 0) on the evaluation set.
    pub objective_start: f64,
    /// The same at the end.
    pub objective_end: f64,
    /// The same for the true weights `w*`.
    pub objective_true: f64,
    /// How the non-zero weights compare with `w*`'s support.
    pub recovery: Recovery,
}

impl SparseSummary {
    /// The summary of `weights` learned on `spec` with penalty `l1`, on `eval` held-out examples.
    pub fn of(
        spec: &CtrSpec,
        weights: &std::collections::HashMap<u64, f32>,
        l1: f32,
        eval: usize,
    ) -> SparseSummary {
        let start = u64::MAX / 2;
        let examples = spec.examples(start..start + eval as u64);
        let truth = spec.true_weights();
        SparseSummary {
            eval_examples: eval,
            l1,
            objective_start: objective(&Default::default(), &examples, l1),
            objective_end: objective(weights, &examples, l1),
            objective_true: objective(&truth, &examples, l1),
            recovery: recovery(weights, &truth),
        }
    }
}

/// The report of a parameter-server job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PsReport {
    /// The model (`sparse-lr` or a zoo spec).
    pub model: String,
    /// The flags as given.
    pub plan: serde_json::Value,
    /// Parameters (dense) or keys held (sparse).
    pub params: u64,
    /// Every clock, numbered from 1 as train's steps.
    pub steps: Vec<StepRecord>,
    /// The loss of the last clock.
    pub final_loss: f32,
    /// L2 norm of the final model.
    pub param_l2: f64,
    /// L2 norm of each block's final parameters (dense models).
    pub block_l2: Vec<f64>,
    /// The consistency model.
    pub consistency: String,
    /// The servers' update rule.
    pub update: String,
    /// Each server's figures.
    pub servers: Vec<ServerFigures>,
    /// Each worker's traffic.
    pub workers: Vec<ClientFigures>,
    /// The ring.
    pub ring: Vec<RingShare>,
    /// The most clocks a granted pull was ahead of the slowest worker.
    pub max_lead: u64,
    /// Pulls answered "not yet", over every server.
    pub refused_pulls: u64,
    /// Seconds of the workers' loops.
    pub wall_s: f64,
    /// Examples (rows) per second over the run.
    pub samples_per_s: f64,
    /// Sparse logistic regression's objective and support.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse: Option<SparseSummary>,
    /// Copies of every range (chain replication).
    #[serde(default)]
    pub replicas: usize,
    /// Every failover: a server lost, its ranges back on `replicas` servers.
    #[serde(default)]
    pub failovers: Vec<FailoverEvent>,
    /// Copies of every key over the live servers at the end (with more than one replica).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<Replication>,
}

impl PsReport {
    /// The report of `outcome`; `blocks` are the dense model's block sizes (empty for sparse).
    pub fn new(
        model: String,
        plan: serde_json::Value,
        outcome: &PsOutcome,
        blocks: &[usize],
        global_batch: usize,
        update: String,
        consistency: String,
    ) -> PsReport {
        let steps: Vec<StepRecord> = outcome
            .losses
            .iter()
            .enumerate()
            .map(|(c, &loss)| StepRecord {
                step: outcome.first_clock + c as u64 + 1,
                loss,
                time_s: outcome
                    .workers
                    .iter()
                    .map(|w| w.steps[c].time_s)
                    .fold(0.0, f64::max),
                lr: None,
                grad_norm: None,
                loss_scale: None,
                skipped: false,
                transfers: Default::default(),
                fabric: Default::default(),
                fabric_crossing_islands: Default::default(),
            })
            .collect();
        let (params, param_l2, block_l2) = match &outcome.model {
            FinalModel::Dense(flat) => {
                let mut at = 0;
                let block_l2 = blocks
                    .iter()
                    .map(|&n| {
                        at += n;
                        l2(&flat[at - n..at])
                    })
                    .collect();
                (flat.len() as u64, l2(flat), block_l2)
            }
            FinalModel::Sparse(weights) => {
                let values: Vec<f32> = weights.values().copied().collect();
                (weights.len() as u64, l2(&values), Vec::new())
            }
        };
        let servers: Vec<ServerFigures> = outcome.servers.iter().map(|s| s.figures.clone()).collect();
        let ring = outcome
            .ring
            .shares()
            .into_iter()
            .map(|(server, share)| RingShare {
                server,
                share,
                keys: servers.iter().find(|s| s.index == server).map_or(0, |s| s.keys),
            })
            .collect();
        PsReport {
            model,
            plan,
            params,
            final_loss: steps.last().map_or(f32::NAN, |s| s.loss),
            steps,
            param_l2,
            block_l2,
            consistency,
            update,
            refused_pulls: servers.iter().map(|s| s.refused).sum(),
            max_lead: outcome.max_lead(),
            workers: outcome.workers.iter().map(|w| w.figures).collect(),
            servers,
            ring,
            wall_s: outcome.wall_s,
            samples_per_s: (outcome.losses.len() * global_batch) as f64 / outcome.wall_s.max(1e-9),
            sparse: None,
            replicas: outcome.replicas,
            failovers: outcome.failovers.clone(),
            replication: outcome.replication,
        }
    }
}

fn l2(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum::<f64>()
        .sqrt()
}
