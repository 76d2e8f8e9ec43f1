//! The figures a training run collects step by step (per actor: compute and wait times, bubble,
//! peaks of memory and of micro-batches held; per instruction: times) and the report made of
//! them when the steps are done, with what the gang holds at the end (norms, and parameters when
//! asked).

use archipelago_actors::executor::StepReport;
use archipelago_actors::offload::OffloadStats;
use archipelago_dataflow::memory::MemoryEstimate;
use archipelago_dataflow::simulate::Prediction;
use archipelago_dataflow::{Instruction, Plan};

use super::options::TrainOptions;
use crate::JobError;
use crate::gang::Gang;
use crate::process_stats::{load_avg, peak_rss_bytes};
use crate::replay::replay;
use crate::report::{
    ActorParams, ActorRecord, InstructionRecord, OffloadRecord, StepRecord, TrainReport, median,
};

/// Steps whose timings the medians of a report cover at least (the last 1,024 to 2,047): a
/// job of a million steps holds no more timings than one of two thousand.
const RECENT_STEPS: usize = 1024;

/// Per-actor figures of the steps so far (timings of the recent steps only, see
/// [`RECENT_STEPS`]), indexed by actor id.
pub(crate) struct StepFigures {
    compute: Vec<Vec<f64>>,
    wait: Vec<Vec<f64>>,
    bubble: Vec<Vec<f64>>,
    peak_state_bytes: Vec<u64>,
    peak_microbatches_held: Vec<usize>,
    peak_checkpoints: Vec<archipelago_dataflow::CheckpointBytes>,
    /// Times of each instruction of each actor's stream.
    instructions: Vec<Vec<Vec<f64>>>,
}

impl StepFigures {
    /// No steps yet, for the actors of `plan`.
    pub(crate) fn new(plan: &Plan) -> StepFigures {
        let n = plan.actors.len();
        StepFigures {
            compute: vec![Vec::new(); n],
            wait: vec![Vec::new(); n],
            bubble: vec![Vec::new(); n],
            peak_state_bytes: vec![0; n],
            peak_microbatches_held: vec![0; n],
            peak_checkpoints: vec![Default::default(); n],
            instructions: (plan.actors.iter())
                .map(|a| vec![Vec::new(); plan.class_stream(a.actor).len()])
                .collect(),
        }
    }

    /// Adds one step's reports; its bubbles count when `count_bubble` (not the first step of a
    /// run of several, which warms up).
    pub(crate) fn add(&mut self, plan: &Plan, reports: &[StepReport], count_bubble: bool) {
        // The step as the actors saw it: from the first stream's start to the last one's end.
        let first = reports
            .iter()
            .map(|r| r.began_unix_s)
            .fold(f64::INFINITY, f64::min);
        let span = reports
            .iter()
            .map(|r| r.began_unix_s + r.seconds - first)
            .fold(0.0, f64::max);
        for r in reports {
            let a = r.actor;
            let (compute, wait) = split_time(plan.class_stream(a), r);
            push_recent(&mut self.compute[a], compute);
            push_recent(&mut self.wait[a], wait);
            if count_bubble {
                push_recent(&mut self.bubble[a], 1.0 - compute / span.max(1e-12));
            }
            self.peak_state_bytes[a] = self.peak_state_bytes[a].max(r.metrics.peak_model_state_bytes);
            self.peak_microbatches_held[a] =
                self.peak_microbatches_held[a].max(r.metrics.peak_microbatches_held);
            let (peak, now) = (&mut self.peak_checkpoints[a], r.metrics.activation_checkpoints);
            (peak.device, peak.host) = (peak.device.max(now.device), peak.host.max(now.host));
            for t in &r.timings {
                push_recent(&mut self.instructions[a][t.index], t.seconds);
            }
        }
    }
}

/// The report of a run: its `steps`, the figures, the `last` step's reports, and what `gang`
/// holds at the end.
pub(crate) async fn final_report<G: Gang>(
    gang: &mut G,
    plan: &Plan,
    options: &TrainOptions,
    steps: &[StepRecord],
    last: &[StepReport],
    mut figures: StepFigures,
) -> Result<TrainReport, JobError> {
    let instruction_medians: Vec<Vec<f64>> = (figures.instructions.iter_mut())
        .map(|actor| actor.iter_mut().map(|times| median(times)).collect())
        .collect();
    let replayed = replay(plan, &instruction_medians);
    let squares = block_squares(gang, plan).await?;
    let held_params = if options.keep_params {
        held_params(gang, plan).await?
    } else {
        Vec::new()
    };
    let mut times: Vec<f64> = steps
        .iter()
        .skip(usize::from(steps.len() > 1))
        .map(|s| s.time_s)
        .collect();
    let median_step_s = median(&mut times);
    let program = &plan.program;
    let samples_per_s = if median_step_s > 0.0 {
        program.plan.batch as f64 / median_step_s
    } else {
        0.0
    };
    let tokens = program.model.input.tokens_per_sample();
    Ok(TrainReport {
        model: program.model.name.clone(),
        plan: options.flags.clone(),
        params: program.model.distinct_params(),
        trainable_params: (program.model.blocks.iter()).map(|b| b.trained_params()).sum(),
        final_loss: steps.last().map_or(f32::NAN, |s| s.loss),
        restarts: Vec::new(),
        steps: steps.to_vec(),
        param_l2: squares.iter().sum::<f64>().sqrt(),
        block_l2: squares.iter().map(|s| s.sqrt()).collect(),
        held_params,
        actors: (last.iter())
            .map(|r| actor_record(plan, r, &mut figures, &replayed, &instruction_medians[r.actor]))
            .collect(),
        // The largest process: this one, or a host's (multi-host jobs).
        peak_rss_bytes: last
            .iter()
            .map(|r| r.host_peak_rss_bytes)
            .fold(peak_rss_bytes(), u64::max),
        samples_per_s,
        tokens_per_s: (tokens > 1).then_some(samples_per_s * tokens as f64),
        median_step_s,
        predicted_step_s: plan.prediction.step_s,
        replayed_step_s: replayed.step_s,
        load_avg: load_avg(),
        cpu_matmul: archipelago_actors::kernels::describe(),
    })
}

