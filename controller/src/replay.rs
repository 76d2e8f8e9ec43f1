//! Replays a finished run's schedule in the step simulator with the pass costs it measured.
//!
//! The plan's prediction uses the cost model's rates; this one uses each chunk's median forward
//! and backward times and each stage's optimizer time as they ran, so the difference between the
//! replayed and the measured bubble isolates what the dependency model misses (contention between
//! actors sharing cores or memory bandwidth, transfer latency), not the rates.

use archipelago_dataflow::passes::schedule::{PassCosts, PipelineShape};
use archipelago_dataflow::simulate::{Prediction, simulate};
use archipelago_dataflow::{ComputeOp, Instruction, Plan};

/// The simulator's prediction with measured costs; `medians[actor][index]` is the median seconds
/// of each instruction of each actor's stream.
pub fn replay(plan: &Plan, medians: &[Vec<f64>]) -> Prediction {
    let p = &plan.program.plan;
    let shape = PipelineShape {
        pp: p.pp,
        v: p.virtual_stages,
        m: p.microbatches,
    };
    let chunks = plan.chunks.len();
    let chunk_of = |block: usize| {
        plan.chunks
            .iter()
            .position(|&(s, e)| (s..e).contains(&block))
            .unwrap_or(0)
    };
    let mut forward = vec![0.0; chunks];
    let mut backward = vec![0.0; chunks];
    let mut weight = vec![0.0; chunks];
    let mut optimizer = vec![0.0; p.pp];
    let replicas = p.dp as f64;
    for a in &plan.actors {
        for (instruction, &t) in plan.class_stream(a.actor).iter().zip(&medians[a.actor]) {
            let Instruction::Compute { op, .. } = instruction else {
                continue;
            };
            let share = t / replicas / shape.m as f64;
            match op {
                ComputeOp::Forward { start, .. } => forward[chunk_of(*start)] += share,
                ComputeOp::Loss { .. } => forward[chunks - 1] += share,
                ComputeOp::Backward { start, .. } | ComputeOp::BackwardInput { start, .. } => {
                    backward[chunk_of(*start)] += share
                }
                ComputeOp::BackwardWeight { start, .. } => {
                    backward[chunk_of(*start)] += share;
                    weight[chunk_of(*start)] += share;
                }
                ComputeOp::OptimizerStep { .. }
                | ComputeOp::GradNorm { .. }
                | ComputeOp::TrustNorms { .. } => optimizer[a.stage] += t / replicas,
                _ => {}
            }
        }
    }
    let costs = PassCosts {
        forward,
        backward,
        weight: Some(weight),
    };
    simulate(p.schedule, shape, &plan.schedule, &costs, &optimizer)
}
