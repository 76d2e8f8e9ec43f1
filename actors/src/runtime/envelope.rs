//! Envelopes: a typed message with its reply channel and cancel flag, boxed behind one trait so
//! that one ractor mailbox per actor carries every message type the actor handles.

use std::any::type_name;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::BoxFuture;
use tokio::sync::oneshot;

use super::actor::{Handler, Message};
use super::context::Context;
use super::remote::registry::RemoteReply;
use super::supervision::{ActorShared, CallError};
use crate::codec::CodecError;

/// One message in an actor's mailbox, its type erased.
pub(crate) trait Envelope<A>: Send {
    /// Its sequence number on the actor.
    fn seq(&self) -> u64;
    /// The message's Rust type, for errors.
    fn message_type(&self) -> &'static str;
    /// Whether the caller gave up on it before it started.
    fn cancelled(&self) -> bool;
    /// Runs the handler and sends the reply.
    fn run<'a>(&'a mut self, actor: &'a mut A, ctx: &'a Context<A>) -> BoxFuture<'a, ()>
    where
        A: super::actor::Actor;
    /// Answers the caller with `error` instead (when the handler did not reply).
    fn fail(&mut self, error: CallError);
}

/// The boxed form an actor's mailbox holds.
pub(crate) type Mail<A> = Box<dyn Envelope<A>>;

/// Where a call's reply goes.
pub(crate) type ReplyTx<R> = oneshot::Sender<Result<R, CallError>>;

/// Where a call's reply goes: a waiting [`Call`](super::Call), or a caller in another process
/// (the reply is encoded and queued on its connection on the actor's own thread).
pub(crate) enum ReplyTo<R> {
    /// A local caller's future (a dropped sender tells it the actor ended).
    Channel(ReplyTx<R>),
    /// A remote caller — or, when the letter is dropped unanswered (the actor ended with it
    /// queued), told the actor's end.
    Remote(EncodedReply<R>),
}

impl<R> ReplyTo<R> {
    pub(crate) fn send(self, result: Result<R, CallError>) {
        match self {
            // The caller may have stopped waiting (timeout, dropped future): nothing to do.
            ReplyTo::Channel(tx) => {
                let _ = tx.send(result);
            }
            ReplyTo::Remote(mut reply) => reply.send(result),
        }
    }

    /// Whether a remote caller gave up on the call.
    fn cancelled(&self) -> bool {
        matches!(self, ReplyTo::Remote(EncodedReply { to: Some(to), .. }) if to.cancelled())
    }
}

/// Encodes a reply.
pub(crate) type EncodeFn<R> = fn(&R) -> Result<Vec<u8>, CodecError>;

/// A remote call's reply, encoded when it is sent; it always answers: dropped without a
/// reply, it reports the actor's end.
pub(crate) struct EncodedReply<R> {
    to: Option<RemoteReply>,
    encode: EncodeFn<R>,
    actor: Arc<ActorShared>,
    message: &'static str,
}

impl<R> EncodedReply<R> {
    pub(crate) fn new(
        to: RemoteReply,
        encode: EncodeFn<R>,
        actor: Arc<ActorShared>,
        message: &'static str,
    ) -> EncodedReply<R> {
        EncodedReply {
            to: Some(to),
            encode,
            actor,
            message,
        }
    }

    fn send(&mut self, result: Result<R, CallError>) {
        let Some(to) = self.to.take() else { return };
        let encoded = result.and_then(|reply| {
            (self.encode)(&reply).map_err(|e| CallError::NotRemote {
                actor: self.actor.label(),
                message: self.message.to_string(),
                reason: format!("its reply: {e}"),
            })
        });
        to.send(encoded);
    }
}

impl<R> Drop for EncodedReply<R> {
    fn drop(&mut self) {
        if let Some(to) = self.to.take() {
            to.send(Err(self.actor.ended_error(self.message)));
        }
    }
}

/// A message of type `M` (a call when it has a reply channel, a cast otherwise).
pub(crate) struct Letter<M: Message> {
    pub(crate) message: Option<M>,
    pub(crate) reply: Option<ReplyTo<M::Reply>>,
    pub(crate) cancel: Option<Arc<AtomicBool>>,
    pub(crate) seq: u64,
}

impl<A, M> Envelope<A> for Letter<M>
where
    A: Handler<M>,
    M: Message,
{
    fn seq(&self) -> u64 {
        self.seq
    }

    fn message_type(&self) -> &'static str {
        super::system::short_name(type_name::<M>())
    }

    fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.load(Ordering::Acquire))
            || self.reply.as_ref().is_some_and(ReplyTo::cancelled)
    }

    fn run<'a>(&'a mut self, actor: &'a mut A, ctx: &'a Context<A>) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let Some(message) = self.message.take() else {
                return;
            };
            let reply = actor.handle(message, ctx).await;
            if let Some(to) = self.reply.take() {
                to.send(Ok(reply));
            }
        })
    }

    fn fail(&mut self, error: CallError) {
        if let Some(to) = self.reply.take() {
            to.send(Err(error));
        }
    }
}
