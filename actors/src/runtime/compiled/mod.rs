//! Compiled programs (Pathways): a chain or graph of calls over actors, recorded once, checked
//! and lowered by the dataflow compiler into one instruction stream per actor, dispatched to
//! every actor at once, then run again and again with the values moving actor to actor — the
//! program hands in the input and takes the output, and is not in the loop in between.
//!
//! ```
//! use archipelago_actors::runtime::{Actor, Context, Handler, Message, Registry, Runtime};
//! use archipelago_actors::runtime::compiled::Recorder;
//! use archipelago_dataflow::DeviceSpec;
//!
//! struct AddOne;
//! impl Actor for AddOne {
//!     type Params = ();
//!     async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> { Ok(AddOne) }
//! }
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Step(u64);
//! impl Message for Step { type Reply = u64; }
//! impl Handler<Step> for AddOne {
//!     async fn handle(&mut self, Step(n): Step, _ctx: &Context<Self>) -> u64 { n + 1 }
//! }
//!
//! // What may run on other hosts (strict mode checks it here too, as a cluster would).
//! Registry::new().actor::<AddOne>().compiled::<AddOne, Step, u64>(Step).install();
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
//! Values are shared (`Arc`) between the actors of one process; a value a call needs is moved
//! into its message when nothing else reads it, cloned otherwise. A participant whose stream is
//! one call (receive, call, send the reply on — a chain's link, a device actor's part of a step)
//! runs no interpreter: its calls go straight into the actor's mailbox and the actor's thread
//! sends each reply on. Actors of other hosts take part the same way: their streams are
//! installed on their hosts, and a value crossing processes travels straight from one host to
//! the next (never through the program) in the bincode of its type. Such calls and values must
//! be registered ([`Registry::compiled`](crate::runtime::Registry::compiled)), since the host
//! builds the message with its own binary's constructor; compiling checks that
//! before anything runs.

#[cfg(test)]
mod collective_tests;
mod direct;
mod hosted;
mod interpreter;
mod links;
mod own;
mod plan;
mod registered;
#[cfg(test)]
mod remote_tests;
pub(crate) mod routes;
mod runner;
#[cfg(test)]
mod tests;

pub(crate) use hosted::{Part, install};
pub(crate) use registered::{NodeFn, ValueCodec};

use std::any::Any;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use archipelago_dataflow::ActorId;
use archipelago_dataflow::Instruction;
use archipelago_dataflow::flow::{FlowGraph, Value as FlowValue};
use futures::future::BoxFuture;

pub use runner::CompiledProgram;

use super::remote::HostConnection;
use super::system::RuntimeInner;
use super::{Actor, ActorRef, CallError, Handler, Message, RuntimeHandle};

/// A value in flight between the actors of a compiled program.
pub(crate) type Shared = Arc<dyn Any + Send + Sync>;
/// What runs one recorded call: the actor's handler applied to the input value.
pub(crate) type Invoke = Arc<dyn Fn(Shared) -> BoxFuture<'static, Result<Shared, CallError>> + Send + Sync>;

/// Gathers the values of several calls, in the program's own stream, into one `Vec`.
pub(crate) type GatherFn = fn(Vec<Shared>) -> Shared;

/// The participant of a gathered value: the program's own stream (its index is known only when
/// the recording is compiled).
const GATHERED: usize = usize::MAX - 1;

/// The values as one `Vec`, each moved out of its `Arc` when nothing else holds it (the
/// sender has let go of it by the time it is gathered), cloned otherwise.
fn gather_erased<T: Clone + Send + Sync + 'static>(values: Vec<Shared>) -> Shared {
    let typed: Vec<T> = (values.into_iter())
        .map(|v| {
            let v = v.downcast::<T>().expect("the gathered value type");
            Arc::try_unwrap(v).unwrap_or_else(|shared| (*shared).clone())
        })
        .collect();
    Arc::new(typed)
}

/// A value of type `T` in a program being recorded.
pub struct Value<T> {
    flow: FlowValue,
    _type: PhantomData<fn() -> T>,
}

impl<T> Clone for Value<T> {
    fn clone(&self) -> Self {
        Value {
            flow: self.flow.clone(),
            _type: PhantomData,
        }
    }
}

