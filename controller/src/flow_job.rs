//! Running user dataflow graphs on the embedded controller: the same compiler, verifier, actors
//! and fabric as training, with user functions as the compute.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use archipelago_actors::device_actor::ComputationFactory;
use archipelago_actors::executor::Computation;
use archipelago_actors::fabric::InProcessFabric;
use archipelago_actors::flow_functions::{FlowComputation, FlowOutput, FunctionTable};
use archipelago_dataflow::flow::FlowGraph;
use archipelago_dataflow::{ActorStream, PlanError};

use crate::JobError;
use crate::actor_gang::ActorGang;
use crate::local::{Controller, DEFAULT_PATIENCE};

/// The outputs of a graph run `runs` times.
#[derive(Debug, Clone)]
pub struct FlowRun {
    /// Every output, in arrival order.
    pub outputs: Vec<FlowOutput>,
}

impl FlowRun {
    /// The values output under `key`, ordered by run and actor.
    pub fn values(&self, key: &str) -> Vec<&FlowOutput> {
        let mut v: Vec<&FlowOutput> = self.outputs.iter().filter(|o| o.key == key).collect();
        v.sort_by_key(|o| (o.step, o.actor));
        v
    }
}

impl Controller {
    /// Compiles `graph`, starts one actor per graph actor, runs the graph `runs` times (actor
    /// state persists between runs), and returns what it output.
    pub fn run_flow(
        &self,
        graph: &FlowGraph,
        functions: &FunctionTable,
        runs: u64,
    ) -> Result<FlowRun, JobError> {
        let streams = graph.compile()?;
        if streams.len() > self.devices.len() {
            return Err(JobError::Plan(PlanError::NotEnoughDevices {
                mesh: format!("a dataflow graph over {} actors", streams.len()),
                needed: streams.len(),
                given: self.devices.len(),
            }));
        }
        let (tx, rx) = mpsc::channel();
        let factories: Vec<ComputationFactory> = (0..streams.len())
            .map(|actor| {
                let (functions, tx) = (functions.clone(), tx.clone());
                Box::new(move || {
                    Ok(Box::new(FlowComputation::new(actor, functions, tx)) as Box<dyn Computation>)
                }) as ComputationFactory
            })
            .collect();
        drop(tx);
        let streams: Vec<ActorStream> = streams
            .into_iter()
            .enumerate()
            .map(|(actor, instructions)| ActorStream {
                actor,
                device: self.devices[actor],
                instructions,
            })
            .collect();
        let fabric = Arc::new(InProcessFabric::new(streams.len(), DEFAULT_PATIENCE));
        self.runtime.block_on(async move {
            let watchdog = DEFAULT_PATIENCE + Duration::from_secs(10);
            let mut gang = ActorGang::start("flow", streams, factories, fabric, watchdog).await?;
            let mut result = Ok(());
            for run in 1..=runs {
                if let Err(e) = gang.step(run).await {
                    result = Err(e);
                    break;
                }
            }
            gang.stop().await;
            result
        })?;
        Ok(FlowRun {
            outputs: rx.try_iter().collect(),
        })
    }
}
