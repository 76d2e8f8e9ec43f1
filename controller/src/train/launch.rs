//! The one way a gang of device actors is started from a plan, in this process for a local job
//! and on every host for a job on a cluster: each actor named gets its instruction stream (with
//! the plan's injected test fault, if any) and a factory that builds its trainer on its device
//! from the plan alone, loading its state from the checkpoint when there is one. Only the
//! fabric differs: in-process for a local job, one reaching the other hosts on a cluster.

use std::sync::Arc;
use std::time::Duration;

use archipelago_actors::Builders;
use archipelago_actors::checkpoint::CheckpointReader;
use archipelago_actors::device_actor::ComputationFactory;
use archipelago_actors::fabric::Fabric;
use archipelago_actors::trainer::Placement;
use archipelago_dataflow::{ActorId, DeviceSpec, Plan};

use crate::JobError;
use crate::actor_gang::ActorGang;

/// How long past the receive patience a silent step is reported as a hang.
const WATCHDOG_SLACK: Duration = Duration::from_secs(10);

/// What a gang of a plan's actors is started from.
pub(crate) struct GangLaunch<'a> {
    /// The job's name (in every error an actor reports).
    pub job: &'a str,
    /// The plan (every actor's stream and placement).
    pub plan: &'a Plan,
    /// The actors to start here: all of the plan's for a local job, a host's share on a
    /// cluster.
    pub actors: &'a [ActorId],
    /// How the actors build the model's blocks on their devices.
    pub builders: &'a Builders,
    /// The checkpoint the actors load their state from.
    pub restore: Option<Arc<CheckpointReader>>,
    /// How long a receive may wait before it is reported as a hang.
    pub patience: Duration,
}

/// Starts `launch.actors` over `fabric` and waits until every one has built its trainer; refuses
/// devices the builders cannot use before any actor starts.
pub(crate) async fn start_gang(
    launch: GangLaunch<'_>,
    fabric: Arc<dyn Fabric>,
) -> Result<ActorGang, JobError> {
    let GangLaunch {
        job,
        plan,
        actors,
        builders,
        restore,
        patience,
    } = launch;
    let devices: Vec<DeviceSpec> = actors.iter().map(|&a| plan.actors[a].device).collect();
    builders.check(&devices).map_err(JobError::Runtime)?;
    let residuals_from = (restore.as_deref())
        .filter(|r| same_layout(&r.manifest().layout, &plan.program))
        .filter(|r| same_exchange(r.manifest(), &plan.program))
        .map(|r| r.dir().to_path_buf());
    let factories = trainer_factories(plan, builders, actors, restore);
    let mut streams: Vec<_> = actors.iter().map(|&a| plan.stream(a)).collect();
    crate::hang::inject_stream_fault(&mut streams, plan.program.test_fault);
    let watchdog = patience + WATCHDOG_SLACK;
    let islands = plan.island_indices();
    ActorGang::start(
        job,
        (streams, factories),
        fabric,
        watchdog,
        (residuals_from, islands),
    )
    .await
}

/// Whether a checkpoint of `layout` was written by `program`'s layout: then every actor has the
/// same buckets and takes back the top-k residuals it wrote (at another layout they start at
/// zero, and the resume says so: `preflight`).
pub(crate) fn same_layout(layout: &serde_json::Value, program: &archipelago_dataflow::Program) -> bool {
    // Read back as a plan (a field added since takes its default), not compared as JSON.
    serde_json::from_value::<archipelago_dataflow::ParallelPlan>(layout.clone())
        .is_ok_and(|then| then == program.plan)
}

/// Whether a checkpoint was written under `program`'s compression (with the same momentum moved
/// into the exchange): only then is the per-replica state it holds beside the shards (top-k's
/// residuals and velocities, 1-bit Adam's momentum and errors) this run's to take back. A
/// checkpoint from before runs were recorded holds none.
pub(crate) fn same_exchange(
    manifest: &archipelago_actors::checkpoint::Manifest,
    program: &archipelago_dataflow::Program,
) -> bool {
    manifest.run.as_ref().is_none_or(|was| {
        was.compression == program.compression
            && was.compression.moved_momentum(was.optimizer)
                == program.compression.moved_momentum(program.optimizer)
    })
}

/// One computation factory per actor in `actors`: each builds the actor's trainer on its device
/// and, when `restore` is given, loads its state from that checkpoint.
fn trainer_factories(
    plan: &Plan,
    builders: &Builders,
    actors: &[ActorId],
    restore: Option<Arc<CheckpointReader>>,
) -> Vec<ComputationFactory> {
    actors
        .iter()
        .map(|&id| {
            let a = &plan.actors[id];
            let placement = Placement::of(a);
            let (program, builders, actor, device, restore) = (
                plan.program.clone(),
                builders.clone(),
                a.actor,
                a.device,
                restore.clone(),
            );
            Box::new(move || builders.trainer(&program, actor, device, &placement, restore.as_deref()))
                as ComputationFactory
        })
        .collect()
}