/// A participant: an actor of the program, by its runtime id, with its device and (when it
/// lives in another process) the connection to its host.
pub(crate) struct Participant {
    pub(crate) id: ActorId,
    pub(crate) device: archipelago_dataflow::DeviceSpec,
    /// Its device thread in this process: its interpreter runs there, never on another actor's
    /// thread (which its compute may block while this actor must go on).
    pub(crate) thread: Option<usize>,
    pub(crate) connection: Option<Arc<HostConnection>>,
    /// What keeps the actor alive while the program lives (see `keeper`).
    pub(crate) keeper: Option<Arc<crate::runtime::keeper::Keeper>>,
}

/// What a recorded node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeKind {
    /// A call of an actor's handler.
    Call,
    /// A gather in the program's own stream.
    Gather,
    /// A member's value entering all-reduce `group` (`groups[group]`).
    Reduced { group: usize },
}

/// Records calls over actors into a program whose input is an `I`.
pub struct Recorder<I> {
    flow_calls: Vec<(usize, Vec<FlowValue>, String, NodeKind)>,
    /// Each recorded all-reduce's member nodes.
    groups: Vec<Vec<usize>>,
    /// What recording found wrong, refused at compile.
    errors: Vec<String>,
    /// How long a recorded collective's member waits for the others.
    patience: std::time::Duration,
    participants: Vec<Participant>,
    nodes: Vec<Invoke>,
    /// Each node's direct path (see [`direct`]).
    binders: Vec<direct::Binder>,
    /// Each node's registry key (for actors of other hosts).
    keys: Vec<String>,
    /// Each recorded value's type name, by its name (`input`, `v{n}`).
    value_types: HashMap<String, &'static str>,
    /// The gathers, by the name of the value each makes.
    gathers: HashMap<String, GatherFn>,
    _input: PhantomData<fn(I)>,
}

