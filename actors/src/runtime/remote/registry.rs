//! The registry of the actor and message types that may cross processes. A program registers
//! them once in its `main`; since every host runs the program's own binary, the same names mean
//! the same types everywhere (names are Rust's full type names). A host spawns an actor type by
//! name from bincode parameters, and decodes a message by (actor type, message type) name; a
//! caller encodes a message for a remote actor with the encoder registered for its type.
//!
//! ```
//! use archipelago_actors::runtime::{Actor, Context, Handler, Message, Registry};
//! # struct Counter(i64);
//! # impl Actor for Counter {
//! #     type Params = i64;
//! #     async fn new(n: i64, _ctx: &Context<Self>) -> Result<Self, String> { Ok(Counter(n)) }
//! # }
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Add(i64);
//! impl Message for Add { type Reply = i64; }
//! # impl Handler<Add> for Counter {
//! #     async fn handle(&mut self, Add(n): Add, _ctx: &Context<Self>) -> i64 { self.0 += n; self.0 }
//! # }
//! let registry = Registry::new().actor::<Counter>().handles::<Counter, Add>();
//! registry.install();
//! ```

use std::any::{Any, TypeId, type_name};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock};

use archipelago_dataflow::DeviceSpec;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc::UnboundedSender;

use super::wire::{Frame, Outgoing};

use crate::codec::{self, CodecError};
use crate::runtime::{
    Actor, ActorEnd, ActorInfo, ActorRef, CallError, Handler, Message, Pending, RuntimeHandle, SpawnError,
    SpawnOptions,
};

/// An actor of some registered type, as a host holds it for remote callers.
pub trait ErasedActor: Send + Sync {
    /// Who it is.
    fn info(&self) -> ActorInfo;
    /// Stops it.
    fn stop(&self, reason: &str);
    /// Kills it.
    fn kill(&self, reason: &str);
    /// Ends it once the messages already sent to it are handled.
    fn release(&self);
    /// Resolves when it ends.
    fn ended(&self) -> Pending<ActorEnd>;
    /// The typed reference, for the registered handlers to downcast.
    fn as_any(&self) -> &dyn Any;
    /// The actor's full Rust type name (the registry's key).
    fn type_key(&self) -> &'static str;
    /// Its device thread in this process's runtime.
    fn thread(&self) -> Option<usize>;
}

impl<A: Actor> ErasedActor for ActorRef<A> {
    fn info(&self) -> ActorInfo {
        ActorRef::info(self).clone()
    }
    fn stop(&self, reason: &str) {
        ActorRef::stop(self, reason);
    }
    fn kill(&self, reason: &str) {
        ActorRef::kill(self, reason);
    }
    fn release(&self) {
        ActorRef::release(self);
    }
    fn ended(&self) -> Pending<ActorEnd> {
        ActorRef::ended(self)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn type_key(&self) -> &'static str {
        type_name::<A>()
    }
    fn thread(&self) -> Option<usize> {
        self.shared().thread.get().copied()
    }
}

type SpawnFn = fn(&RuntimeHandle, DeviceSpec, &[u8], SpawnOptions) -> Result<SpawnedErased, SpawnError>;
/// A spawn in progress on a host.
pub type SpawnedErased = Pending<Result<Arc<dyn ErasedActor>, SpawnError>>;
type HandleFn = fn(&dyn ErasedActor, &[u8], Option<RemoteReply>) -> Result<(), CallError>;

/// Cancelled calls kept at most per connection: a `Cancel` that crossed its call's reply on
/// the wire names a call that is already done and stays; past this bound the oldest are
/// forgotten (a caller with more cancelled calls still queued than this would see the oldest
/// run, their replies discarded: its futures still resolve as cancelled).
const MAX_CANCELS: usize = 1 << 16;

/// The calls of one caller's connection that the caller gave up on (its `Cancel` frames). A
/// message looks here before it starts, and only while some cancel is pending: calls carry no
/// state of their own for it.
#[derive(Debug, Default)]
pub struct Cancels {
    pending: AtomicUsize,
    ids: Mutex<BTreeSet<u64>>,
}

