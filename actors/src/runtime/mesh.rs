//! Meshes of actors: one actor per member of a named n-dimensional [`Mesh`] (the same type that
//! lays out training's `dp × pp`), called all at once.

use archipelago_dataflow::Mesh;

use super::actor::{Actor, Handler, Message};
use super::actor_ref::ActorRef;
use super::call::{Call, Pending};
use super::placement::{MeshPlacement, mesh_slots};
use super::supervision::{CallError, SpawnOptions};
use super::system::{RuntimeHandle, SpawnError, short_type_name};

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

    /// Stops every member gracefully ([`ActorRef::stop`]).
    pub fn stop(&self, reason: &str) {
        for member in &self.members {
            member.stop(reason);
        }
    }

    /// Kills every member at once ([`ActorRef::kill`]).
    pub fn kill(&self, reason: &str) {
        for member in &self.members {
            member.kill(reason);
        }
    }
}

impl RuntimeHandle {
    /// Spawns one actor per member of `mesh`, member `r` (row-major over the axes) on the
    /// runtime's `r`-th slot (device), built from `params(coords)`.
    pub fn spawn_mesh<A: Actor>(
        &self,
        mesh: Mesh,
        params: impl Fn(&[usize]) -> A::Params,
    ) -> Pending<Result<ActorMesh<A>, SpawnError>> {
        self.spawn_mesh_with(mesh, params, |_| SpawnOptions::default())
    }

    /// [`spawn_mesh`](Self::spawn_mesh) with each member's name and restart budget from
    /// `options(coords)`.
    pub fn spawn_mesh_with<A: Actor>(
        &self,
        mesh: Mesh,
        params: impl Fn(&[usize]) -> A::Params,
        options: impl Fn(&[usize]) -> SpawnOptions,
    ) -> Pending<Result<ActorMesh<A>, SpawnError>> {
        self.spawn_mesh_placed(mesh, MeshPlacement::InOrder, params, options)
    }

    /// [`spawn_mesh_with`](Self::spawn_mesh_with) with the members laid on the slots by
    /// `placement`: in order, all on one host, or spread across hosts. A member without a name
    /// in its options is named by its type and coordinates (`Shard[dp=1,pp=0]`), the same on
    /// every host and in every run. All or nothing: if one member cannot start, those that did
    /// are stopped and the first error is returned.
    pub fn spawn_mesh_placed<A: Actor>(
        &self,
        mesh: Mesh,
        placement: MeshPlacement,
        params: impl Fn(&[usize]) -> A::Params,
        options: impl Fn(&[usize]) -> SpawnOptions,
    ) -> Pending<Result<ActorMesh<A>, SpawnError>> {
        let driver = self.driver().clone();
        let slots = self.slots();
        if mesh.size() > slots.len() {
            let error = SpawnError::MeshTooLarge {
                mesh: mesh.to_string(),
                needed: mesh.size(),
                available: slots.len(),
            };
            return Pending::new(std::future::ready(Err(error)), driver);
        }
        let chosen = match mesh_slots(&slots, mesh.size(), placement) {
            Ok(chosen) => chosen,
            Err(reason) => {
                let error = SpawnError::Placement {
                    what: format!("a mesh {mesh} of `{}`", short_type_name::<A>()),
                    reason,
                };
                return Pending::new(std::future::ready(Err(error)), driver);
            }
        };
        let spawns: Vec<_> = (chosen.iter().enumerate())
            .map(|(rank, &slot)| {
                let coords = mesh.coords(rank);
                let mut member = options(&coords);
                member.name = member.name.or_else(|| Some(member_name::<A>(&mesh, &coords)));
                self.spawn_at::<A>(slot, params(&coords), member)
            })
            .collect();
        Pending::new(
            async move {
                let mut members = Vec::with_capacity(spawns.len());
                let mut failed = None;
                for spawn in spawns {
                    match spawn.await {
                        Ok(member) => members.push(member),
                        Err(e) => failed = failed.or(Some(e)),
                    }
                }
                match failed {
                    None => Ok(ActorMesh::new(mesh, members)),
                    Some(e) => {
                        members
                            .iter()
                            .for_each(|m| m.stop("another member of its mesh failed to start"));
                        Err(e)
                    }
                }
            },
            driver,
        )
    }
}

/// A member's default name: its type and its coordinates on the mesh's axes.
fn member_name<A>(mesh: &Mesh, coords: &[usize]) -> String {
    let at: Vec<String> = (mesh.axes.iter().zip(coords))
        .map(|((axis, _), c)| format!("{axis}={c}"))
        .collect();
    format!("{}[{}]", short_type_name::<A>(), at.join(","))
}
