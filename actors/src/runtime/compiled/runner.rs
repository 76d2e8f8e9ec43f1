//! Runs a compiled program: one interpreter per actor, spawned once on the actor's device
//! thread, walks that actor's stream every iteration — `Recv` waits for a value from a peer,
//! `Compute` calls the actor's handler (a local call on the same thread), `Send` hands the value
//! to the next actor's interpreter. The program's own stream (the last) sends the input and
//! waits for the output. A failed call travels down the stream as an error value, so an
//! iteration always ends, with the error naming the actor.

use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;
use std::sync::Arc;

use archipelago_dataflow::{ComputeOp, Instruction};
use tokio::sync::Mutex;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::{Invoke, Participant, Shared};
use crate::runtime::{CallError, Pending, RuntimeHandle};

/// What travels between interpreters: `(from, tag, value)`; `None` stops the receiver.
type Parcel = Option<(usize, u64, Result<Shared, CallError>)>;

/// An interpreter's mailbox, matching parcels by `(from, tag)` in arrival order.
struct Inbox {
    rx: UnboundedReceiver<Parcel>,
    waiting: HashMap<(usize, u64), VecDeque<Result<Shared, CallError>>>,
    /// Outputs of runs whose caller stopped waiting: skipped, so a later run gets its own.
    unclaimed: usize,
}

impl Inbox {
    /// The next value from `from` on `tag`; `None` once the program is dropped.
    async fn take(&mut self, from: usize, tag: u64) -> Option<Result<Shared, CallError>> {
        loop {
            if let Some(value) = self.waiting.get_mut(&(from, tag)).and_then(VecDeque::pop_front) {
                return Some(value);
            }
            let (f, t, value) = self.rx.recv().await.flatten()?;
            self.waiting.entry((f, t)).or_default().push_back(value);
        }
    }
}

/// A compiled program, dispatched: [`CompiledProgram::run`] it as often as needed.
pub struct CompiledProgram<I, R> {
    streams: Vec<Vec<Instruction>>,
    outboxes: Arc<Vec<UnboundedSender<Parcel>>>,
    inbox: Arc<Mutex<Inbox>>,
    runtime: RuntimeHandle,
    _types: PhantomData<fn(I) -> R>,
}

/// Spawns each participant's interpreter on its device thread.
pub(crate) fn dispatch<I, R>(
    runtime: &RuntimeHandle,
    participants: Vec<Participant>,
    nodes: Vec<Invoke>,
    streams: Vec<Vec<Instruction>>,
) -> Result<CompiledProgram<I, R>, CallError> {
    let mut inboxes = Vec::new();
    let mut outboxes = Vec::new();
    for _ in 0..streams.len() {
        let (tx, rx) = unbounded_channel();
        outboxes.push(tx);
        inboxes.push(Inbox {
            rx,
            waiting: HashMap::new(),
            unclaimed: 0,
        });
    }
    let outboxes = Arc::new(outboxes);
    let invokers: Arc<Vec<Invoke>> = Arc::new(nodes);
    let program_inbox = inboxes.pop().expect("the program's own stream");
    for ((me, participant), inbox) in participants.iter().enumerate().zip(inboxes) {
        let executor = runtime
            .inner()
            .executor(participant.device)
            .ok_or_else(|| CallError::Program {
                reason: format!(
                    "actor {} is on device {}, which is not one of this runtime's; record calls to actors of the runtime the program runs on",
                    participant.id, participant.device
                ),
            })?;
        let (stream, outboxes, invokers) = (streams[me].clone(), outboxes.clone(), invokers.clone());
        executor.spawn(interpret(me, stream, inbox, outboxes, invokers));
    }
    Ok(CompiledProgram {
        streams,
        outboxes,
        inbox: Arc::new(Mutex::new(program_inbox)),
        runtime: runtime.clone(),
        _types: PhantomData,
    })
}

/// The node a `node:{i}` compute names.
fn node_of(op: &ComputeOp) -> Option<usize> {
    match op {
        ComputeOp::User { name } => name.strip_prefix("node:")?.parse().ok(),
        _ => None,
    }
}

/// Runs `invoke` with panics (in the message constructor or the value's type check) caught
/// and turned into the run's error, so the interpreter lives on.
async fn invoke_caught(invoke: &Invoke, value: Shared, node: usize) -> Result<Shared, CallError> {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| invoke(value)));
    let failed = |text: String| CallError::Program {
        reason: format!("recorded call {node} (building its message or reading its input) {text}"),
    };
    match outcome {
        Ok(call) => futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(call))
            .await
            .unwrap_or_else(|p| Err(failed(crate::error::panic_message(p.as_ref())))),
        Err(p) => Err(failed(crate::error::panic_message(p.as_ref()))),
    }
}