impl Cancels {
    /// The caller gave up on call `call`.
    pub(crate) fn cancel(&self, call: u64) {
        let mut ids = self.ids.lock().expect("cancelled calls");
        ids.insert(call);
        while ids.len() > MAX_CANCELS {
            ids.pop_first();
        }
        self.pending.store(ids.len(), Ordering::Release);
    }

    /// Whether the caller gave up on call `call`.
    fn is_cancelled(&self, call: u64) -> bool {
        self.pending.load(Ordering::Acquire) > 0 && self.ids.lock().expect("cancelled calls").contains(&call)
    }

    /// Call `call` is answered (or skipped): forget its cancel, if any.
    fn done(&self, call: u64) {
        if self.pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut ids = self.ids.lock().expect("cancelled calls");
        if ids.remove(&call) {
            self.pending.store(ids.len(), Ordering::Release);
        }
    }
}

/// Where a remote call's encoded reply (or its error) goes: back on the caller's connection
/// as [`Frame::Reply`] to call `call`; sent from the actor's thread.
pub struct RemoteReply {
    call: u64,
    out: UnboundedSender<Outgoing>,
    cancels: Arc<Cancels>,
}

impl RemoteReply {
    /// The reply to call `call`, queued on `out`; `cancels` are its connection's.
    pub fn new(call: u64, out: UnboundedSender<Outgoing>, cancels: Arc<Cancels>) -> RemoteReply {
        RemoteReply { call, out, cancels }
    }

    /// Whether the caller gave up on the call.
    pub(crate) fn cancelled(&self) -> bool {
        self.cancels.is_cancelled(self.call)
    }

    /// Answers the call (a closed connection drops the answer).
    pub fn send(self, result: Result<Vec<u8>, CallError>) {
        self.cancels.done(self.call);
        let _ = self.out.send(
            Frame::Reply {
                call: self.call,
                result,
            }
            .into(),
        );
    }
}
type EncodeFn = fn(&dyn Any) -> Result<Vec<u8>, CodecError>;
type DecodeReplyFn = fn(&[u8]) -> Result<Box<dyn Any + Send>, CodecError>;

/// How a registered message type is encoded, and its reply decoded, by a caller.
#[derive(Clone, Copy)]
pub(crate) struct MessageCodec {
    pub(crate) encode: EncodeFn,
    pub(crate) decode_reply: DecodeReplyFn,
}

/// Actor and message types that may cross processes.
#[derive(Default, Clone)]
pub struct Registry {
    actors: HashMap<&'static str, SpawnFn>,
    handlers: HashMap<(&'static str, &'static str), HandleFn>,
    codecs: HashMap<TypeId, MessageCodec>,
    params: HashMap<TypeId, EncodeFn>,
    /// Calls that compiled programs may record on other hosts, by node key.
    pub(in crate::runtime) program_calls: HashMap<String, crate::runtime::compiled::NodeFn>,
    /// Values that may travel between the interpreters of a compiled program, by type name.
    pub(in crate::runtime) values: HashMap<&'static str, crate::runtime::compiled::ValueCodec>,
}