impl<I: Clone + Send + Sync + 'static> Default for Recorder<I> {
    fn default() -> Self {
        Recorder {
            flow_calls: Vec::new(),
            groups: Vec::new(),
            errors: Vec::new(),
            patience: crate::runtime::DEFAULT_PATIENCE,
            participants: Vec::new(),
            nodes: Vec::new(),
            binders: Vec::new(),
            keys: Vec::new(),
            value_types: HashMap::from([("input".to_string(), std::any::type_name::<I>())]),
            gathers: HashMap::new(),
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
        self.binders.push(direct::binder(actor, make));
        self.nodes.push(registered::invoke(actor.clone(), make));
        self.keys.push(registered::node_key::<A, M, T>());
        let output = format!("v{index}");
        self.value_types
            .insert(output.clone(), std::any::type_name::<M::Reply>());
        self.flow_calls.push((
            participant,
            vec![value.flow.clone()],
            output.clone(),
            NodeKind::Call,
        ));
        Value {
            flow: FlowValue {
                actor: participant,
                name: output,
            },
            _type: PhantomData,
        }
    }

    /// Records a gather: the values of several calls (their replies, in order) as one `Vec`,
    /// made in the program's own stream — a fan-in after a fan-out, such as one step of every
    /// device actor. A failed call fails the gather with its error.
    pub fn gather<T: Clone + Send + Sync + 'static>(&mut self, values: &[Value<T>]) -> Value<Vec<T>> {
        let index = self.nodes.len();
        // A gather is no call: its node index keeps values and nodes numbered alike.
        self.nodes.push(Arc::new(|_| {
            Box::pin(async {
                Err(CallError::Program {
                    reason: "a gather is not a call".into(),
                })
            })
        }));
        self.keys.push("gather".into());
        self.binders.push(Arc::new(|_: &RuntimeInner, _| None));
        let output = format!("v{index}");
        self.value_types
            .insert(output.clone(), std::any::type_name::<Vec<T>>());
        self.gathers.insert(output.clone(), gather_erased::<T>);
        let inputs = values.iter().map(|v| v.flow.clone()).collect();
        self.flow_calls
            .push((GATHERED, inputs, output.clone(), NodeKind::Gather));
        Value {
            flow: FlowValue {
                actor: GATHERED,
                name: output,
            },
            _type: PhantomData,
        }
    }

    /// How long a member of a recorded all-reduce waits for the others (60 s unless told): a
    /// member later than that breaks the program's group, whose later runs then fail naming the
    /// wait (compile again).
    pub fn collective_patience(&mut self, patience: std::time::Duration) -> &mut Self {
        self.patience = patience;
        self
    }

    /// Records an all-reduce: the values (one [`TypedTensor`](crate::typed_tensor::TypedTensor)
    /// on each of several actors, from their calls) summed, every actor getting the total in
    /// place of its value — with the collective training's executor runs
    /// ([`Context::all_reduce`](crate::runtime::Context::all_reduce)'s, through shared buffers).
    /// The actors must be distinct and live in this process.
    pub fn all_reduce(
        &mut self,
        values: &[Value<crate::typed_tensor::TypedTensor>],
    ) -> Vec<Value<crate::typed_tensor::TypedTensor>> {
        let group = self.groups.len();
        let holders: Vec<usize> = values.iter().map(|v| v.flow.actor).collect();
        if holders.iter().any(|&a| a == usize::MAX || a == GATHERED) {
            self.errors
                .push("an all-reduce joins values of actors' calls, not the input or a gather".into());
        } else if (1..holders.len()).any(|i| holders[..i].contains(&holders[i])) {
            self.errors.push(format!(
                "an all-reduce joins values of distinct actors; got participants {holders:?}"
            ));
        }
        let mut members = Vec::with_capacity(values.len());
        let reduced = (values.iter())
            .map(|value| {
                let index = self.nodes.len();
                members.push(index);
                // A member's alias is no call: its node index keeps values and nodes numbered alike.
                self.nodes.push(Arc::new(|_| {
                    Box::pin(async {
                        Err(CallError::Program {
                            reason: "an all-reduce is not a call".into(),
                        })
                    })
                }));
                self.keys.push("all_reduce".into());
                self.binders.push(Arc::new(|_: &RuntimeInner, _| None));
                let output = format!("v{index}");
                self.value_types.insert(
                    output.clone(),
                    std::any::type_name::<crate::typed_tensor::TypedTensor>(),
                );
                let kind = NodeKind::Reduced { group };
                (self.flow_calls).push((value.flow.actor, vec![value.flow.clone()], output.clone(), kind));
                Value {
                    flow: FlowValue {
                        actor: value.flow.actor,
                        name: output,
                    },
                    _type: PhantomData,
                }
            })
            .collect();
        self.groups.push(members);
        reduced
    }

    fn participant<A: Actor>(&mut self, actor: &ActorRef<A>) -> usize {
        // Ids are per runtime: an actor is its id on its host.
        let (id, addr) = (actor.info().id, actor.remote_addr());
        if let Some(i) = self
            .participants
            .iter()
            .position(|p| p.id == id && p.connection.as_ref().map(|c| c.addr()) == addr)
        {
            return i;
        }
        self.participants.push(Participant {
            id,
            device: actor.info().device,
            thread: actor.shared().thread.get().copied(),
            connection: actor.remote_connection().cloned(),
            keeper: actor.keeper().cloned(),
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
        if let Some(error) = self.errors.first() {
            return Err(refused(error.clone()));
        }
        let program = self.participants.len();
        let mut flow = FlowGraph::new(program + 1);
        let input = flow.compute(program, "input", &[], "input");
        let mut values: Vec<FlowValue> = Vec::new();
        for (participant, inputs, output, kind) in &self.flow_calls {
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
            values.push(match kind {
                NodeKind::Gather => flow.compute(program, "gather", &inputs, output),
                NodeKind::Call => flow.compute(*participant, &format!("node:{node}"), &inputs, output),
                // Every member's value under the group's one name, all-reduced once the last
                // member's is there.
                NodeKind::Reduced { group } => {
                    let value = flow.compute(*participant, "alias", &inputs, &format!("all_reduce{group}"));
                    if self.groups[*group].last() == Some(&node) {
                        let mut members: Vec<FlowValue> = self.groups[*group]
                            [..self.groups[*group].len() - 1]
                            .iter()
                            .map(|&m| values[m].clone())
                            .collect();
                        members.push(value.clone());
                        flow.all_reduce(&members);
                    }
                    value
                }
            });
        }
        let result = if output.flow.actor == usize::MAX {
            &input
        } else {
            &values[index_of(&output.flow.name)]
        };
        flow.compute(program, "return", &[result], "return");
        let streams: Vec<Vec<Instruction>> = flow.compile().map_err(|e| refused(e.to_string()))?;
        let recorded = runner::Recorded {
            participants: self.participants,
            invokers: self.nodes,
            binders: self.binders,
            keys: self.keys,
            value_types: self.value_types,
            gathers: self.gathers,
            patience: self.patience,
        };
        runner::dispatch(runtime, recorded, streams)
    }
}

/// The node index of a recorded value's name (`v{index}`).
fn index_of(name: &str) -> usize {
    name[1..].parse().expect("recorded value names are v{index}")
}
