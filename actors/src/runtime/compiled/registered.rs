//! What a compiled program needs from the [`Registry`] to run over actors of other hosts: each
//! recorded call as data (a node key naming actor type, message type and value type, resolved on
//! the host to the constructor the same binary registered), and a codec for every value that
//! crosses processes between interpreters.
//!
//! ```
//! use archipelago_actors::runtime::{Actor, Context, Handler, Message, Registry};
//! # struct AddOne;
//! # impl Actor for AddOne {
//! #     type Params = ();
//! #     async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> { Ok(AddOne) }
//! # }
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Step(u64);
//! impl Message for Step { type Reply = u64; }
//! # impl Handler<Step> for AddOne {
//! #     async fn handle(&mut self, Step(n): Step, _ctx: &Context<Self>) -> u64 { n + 1 }
//! # }
//! // `recorder.call(&a, &x, Step)` on an `AddOne` of another host runs `Step(x)` there.
//! let registry = Registry::new().actor::<AddOne>().compiled::<AddOne, Step, u64>(Step);
//! registry.install();
//! ```

use std::any::{Any, type_name};
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::direct::{Binder, binder};
use super::{Invoke, Shared};
use crate::codec::{self, CodecError};
use crate::runtime::remote::ErasedActor;
use crate::runtime::{ActorRef, Handler, Message, Registry};

/// One recorded call as a host runs it: resolved once, when the program is installed, against
/// the host's actor (or why that actor cannot take it).
pub(crate) type NodeFn = Arc<dyn Fn(&Arc<dyn ErasedActor>) -> Result<Node, String> + Send + Sync>;

/// A recorded call bound to its actor: as an interpreter makes it, and as the direct path does.
pub(crate) struct Node {
    pub(crate) invoke: Invoke,
    pub(crate) bind: Binder,
}

/// The value as a `T`, moved out of its `Arc` when nothing else holds it (cloned otherwise).
///
/// # Panics
/// When it is no `T` (the recording's types make it one).
pub(crate) fn take<T: Clone + Send + Sync + 'static>(value: Shared) -> T {
    let value = value.downcast::<T>().expect("the recorded value type");
    Arc::try_unwrap(value).unwrap_or_else(|shared| (*shared).clone())
}

/// The call `make(value)` to `actor`, as a compiled program runs it: the value is moved out of
/// its `Arc` into the message when nothing else holds it (cloned otherwise), and the reply is
/// the next value.
pub(crate) fn invoke<A, M, T>(actor: ActorRef<A>, make: fn(T) -> M) -> Invoke
where
    A: Handler<M>,
    M: Message,
    M::Reply: Sync,
    T: Clone + Send + Sync + 'static,
{
    Arc::new(move |value: Shared| {
        let call = actor.call(make(take(value)));
        Box::pin(async move { Ok(Arc::new(call.await?) as Shared) })
    })
}

/// How a value crosses processes between interpreters.
#[derive(Clone, Copy)]
pub(crate) struct ValueCodec {
    pub(crate) encode: fn(&Shared) -> Result<Vec<u8>, CodecError>,
    pub(crate) decode: fn(&[u8]) -> Result<Shared, CodecError>,
}

/// The key of a call `make(value: T)` to an actor of type `A` (full Rust type names).
pub(crate) fn node_key<A: 'static, M: 'static, T: 'static>() -> String {
    format!(
        "{} <- {}({})",
        type_name::<A>(),
        type_name::<M>(),
        type_name::<T>()
    )
}

impl Registry {
    /// Lets compiled programs record calls `make(value)` of message `M` built from a value of
    /// type `T` to actors of type `A` on other hosts. Every host runs the same binary, so the
    /// `make` registered here is the one the host applies: record the same constructor.
    /// Registers the codecs of `T` and of `M`'s reply, the values that travel between actors,
    /// and `M` itself for eager calls (as [`handles`](Registry::handles) does).
    pub fn compiled<A, M, T>(mut self, make: fn(T) -> M) -> Registry
    where
        A: Handler<M>,
        M: Message + Serialize + DeserializeOwned,
        M::Reply: Clone + Sync + Serialize + DeserializeOwned,
        T: Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    {
        let node: NodeFn = Arc::new(move |actor: &Arc<dyn ErasedActor>| {
            let typed = actor.as_any().downcast_ref::<ActorRef<A>>().cloned();
            let typed = typed.ok_or_else(|| {
                format!(
                    "a recorded call to a `{}` reached a `{}`",
                    type_name::<A>(),
                    actor.type_key()
                )
            })?;
            Ok(Node {
                bind: binder(&typed, make),
                invoke: invoke(typed, make),
            })
        });
        self.program_calls.insert(node_key::<A, M, T>(), node);
        (self.program_value::<T>().program_value::<M::Reply>()).handles::<A, M>()
    }

    /// Lets values of type `T` travel between the processes of a compiled program (the input
    /// and output of a program, when no registered call takes or returns them).
    pub fn program_value<T>(mut self) -> Registry
    where
        T: Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    {
        self.values.insert(
            type_name::<T>(),
            ValueCodec {
                encode: encode_value::<T>,
                decode: decode_value::<T>,
            },
        );
        self
    }
}

fn encode_value<T: Serialize + 'static>(value: &Shared) -> Result<Vec<u8>, CodecError> {
    let any: &dyn Any = value.as_ref();
    let value = any.downcast_ref::<T>().expect("the codec of this value type");
    codec::encode(value)
}

fn decode_value<T: DeserializeOwned + Send + Sync + 'static>(bytes: &[u8]) -> Result<Shared, CodecError> {
    Ok(Arc::new(codec::decode::<T>(bytes)?))
}

/// The registered call of `key`, if this process installed one.
pub(crate) fn node(key: &str) -> Option<NodeFn> {
    Registry::installed(|r| r.program_calls.get(key).cloned())
}

/// The registered codec of values of the type named `name`.
pub(crate) fn value_codec(name: &str) -> Option<ValueCodec> {
    Registry::installed(|r| r.values.get(name).copied())
}
