//! What a handler sees of the world besides its message: its own reference, its device, the
//! runtime (to spawn more actors) and its tensor store.

use super::actor::Actor;
use super::actor_ref::ActorRef;
use super::supervision::ActorInfo;
use super::system::RuntimeHandle;

/// The context of an actor's constructor and handlers.
pub struct Context<A: Actor> {
    myself: ActorRef<A>,
    runtime: RuntimeHandle,
}

impl<A: Actor> Context<A> {
    pub(crate) fn new(myself: ActorRef<A>, runtime: RuntimeHandle) -> Context<A> {
        Context { myself, runtime }
    }

    /// A reference to this actor (to hand to others, or to `cast` to itself).
    pub fn myself(&self) -> &ActorRef<A> {
        &self.myself
    }

    /// Who this actor is.
    pub fn info(&self) -> &ActorInfo {
        self.myself.info()
    }

    /// The device it runs on.
    pub fn device(&self) -> archipelago_dataflow::DeviceSpec {
        self.myself.info().device
    }

    /// How many times it has been restarted (0 in its first life).
    pub fn restarts(&self) -> u32 {
        self.myself.restarts()
    }

    /// The runtime it runs in.
    pub fn runtime(&self) -> &RuntimeHandle {
        &self.runtime
    }
}
