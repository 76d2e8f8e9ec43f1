//! Dispatches a compiled program once — each participant's stream, in this process or
//! installed on the actor's host (a [`Frame::Program`], answered once the host has resolved the
//! registered calls and codecs), to an interpreter on its actor's device thread or, for a
//! stream of one call, to the [`direct`](super::direct) path — and runs it: the program's own
//! stream (the last, [`Own`]) sends the input and waits for the output.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use archipelago_dataflow::Instruction;

use super::interpreter::{self, node_of};
use super::own::Own;
use super::plan::{Plan, Resolve, StreamCollectives};
use super::registered::{node, value_codec};
use super::routes::{self, Outbox, Route, value_name};
use super::{Invoke, Participant};
use crate::runtime::remote::HostConnection;
use crate::runtime::remote::wire::{Frame, Peer};
use crate::runtime::{CallError, CollectiveGroup, Pending, RuntimeHandle};

/// A compiled program, dispatched: [`CompiledProgram::run`] it as often as needed.
pub struct CompiledProgram<I, R> {
    program: u64,
    streams: Vec<Vec<Instruction>>,
    /// The program's own stream (the last), lowered, shared by its runs.
    own: Arc<Own>,
    /// The hosts with interpreters of this program, told when it is dropped.
    hosts: Vec<Arc<HostConnection>>,
    /// The participants whose interpreters run in this process (its own stream included).
    here: Vec<usize>,
    runtime: RuntimeHandle,
    /// Its actors' keepers: a program keeps its actors alive as their references do.
    _keepers: Vec<Arc<crate::runtime::keeper::Keeper>>,
    /// Its collective groups, closed with it.
    _groups: Groups,
    _types: PhantomData<fn(I) -> R>,
}

/// What a dispatch needs besides the streams: the recorded calls (this process's invokers and
/// their registry keys) and the type of every recorded value.
pub(crate) struct Recorded {
    pub(crate) participants: Vec<Participant>,
    pub(crate) invokers: Vec<Invoke>,
    /// Each node's direct path.
    pub(crate) binders: Vec<super::direct::Binder>,
    pub(crate) keys: Vec<String>,
    pub(crate) value_types: HashMap<String, &'static str>,
    pub(crate) gathers: HashMap<String, super::GatherFn>,
    /// How long a recorded collective's member waits for the others.
    pub(crate) patience: std::time::Duration,
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

/// A participant's part that runs in this process: its index, the executor of its actor's
/// device thread, its calls and collective groups, and its outbox.
type LocalPart = (
    usize,
    Executor,
    (HashMap<usize, Invoke>, StreamCollectives),
    Outbox,
);

type Executor = tokio::runtime::Handle;

/// What every participant's part is built from: the program's id, the streams, where each
/// runs (`None`: in this process, else the connection to its host) and what was recorded.
struct Parts<'a> {
    program: u64,
    streams: &'a [Vec<Instruction>],
    place: Vec<Option<Arc<HostConnection>>>,
    recorded: &'a Recorded,
}

