//! Typed references to actors: [`ActorRef<A>`] accepts exactly the messages `A` has handlers
//! for. Messages from one caller to one actor are handled in the order they were sent (one
//! mailbox per actor, first in, first out); messages from different callers interleave.
//!
//! A reference to an actor of another host follows its [`RemoteActor`]: when the driver
//! re-places the actor after its host was lost, every clone of the reference sends to the new
//! incarnation (messages sent while it is re-placed wait, in order, and go there).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::actor::{Actor, Handler, Message};
use super::call::{Call, Canceller, Pending, RemoteCall};
use super::envelope::{EncodeFn, EncodedReply, Letter, Mail, ReplyTo};
use super::keeper::Keeper;
use super::remote::HostConnection;
use super::remote::connection::Deliver;
use super::remote::registry::{MessageCodec, Registry, RemoteReply};
use super::supervision::{ActorEnd, ActorInfo, ActorShared, CallError, Incarnation, RemoteActor};

tokio::task_local! {
    /// The actor whose handler runs on this task (its process-unique key).
    pub(crate) static CURRENT_ACTOR: u64;
}

/// Where an actor's messages go.
enum Port<A: Actor> {
    /// Its mailbox in this process, and its state.
    Local(ractor::ActorRef<Mail<A>>, Arc<ActorShared>),
    /// Its incarnations on other hosts (the latest one's actor port takes its messages).
    Remote(Arc<RemoteActor>),
}

impl<A: Actor> Clone for Port<A> {
    fn clone(&self) -> Self {
        match self {
            Port::Local(port, shared) => Port::Local(port.clone(), shared.clone()),
            Port::Remote(remote) => Port::Remote(remote.clone()),
        }
    }
}

/// A typed reference to an actor of type `A`, in this process or on another host; cheap to
/// clone.
pub struct ActorRef<A: Actor> {
    port: Port<A>,
    key: u64,
    driver: Handle,
    /// Shared by the clones of the reference a spawn returned: the actor ends when the last
    /// drops (`None`: this reference does not keep the actor alive).
    keeper: Option<Arc<Keeper>>,
}

impl<A: Actor> Clone for ActorRef<A> {
    fn clone(&self) -> Self {
        ActorRef {
            port: self.port.clone(),
            key: self.key,
            driver: self.driver.clone(),
            keeper: self.keeper.clone(),
        }
    }
}

