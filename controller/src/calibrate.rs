//! The step simulator's cost model calibrated on this machine (`archipelago plan --rate measure`).
//!
//! The rates come from a short real run of the job's own model on one actor of this process at
//! the plan's micro-batch size (a few steps, the first untimed): the forward's flop rate (the cost
//! model's `2 · params` flops per token over the forward's median time), the backward over the
//! forward (the forward counting the batch load and the loss: on a GPU the forward's kernels
//! drain where the loss is read back), and the optimizer's parameters per second. A CPU plan is timed on one CPU actor; a GPU
//! plan on one actor of its first GPU, with the plan's state placement (the GPU's own rates). The
//! plan's actors take turns on the compute units they share (this machine's cores; the plan's
//! distinct GPUs where several actors sit on one): the step is then at least their total busy time
//! over the units (`Prediction::share_cores`). A model too large to run here for a few steps, or a
//! plan that mixes CPUs and GPUs, keeps the default rates (those of the project's 2-core machine),
//! and says so.

use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::{CostModel, DeviceSpec, ParallelPlan, Program, StatePlacement};

use crate::Controller;
use crate::train::TrainOptions;

/// Steps of the calibration run (the first is not timed).
const STEPS: u64 = 8;
/// Models larger than this are not run for calibration (parameters).
const MAX_PARAMS: u64 = 200_000_000;

/// A calibrated cost model and how it was made, in words.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The rates.
    pub cost_model: CostModel,
    /// Where they come from.
    pub how: String,
}

/// The cost model for `program` on this machine.
pub fn cost_model(program: &Program) -> Calibration {
    let base = CostModel::default();
    let default = |why: &str| Calibration {
        cost_model: base,
        how: format!("the default rates of the project's 2-core CPU machine ({why})"),
    };
    let Some(target) = timing_target(&program.devices) else {
        return default("the plan mixes CPU and GPU devices");
    };
    if program.model.params() > MAX_PARAMS {
        return default("the model is too large to time here");
    }
    let rows = micro_batch_rows(&program.plan);
    let timed = match time_one_actor(program, rows, &target) {
        Ok(timed) => timed,
        Err(why) => return default(&format!("the timing run failed: {why}")),
    };
    let actors = program.plan.actors();
    let units = target.units;
    let tokens = (rows * program.model.input.tokens_per_sample()) as f64;
    let flops = 2.0 * program.model.params() as f64 * tokens;
    let trained: u64 = program.model.blocks.iter().map(|b| b.trained_params()).sum();
    let cost_model = CostModel {
        flops_per_s: flops / timed.forward_s.max(1e-9),
        backward_over_forward: timed.backward_s / timed.forward_s.max(1e-9),
        optimizer_params_per_s: trained as f64 / timed.optimizer_s.max(1e-9),
        compute_units: Some(units),
        ..base
    };
    let shared = if actors > units {
        format!("; {actors} actors take turns on {units} {}", target.unit_name)
    } else {
        String::new()
    };
    Calibration {
        cost_model,
        how: format!(
            "measured: {} steps of this model on one actor of {} at {rows} rows a micro-batch (forward \
             {:.1} ms, backward {:.1} ms, optimizer {:.1} ms){shared}",
            STEPS,
            target.device,
            1e3 * timed.forward_s,
            1e3 * timed.backward_s,
            1e3 * timed.optimizer_s
        ),
    }
}

/// Where the calibration runs and what the plan's actors share.
struct TimingTarget {
    /// The device the one timing actor runs on.
    device: DeviceSpec,
    /// The timing run's state placement (the host for a CPU; the plan's own for a GPU).
    state: Option<StatePlacement>,
    /// Compute units the plan's actors share.
    units: usize,
    /// Their name, plural.
    unit_name: &'static str,
}