/// One actor's interpreter: its stream, every iteration, until the program is dropped.
async fn interpret(
    me: usize,
    stream: Vec<Instruction>,
    mut inbox: Inbox,
    outboxes: Arc<Vec<UnboundedSender<Parcel>>>,
    invokers: Arc<Vec<Invoke>>,
) {
    loop {
        let mut table: HashMap<&str, Result<Shared, CallError>> = HashMap::new();
        for instruction in &stream {
            match instruction {
                Instruction::Recv { tensor, from, tag } => {
                    let Some(value) = inbox.take(*from, *tag).await else {
                        return;
                    };
                    table.insert(tensor, value);
                }
                Instruction::Compute { op, inputs, outputs } => {
                    let (Some(node), Some(input), Some(output)) =
                        (node_of(op), inputs.first(), outputs.first())
                    else {
                        continue;
                    };
                    let value = match table.get(input.as_str()).cloned() {
                        Some(Ok(value)) => invoke_caught(&invokers[node], value, node).await,
                        Some(Err(error)) => Err(error),
                        None => continue,
                    };
                    table.insert(output, value);
                }
                Instruction::Send { tensor, to, tag } => {
                    let Some(value) = table.get(tensor.as_str()).cloned() else {
                        continue;
                    };
                    if outboxes[*to].send(Some((me, *tag, value))).is_err() {
                        return;
                    }
                }
                _ => {}
            }
        }
    }
}

impl<I, R> CompiledProgram<I, R>
where
    I: Send + Sync + 'static,
    R: Clone + Send + Sync + 'static,
{
    /// Runs the program once on `input`: the input goes to the first actors, the values move
    /// actor to actor, and the output comes back. Runs are handled in order.
    pub fn run(&self, input: I) -> Pending<Result<R, CallError>> {
        let stream = self.streams.last().cloned().unwrap_or_default();
        let (outboxes, inbox) = (self.outboxes.clone(), self.inbox.clone());
        let me = self.streams.len() - 1;
        let run = async move {
            let mut inbox = inbox.lock().await;
            // Counted until this run's output is taken: a run whose future is dropped midway
            // leaves its output to be skipped by the next run.
            inbox.unclaimed += 1;
            let mut table: HashMap<&str, Result<Shared, CallError>> = HashMap::new();
            table.insert("input", Ok(Arc::new(input) as Shared));
            let stopped = || {
                CallError::Program {
                reason: "its interpreters have stopped (the runtime shut down); compile it again on a live runtime".into(),
            }
            };
            for instruction in &stream {
                match instruction {
                    Instruction::Send { tensor, to, tag } => {
                        let value = table
                            .get(tensor.as_str())
                            .cloned()
                            .unwrap_or_else(|| Err(stopped()));
                        outboxes[*to]
                            .send(Some((me, *tag, value)))
                            .map_err(|_| stopped())?;
                    }
                    Instruction::Recv { tensor, from, tag } => {
                        let value = loop {
                            let value = inbox.take(*from, *tag).await.ok_or_else(stopped)?;
                            if inbox.unclaimed == 1 {
                                break value;
                            }
                            inbox.unclaimed -= 1;
                        };
                        inbox.unclaimed -= 1;
                        table.insert(tensor, value);
                    }
                    Instruction::Compute {
                        op: ComputeOp::User { name },
                        inputs,
                        ..
                    } if name == "return" => {
                        let value = inputs
                            .first()
                            .and_then(|i| table.remove(i.as_str()))
                            .unwrap_or_else(|| Err(stopped()))?;
                        let typed = value.downcast_ref::<R>().expect("the recorded output type");
                        return Ok(typed.clone());
                    }
                    _ => {}
                }
            }
            Err(stopped())
        };
        Pending::new(run, self.runtime.driver().clone())
    }

    /// The per-actor streams (the program's own last), as compiled: data to print or check.
    pub fn streams(&self) -> &[Vec<Instruction>] {
        &self.streams
    }
}

impl<I, R> Drop for CompiledProgram<I, R> {
    fn drop(&mut self) {
        for outbox in self.outboxes.iter() {
            let _ = outbox.send(None);
        }
    }
}