impl<A: Actor> std::fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActorRef({})", self.shared().info)
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
            port: Port::Local(port, shared),
            key,
            driver,
            keeper: None,
        }
    }

    /// A reference to an actor of another host that is never re-placed (e.g. one that arrived
    /// in a message).
    pub(crate) fn remote(
        connection: Arc<HostConnection>,
        shared: Arc<ActorShared>,
        key: u64,
        driver: Handle,
    ) -> Self {
        let shared = connection.track(&shared, None);
        let remote = RemoteActor::new(Incarnation::new(connection, shared), None);
        ActorRef::following(remote, key, driver)
    }

    /// A reference that follows `remote`'s incarnations.
    pub(crate) fn following(remote: Arc<RemoteActor>, key: u64, driver: Handle) -> Self {
        ActorRef {
            port: Port::Remote(remote),
            key,
            driver,
            keeper: None,
        }
    }

    /// The same reference, keeping its actor alive while it or a clone of it lives (what a
    /// spawn that is not detached returns).
    pub(crate) fn keeping(mut self) -> Self {
        self.keeper = Some(match &self.port {
            Port::Local(port, shared) => Keeper::local(port.clone(), shared.clone()),
            Port::Remote(remote) => Keeper::remote(remote.clone()),
        });
        self
    }

    /// What keeps the actor alive, when this reference does.
    pub(crate) fn keeper(&self) -> Option<&Arc<Keeper>> {
        self.keeper.as_ref()
    }

    /// Ends this process's actor once the messages already sent to it are handled (a host's
    /// answer to the `Release` of the process holding the actor's handles).
    pub(crate) fn release(&self) {
        if let Port::Local(port, shared) = &self.port {
            super::keeper::release_local(port, shared);
        }
    }

    /// The actor's state as this process sees it (of its latest incarnation, for an actor of
    /// another host).
    pub(crate) fn shared(&self) -> &Arc<ActorShared> {
        match &self.port {
            Port::Local(_, shared) => shared,
            Port::Remote(remote) => &remote.current().shared,
        }
    }

    pub(crate) fn key(&self) -> u64 {
        self.key
    }

    /// The actor port of the actor's host, for a reference to another process's actor.
    pub(crate) fn remote_addr(&self) -> Option<&str> {
        self.remote_connection().map(|connection| connection.addr())
    }

    /// The connection to the actor's host, when it lives in another process.
    pub(crate) fn remote_connection(&self) -> Option<&Arc<HostConnection>> {
        match &self.port {
            Port::Remote(remote) => Some(&remote.current().connection),
            Port::Local(..) => None,
        }
    }

    /// Whether the actor lives in another process.
    pub fn is_remote(&self) -> bool {
        matches!(self.port, Port::Remote(_))
    }

    /// Who the actor is (id, type, name, device, host).
    pub fn info(&self) -> &ActorInfo {
        &self.shared().info
    }

    /// Sends `message` and returns the future of its reply.
    pub fn call<M: Message>(&self, message: M) -> Call<M::Reply>
    where
        A: Handler<M>,
    {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        let shared = self.shared();
        if CURRENT_ACTOR.try_with(|k| *k == self.key).unwrap_or(false) {
            let error = CallError::SelfCall {
                actor: shared.label(),
                message: message_type.to_string(),
            };
            return Call::failed(error, self.driver.clone());
        }
        let (tx, rx) = oneshot::channel();
        let cancel = match &self.port {
            Port::Local(port, _) => {
                if let Err(error) = self.strict_check(&message) {
                    return Call::failed(error, self.driver.clone());
                }
                let flag = Arc::new(AtomicBool::new(false));
                let letter = Letter {
                    message: Some(message),
                    reply: Some(ReplyTo::Channel(tx)),
                    cancel: Some(flag.clone()),
                    seq: shared.sequence(),
                };
                if port.send_message(Box::new(letter)).is_err() {
                    return Call::failed(shared.ended_error(message_type), self.driver.clone());
                }
                Canceller::Flag(flag)
            }
            Port::Remote(remote) => match self.call_remote(remote, &message, tx) {
                Ok(call) => Canceller::Remote(call),
                Err(error) => return Call::failed(error, self.driver.clone()),
            },
        };
        Call::waiting(rx, cancel, shared.clone(), message_type, self.driver.clone())
    }

    /// Sends a call to the latest incarnation of an actor of another host (once it is re-placed,
    /// while it is); `reply` gets the decoded reply.
    fn call_remote<M: Message>(
        &self,
        remote: &RemoteActor,
        message: &M,
        reply: oneshot::Sender<Result<M::Reply, CallError>>,
    ) -> Result<Arc<RemoteCall>, CallError> {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        if self.shared().end().is_some() {
            return Err(self.shared().ended_error(message_type));
        }
        let (codec, payload) = self.encode(message)?;
        let deliver = decode_reply::<M>(self.shared().clone(), codec, reply);
        let call = Arc::new(RemoteCall::default());
        let sent = call.clone();
        remote.send(move |incarnation| {
            let Incarnation {
                connection, shared, ..
            } = incarnation;
            if shared.end().is_some() {
                return deliver(Err(shared.ended_error(message_type)));
            }
            shared.sequence();
            sent.send(connection, move || {
                connection.call(shared, message_type, std::any::type_name::<M>(), payload, deliver)
            });
        });
        Ok(call)
    }

    /// Sends `message` to this process's actor with its reply encoded by `encode` and sent to
    /// `reply` on the actor's thread: how a host answers callers of other processes without a
    /// task (or a boxed closure) per call.
    pub(crate) fn call_into<M: Message>(&self, message: M, reply: RemoteReply, encode: EncodeFn<M::Reply>)
    where
        A: Handler<M>,
    {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        let Port::Local(port, shared) = &self.port else {
            reply.send(Err(CallError::NotRemote {
                actor: self.shared().label(),
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
                shared.clone(),
                message_type,
            ))),
            cancel: None,
            seq: shared.sequence(),
        };
        // A letter the mailbox refuses is dropped here, and its reply answers with the end.
        let _ = port.send_message(Box::new(letter) as Mail<A>);
    }

    /// Encodes `message` for the actor's host with the codec registered for its type.
    fn encode<M: Message>(&self, message: &M) -> Result<(MessageCodec, Vec<u8>), CallError> {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        let not_remote = |reason: String| CallError::NotRemote {
            actor: self.shared().label(),
            message: message_type.to_string(),
            reason,
        };
        let codec = Registry::codec::<M>().ok_or_else(|| {
            not_remote(format!(
                "`{message_type}` is not registered; add `.handles::<{}, {message_type}>()` to the Registry the program installs",
                self.shared().info.type_name
            ))
        })?;
        let payload = (codec.encode)(message).map_err(|e| not_remote(e.to_string()))?;
        Ok((codec, payload))
    }

    /// In strict registration mode, refuses a message to this process's actor that a cluster
    /// would refuse: its type not registered for `A`, or its bytes not encoding.
    fn strict_check<M: Message>(&self, message: &M) -> Result<(), CallError> {
        if !self.shared().strict.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        super::dry_run::dry_run(|| self.encode(message))?;
        let (actor, message_type) = (std::any::type_name::<A>(), std::any::type_name::<M>());
        if Registry::handles_registered(actor, message_type) {
            return Ok(());
        }
        let short = super::system::short_name(message_type);
        Err(CallError::NotRemote {
            actor: self.shared().label(),
            message: short.to_string(),
            reason: format!(
                "the message is not registered for `{0}`; add `.handles::<{0}, {short}>()` to the Registry",
                self.shared().info.type_name
            ),
        })
    }

    /// Sends `message` without waiting for (or getting) its reply. Fails only when the actor
    /// has already ended (a cast sent while the actor is re-placed goes to the new incarnation,
    /// and is dropped if there is none).
    pub fn cast<M: Message>(&self, message: M) -> Result<(), CallError>
    where
        A: Handler<M>,
    {
        let message_type = super::system::short_name(std::any::type_name::<M>());
        let shared = self.shared();
        match &self.port {
            Port::Local(port, _) => {
                self.strict_check(&message)?;
                let letter = Letter {
                    message: Some(message),
                    reply: None,
                    cancel: None,
                    seq: shared.sequence(),
                };
                port.send_message(Box::new(letter))
                    .map_err(|_| shared.ended_error(message_type))
            }
            Port::Remote(remote) => {
                if shared.end().is_some() {
                    return Err(shared.ended_error(message_type));
                }
                let (_, payload) = self.encode(&message)?;
                let sent = remote.send(
                    move |Incarnation {
                              connection, shared, ..
                          }| {
                        if shared.end().is_some() {
                            return Err(shared.ended_error(message_type));
                        }
                        shared.sequence();
                        connection.cast(shared, message_type, std::any::type_name::<M>(), payload)
                    },
                );
                sent.unwrap_or(Ok(()))
            }
        }
    }

    /// Stops the actor gracefully: it finishes the message it is handling, runs
    /// [`Actor::stopping`], and ends with [`ActorEnd::Stopped`] and `reason`; messages still
    /// queued fail with [`CallError::Stopped`].
    pub fn stop(&self, reason: &str) {
        let end = ActorEnd::Stopped {
            reason: reason.to_string(),
        };
        match &self.port {
            Port::Local(port, shared) => {
                shared.set_end(end);
                port.stop(Some(reason.to_string()));
            }
            Port::Remote(remote) => remote.stop(end, reason, false),
        }
    }

    /// Kills the actor at once: the handler it is running is dropped at its next `.await` (a
    /// kernel already running on the device thread finishes first), [`Actor::stopping`] does not
    /// run, and it ends with [`ActorEnd::Stopped`] and `killed: {reason}`; the call being handled
    /// and every queued one fail with [`CallError::Stopped`], its tensors are freed.
    pub fn kill(&self, reason: &str) {
        let end = ActorEnd::Stopped {
            reason: format!("killed: {reason}"),
        };
        match &self.port {
            Port::Local(port, shared) => {
                shared.set_end(end);
                port.kill();
            }
            Port::Remote(remote) => remote.stop(end, reason, true),
        }
    }

    /// How the actor ended, once it has ended.
    pub fn end(&self) -> Option<ActorEnd> {
        self.shared().ended()
    }

    /// Resolves when the actor ends (stopped, or failed without a restart left — for an actor
    /// of another host, lost with its host and not re-placed).
    pub fn ended(&self) -> Pending<ActorEnd> {
        let (mut shared, mut incarnation) = match &self.port {
            Port::Local(_, shared) => (shared.clone(), None),
            Port::Remote(remote) => (remote.first().shared.clone(), Some(remote.first().clone())),
        };
        let future = async move {
            loop {
                let end = end_of(&shared).await;
                // An incarnation re-placed elsewhere has its successor linked before its end.
                match incarnation.as_ref().and_then(|i| i.next()).cloned() {
                    Some(next) => (shared, incarnation) = (next.shared.clone(), Some(next)),
                    None => return end,
                }
            }
        };
        Pending::new(future, self.driver.clone())
    }

    /// How many times the actor was restarted: after a panic, or (an actor of another host the
    /// driver spawned) re-placed after its host was lost — as this process sees it.
    pub fn restarts(&self) -> u32 {
        self.shared().restarts.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Messages sent to it and not yet taken off its queue.
    pub fn queue_depth(&self) -> u64 {
        self.shared().queue_depth()
    }
}

/// How `shared`'s actor ends (once it has).
async fn end_of(shared: &ActorShared) -> ActorEnd {
    let mut watch = shared.subscribe_end();
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
}

/// What a remote call does with its reply bytes: decodes them into `M`'s reply for `reply`
/// (naming `actor` when they cannot be read).
fn decode_reply<M: Message>(
    actor: Arc<ActorShared>,
    codec: MessageCodec,
    reply: oneshot::Sender<Result<M::Reply, CallError>>,
) -> Deliver {
    let message_type = super::system::short_name(std::any::type_name::<M>());
    Box::new(move |result: Result<&[u8], CallError>| {
        let decoded = result.and_then(|bytes| {
            let decoded = (codec.decode_reply)(bytes).map_err(|e| CallError::NotRemote {
                actor: actor.label(),
                message: message_type.to_string(),
                reason: format!("its reply: {e}"),
            })?;
            Ok(*decoded
                .downcast::<M::Reply>()
                .expect("the reply type registered for this message"))
        });
        let _ = reply.send(decoded);
    })
}
