//! Typed references to actors: [`ActorRef<A>`] accepts exactly the messages `A` has handlers
//! for. Messages from one caller to one actor are handled in the order they were sent (one
//! mailbox per actor, first in, first out); messages from different callers interleave.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::actor::{Actor, Handler, Message};
use super::call::{Call, Canceller, Pending};
use super::envelope::{EncodeFn, EncodedReply, Letter, Mail, ReplyTo};
use super::remote::HostConnection;
use super::remote::registry::{MessageCodec, Registry, RemoteReply};
use super::supervision::{ActorEnd, ActorInfo, ActorShared, CallError};

tokio::task_local! {
    /// The actor whose handler runs on this task (its process-unique key).
    pub(crate) static CURRENT_ACTOR: u64;
}

/// Where an actor's messages go.
enum Port<A: Actor> {
    /// Its mailbox in this process.
    Local(ractor::ActorRef<Mail<A>>),
    /// The actor port of its host.
    Remote(Arc<HostConnection>),
}

impl<A: Actor> Clone for Port<A> {
    fn clone(&self) -> Self {
        match self {
            Port::Local(port) => Port::Local(port.clone()),
            Port::Remote(connection) => Port::Remote(connection.clone()),
        }
    }
}

/// A typed reference to an actor of type `A`, in this process or on another host; cheap to
/// clone.
pub struct ActorRef<A: Actor> {
    port: Port<A>,
    shared: Arc<ActorShared>,
    key: u64,
    driver: Handle,
}

impl<A: Actor> Clone for ActorRef<A> {
    fn clone(&self) -> Self {
        ActorRef {
            port: self.port.clone(),
            shared: self.shared.clone(),
            key: self.key,
            driver: self.driver.clone(),
        }
    }
}

impl<A: Actor> std::fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActorRef({})", self.shared.info)
    }
}

impl<A: Actor> ActorRef<A> {
    pub(crate) fn new(
        port: ractor::ActorRef<Mail<A>>,
        shared: Arc<ActorShared>,
        key: u64,
        driver: Handle,
    ) -> Self {
        ActorRef {
            port: Port::Local(port),
            shared,
            key,
            driver,
        }
    }

    pub(crate) fn remote(
        connection: Arc<HostConnection>,
        shared: Arc<ActorShared>,
        key: u64,
        driver: Handle,
    ) -> Self {
        connection.track(&shared);
        ActorRef {
            port: Port::Remote(connection),
            shared,
            key,
            driver,
        }
    }

    pub(crate) fn shared(&self) -> &Arc<ActorShared> {
        &self.shared
    }

    pub(crate) fn key(&self) -> u64 {
        self.key
    }

    /// The actor port of the actor's host, for a reference to another process's actor.
    pub(crate) fn remote_addr(&self) -> Option<&str> {
        match &self.port {
            Port::Remote(connection) => Some(connection.addr()),
            Port::Local(_) => None,
        }
    }

    /// The connection to the actor's host, when it lives in another process.
    pub(crate) fn remote_connection(&self) -> Option<&Arc<HostConnection>> {
        match &self.port {
            Port::Remote(connection) => Some(connection),
            Port::Local(_) => None,
        }
    }

    /// Whether the actor lives in another process.
    pub fn is_remote(&self) -> bool {
        matches!(self.port, Port::Remote(_))
    }

    /// Who the actor is (id, type, name, device, host).
    pub fn info(&self) -> &ActorInfo {
        &self.shared.info
    }

    /// Sends `message` and returns the future of its reply.
    pub fn call<M: Message>(&self, message: M) -> Call<M::Reply>
    where
        A: Handler<M>,
    {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        if CURRENT_ACTOR.try_with(|k| *k == self.key).unwrap_or(false) {
            let error = CallError::SelfCall {
                actor: self.shared.label(),
                message: message_type.to_string(),
            };
            return Call::failed(error, self.driver.clone());
        }
        let (tx, rx) = oneshot::channel();
        let cancel = match &self.port {
            Port::Local(port) => {
                if let Err(error) = self.strict_check(&message) {
                    return Call::failed(error, self.driver.clone());
                }
                let flag = Arc::new(AtomicBool::new(false));
                let letter = Letter {
                    message: Some(message),
                    reply: Some(ReplyTo::Channel(tx)),
                    cancel: Some(flag.clone()),
                    seq: self.shared.sequence(),
                };
                if port.send_message(Box::new(letter)).is_err() {
                    return Call::failed(self.shared.ended_error(message_type), self.driver.clone());
                }
                Canceller::Flag(flag)
            }
            Port::Remote(connection) => {
                if self.shared.end().is_some() {
                    return Call::failed(self.shared.ended_error(message_type), self.driver.clone());
                }
                let (codec, payload) = match self.encode(&message) {
                    Ok(encoded) => encoded,
                    Err(error) => return Call::failed(error, self.driver.clone()),
                };
                // The actor is named only when the reply cannot be read (not on every call).
                let (actor, decode) = (self.shared.clone(), codec.decode_reply);
                let deliver = Box::new(move |result: Result<&[u8], CallError>| {
                    let reply = result.and_then(|bytes| {
                        let decoded = decode(bytes).map_err(|e| CallError::NotRemote {
                            actor: actor.label(),
                            message: message_type.to_string(),
                            reason: format!("its reply: {e}"),
                        })?;
                        Ok(*decoded
                            .downcast::<M::Reply>()
                            .expect("the reply type registered for this message"))
                    });
                    let _ = tx.send(reply);
                });
                self.shared.sequence();
                let id = connection.call(
                    &self.shared,
                    message_type,
                    std::any::type_name::<M>(),
                    payload,
                    deliver,
                );
                Canceller::Remote(connection.clone(), id)
            }
        };
        Call::waiting(rx, cancel, self.shared.clone(), message_type, self.driver.clone())
    }

