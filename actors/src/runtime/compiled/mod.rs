//! Compiled programs (Pathways): a chain or graph of calls over actors, recorded once, checked
//! and lowered by the dataflow compiler into one instruction stream per actor, dispatched to
//! every actor at once, then run again and again with the values moving actor to actor — the
//! program hands in the input and takes the output, and is not in the loop in between.
//!
//! ```
//! use archipelago_actors::runtime::{Actor, Context, Handler, Message, Runtime};
//! use archipelago_actors::runtime::compiled::Recorder;
//! use archipelago_dataflow::DeviceSpec;
//!
//! struct AddOne;
//! impl Actor for AddOne {
//!     type Params = ();
//!     async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> { Ok(AddOne) }
//! }
//! struct Step(u64);
//! impl Message for Step { type Reply = u64; }
//! impl Handler<Step> for AddOne {
//!     async fn handle(&mut self, Step(n): Step, _ctx: &Context<Self>) -> u64 { n + 1 }
//! }
//!
//! let runtime = Runtime::local(DeviceSpec::cpus(2));
//! let a = runtime.spawn::<AddOne>(DeviceSpec::Cpu(0), ()).get().unwrap();
//! let b = runtime.spawn::<AddOne>(DeviceSpec::Cpu(1), ()).get().unwrap();
//! let mut recorder = Recorder::<u64>::new();
//! let input = recorder.input();
//! let x = recorder.call(&a, &input, Step);
//! let y = recorder.call(&b, &x, Step);
//! let program = recorder.compile(&runtime, &y).unwrap();
//! assert_eq!(program.run(40).get().unwrap(), 42);
//! ```
//!
//! Values are shared (`Arc`) between the actors of one process; a value a call needs is cloned
//! into its message. Across hosts the streams would run on the hosts' interpreters with the
//! registered codecs; that is not built yet: a program over actors of other hosts is refused.

mod runner;
#[cfg(test)]
mod tests;

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use archipelago_dataflow::ActorId;
use archipelago_dataflow::Instruction;
use archipelago_dataflow::flow::{FlowGraph, Value as FlowValue};
use futures::future::BoxFuture;

pub use runner::CompiledProgram;

use super::{Actor, ActorRef, CallError, Handler, Message, RuntimeHandle};

/// A value in flight between the actors of a compiled program.
pub(crate) type Shared = Arc<dyn Any + Send + Sync>;
/// What runs one recorded call: the actor's handler applied to the input value.
pub(crate) type Invoke = Arc<dyn Fn(Shared) -> BoxFuture<'static, Result<Shared, CallError>> + Send + Sync>;

/// A value of type `T` in a program being recorded.
pub struct Value<T> {
    flow: FlowValue,
    _type: PhantomData<fn() -> T>,
}

/// A participant: an actor of the program, by its runtime id, with its device.
pub(crate) struct Participant {
    pub(crate) id: ActorId,
    pub(crate) device: archipelago_dataflow::DeviceSpec,
    pub(crate) remote: bool,
}

/// Records calls over actors into a program whose input is an `I`.
pub struct Recorder<I> {
    flow_calls: Vec<(usize, Vec<FlowValue>, String)>,
    participants: Vec<Participant>,
    nodes: Vec<Invoke>,
    _input: PhantomData<fn(I)>,
}

impl<I: Clone + Send + Sync + 'static> Default for Recorder<I> {
    fn default() -> Self {
        Recorder {
            flow_calls: Vec::new(),
            participants: Vec::new(),
            nodes: Vec::new(),
            _input: PhantomData,
        }
    }
}

impl<I: Clone + Send + Sync + 'static> Recorder<I> {
    /// An empty program.
    pub fn new() -> Recorder<I> {
        Recorder::default()
    }

    /// The program's input (what [`CompiledProgram::run`] is given).
    pub fn input(&mut self) -> Value<I> {
        Value {
            flow: FlowValue {
                actor: usize::MAX,
                name: "input".into(),
            },
            _type: PhantomData,
        }
    }

    /// Records a call to `actor` with the message `make(value)`; its reply is a new value.
    pub fn call<A, M, T>(
        &mut self,
        actor: &ActorRef<A>,
        value: &Value<T>,
        make: fn(T) -> M,
    ) -> Value<M::Reply>
    where
        A: Handler<M>,
        M: Message,
        M::Reply: Sync,
        T: Clone + Send + Sync + 'static,
    {
        let participant = self.participant(actor);
        let index = self.nodes.len();
        let target = actor.clone();
        let invoke: Invoke = Arc::new(move |value: Shared| {
            let input = value
                .downcast_ref::<T>()
                .expect("the recorded value type")
                .clone();
            let call = target.call(make(input));
            Box::pin(async move { Ok(Arc::new(call.await?) as Shared) })
        });
        self.nodes.push(invoke);
        let output = format!("v{index}");
        self.flow_calls
            .push((participant, vec![value.flow.clone()], output.clone()));
        Value {
            flow: FlowValue {
                actor: participant,
                name: output,
            },
            _type: PhantomData,
        }
    }

    fn participant<A: Actor>(&mut self, actor: &ActorRef<A>) -> usize {
        let id = actor.info().id;
        if let Some(i) = self.participants.iter().position(|p| p.id == id) {
            return i;
        }
        self.participants.push(Participant {
            id,
            device: actor.info().device,
            remote: actor.is_remote(),
        });
        self.participants.len() - 1
    }

    /// Checks and lowers the program (one stream per actor, the program's own last), and
    /// dispatches the streams to the actors' devices once.
    pub fn compile<R: Clone + Send + Sync + 'static>(
        self,
        runtime: &RuntimeHandle,
        output: &Value<R>,
    ) -> Result<CompiledProgram<I, R>, CallError> {
        let refused = |reason: String| CallError::Program { reason };
        if self.participants.iter().any(|p| p.remote) {
            return Err(refused(
                "its actors must be on this process for now (compiled programs across hosts are not built yet)".into(),
            ));
        }
        let program = self.participants.len();
        let mut flow = FlowGraph::new(program + 1);
        let input = flow.compute(program, "input", &[], "input");
        let mut values: Vec<FlowValue> = Vec::new();
        for (participant, inputs, output) in &self.flow_calls {
            let inputs: Vec<&FlowValue> = inputs
                .iter()
                .map(|v| {
                    if v.actor == usize::MAX {
                        &input
                    } else {
                        &values[index_of(&v.name)]
                    }
                })
                .collect();
            let node = values.len();
            values.push(flow.compute(*participant, &format!("node:{node}"), &inputs, output));
        }
        let result = if output.flow.actor == usize::MAX {
            &input
        } else {
            &values[index_of(&output.flow.name)]
        };
        flow.compute(program, "return", &[result], "return");
        let streams: Vec<Vec<Instruction>> = flow.compile().map_err(|e| refused(e.to_string()))?;
        runner::dispatch(runtime, self.participants, self.nodes, streams)
    }
}

/// The node index of a recorded value's name (`v{index}`).
fn index_of(name: &str) -> usize {
    name[1..].parse().expect("recorded value names are v{index}")
}