static GLOBAL: LazyLock<RwLock<Registry>> = LazyLock::new(RwLock::default);

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Registers actor type `A`, spawnable on another host from its parameters.
    pub fn actor<A: Actor>(mut self) -> Registry
    where
        A::Params: Serialize + DeserializeOwned,
    {
        self.actors.insert(type_name::<A>(), spawn_erased::<A>);
        self.params.insert(TypeId::of::<A>(), encode_erased::<A::Params>);
        self
    }

    /// Registers message `M` of actor `A` (and its reply) to cross processes.
    pub fn handles<A, M>(mut self) -> Registry
    where
        A: Handler<M>,
        M: Message + Serialize + DeserializeOwned,
        M::Reply: Serialize + DeserializeOwned,
    {
        self.handlers
            .insert((type_name::<A>(), type_name::<M>()), handle_erased::<A, M>);
        self.codecs.insert(
            TypeId::of::<M>(),
            MessageCodec {
                encode: encode_erased::<M>,
                decode_reply: decode_reply_erased::<M>,
            },
        );
        self
    }

    /// This registry with `other`'s types added (programs made of several parts).
    pub fn merge(mut self, other: Registry) -> Registry {
        self.actors.extend(other.actors);
        self.handlers.extend(other.handlers);
        self.codecs.extend(other.codecs);
        self.params.extend(other.params);
        self.program_calls.extend(other.program_calls);
        self.values.extend(other.values);
        self
    }

    /// Makes these types known to this process (added to what is already installed).
    pub fn install(self) {
        let mut global = GLOBAL.write().expect("registry");
        global.actors.extend(self.actors);
        global.handlers.extend(self.handlers);
        global.codecs.extend(self.codecs);
        global.params.extend(self.params);
        global.program_calls.extend(self.program_calls);
        global.values.extend(self.values);
    }

    /// Reads the registry this process installed.
    pub(in crate::runtime) fn installed<T>(read: impl FnOnce(&Registry) -> T) -> T {
        read(&GLOBAL.read().expect("registry"))
    }

    /// Spawns the registered actor type `actor_type` from its encoded parameters.
    pub fn spawn(
        runtime: &RuntimeHandle,
        actor_type: &str,
        device: DeviceSpec,
        params: &[u8],
        options: SpawnOptions,
    ) -> Result<SpawnedErased, SpawnError> {
        let spawn = GLOBAL.read().expect("registry").actors.get(actor_type).copied();
        let spawn = spawn.ok_or_else(|| SpawnError::Constructor {
            actor: format!("an actor of type `{actor_type}`"),
            reason: format!(
                "`{actor_type}` is not registered on host {}; add `.actor::<{}>()` to the Registry the program installs (hosts run the same binary)",
                runtime.host(),
                super::super::system::short_name(actor_type)
            ),
        })?;
        spawn(runtime, device, params, options)
    }

    /// Hands the encoded `message_type` message to `actor`: a call when `reply` is given (the
    /// reply, or why there is none, goes there), else a cast (an error is returned).
    pub fn deliver(
        actor: &dyn ErasedActor,
        message_type: &str,
        payload: &[u8],
        reply: Option<RemoteReply>,
    ) -> Result<(), CallError> {
        let found = GLOBAL
            .read()
            .expect("registry")
            .handlers
            .get(&(actor.type_key(), message_type))
            .copied();
        let Some(handle) = found else {
            let info = actor.info();
            let error = CallError::NotRemote {
                actor: info.to_string(),
                message: message_type.to_string(),
                reason: format!(
                    "the message is not registered for `{}` on host {}; add `.handles::<{}, {}>()` to the Registry",
                    info.type_name,
                    info.host,
                    info.type_name,
                    super::super::system::short_name(message_type)
                ),
            };
            return match reply {
                Some(reply) => {
                    reply.send(Err(error));
                    Ok(())
                }
                None => Err(error),
            };
        };
        handle(actor, payload, reply)
    }

    /// Encodes actor type `A`'s parameters for a spawn on another host.
    pub(crate) fn encode_params<A: Actor>(params: &A::Params) -> Result<Vec<u8>, String> {
        let encode = GLOBAL
            .read()
            .expect("registry")
            .params
            .get(&TypeId::of::<A>())
            .copied();
        let encode = encode.ok_or_else(|| {
            format!(
                "`{}` is not registered to run on other hosts; add `.actor::<{}>()` to the Registry the program installs",
                type_name::<A>(),
                super::super::system::short_name(type_name::<A>())
            )
        })?;
        encode(params).map_err(|e| e.to_string())
    }

    /// Whether message type `message` is registered for actor type `actor` (full type names).
    pub(crate) fn handles_registered(actor: &'static str, message: &'static str) -> bool {
        GLOBAL
            .read()
            .expect("registry")
            .handlers
            .contains_key(&(actor, message))
    }

    pub(crate) fn codec<M: 'static>() -> Option<MessageCodec> {
        GLOBAL
            .read()
            .expect("registry")
            .codecs
            .get(&TypeId::of::<M>())
            .copied()
    }
}

