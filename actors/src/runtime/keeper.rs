//! An actor's life tied to its handles, as Ray ends an actor once every handle to it is out of
//! scope: the reference a spawn returns carries a [`Keeper`], shared by every clone of it; when
//! the last clone drops, the actor gets a [`Release`] letter behind whatever was already sent,
//! so the calls in flight are answered first, then it stops (`ended()` resolves with
//! [`RELEASED`], its tensors are freed). An actor spawned
//! [`detached`](super::SpawnOptions::detached) has no keeper and lives until it is stopped,
//! killed, fails, or its runtime ends.
//!
//! References that do not keep an actor alive: an actor's own (`ctx.myself()`), one found by
//! name, and one rebuilt from a message in another process (only the creator's process counts
//! handles; spawn an actor that other processes use after its creator lets go detached).

use std::any::type_name;

use futures::future::BoxFuture;

use super::actor::Actor;
use super::context::Context;
use super::envelope::{Envelope, Mail};
use super::remote::wire::Frame;
use super::supervision::{ActorEnd, ActorShared, CallError, RemoteActor};
use std::sync::Arc;

/// The reason an actor ends with when its last handle was dropped.
pub const RELEASED: &str = "its last handle was dropped";

/// Runs its release once, when the last handle holding it drops.
pub(crate) struct Keeper {
    release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

impl Keeper {
    /// The keeper of this process's actor behind `port`.
    pub(crate) fn local<A: Actor>(port: ractor::ActorRef<Mail<A>>, shared: Arc<ActorShared>) -> Arc<Keeper> {
        Arc::new(Keeper {
            release: Some(Box::new(move || release_local(&port, &shared))),
        })
    }

    /// The keeper of an actor of another host: its host gets a `Release` frame after every
    /// message this process sent it (the latest incarnation's, once it is re-placed).
    pub(crate) fn remote(remote: Arc<RemoteActor>) -> Arc<Keeper> {
        Arc::new(Keeper {
            release: Some(Box::new(move || {
                remote.send(|incarnation| {
                    let actor = incarnation.shared.info.id;
                    incarnation.connection.send(Frame::Release { actor });
                });
            })),
        })
    }
}

/// Queues the [`Release`] letter of the actor behind `port` (nothing when it has ended).
pub(crate) fn release_local<A: Actor>(port: &ractor::ActorRef<Mail<A>>, shared: &Arc<ActorShared>) {
    let (stopper, ender) = (port.clone(), shared.clone());
    let release = Release {
        seq: shared.sequence(),
        stop: Some(Box::new(move || {
            ender.set_end(ActorEnd::Stopped {
                reason: RELEASED.into(),
            });
            stopper.stop(Some(RELEASED.into()));
        })),
    };
    let _ = port.send_message(Box::new(release) as Mail<A>);
}

/// The last letter of an actor nobody holds: taken off the mailbox after everything sent
/// before it (or failed in its place after a panic), it stops the actor.
struct Release {
    seq: u64,
    stop: Option<Box<dyn FnOnce() + Send>>,
}

impl Release {
    fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop();
        }
    }
}

impl<A: Actor> Envelope<A> for Release {
    fn seq(&self) -> u64 {
        self.seq
    }

    fn message_type(&self) -> &'static str {
        type_name::<Release>()
    }

    fn cancelled(&self) -> bool {
        false
    }

    fn run<'a>(&'a mut self, _actor: &'a mut A, _ctx: &'a Context<A>) -> BoxFuture<'a, ()> {
        self.stop();
        Box::pin(std::future::ready(()))
    }

    fn fail(&mut self, _error: CallError) {
        self.stop();
    }
}