impl Parts<'_> {
    fn refused(reason: String) -> CallError {
        CallError::Program { reason }
    }

    /// The address of stream `q`'s host (`None`: this process).
    fn addr(&self, q: usize) -> Option<String> {
        self.place[q].as_ref().map(|c| c.addr().to_string())
    }

    /// The codecs of the values stream `p` sends to another process.
    fn sends(&self, p: usize) -> Result<HashMap<String, (String, super::registered::ValueCodec)>, CallError> {
        let mut codecs = HashMap::new();
        for instruction in &self.streams[p] {
            let Instruction::Send { tensor, to, .. } = instruction else {
                continue;
            };
            if self.addr(*to) == self.addr(p) {
                continue;
            }
            let name = value_name(tensor).to_string();
            let value_type = self.recorded.value_types.get(&name).copied().unwrap_or("?");
            let codec = value_codec(value_type).ok_or_else(|| {
                Self::refused(format!(
                    "value `{name}` (a `{value_type}`) crosses processes but has no registered codec; add `.program_value::<{}>()` (or a `.compiled::<..>` call taking or returning it) to the Registry",
                    crate::runtime::system::short_name(value_type)
                ))
            })?;
            codecs.insert(name, (value_type.to_string(), codec));
        }
        Ok(codecs)
    }

    /// The outbox of stream `p`, run in this process.
    fn outbox_here(&self, p: usize) -> Result<Outbox, CallError> {
        let routes = (routes::destinations(&self.streams[p]).into_iter())
            .map(|q| match &self.place[q] {
                None => (q, Route::Local(routes::door(self.program, q))),
                Some(connection) => (q, Route::Host(connection.clone())),
            })
            .collect();
        Ok(Outbox {
            program: self.program,
            me: p,
            routes,
            codecs: self.sends(p)?,
        })
    }

    /// Participant `p`'s part in this process, checked (its calls registered under a strict
    /// registry, its device one of the runtime's).
    fn local(&self, p: usize, runtime: &RuntimeHandle, groups: &Groups) -> Result<LocalPart, CallError> {
        let (participant, recorded) = (&self.recorded.participants[p], self.recorded);
        let nodes = nodes_of(&self.streams[p]);
        if runtime.strict_registry()
            && let Some(key) = nodes
                .iter()
                .map(|&n| &recorded.keys[n])
                .find(|k| node(k).is_none())
        {
            return Err(Self::refused(format!(
                "recorded call `{key}` is not registered (strict registration mode: a cluster would refuse it); add `.compiled::<A, M, T>(make)` with the same constructor to the Registry"
            )));
        }
        let executor = runtime.inner().executor_of(participant.thread, participant.device).ok_or_else(|| Self::refused(format!(
            "actor {} is on device {}, which is not one of this runtime's; record calls to actors of the runtime the program runs on",
            participant.id, participant.device
        )))?;
        let invokers: HashMap<usize, Invoke> = nodes
            .iter()
            .map(|n| (*n, recorded.invokers[*n].clone()))
            .collect();
        let collectives = StreamCollectives {
            me: participant.id,
            groups: groups.0.clone(),
        };
        Ok((p, executor, (invokers, collectives), self.outbox_here(p)?))
    }

    /// The frame that installs participant `p`'s part on its host `connection` (every call it
    /// makes must be registered there).
    fn host_frame(&self, p: usize, connection: &HostConnection) -> Result<Frame, CallError> {
        let participant = &self.recorded.participants[p];
        let mut keys = Vec::new();
        for n in nodes_of(&self.streams[p]) {
            let key = &self.recorded.keys[n];
            if node(key).is_none() {
                return Err(Self::refused(format!(
                    "recorded call {n} (`{key}`) is to an actor of host {}, and compiled calls to other hosts must be registered: add `.compiled::<A, M, T>(make)` with the same constructor to the Registry",
                    connection.host()
                )));
            }
            keys.push((n, key.clone()));
        }
        let peers = (self.place.iter())
            .map(|at| match at {
                None => Peer::Caller,
                Some(c) if c.addr() == connection.addr() => Peer::Here,
                Some(c) => Peer::Host {
                    host: c.host().to_string(),
                    addr: c.addr().to_string(),
                },
            })
            .collect();
        let sends = (self.sends(p)?.into_iter())
            .map(|(name, (value_type, _))| (name, value_type))
            .collect();
        Ok(Frame::Program {
            program: self.program,
            me: p,
            actor: participant.id,
            stream: self.streams[p].clone(),
            nodes: keys,
            peers,
            sends,
        })
    }
}

/// The hosts a program was installed on (each once) and, per part, its host's name and the
/// answer to come.
type Installs = (
    Vec<Arc<HostConnection>>,
    Vec<(String, tokio::sync::oneshot::Receiver<Result<(), String>>)>,
);

/// Sends every host its parts' frames.
fn install_on_hosts(program: u64, installs: Vec<(Arc<HostConnection>, usize, Frame)>) -> Installs {
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
    (hosts, answers)
}

