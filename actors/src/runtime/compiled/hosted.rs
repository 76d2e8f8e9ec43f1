//! A host's side of a compiled program: a [`Frame::Program`] installs one participant's stream
//! on the actor's device thread — its recorded calls resolved to the constructors this binary
//! registered, its peers to routes (the installing connection, this process, or another host's
//! actor port through a [`link`](super::links) written by the actor's own thread) — or says why
//! it cannot, before anything runs.

use std::collections::HashMap;
use std::sync::Arc;

use archipelago_dataflow::{ActorId, Instruction};
use tokio::sync::mpsc::UnboundedSender;

use super::interpreter;
use super::links;
use super::registered::{node, value_codec};
use super::routes::{self, Outbox, Route};
use crate::runtime::RuntimeHandle;
use crate::runtime::remote::ErasedActor;
use crate::runtime::remote::wire::{Outgoing, Peer};

/// One participant's part of a program, as a [`Frame::Program`](crate::runtime::remote::wire::Frame::Program) carries it.
pub(crate) struct Part {
    pub(crate) program: u64,
    pub(crate) me: usize,
    pub(crate) actor: ActorId,
    pub(crate) stream: Vec<Instruction>,
    pub(crate) nodes: Vec<(usize, String)>,
    pub(crate) peers: Vec<Peer>,
    pub(crate) sends: Vec<(String, String)>,
}

/// Installs `part` on `runtime` (the host), its values to the caller going back on `caller`.
pub(crate) fn install(
    runtime: &RuntimeHandle,
    actor: Option<Arc<dyn ErasedActor>>,
    caller: &UnboundedSender<Outgoing>,
    part: Part,
) -> Result<(), String> {
    let host = runtime.host();
    let actor = actor.ok_or_else(|| format!("no live actor {} on host {host}", part.actor))?;
    if part.me >= part.peers.len() {
        return Err(format!(
            "participant {} of a program of {} participants",
            part.me,
            part.peers.len()
        ));
    }
    let (mut invokers, mut binders) = (HashMap::new(), HashMap::new());
    for (n, key) in &part.nodes {
        let call = node(key).ok_or_else(|| {
            format!(
                "the recorded call `{key}` is not registered on host {host}; add `.compiled::<A, M, T>(make)` to the Registry the program installs (hosts run the same binary)"
            )
        })?;
        let bound = call(&actor)?;
        invokers.insert(*n, bound.invoke);
        binders.insert(*n, bound.bind);
    }
    let mut codecs = HashMap::new();
    for (name, value_type) in part.sends {
        let codec = value_codec(&value_type).ok_or_else(|| {
            format!(
                "values of type `{value_type}` are not registered on host {host} (`Registry::program_value`)"
            )
        })?;
        codecs.insert(name, (value_type, codec));
    }
    let device = actor.info().device;
    let executor = runtime
        .inner()
        .executor_of(actor.thread(), device)
        .ok_or_else(|| format!("device {device} is not one of host {host}'s"))?;
    let mut routes = HashMap::new();
    let destinations = routes::destinations(&part.stream);
    for (q, peer) in part.peers.iter().enumerate() {
        if !destinations.contains(&q) {
            continue;
        }
        routes.insert(
            q,
            match peer {
                Peer::Caller => Route::Caller(caller.clone()),
                Peer::Here => Route::Local(routes::door(part.program, q)),
                Peer::Host { host, addr } => {
                    let from = (actor.thread(), device);
                    let link = links::from_device_thread(runtime, from, &executor, (host, addr))?;
                    Route::Host(link)
                }
            },
        );
    }
    let outbox = Outbox {
        program: part.program,
        me: part.me,
        routes,
        codecs,
    };
    let bind = |n: usize| binders.get(&n).and_then(|bind| bind(runtime.inner(), n));
    let me = (part.program, part.me);
    interpreter::start(
        me,
        &part.stream,
        &outbox,
        (&invokers, &Default::default()),
        bind,
        &executor,
    )
}