fn spawn_erased<A: Actor>(
    runtime: &RuntimeHandle,
    device: DeviceSpec,
    params: &[u8],
    options: SpawnOptions,
) -> Result<SpawnedErased, SpawnError>
where
    A::Params: DeserializeOwned,
{
    let params: A::Params = codec::decode(params).map_err(|e| SpawnError::Constructor {
        actor: format!("an actor of type `{}`", type_name::<A>()),
        reason: e.to_string(),
    })?;
    let spawning = runtime.spawn_with::<A>(device, params, options);
    let driver = runtime.driver().clone();
    Ok(Pending::new(
        async move { spawning.await.map(|a| Arc::new(a) as Arc<dyn ErasedActor>) },
        driver,
    ))
}

fn handle_erased<A, M>(
    actor: &dyn ErasedActor,
    payload: &[u8],
    reply: Option<RemoteReply>,
) -> Result<(), CallError>
where
    A: Handler<M>,
    M: Message + DeserializeOwned,
    M::Reply: Serialize,
{
    // Named only when something fails (formatting the actor costs allocations on every call).
    let not_remote = |actor: &ActorInfo, reason: String| CallError::NotRemote {
        actor: actor.to_string(),
        message: super::super::system::short_name(type_name::<M>()).to_string(),
        reason,
    };
    let typed = actor.as_any().downcast_ref::<ActorRef<A>>().ok_or_else(|| {
        not_remote(
            &actor.info(),
            format!("the actor is not a `{}`", type_name::<A>()),
        )
    });
    let decoded = typed.and_then(|typed| {
        let message = codec::decode::<M>(payload).map_err(|e| not_remote(typed.info(), e.to_string()))?;
        Ok((typed, message))
    });
    match (decoded, reply) {
        (Ok((typed, message)), None) => typed.cast(message),
        (Err(error), None) => Err(error),
        (Err(error), Some(reply)) => {
            reply.send(Err(error));
            Ok(())
        }
        (Ok((typed, message)), Some(reply)) => {
            typed.call_into(message, reply, codec::encode::<M::Reply>);
            Ok(())
        }
    }
}

fn encode_erased<M: Serialize + 'static>(message: &dyn Any) -> Result<Vec<u8>, CodecError> {
    let message = message
        .downcast_ref::<M>()
        .expect("the codec of this message type");
    codec::encode(message)
}

fn decode_reply_erased<M>(bytes: &[u8]) -> Result<Box<dyn Any + Send>, CodecError>
where
    M: Message,
    M::Reply: DeserializeOwned,
{
    Ok(Box::new(codec::decode::<M::Reply>(bytes)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cancel is seen by its call only, forgotten when the call is done, and cancels that
    /// crossed their replies are kept to a bound.
    #[test]
    fn cancels_name_their_calls_and_stay_bounded() {
        let cancels = Cancels::default();
        assert!(!cancels.is_cancelled(1));
        cancels.cancel(1);
        assert!(cancels.is_cancelled(1) && !cancels.is_cancelled(2));
        cancels.done(1);
        assert!(!cancels.is_cancelled(1));
        assert_eq!(cancels.pending.load(Ordering::Relaxed), 0);
        for call in 0..(MAX_CANCELS as u64 + 10) {
            cancels.cancel(call);
        }
        assert_eq!(cancels.pending.load(Ordering::Relaxed), MAX_CANCELS);
        assert!(!cancels.is_cancelled(0) && cancels.is_cancelled(MAX_CANCELS as u64 + 9));
    }
}
