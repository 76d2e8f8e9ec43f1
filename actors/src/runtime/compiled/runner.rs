//! Dispatches a compiled program once — each participant's stream to an interpreter on its
//! actor's device thread, in this process or installed on the actor's host (a
//! [`Frame::Program`], answered once the host has resolved the registered calls and codecs) —
//! and runs it: the program's own stream (the last) sends the input and waits for the output.

use archipelago_dataflow::TensorId;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use archipelago_dataflow::{ComputeOp, Instruction};
use tokio::sync::Mutex;

use super::interpreter::{interpret, node_of};
use super::registered::{node, value_codec};
use super::routes::{self, Inbox, Outbox, Route, value_name};
use super::{Invoke, Participant, Shared};
use crate::runtime::remote::HostConnection;
use crate::runtime::remote::wire::{Frame, Peer};
use crate::runtime::{CallError, Pending, RuntimeHandle};

/// A compiled program, dispatched: [`CompiledProgram::run`] it as often as needed.
pub struct CompiledProgram<I, R> {
    program: u64,
    streams: Vec<Vec<Instruction>>,
    /// The program's own stream (the last), shared by its runs.
    own: Arc<Vec<Instruction>>,
    /// Set when a run was dropped midway through a stream that sends after it receives: later
    /// runs would wait for a value that depends on an unsent one, so they fail instead.
    abandoned: Arc<std::sync::atomic::AtomicBool>,
    sends_after_recv: bool,
    /// The values its own stream's instructions read more than once (kept in a run's table, not
    /// moved out by their first reader).
    reused: Arc<std::collections::HashSet<TensorId>>,
    outbox: Arc<Outbox>,
    inbox: Arc<Mutex<Inbox>>,
    /// The hosts with interpreters of this program, told when it is dropped.
    hosts: Vec<Arc<HostConnection>>,
    /// The participants whose interpreters run in this process (its own stream included).
    here: Vec<usize>,
    /// The gathers its own stream makes, by value name.
    gathers: Arc<HashMap<String, super::GatherFn>>,
    runtime: RuntimeHandle,
    _types: PhantomData<fn(I) -> R>,
}

/// What a dispatch needs besides the streams: the recorded calls (this process's invokers and
/// their registry keys) and the type of every recorded value.
pub(crate) struct Recorded {
    pub(crate) participants: Vec<Participant>,
    pub(crate) invokers: Vec<Invoke>,
    pub(crate) keys: Vec<String>,
    pub(crate) value_types: HashMap<String, &'static str>,
    pub(crate) gathers: HashMap<String, super::GatherFn>,
}

/// A program id no other process picks (this process's random id, then a count).
fn new_program_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    crate::runtime::remote::links::process_id().wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed) << 1)
}

/// The nodes a stream computes.
fn nodes_of(stream: &[Instruction]) -> Vec<usize> {
    stream
        .iter()
        .filter_map(|i| match i {
            Instruction::Compute { op, .. } => node_of(op),
            _ => None,
        })
        .collect()
}

