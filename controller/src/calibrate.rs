//! The step simulator's cost model calibrated on this machine (`archipelago plan --rate measure`).
//!
//! The rates come from a short real run of the job's own model on one actor of this process at
//! the plan's micro-batch size (a few steps, the first untimed): the forward's flop rate (the cost
//! model's `2 · params` flops per token over the forward's median time), the backward over the
//! forward, and the optimizer's parameters per second. Where the plan's CPU actors outnumber this
//! machine's cores they take turns on them: the step is then at least their total busy time over
//! the cores (`Prediction::share_cores`). A
//! model too large to run here for a few steps, or a plan for GPUs (not measured here), keeps the
//! default rates (those of the project's 2-core machine), and says so.

use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::{CostModel, ParallelPlan, Program, StatePlacement};

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
    if program.devices.iter().any(|d| d.cuda_ordinal().is_some()) {
        return default("GPU rates are not measured by plan");
    }
    if program.model.params() > MAX_PARAMS {
        return default("the model is too large to time here");
    }
    let rows = micro_batch_rows(&program.plan);
    let timed = match time_one_actor(program, rows) {
        Ok(timed) => timed,
        Err(why) => return default(&format!("the timing run failed: {why}")),
    };
    let actors = program.plan.dp * program.plan.pp;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tokens = (rows * program.model.input.tokens_per_sample()) as f64;
    let flops = 2.0 * program.model.params() as f64 * tokens;
    let trained: u64 = program.model.blocks.iter().map(|b| b.trained_params()).sum();
    let cost_model = CostModel {
        flops_per_s: flops / timed.forward_s.max(1e-9),
        backward_over_forward: timed.backward_s / timed.forward_s.max(1e-9),
        optimizer_params_per_s: trained as f64 / timed.optimizer_s.max(1e-9),
        cpu_cores: Some(cores),
        ..base
    };
    let shared = if actors > cores {
        format!("; {actors} CPU actors take turns on {cores} cores")
    } else {
        String::new()
    };
    Calibration {
        cost_model,
        how: format!(
            "measured: {} steps of this model on one actor at {rows} rows a micro-batch (forward {:.1} ms, \
             backward {:.1} ms, optimizer {:.1} ms){shared}",
            STEPS,
            1e3 * timed.forward_s,
            1e3 * timed.backward_s,
            1e3 * timed.optimizer_s
        ),
    }
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

/// Trains `program`'s model on one CPU actor of this process at `rows` rows a step, for
/// [`STEPS`] steps on its synthetic data, and reads the median forward, backward and optimizer
/// times from the report.
fn time_one_actor(program: &Program, rows: usize) -> Result<Timed, String> {
    let mut one = program.clone();
    one.data = DataSpec::synthetic_for(one.model.input);
    (one.init, one.cost_model, one.islands) = (None, None, Vec::new());
    one.plan = ParallelPlan {
        batch: rows,
        state: StatePlacement::Host,
        ..ParallelPlan::default()
    };
    one.devices = archipelago_dataflow::DeviceSpec::cpus(1);
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
    let timed = Timed {
        forward_s: sum("Forward"),
        backward_s: sum("Backward"),
        optimizer_s: sum("OptimizerStep"),
    };
    if timed.forward_s <= 0.0 {
        return Err("no forward was timed".into());
    }
    Ok(timed)
}
