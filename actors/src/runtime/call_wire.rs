//! Futures that travel (Ray's `ObjectRef` passed to another task): a [`Call`] inside a message
//! to an actor of another process is sent as a number the sending process keeps its reply
//! under — the caller stays the owner. The receiving host rebuilds a `Call` that asks the owner
//! for that reply over the connection the message came on ([`Frame::Await`]) and resolves when
//! the owner answers ([`Frame::Awaited`], sent once the reply is there). A reply holding a
//! [`TensorRef`](super::TensorRef) carries only the reference: the bytes still go from the
//! tensor's owner straight to whoever fetches them.
//!
//! A passed `Call` is awaited once, by its receiver; the sender's own copy of it went with the
//! message. Only messages carry them (not replies, nor compiled programs' values).

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use super::call::{Call, Canceller};
use super::remote::wire::{Frame, Outgoing};
use super::supervision::{ActorInfo, ActorShared, CallError};
use crate::codec;

/// The message name a rebuilt call's errors give (the sender's message type is not a type of
/// this process's registry by then).
const PASSED: &str = "a call passed from another process";

/// A call on the wire.
#[derive(Serialize, Deserialize)]
struct WireCall {
    /// Its number in the owner's table of exported calls.
    future: u64,
    /// The actor called, and the job (for errors); `None` for a call that had failed already.
    actor: Option<ActorInfo>,
    job: String,
}

/// The replies of calls this process sent away, encoded once they are there, by number.
type Exported = HashMap<u64, BoxFuture<'static, Result<Vec<u8>, CallError>>>;

static EXPORTED: LazyLock<Mutex<Exported>> = LazyLock::new(Mutex::default);
static NEXT_EXPORT: AtomicU64 = AtomicU64::new(1);

impl<R: Serialize + Send + 'static> Serialize for Call<R> {
    /// Keeps the reply (or the error a failed call resolved to) in this process under a new
    /// number: the call is then the receiver's. Strict mode's dry run writes a placeholder.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let actor = self.callee().cloned();
        let wire = |future| WireCall {
            future,
            actor: actor.as_ref().map(|a| a.info.clone()),
            job: actor.as_ref().map(|a| a.job.clone()).unwrap_or_default(),
        };
        if super::dry_run::is_dry_run() {
            return wire(0).serialize(serializer);
        }
        let reply = self.take_reply().ok_or_else(|| {
            serde::ser::Error::custom("a call already awaited cannot be passed on: pass its value")
        })?;
        let wire = wire(NEXT_EXPORT.fetch_add(1, Ordering::Relaxed));
        let label = actor.map_or_else(|| "the actor called".into(), |a| a.label());
        let future = wire.future;
        let encoded = async move {
            let reply = reply.await?;
            codec::encode(&reply).map_err(|e| CallError::NotRemote {
                actor: label,
                message: PASSED.into(),
                reason: e.to_string(),
            })
        };
        EXPORTED
            .lock()
            .expect("exported calls")
            .insert(future, Box::pin(encoded));
        wire.serialize(serializer)
    }
}

impl<'de, R: DeserializeOwned + Send + 'static> Deserialize<'de> for Call<R> {
    /// A call that asks the owner over the connection this message arrived on.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Call<R>, D::Error> {
        let wire = WireCall::deserialize(deserializer)?;
        let inbound = INBOUND.with(|i| i.borrow().clone()).ok_or_else(|| {
            serde::de::Error::custom(
                "a Call arrived outside a message to an actor: only messages carry calls",
            )
        })?;
        let driver = tokio::runtime::Handle::try_current().map_err(serde::de::Error::custom)?;
        let info = wire.actor.unwrap_or_else(|| ActorInfo {
            id: 0,
            type_name: String::new(),
            name: "the actor of a call that failed before it was passed".into(),
            device: archipelago_dataflow::DeviceSpec::Cpu(0),
            host: "the caller's".into(),
        });
        let actor = Arc::new(ActorShared::new(info, wire.job));
        let (tx, rx) = oneshot::channel();
        let label = actor.label();
        inbound.ask(
            wire.future,
            Box::new(move |result| {
                let decoded = result.and_then(|bytes| {
                    codec::decode::<R>(&bytes).map_err(|e| CallError::NotRemote {
                        actor: label,
                        message: PASSED.into(),
                        reason: e.to_string(),
                    })
                });
                let _ = tx.send(decoded);
            }),
        );
        let cancel = Canceller::Flag(Arc::default());
        Ok(Call::waiting(rx, cancel, actor, PASSED, driver))
    }
}