    /// Sends `message` to this process's actor with its reply encoded by `encode` and sent to
    /// `reply` on the actor's thread: how a host answers callers of other processes without a
    /// task (or a boxed closure) per call.
    pub(crate) fn call_into<M: Message>(&self, message: M, reply: RemoteReply, encode: EncodeFn<M::Reply>)
    where
        A: Handler<M>,
    {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        let Port::Local(port) = &self.port else {
            reply.send(Err(CallError::NotRemote {
                actor: self.shared.label(),
                message: message_type.to_string(),
                reason: "a host forwards only to actors of its own process".into(),
            }));
            return;
        };
        let letter = Letter {
            message: Some(message),
            reply: Some(ReplyTo::Remote(EncodedReply::new(
                reply,
                encode,
                self.shared.clone(),
                message_type,
            ))),
            cancel: None,
            seq: self.shared.sequence(),
        };
        // A letter the mailbox refuses is dropped here, and its reply answers with the end.
        let _ = port.send_message(Box::new(letter) as Mail<A>);
    }

    /// Encodes `message` for the actor's host with the codec registered for its type.
    fn encode<M: Message>(&self, message: &M) -> Result<(MessageCodec, Vec<u8>), CallError> {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        let not_remote = |reason: String| CallError::NotRemote {
            actor: self.shared.label(),
            message: message_type.to_string(),
            reason,
        };
        let codec = Registry::codec::<M>().ok_or_else(|| {
            not_remote(format!(
                "`{message_type}` is not registered; add `.handles::<{}, {message_type}>()` to the Registry the program installs",
                self.shared.info.type_name
            ))
        })?;
        let payload = (codec.encode)(message).map_err(|e| not_remote(e.to_string()))?;
        Ok((codec, payload))
    }

    /// In strict registration mode, refuses a message to this process's actor that a cluster
    /// would refuse: its type not registered for `A`, or its bytes not encoding.
    fn strict_check<M: Message>(&self, message: &M) -> Result<(), CallError> {
        if !self.shared.strict.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        self.encode(message)?;
        let (actor, message_type) = (std::any::type_name::<A>(), std::any::type_name::<M>());
        if Registry::handles_registered(actor, message_type) {
            return Ok(());
        }
        let short = super::system::short_name(message_type);
        Err(CallError::NotRemote {
            actor: self.shared.label(),
            message: short.to_string(),
            reason: format!(
                "the message is not registered for `{0}`; add `.handles::<{0}, {short}>()` to the Registry",
                self.shared.info.type_name
            ),
        })
    }

    /// Sends `message` without waiting for (or getting) its reply. Fails only when the actor
    /// has already ended.
    pub fn cast<M: Message>(&self, message: M) -> Result<(), CallError>
    where
        A: Handler<M>,
    {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        match &self.port {
            Port::Local(port) => {
                self.strict_check(&message)?;
                let letter = Letter {
                    message: Some(message),
                    reply: None,
                    cancel: None,
                    seq: self.shared.sequence(),
                };
                port.send_message(Box::new(letter))
                    .map_err(|_| self.shared.ended_error(message_type))
            }
            Port::Remote(connection) => {
                if self.shared.end().is_some() {
                    return Err(self.shared.ended_error(message_type));
                }
                let (_, payload) = self.encode(&message)?;
                self.shared.sequence();
                connection.cast(&self.shared, message_type, std::any::type_name::<M>(), payload)
            }
        }
    }

    /// Stops the actor gracefully: it finishes the message it is handling, runs
    /// [`Actor::stopping`], and ends with [`ActorEnd::Stopped`] and `reason`; messages still
    /// queued fail with [`CallError::Stopped`].
    pub fn stop(&self, reason: &str) {
        self.shared.set_end(ActorEnd::Stopped {
            reason: reason.to_string(),
        });
        match &self.port {
            Port::Local(port) => port.stop(Some(reason.to_string())),
            Port::Remote(connection) => connection.stop(self.shared.info.id, reason, false),
        }
    }

    /// Kills the actor at once: the handler it is running is dropped at its next `.await` (a
    /// kernel already running on the device thread finishes first), [`Actor::stopping`] does not
    /// run, and it ends with [`ActorEnd::Stopped`] and `killed: {reason}`; the call being handled
    /// and every queued one fail with [`CallError::Stopped`], its tensors are freed.
    pub fn kill(&self, reason: &str) {
        self.shared.set_end(ActorEnd::Stopped {
            reason: format!("killed: {reason}"),
        });
        match &self.port {
            Port::Local(port) => port.kill(),
            Port::Remote(connection) => connection.stop(self.shared.info.id, reason, true),
        }
    }

    /// How the actor ended, once it has ended.
    pub fn end(&self) -> Option<ActorEnd> {
        self.shared.ended()
    }

    /// Resolves when the actor ends (stopped, or failed without a restart left).
    pub fn ended(&self) -> Pending<ActorEnd> {
        let mut watch = self.shared.subscribe_end();
        let future = async move {
            loop {
                if let Some(end) = watch.borrow_and_update().clone() {
                    return end;
                }
                if watch.changed().await.is_err() {
                    return ActorEnd::Stopped {
                        reason: "its runtime shut down".into(),
                    };
                }
            }
        };
        Pending::new(future, self.driver.clone())
    }

    /// How many times the actor was restarted after a panic.
    pub fn restarts(&self) -> u32 {
        self.shared.restarts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Messages sent to it and not yet taken off its queue.
    pub fn queue_depth(&self) -> u64 {
        self.shared.queue_depth()
    }
}
