//! Meshes of actors: one actor per member of a named n-dimensional [`Mesh`] (the same type that
//! lays out training's `dp × pp`), called all at once.

use archipelago_dataflow::Mesh;

use super::actor::{Actor, Handler, Message};
use super::actor_ref::ActorRef;
use super::call::Call;
use super::supervision::CallError;

/// Actors of type `A` laid out on a mesh.
pub struct ActorMesh<A: Actor> {
    mesh: Mesh,
    members: Vec<ActorRef<A>>,
}

impl<A: Actor> Clone for ActorMesh<A> {
    fn clone(&self) -> Self {
        ActorMesh {
            mesh: self.mesh.clone(),
            members: self.members.clone(),
        }
    }
}

impl<A: Actor> std::fmt::Debug for ActorMesh<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActorMesh({}, {} members)", self.mesh, self.members.len())
    }
}

impl<A: Actor> ActorMesh<A> {
    pub(crate) fn new(mesh: Mesh, members: Vec<ActorRef<A>>) -> ActorMesh<A> {
        ActorMesh { mesh, members }
    }

    /// The layout.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Every member, by rank (row-major over the axes).
    pub fn members(&self) -> &[ActorRef<A>] {
        &self.members
    }

    /// The member at `coords` (one coordinate per axis).
    pub fn at(&self, coords: &[usize]) -> &ActorRef<A> {
        &self.members[self.mesh.rank(coords)]
    }

    /// The members of `rank`'s group along `axis` (e.g. its `dp` replicas), in axis order.
    pub fn group(&self, rank: usize, axis: &str) -> Vec<ActorRef<A>> {
        self.mesh
            .group(rank, axis)
            .into_iter()
            .map(|r| self.members[r].clone())
            .collect()
    }

    /// Calls every member with a clone of `message`: one future per member, by rank.
    pub fn call_all<M: Message + Clone>(&self, message: M) -> Vec<Call<M::Reply>>
    where
        A: Handler<M>,
    {
        self.members.iter().map(|m| m.call(message.clone())).collect()
    }

    /// Casts a clone of `message` to every member.
    pub fn cast_all<M: Message + Clone>(&self, message: M) -> Result<(), CallError>
    where
        A: Handler<M>,
    {
        self.members.iter().try_for_each(|m| m.cast(message.clone()))
    }

    /// Stops every member.
    pub fn stop(&self, reason: &str) {
        for member in &self.members {
            member.stop(reason);
        }
    }
}
