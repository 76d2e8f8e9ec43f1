//! The cell that runs one user actor inside a ractor actor: it takes each envelope off the
//! mailbox, skips cancelled ones, fails those sent before a panic was handled, runs the handler with the
//! panic caught, and applies the restart policy.

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::FutureExt;
use ractor::ActorProcessingErr;

use super::actor::Actor;
use super::actor_ref::{ActorRef, CURRENT_ACTOR};
use super::context::Context;
use super::envelope::Mail;
use super::supervision::{ActorEnd, ActorShared, CallError};
use super::system::RuntimeHandle;
use crate::error::panic_message;

/// The ractor actor hosting a user actor of type `A`.
pub(crate) struct Cell<A>(PhantomData<fn() -> A>);

impl<A> Cell<A> {
    pub(crate) fn new() -> Cell<A> {
        Cell(PhantomData)
    }
}

/// What a cell starts from.
pub(crate) struct CellArgs<A: Actor> {
    pub(crate) params: A::Params,
    pub(crate) shared: Arc<ActorShared>,
    pub(crate) key: u64,
    pub(crate) runtime: RuntimeHandle,
    pub(crate) max_restarts: u32,
}

/// A cell's state: the user actor (None between a panic and its restart) and its context.
pub(crate) struct CellState<A: Actor> {
    actor: Option<A>,
    ctx: Context<A>,
    params: A::Params,
    max_restarts: u32,
}

/// Runs the constructor with panics caught, as the actor (so that calling itself from its
/// constructor is refused like a self-call from a handler).
async fn construct<A: Actor>(params: &A::Params, ctx: &Context<A>) -> Result<A, String> {
    let build = AssertUnwindSafe(A::new(params.clone(), ctx)).catch_unwind();
    CURRENT_ACTOR
        .scope(ctx.myself().key(), build)
        .await
        .unwrap_or_else(|p| Err(panic_message(p.as_ref())))
}

impl<A: Actor> ractor::Actor for Cell<A> {
    type Msg = Mail<A>;
    type State = CellState<A>;
    type Arguments = CellArgs<A>;

    async fn pre_start(
        &self,
        myself: ractor::ActorRef<Mail<A>>,
        args: CellArgs<A>,
    ) -> Result<CellState<A>, ActorProcessingErr> {
        let driver = args.runtime.driver().clone();
        let me = ActorRef::new(myself, args.shared.clone(), args.key, driver);
        let ctx = Context::new(me, args.runtime);
        let actor = construct(&args.params, &ctx).await?;
        Ok(CellState {
            actor: Some(actor),
            ctx,
            params: args.params,
            max_restarts: args.max_restarts,
        })
    }

    async fn handle(
        &self,
        myself: ractor::ActorRef<Mail<A>>,
        mut mail: Mail<A>,
        state: &mut CellState<A>,
    ) -> Result<(), ActorProcessingErr> {
        let shared = state.ctx.myself().shared().clone();
        shared.handled.fetch_add(1, Ordering::Relaxed);
        if mail.cancelled() {
            let error = CallError::Cancelled {
                actor: shared.label(),
                message: mail.message_type().to_string(),
            };
            mail.fail(error);
            return Ok(());
        }
        if let Some(failure) = shared.inherited_failure(mail.seq()) {
            mail.fail(CallError::Failed(failure));
            return Ok(());
        }
        let Some(actor) = state.actor.as_mut() else {
            mail.fail(shared.ended_error(mail.message_type()));
            return Ok(());
        };
        let key = state.ctx.myself().key();
        let outcome = CURRENT_ACTOR
            .scope(key, AssertUnwindSafe(mail.run(actor, &state.ctx)).catch_unwind())
            .await;
        let Err(panic) = outcome else {
            return Ok(());
        };
        let failure = shared.failure(mail.message_type(), mail.seq(), panic_message(panic.as_ref()));
        tracing::error!(%failure, "actor handler panicked");
        shared.failures.fetch_add(1, Ordering::Relaxed);
        // Everything already queued fails with this failure; the caller of this message too.
        shared.fail_pending(failure.clone());
        mail.fail(CallError::Failed(failure.clone()));
        state.actor = None;
        let restarts = shared.restarts.load(Ordering::Relaxed);
        if restarts >= state.max_restarts {
            shared.set_end(ActorEnd::Failed(failure));
            myself.stop(Some("its handler panicked".into()));
            return Ok(());
        }
        shared.restarts.store(restarts + 1, Ordering::Relaxed);
        match construct(&state.params, &state.ctx).await {
            Ok(actor) => {
                tracing::warn!(actor = %shared.info, restart = restarts + 1, "actor restarted");
                state.actor = Some(actor);
            }
            Err(reason) => {
                let mut failure = failure;
                failure.message = format!("{}; its restart failed too: {reason}", failure.message);
                shared.set_end(ActorEnd::Failed(failure));
                myself.stop(Some("its restart failed".into()));
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ractor::ActorRef<Mail<A>>,
        state: &mut CellState<A>,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(actor) = state.actor.as_mut() {
            let _ = AssertUnwindSafe(actor.stopping(&state.ctx)).catch_unwind().await;
        }
        // The end is published when the state drops (below), after a kill as well.
        Ok(())
    }
}

/// The end of every actor that started, however it ended: a stop (after `post_stop`), a final
/// panic, or a kill (which runs no `post_stop`: the handler's future is dropped at its `.await`
/// and the state with it). Its runtime forgets it, its tensors are freed, and `ended()` resolves.
impl<A: Actor> Drop for CellState<A> {
    fn drop(&mut self) {
        let shared = self.ctx.myself().shared().clone();
        shared.set_end(ActorEnd::Stopped {
            reason: "stopped".into(),
        });
        self.ctx.runtime().actor_ended(&shared);
        shared.publish_end();
    }
}