/// Dispatches every participant's stream; fails (before anything runs) when a host cannot run
/// its part.
pub(crate) fn dispatch<I, R>(
    runtime: &RuntimeHandle,
    recorded: Recorded,
    streams: Vec<Vec<Instruction>>,
) -> Result<CompiledProgram<I, R>, CallError> {
    let program = new_program_id();
    let own = streams.len() - 1;
    let place: Vec<Option<Arc<HostConnection>>> = (recorded.participants.iter())
        .map(|p| p.connection.clone())
        .chain([None])
        .collect();
    let parts = Parts {
        program,
        streams: &streams,
        place,
        recorded: &recorded,
    };
    let groups = collective_groups(&recorded.participants, &streams, recorded.patience)?;
    // Check and build everything before starting anything.
    let mut local = Vec::new();
    let mut installs = Vec::new();
    for (p, participant) in recorded.participants.iter().enumerate() {
        match &participant.connection {
            None => local.push(parts.local(p, runtime, &groups)?),
            Some(connection) => installs.push((connection.clone(), p, parts.host_frame(p, connection)?)),
        }
    }
    let own_outbox = parts.outbox_here(own)?;
    let here: Vec<usize> = (parts.place.iter().enumerate())
        .filter(|(_, at)| at.is_none())
        .map(|(p, _)| p)
        .collect();
    let (hosts, answers) = install_on_hosts(program, installs);
    let inbox = routes::claim_inbox(program, own).expect("a new program's inbox");
    let own_stream = streams.last().cloned().unwrap_or_default();
    let resolve = Resolve {
        invokers: None,
        gathers: Some(&recorded.gathers),
        collectives: None,
    };
    let plan = Plan::lower(&own_stream, &own_outbox, resolve);
    let compiled = CompiledProgram {
        program,
        own: Arc::new(Own::new(&own_stream, plan, inbox)),
        streams,
        hosts,
        here,
        runtime: runtime.clone(),
        _keepers: (recorded.participants.iter())
            .filter_map(|p| p.keeper.clone())
            .collect(),
        _groups: groups,
        _types: PhantomData,
    };
    for (p, executor, (invokers, collectives), outbox) in local {
        let bind = |node: usize| (recorded.binders[node])(runtime.inner(), node);
        interpreter::start(
            (program, p),
            &compiled.streams[p],
            &outbox,
            (&invokers, &collectives),
            bind,
            &executor,
        )
        .map_err(Parts::refused)?;
    }
    // A refusal drops `compiled`, which stops whatever did start.
    for (host, answer) in answers {
        let answer =
            futures::executor::block_on(answer).unwrap_or_else(|_| Err("the connection to it ended".into()));
        answer.map_err(|e| Parts::refused(format!("host {host} could not install its part: {e}")))?;
    }
    Ok(compiled)
}

/// The collective group of every recorded collective, by its tag: the participants it joins
/// (in the group's order), which must all run in this process.
fn collective_groups(
    participants: &[Participant],
    streams: &[Vec<Instruction>],
    patience: std::time::Duration,
) -> Result<Groups, CallError> {
    let mut groups = Groups(HashMap::new());
    for instruction in streams.iter().flatten() {
        let Instruction::StartCollective { group, tag, .. } = instruction else {
            continue;
        };
        if groups.0.contains_key(tag) {
            continue;
        }
        let mut members = Vec::with_capacity(group.len());
        for &p in group {
            let participant = &participants[p];
            if let Some(connection) = &participant.connection {
                return Err(CallError::Program {
                    reason: format!(
                        "a recorded all-reduce joins actor {} of host {}: collective groups meet in one process (record it over actors of this runtime's devices)",
                        participant.id,
                        connection.host()
                    ),
                });
            }
            members.push((
                participant.id,
                format!("actor {} on {}", participant.id, participant.device),
            ));
        }
        let made = CollectiveGroup::new(&members, patience).map_err(|e| CallError::Program {
            reason: e.to_string(),
        })?;
        groups.0.insert(*tag, made);
    }
    Ok(groups)
}

/// A program's collective groups, by tag, closed when the program (or a dispatch that fails)
/// drops them.
struct Groups(HashMap<u64, CollectiveGroup>);

impl Drop for Groups {
    fn drop(&mut self) {
        self.0.values().for_each(CollectiveGroup::close);
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
        let own = self.own.clone();
        Pending::new(
            async move { own.run::<R>(Arc::new(input)).await },
            self.runtime.driver().clone(),
        )
    }

    /// The per-actor streams (the program's own last), as compiled: data to print or check.
    pub fn streams(&self) -> &[Vec<Instruction>] {
        &self.streams
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
