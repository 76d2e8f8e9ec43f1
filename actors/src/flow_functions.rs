//! User functions for dataflow graphs: a table of named closures over host tensors, and the
//! computation that runs them on an actor.
//!
//! A function sees its inputs as [`HostTensor`]s and the actor's persistent state (kept across
//! runs, e.g. an accumulator of a producer → consumer loop); it can turn them into burn tensors
//! with [`to_burn`] / [`from_burn`] and compute on the actor's device.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc;

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use archipelago_dataflow::{ActorId, ComputeOp};

use crate::executor::{Computation, StepMetrics, TensorTable};
use crate::host_tensor::HostTensor;

/// What a user function can see besides its inputs.
pub struct FlowContext<'a> {
    /// The actor running it.
    pub actor: ActorId,
    /// The run (step) number, from 1.
    pub step: u64,
    /// State kept on this actor across runs.
    pub state: &'a mut HashMap<String, HostTensor>,
}

/// A user function: inputs → one output.
pub type FlowFn = Arc<dyn Fn(&mut FlowContext, &[HostTensor]) -> HostTensor + Send + Sync>;

/// Named user functions of a job.
#[derive(Clone, Default)]
pub struct FunctionTable {
    functions: HashMap<String, FlowFn>,
}

impl FunctionTable {
    /// An empty table.
    pub fn new() -> FunctionTable {
        FunctionTable::default()
    }

    /// Registers `f` under `name`.
    pub fn register(
        &mut self,
        name: &str,
        f: impl Fn(&mut FlowContext, &[HostTensor]) -> HostTensor + Send + Sync + 'static,
    ) -> &mut Self {
        self.functions.insert(name.to_string(), Arc::new(f));
        self
    }

    /// Looks a function up.
    pub fn get(&self, name: &str) -> Option<&FlowFn> {
        self.functions.get(name)
    }
}

/// A value a graph handed back to its caller.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowOutput {
    /// The run it came from.
    pub step: u64,
    /// The actor that produced it.
    pub actor: ActorId,
    /// The key given to `output`.
    pub key: String,
    /// The value.
    pub tensor: HostTensor,
}

/// Runs user functions on one actor.
pub struct FlowComputation {
    actor: ActorId,
    functions: FunctionTable,
    state: HashMap<String, HostTensor>,
    outputs: mpsc::Sender<FlowOutput>,
}

impl FlowComputation {
    /// The computation of `actor`, delivering outputs to `outputs`.
    pub fn new(
        actor: ActorId,
        functions: FunctionTable,
        outputs: mpsc::Sender<FlowOutput>,
    ) -> FlowComputation {
        FlowComputation {
            actor,
            functions,
            state: HashMap::new(),
            outputs,
        }
    }
}

impl Computation for FlowComputation {
    fn compute(
        &mut self,
        step: u64,
        op: &ComputeOp,
        inputs: &[String],
        outputs: &[String],
        table: &mut TensorTable,
    ) -> Result<(), String> {
        let args: Vec<HostTensor> = inputs
            .iter()
            .map(|name| {
                table
                    .get(name)
                    .cloned()
                    .ok_or_else(|| format!("tensor `{name}` is not on this actor"))
            })
            .collect::<Result<_, _>>()?;
        match op {
            ComputeOp::User { name } => {
                let f = self
                    .functions
                    .get(name)
                    .ok_or_else(|| format!("no function `{name}` is registered"))?;
                let mut ctx = FlowContext {
                    actor: self.actor,
                    step,
                    state: &mut self.state,
                };
                let result = f(&mut ctx, &args);
                if let Some(out) = outputs.first() {
                    table.insert(out.clone(), result);
                }
                Ok(())
            }
            ComputeOp::Output { key } => {
                let tensor = args.into_iter().next().ok_or("output of nothing")?;
                let output = FlowOutput {
                    step,
                    actor: self.actor,
                    key: key.clone(),
                    tensor,
                };
                self.outputs
                    .send(output)
                    .map_err(|_| "the caller stopped listening for outputs".to_string())
            }
            other => Err(format!("a dataflow actor cannot run `{other}`")),
        }
    }

    fn finish_step(&mut self) -> StepMetrics {
        StepMetrics::default()
    }
}

/// A host tensor as a burn tensor of rank `D` on `device`.
///
/// # Panics
/// When the host tensor's rank is not `D`.
pub fn to_burn<B: Backend, const D: usize>(t: &HostTensor, device: &B::Device) -> Tensor<B, D> {
    into_burn(t.clone(), device)
}

/// [`to_burn`] for a tensor the caller gives up: its buffer is not copied when nobody else
/// holds it (a received activation, say).
///
/// # Panics
/// When the host tensor's rank is not `D`.
pub fn into_burn<B: Backend, const D: usize>(t: HostTensor, device: &B::Device) -> Tensor<B, D> {
    assert_eq!(
        t.shape.len(),
        D,
        "tensor of rank {} read as rank {D}",
        t.shape.len()
    );
    let shape = t.shape.clone();
    Tensor::from_data(TensorData::new(t.into_vec(), shape), device)
}

/// A burn tensor back in host memory.
pub fn from_burn<B: Backend, const D: usize>(t: Tensor<B, D>) -> HostTensor {
    let shape = t.dims().to_vec();
    let data = t
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 data");
    HostTensor::new(shape, data)
}