/// Answers a receiver's [`Frame::Await`] on `out` once the exported call `future` has its
/// reply (at once when this process has no such call).
pub(crate) fn answer(request: u64, future: u64, out: &UnboundedSender<Outgoing>) {
    let exported = EXPORTED.lock().expect("exported calls").remove(&future);
    let out = out.clone();
    let reply = async move {
        let result = match exported {
            Some(reply) => reply.await,
            None => Err(CallError::NotRemote {
                actor: "the owner of a passed call".into(),
                message: PASSED.into(),
                reason: format!("this process has no pending call {future} (awaited twice?)"),
            }),
        };
        let _ = out.send(Frame::Awaited { request, result }.into());
    };
    match tokio::runtime::Handle::try_current() {
        Ok(executor) => drop(executor.spawn(reply)),
        Err(_) => tracing::warn!("a passed call's owner answered outside an executor"),
    }
}

/// What a rebuilt call does with its owner's answer.
type Answered = Box<dyn FnOnce(Result<Vec<u8>, CallError>) + Send>;

/// One incoming connection's side of passed calls: how to ask the owner (its writer) and the
/// calls waiting for an answer. Dropped with the connection: those still waiting fail.
pub(crate) struct Inbound {
    out: UnboundedSender<Outgoing>,
    waiting: Mutex<HashMap<u64, Answered>>,
    next: AtomicU64,
}

impl Inbound {
    pub(crate) fn new(out: UnboundedSender<Outgoing>) -> Arc<Inbound> {
        Arc::new(Inbound {
            out,
            waiting: Mutex::default(),
            next: AtomicU64::new(1),
        })
    }

    fn ask(&self, future: u64, answered: Answered) {
        let request = self.next.fetch_add(1, Ordering::Relaxed);
        self.waiting
            .lock()
            .expect("passed calls")
            .insert(request, answered);
        let _ = self.out.send(Frame::Await { request, future }.into());
    }

    /// The owner's answer to request `request`.
    pub(crate) fn arrived(&self, request: u64, result: Result<Vec<u8>, CallError>) {
        let answered = self.waiting.lock().expect("passed calls").remove(&request);
        if let Some(answered) = answered {
            answered(result);
        }
    }

    /// Runs `decode` with this connection as where the calls it rebuilds ask their owner.
    pub(crate) fn scope<T>(self: &Arc<Self>, decode: impl FnOnce() -> T) -> T {
        struct Restore(Option<Arc<Inbound>>);
        impl Drop for Restore {
            fn drop(&mut self) {
                INBOUND.with(|i| *i.borrow_mut() = self.0.take());
            }
        }
        let _restore = Restore(INBOUND.with(|i| i.borrow_mut().replace(self.clone())));
        decode()
    }
}

impl Drop for Inbound {
    fn drop(&mut self) {
        let waiting = std::mem::take(&mut *self.waiting.lock().expect("passed calls"));
        for (_, answered) in waiting {
            answered(Err(CallError::NotRemote {
                actor: "the owner of a passed call".into(),
                message: PASSED.into(),
                reason: "the connection to the process that owns it closed before it resolved".into(),
            }));
        }
    }
}

thread_local! {
    /// The connection whose message is being decoded on this thread.
    static INBOUND: RefCell<Option<Arc<Inbound>>> = const { RefCell::new(None) };
}