/// Dispatches every participant's stream; fails (before anything runs) when a host cannot run
/// its part.
pub(crate) fn dispatch<I, R>(
    runtime: &RuntimeHandle,
    recorded: Recorded,
    streams: Vec<Vec<Instruction>>,
) -> Result<CompiledProgram<I, R>, CallError> {
    let refused = |reason: String| CallError::Program { reason };
    let program = new_program_id();
    let own = streams.len() - 1;
    // Where each stream runs: `None` in this process, else the connection to its host.
    let place: Vec<Option<Arc<HostConnection>>> = recorded
        .participants
        .iter()
        .map(|p| p.connection.clone())
        .chain([None])
        .collect();
    let addr = |q: usize| place[q].as_ref().map(|c| c.addr().to_string());
    // The codecs of the values each stream sends to another process.
    let sends = |p: usize| -> Result<HashMap<String, (String, super::registered::ValueCodec)>, CallError> {
        let mut codecs = HashMap::new();
        for instruction in &streams[p] {
            let Instruction::Send { tensor, to, .. } = instruction else {
                continue;
            };
            if addr(*to) == addr(p) {
                continue;
            }
            let name = value_name(tensor).to_string();
            let value_type = recorded.value_types.get(&name).copied().unwrap_or("?");
            let codec = value_codec(value_type).ok_or_else(|| {
                refused(format!(
                    "value `{name}` (a `{value_type}`) crosses processes but has no registered codec; add `.program_value::<{}>()` (or a `.compiled::<..>` call taking or returning it) to the Registry",
                    crate::runtime::system::short_name(value_type)
                ))
            })?;
            codecs.insert(name, (value_type.to_string(), codec));
        }
        Ok(codecs)
    };
    let outbox_here = |p: usize| -> Result<Outbox, CallError> {
        let routes = (routes::destinations(&streams[p]).into_iter())
            .map(|q| match &place[q] {
                None => (q, Route::Local(routes::inbox_sender(program, q))),
                Some(connection) => (q, Route::Host(connection.clone())),
            })
            .collect();
        Ok(Outbox {
            program,
            me: p,
            routes,
            codecs: sends(p)?,
        })
    };
    // Check and build everything before starting anything.
    let mut local = Vec::new();
    let mut installs = Vec::new();
    for (p, participant) in recorded.participants.iter().enumerate() {
        let nodes = nodes_of(&streams[p]);
        match &participant.connection {
            None => {
                if runtime.strict_registry()
                    && let Some(key) = nodes
                        .iter()
                        .map(|&n| &recorded.keys[n])
                        .find(|k| node(k).is_none())
                {
                    return Err(refused(format!(
                        "recorded call `{key}` is not registered (strict registration mode: a cluster would refuse it); add `.compiled::<A, M, T>(make)` with the same constructor to the Registry"
                    )));
                }
                let executor = runtime.inner().executor_of(participant.thread, participant.device).ok_or_else(|| refused(format!(
                    "actor {} is on device {}, which is not one of this runtime's; record calls to actors of the runtime the program runs on",
                    participant.id, participant.device
                )))?;
                let invokers: HashMap<usize, Invoke> = nodes
                    .iter()
                    .map(|n| (*n, recorded.invokers[*n].clone()))
                    .collect();
                local.push((p, executor, invokers, outbox_here(p)?));
            }
            Some(connection) => {
                let mut keys = Vec::new();
                for n in nodes {
                    let key = &recorded.keys[n];
                    if node(key).is_none() {
                        return Err(refused(format!(
                            "recorded call {n} (`{key}`) is to an actor of host {}, and compiled calls to other hosts must be registered: add `.compiled::<A, M, T>(make)` with the same constructor to the Registry",
                            connection.host()
                        )));
                    }
                    keys.push((n, key.clone()));
                }
                let peers = place
                    .iter()
                    .map(|at| match at {
                        None => Peer::Caller,
                        Some(c) if c.addr() == connection.addr() => Peer::Here,
                        Some(c) => Peer::Host {
                            host: c.host().to_string(),
                            addr: c.addr().to_string(),
                        },
                    })
                    .collect();
                let sends = sends(p)?
                    .into_iter()
                    .map(|(name, (value_type, _))| (name, value_type))
                    .collect();
                let frame = Frame::Program {
                    program,
                    me: p,
                    actor: participant.id,
                    stream: streams[p].clone(),
                    nodes: keys,
                    peers,
                    sends,
                };
                installs.push((connection.clone(), p, frame));
            }
        }
    }
    let own_outbox = outbox_here(own)?;
    let mut hosts: Vec<Arc<HostConnection>> = Vec::new();
    let mut answers = Vec::new();
    for (connection, p, frame) in installs {
        answers.push((
            connection.host().to_string(),
            connection.install_program(program, p, frame),
        ));
        if !hosts.iter().any(|h| h.addr() == connection.addr()) {
            hosts.push(connection);
        }
    }
    let inbox = routes::claim_inbox(program, own).expect("a new program's inbox");
    let own_stream = streams.last().cloned().unwrap_or_default();
    let mut reads: HashMap<TensorId, usize> = HashMap::new();
    for instruction in &own_stream {
        for input in instruction.reads() {
            *reads.entry(input.clone()).or_default() += 1;
        }
    }
    // A Send after a receive: a run dropped in between would leave a value unsent that a
    // later receive of this stream depends on, and the next run would wait for it.
    let first_recv = own_stream
        .iter()
        .position(|i| matches!(i, Instruction::Recv { .. }));
    let sends_after_recv =
        first_recv.is_some_and(|r| (own_stream[r..].iter()).any(|i| matches!(i, Instruction::Send { .. })));
    let compiled = CompiledProgram {
        program,
        abandoned: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        sends_after_recv,
        reused: Arc::new(
            reads
                .into_iter()
                .filter(|(_, n)| *n > 1)
                .map(|(t, _)| t)
                .collect(),
        ),
        own: Arc::new(own_stream),
        streams,
        outbox: Arc::new(own_outbox),
        inbox: Arc::new(Mutex::new(inbox)),
        hosts,
        here: place
            .iter()
            .enumerate()
            .filter(|(_, at)| at.is_none())
            .map(|(p, _)| p)
            .collect(),
        gathers: Arc::new(recorded.gathers),
        runtime: runtime.clone(),
        _types: PhantomData,
    };
    for (p, executor, invokers, outbox) in local {
        let inbox = routes::claim_inbox(program, p).expect("a new program's inbox");
        executor.spawn(interpret(compiled.streams[p].clone(), inbox, outbox, invokers));
    }
    // A refusal drops `compiled`, which stops whatever did start.
    for (host, answer) in answers {
        let answer =
            futures::executor::block_on(answer).unwrap_or_else(|_| Err("the connection to it ended".into()));
        answer.map_err(|e| refused(format!("host {host} could not install its part: {e}")))?;
    }
    Ok(compiled)
}