/// Sums of squares of the parameters by block, over every actor.
async fn block_squares<G: Gang>(gang: &mut G, plan: &Plan) -> Result<Vec<f64>, JobError> {
    let mut squares = vec![0.0f64; plan.program.model.blocks.len()];
    for (block, sq) in gang.block_squares().await? {
        squares[block] += sq;
    }
    Ok(squares)
}

/// A copy of every parameter every actor holds, with each actor's stage and replica.
async fn held_params<G: Gang>(gang: &mut G, plan: &Plan) -> Result<Vec<ActorParams>, JobError> {
    let held = gang.held_params().await?;
    Ok((held.into_iter())
        .map(|(actor, parts)| ActorParams {
            actor,
            stage: plan.actors[actor].stage,
            replica: plan.actors[actor].replica,
            parts,
        })
        .collect())
}

/// The report's record of the actor of `r` (the last step's report).
fn actor_record(
    plan: &Plan,
    r: &StepReport,
    figures: &mut StepFigures,
    replayed: &Prediction,
    instruction_medians: &[f64],
) -> ActorRecord {
    let a = r.actor;
    let (placed, memory) = (&plan.actors[a], &plan.memory[a]);
    ActorRecord {
        actor: a,
        device: placed.device.to_string(),
        model_state_bytes: r.metrics.model_state_bytes,
        optimizer_state_bytes: r.metrics.optimizer_state_bytes,
        estimated_optimizer_state_bytes: memory.optimizer,
        peak_model_state_bytes: figures.peak_state_bytes[a],
        estimated_model_state_bytes: memory.model_state(),
        compute_weight_bytes: r.metrics.compute_weight_bytes,
        estimated_compute_weight_bytes: memory.compute_weights,
        estimated_device_bytes: memory.total(),
        device_memory: r.metrics.device_memory,
        fabric_bytes_per_step: r.metrics.fabric,
        predicted_fabric_bytes_per_step: plan.fabric.get(a).copied().unwrap_or_default(),
        fabric_crossing_islands_per_step: r.metrics.fabric_crossing_islands,
        hpz_secondary_bytes: r.metrics.hpz_secondary_bytes,
        estimated_hpz_secondary_bytes: memory.secondary_params,
        offload_bytes_per_step: r.metrics.offload_traffic,
        predicted_offload_bytes_per_step: plan.offload_traffic.get(a).copied().unwrap_or_default(),
        offload: r.metrics.offload.map(|o| offload_record(&o, memory)),
        stage: placed.stage,
        replica: placed.replica,
        bubble: median(&mut figures.bubble[a]),
        predicted_bubble: plan.prediction.bubble[placed.stage],
        replayed_bubble: replayed.bubble[placed.stage],
        peak_microbatches_held: figures.peak_microbatches_held[a],
        predicted_peak_microbatches_held: plan.prediction.peak_in_flight[placed.stage],
        activation_checkpoint_bytes: figures.peak_checkpoints[a],
        estimated_activation_checkpoint_bytes: archipelago_dataflow::CheckpointBytes {
            device: memory.activation_checkpoints,
            host: memory.activation_checkpoints_host,
        },
        compute_s: median(&mut figures.compute[a]),
        comm_wait_s: median(&mut figures.wait[a]),
        instructions: (plan.stream(a).instructions.iter())
            .zip(instruction_medians)
            .map(|(i, &median_s)| InstructionRecord {
                instruction: i.to_string(),
                median_s,
            })
            .collect(),
    }
}

/// The report's view of an offload actor's figures.
fn offload_record(o: &OffloadStats, estimate: &MemoryEstimate) -> OffloadRecord {
    let rate = |bytes: u64, s: f64| if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 };
    OffloadRecord {
        host_bytes: o.tier.host_bytes,
        estimated_host_bytes: estimate.host,
        disk_bytes: o.tier.disk_bytes,
        estimated_disk_bytes: estimate.disk,
        read_bytes: o.tier.read_bytes,
        read_gb_s: rate(o.tier.read_bytes, o.tier.read_s),
        written_bytes: o.tier.written_bytes,
        write_gb_s: rate(o.tier.written_bytes, o.tier.write_s),
        wait_s: o.tier.wait_s,
        optimizer_s: o.optimizer_s,
    }
}

/// Seconds in compute and seconds waiting for peers (receives and collective waits) in a step.
fn split_time(stream: &[Instruction], report: &StepReport) -> (f64, f64) {
    let mut compute = 0.0;
    let mut wait = 0.0;
    for t in &report.timings {
        match stream.get(t.index) {
            Some(Instruction::Compute { .. }) => compute += t.seconds,
            Some(Instruction::Recv { .. } | Instruction::WaitCollective { .. }) => wait += t.seconds,
            _ => {}
        }
    }
    (compute, wait)
}

/// Appends a step's timing, forgetting the oldest [`RECENT_STEPS`] once twice as many are held.
fn push_recent(times: &mut Vec<f64>, value: f64) {
    times.push(value);
    if times.len() >= 2 * RECENT_STEPS {
        times.drain(..RECENT_STEPS);
    }
}
