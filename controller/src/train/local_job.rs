//! A training job in this process: its actors on this process's devices, tensors through an
//! in-process fabric (groups reduce through each other's buffers unless the options ask for
//! rings), the same preflight, gang start and step loop as a job on a cluster.

use std::sync::Arc;

use archipelago_actors::Builders;
use archipelago_actors::fabric::InProcessFabric;
use archipelago_dataflow::{ActorId, Plan};

use super::launch::{GangLaunch, start_gang};
use super::options::TrainOptions;
use super::preflight::preflight;
use super::step_loop::drive;
use crate::JobError;
use crate::report::TrainReport;

/// Runs `plan` (every actor here) with the blocks `builders` make, and reports.
pub(crate) async fn run_local(
    plan: Plan,
    builders: Builders,
    options: &TrainOptions,
) -> Result<TrainReport, JobError> {
    let start = preflight(&plan.program, options)?;
    for note in &start.notes {
        eprintln!("{note}");
    }
    let n = plan.actors.len();
    let fabric = Arc::new(InProcessFabric::with_collectives(
        n,
        options.patience,
        options.collectives,
    ));
    let all: Vec<ActorId> = (0..n).collect();
    let launch = GangLaunch {
        job: &options.job,
        plan: &plan,
        actors: &all,
        builders: &builders,
        restore: start.restore,
        patience: options.patience,
    };
    let mut gang = start_gang(launch, fabric).await?;
    let result = drive(&mut gang, &plan, options, start.first_step, &mut Vec::new()).await;
    gang.stop().await;
    result
}