impl<I, R> CompiledProgram<I, R>
where
    I: Send + Sync + 'static,
    R: Clone + Send + Sync + 'static,
{
    /// Runs the program once on `input`: the input goes to the first actors, the values move
    /// actor to actor, and the output comes back. Runs are handled in order.
    pub fn run(&self, input: I) -> Pending<Result<R, CallError>> {
        let stream = self.own.clone();
        let (outbox, inbox, gathers) = (self.outbox.clone(), self.inbox.clone(), self.gathers.clone());
        let reused = self.reused.clone();
        let abandoned = self.abandoned.clone();
        let guard_armed = self.sends_after_recv;
        let run = async move {
            let mut inbox = inbox.lock().await;
            if abandoned.load(Ordering::Acquire) {
                return Err(CallError::Program {
                    reason: "an earlier run was abandoned between a receive and a later send; compile the program again".into(),
                });
            }
            // Marks the program abandoned unless this run reaches its end.
            let mut guard = AbandonGuard {
                flag: abandoned,
                armed: guard_armed,
            };
            // Counted until this run's values are taken: a run whose future is dropped midway
            // leaves its values to be skipped by the next run.
            for instruction in stream.iter() {
                if let Instruction::Recv { from, tag, .. } = instruction {
                    *inbox.unclaimed.entry((*from, *tag)).or_default() += 1;
                }
            }
            if let Some(error) = inbox.broken() {
                return Err(error.clone());
            }
            let input_id = TensorId::named("input");
            let mut table: HashMap<&TensorId, Result<Shared, CallError>> = HashMap::new();
            table.insert(&input_id, Ok(Arc::new(input) as Shared));
            let stopped = || {
                CallError::Program {
                reason: "its interpreters have stopped (the runtime shut down); compile it again on a live runtime"
                    .into(),
            }
            };
            for instruction in stream.iter() {
                match instruction {
                    Instruction::Send { tensor, to, tag } => {
                        let value = table.get(tensor).cloned().unwrap_or_else(|| Err(stopped()));
                        outbox.send(tensor, *to, *tag, value)?;
                    }
                    Instruction::Recv { tensor, from, tag } => {
                        let value = loop {
                            let value = inbox.take(*from, *tag).await.ok_or_else(stopped)?;
                            let unclaimed = inbox.unclaimed.entry((*from, *tag)).or_default();
                            *unclaimed = unclaimed.saturating_sub(1);
                            if *unclaimed == 0 {
                                break value;
                            }
                        };
                        table.insert(tensor, value);
                    }
                    Instruction::Compute {
                        op: ComputeOp::User { name },
                        inputs,
                        outputs,
                    } if name == "gather" => {
                        let Some(output) = outputs.first() else { continue };
                        let values: Result<Vec<Shared>, CallError> = (inputs.iter())
                            .map(|i| {
                                let value = if reused.contains(i) {
                                    table.get(i).cloned()
                                } else {
                                    table.remove(i)
                                };
                                value.unwrap_or_else(|| Err(stopped()))
                            })
                            .collect();
                        let gather = gathers.get(value_name(output)).ok_or_else(stopped)?;
                        table.insert(output, values.map(gather));
                    }
                    Instruction::Compute {
                        op: ComputeOp::User { name },
                        inputs,
                        ..
                    } if name == "return" => {
                        let value = inputs
                            .first()
                            .and_then(|i| table.remove(i))
                            .unwrap_or_else(|| Err(stopped()))?;
                        // Moved out when this run holds the only reference (a gathered value).
                        guard.armed = false;
                        let typed = value.downcast::<R>().expect("the recorded output type");
                        return Ok(Arc::try_unwrap(typed).unwrap_or_else(|shared| (*shared).clone()));
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

/// Sets its flag when dropped armed (see `CompiledProgram::abandoned`).
struct AbandonGuard {
    flag: Arc<std::sync::atomic::AtomicBool>,
    armed: bool,
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Release);
        }
    }
}

impl<I, R> Drop for CompiledProgram<I, R> {
    fn drop(&mut self) {
        routes::end_participants(self.program, &self.here);
        for host in &self.hosts {
            host.end_program(self.program);
        }
    }
}