/// A CPU plan is timed on `cpu:0` and shares this machine's cores; a GPU plan on its first GPU,
/// sharing its distinct GPUs. `None` for a plan that mixes the two.
fn timing_target(devices: &[DeviceSpec]) -> Option<TimingTarget> {
    let mut gpus: Vec<DeviceSpec> = devices
        .iter()
        .copied()
        .filter(|d| d.cuda_ordinal().is_some())
        .collect();
    if gpus.is_empty() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        return Some(TimingTarget {
            device: DeviceSpec::Cpu(0),
            state: Some(StatePlacement::Host),
            units: cores,
            unit_name: "CPU cores",
        });
    }
    if gpus.len() != devices.len() {
        return None;
    }
    let device = gpus[0];
    gpus.sort_by_key(|d| d.cuda_ordinal());
    gpus.dedup();
    Some(TimingTarget {
        device,
        state: None,
        units: gpus.len(),
        unit_name: if gpus.len() == 1 { "GPU" } else { "GPUs" },
    })
}

/// Rows of one micro-batch on one replica.
fn micro_batch_rows(plan: &ParallelPlan) -> usize {
    (plan.batch / plan.dp.max(1) / plan.microbatches.max(1)).max(1)
}

/// Median seconds of the timing run's passes.
struct Timed {
    forward_s: f64,
    backward_s: f64,
    optimizer_s: f64,
}

/// Trains `program`'s model on one actor of this process on `target`'s device at `rows` rows a
/// step, for [`STEPS`] steps on its synthetic data, and reads the median forward, backward and
/// optimizer times from the report.
fn time_one_actor(program: &Program, rows: usize, target: &TimingTarget) -> Result<Timed, String> {
    let mut one = program.clone();
    one.data = DataSpec::synthetic_for(one.model.input);
    (one.init, one.cost_model, one.islands) = (None, None, Vec::new());
    // One actor has no data-parallel collective to compress (and the pass refuses one at dp=1);
    // the forward, backward and optimizer it times do not depend on the codec.
    one.compression = archipelago_dataflow::Compression::None;
    (one.quantize_grads, one.quantize_weights) = (false, false);
    one.plan = ParallelPlan {
        batch: rows,
        state: target.state.unwrap_or(program.plan.state),
        ..ParallelPlan::default()
    };
    one.devices = vec![target.device];
    let options = TrainOptions {
        steps: STEPS,
        job: "plan-calibration".into(),
        ..TrainOptions::default()
    };
    let report = Controller::local(one.devices.clone())
        .train(&one, &options)
        .map_err(|e| e.to_string())?;
    let actor = report.actors.first().ok_or("no actor in the report")?;
    let sum = |prefix: &str| -> f64 {
        (actor.instructions.iter())
            .filter(|i| i.instruction.starts_with(prefix))
            .map(|i| i.median_s)
            .sum()
    };
    // On a GPU kernels run asynchronously and an instruction's time is when the host waited:
    // the forward's kernels drain in `Loss`, which reads the loss back (79 of the 151M gpt's
    // 415 ms step on an H100), so the forward counts the batch load and the loss.
    let timed = Timed {
        forward_s: sum("LoadBatch") + sum("Forward") + sum("Loss"),
        backward_s: sum("Backward"),
        optimizer_s: sum("OptimizerStep"),
    };
    if timed.forward_s <= 0.0 {
        return Err("no forward was timed".into());
    }
    Ok(timed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_plans_are_timed_on_their_first_gpu_and_share_their_distinct_gpus() {
        let list = |s: &str| DeviceSpec::parse_list(s).unwrap();
        let one_gpu = timing_target(&list("cuda:0,cuda:0")).unwrap();
        assert_eq!((one_gpu.device, one_gpu.units), (DeviceSpec::Cuda(0), 1));
        assert_eq!(
            one_gpu.state, None,
            "a GPU is timed with the plan's own state placement"
        );
        let two = timing_target(&list("cuda:1,cuda:0,cuda:1")).unwrap();
        assert_eq!((two.device, two.units), (DeviceSpec::Cuda(1), 2));
        let cpu = timing_target(&list("cpu:0,cpu:1")).unwrap();
        assert_eq!(cpu.device, DeviceSpec::Cpu(0));
        assert_eq!(cpu.state, Some(StatePlacement::Host));
        assert!(
            timing_target(&list("cpu:0,cuda:0")).is_none(),
            "a mixed plan keeps the default rates"
        );
    }
}
