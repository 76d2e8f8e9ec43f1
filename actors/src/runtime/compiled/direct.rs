//! The direct path of a participant whose stream is one receive, one call on what it received,
//! and sends of the reply (a chain's link, a device actor's part of a step): no interpreter
//! runs for it. Whoever hands it its value — the reader of the connection the value arrived on,
//! or the sender in this process — puts the call straight into the actor's mailbox as a [`Hop`],
//! and the actor's own thread, right after the handler, sends the reply on to the next
//! participants: one wake-up of the actor's thread per call, as an eager call from another
//! process costs, instead of the interpreter's three polls (woken by the value, calling the
//! actor, woken by the reply). Values and errors go through the mailbox alike, so they stay in
//! order; a panic, a refused message or an ended actor forwards its error.

use std::any::type_name;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::future::BoxFuture;

use super::Shared;
use super::routes::Port;
use crate::runtime::context::Context;
use crate::runtime::envelope::{Envelope, Mail};
use crate::runtime::supervision::ActorShared;
use crate::runtime::system::{RuntimeInner, short_name};
use crate::runtime::{ActorRef, CallError, Handler, Message};

/// Starts one recorded call on its input (or passes on the error that replaced the input)
/// through the actor's mailbox; the actor's thread sends the outcome [`Onward`].
pub(crate) type Deliver = Arc<dyn Fn(Result<Shared, CallError>, Arc<Onward>) + Send + Sync>;

/// The [`Deliver`] of recorded call `node` on its actor of `runtime` (`None` when the actor is
/// not a live actor of that runtime).
pub(crate) type Binder = Arc<dyn Fn(&RuntimeInner, usize) -> Option<Deliver> + Send + Sync>;

/// The binder of the call `make(value)` to `actor`.
pub(crate) fn binder<A, M, T>(actor: &ActorRef<A>, make: fn(T) -> M) -> Binder
where
    A: Handler<M>,
    M: Message,
    M::Reply: Sync,
    T: Clone + Send + Sync + 'static,
{
    let shared = actor.shared().clone();
    Arc::new(move |runtime: &RuntimeInner, node: usize| {
        let live = runtime.live.lock().expect("live actors");
        let cell = (live.get(&shared.info.id))
            .filter(|a| Arc::ptr_eq(&a.shared, &shared))
            .map(|a| a.cell.clone())?;
        let shared = shared.clone();
        Some(
            Arc::new(move |value: Result<Shared, CallError>, then: Arc<Onward>| {
                let hop = Hop::<M> {
                    message: Some(value.and_then(|v| message(v, make, node))),
                    then: Some(then),
                    seq: shared.sequence(),
                    shared: shared.clone(),
                };
                // A refused letter (the actor ended) is dropped here, and passes on the actor's end.
                let _ = cell.send_message::<Mail<A>>(Box::new(hop));
            }) as Deliver,
        )
    })
}

/// The message `make(value)`, the value moved out of its `Arc` when nothing else holds it; a
/// panic (in `make`, or a value of another type) is the run's error.
fn message<M, T>(value: Shared, make: fn(T) -> M, node: usize) -> Result<M, CallError>
where
    T: Clone + Send + Sync + 'static,
{
    std::panic::catch_unwind(AssertUnwindSafe(|| make(super::registered::take(value)))).map_err(|p| {
        CallError::Program {
            reason: format!(
                "recorded call {node} (building its message or reading its input) {}",
                crate::error::panic_message(p.as_ref())
            ),
        }
    })
}

/// One call of a direct participant in the actor's mailbox: the message (or the error that
/// replaced it upstream) and where its reply goes.
struct Hop<M: Message> {
    message: Option<Result<M, CallError>>,
    then: Option<Arc<Onward>>,
    seq: u64,
    shared: Arc<ActorShared>,
}

impl<M: Message> Hop<M> {
    /// Hands the outcome on (once); a panic there is not the actor's.
    fn answer(&mut self, outcome: Result<Shared, CallError>) {
        if let Some(then) = self.then.take() {
            let _ = std::panic::catch_unwind(AssertUnwindSafe(|| then.send(outcome)));
        }
    }

    /// The error to pass on instead of a reply: the upstream one when the input was an error.
    fn error(&mut self, otherwise: impl FnOnce() -> CallError) -> CallError {
        match self.message.take() {
            Some(Err(upstream)) => upstream,
            _ => otherwise(),
        }
    }
}

impl<A, M> Envelope<A> for Hop<M>
where
    A: Handler<M>,
    M: Message,
    M::Reply: Sync,
{
    fn seq(&self) -> u64 {
        self.seq
    }

    fn message_type(&self) -> &'static str {
        short_name(type_name::<M>())
    }

    fn cancelled(&self) -> bool {
        false
    }

    fn run<'a>(&'a mut self, actor: &'a mut A, ctx: &'a Context<A>) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let outcome = match self.message.take() {
                Some(Ok(message)) => Ok(Arc::new(actor.handle(message, ctx).await) as Shared),
                Some(Err(upstream)) => Err(upstream),
                None => return,
            };
            self.answer(outcome);
        })
    }

    fn fail(&mut self, error: CallError) {
        let error = self.error(|| error);
        self.answer(Err(error));
    }
}

impl<M: Message> Drop for Hop<M> {
    fn drop(&mut self) {
        if self.then.is_some() {
            let shared = self.shared.clone();
            let error = self.error(|| shared.ended_error(short_name(type_name::<M>())));
            self.answer(Err(error));
        }
    }
}

/// Where a direct participant's replies go: its stream's sends, in order.
pub(crate) struct Onward(pub(crate) Vec<(u64, Port)>);

impl Onward {
    /// Sends `outcome` to every peer (a peer gone is the program's end: nothing to do).
    fn send(&self, outcome: Result<Shared, CallError>) {
        let Some(((last_tag, last), rest)) = self.0.split_last() else {
            return;
        };
        for (tag, port) in rest {
            let _ = port.send(*tag, outcome.clone());
        }
        let _ = last.send(*last_tag, outcome);
    }
}

/// A participant on the direct path: the value it waits for (from whom, on which tag), its
/// call, and where the reply goes.
pub(crate) struct Direct {
    pub(crate) from: usize,
    pub(crate) tag: u64,
    pub(crate) deliver: Deliver,
    pub(crate) onward: Arc<Onward>,
}

impl Direct {
    /// Starts the call on `value` (or passes its error on) through the actor's mailbox.
    pub(crate) fn take(&self, value: Result<Shared, CallError>) {
        (self.deliver)(value, self.onward.clone());
    }
}
