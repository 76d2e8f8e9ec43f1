//! What a user writes: an [`Actor`] (its state and constructor), its [`Message`] types and one
//! [`Handler`] per message type — an actor's protocol is the list of its handlers, as in
//! hyperactor.
//!
//! ```
//! use archipelago_actors::runtime::{Actor, Context, Handler, Message};
//!
//! struct Counter { total: i64 }
//! struct Add(i64);
//! impl Message for Add { type Reply = i64; }
//!
//! impl Actor for Counter {
//!     type Params = i64;
//!     async fn new(start: i64, _ctx: &Context<Self>) -> Result<Self, String> {
//!         Ok(Counter { total: start })
//!     }
//! }
//! impl Handler<Add> for Counter {
//!     async fn handle(&mut self, Add(n): Add, _ctx: &Context<Self>) -> i64 {
//!         self.total += n;
//!         self.total
//!     }
//! }
//! ```

use std::future::Future;

use super::context::Context;

/// An actor type: state built by [`Actor::new`] on the actor's device, then changed only by its
/// handlers, one message at a time.
pub trait Actor: Sized + Send + 'static {
    /// What the constructor takes. It is cloned for every restart (see
    /// [`SpawnOptions::max_restarts`](super::SpawnOptions::max_restarts)).
    type Params: Clone + Send + Sync + 'static;

    /// Builds the actor on its device's thread (burn modules are made where they live). An
    /// error refuses the spawn; after a restart it ends the actor.
    fn new(params: Self::Params, ctx: &Context<Self>) -> impl Future<Output = Result<Self, String>> + Send;

    /// Runs when the actor stops normally (not after a panic it does not survive).
    fn stopping(&mut self, _ctx: &Context<Self>) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// A message type and what answers it.
pub trait Message: Send + 'static {
    /// The reply; `()` for messages only ever cast.
    type Reply: Send + 'static;
}

/// How actor `Self` handles message `M`.
///
/// A handler runs to completion before the actor takes its next message: its `.await`s wait
/// (for another actor's reply, a tensor, a timer) without letting other messages of this actor
/// in. Unlike Ray's async actors, state is never seen half-updated by an interleaved handler;
/// the price is that an actor waiting on a call to itself would wait forever, so such a call is
/// refused with [`CallError::SelfCall`](super::CallError::SelfCall).
pub trait Handler<M: Message>: Actor {
    /// Handles one message and returns its reply. A panic fails this call and every call queued
    /// on the actor before it, naming the message; see [`SpawnOptions`](super::SpawnOptions)
    /// for restarts.
    fn handle(&mut self, message: M, ctx: &Context<Self>) -> impl Future<Output = M::Reply> + Send;
}
