//! The runtime API: typed actors, futures of replies, tensors that stay with their owner, meshes
//! and supervision — the layer of the Ray / Monarch (hyperactor) class that training, the
//! parameter server and trial search are programs on.
//!
//! - An actor type implements [`Actor`] (state + constructor) and one [`Handler<M>`] per
//!   [`Message`] type; [`RuntimeHandle::spawn`] places it on a device and gives a typed
//!   [`ActorRef<A>`].
//! - [`ActorRef::call`] returns a [`Call`] future (`.await` it, or [`Call::get`] from a plain
//!   thread; [`Call::timeout`], [`Call::cancel`]); [`ActorRef::cast`] sends without a reply;
//!   [`wait`] (and [`Runtime::wait`]) returns the first `k` of many calls, as Ray's `wait`.
//! - [`RuntimeHandle::spawn_mesh`] spawns one actor per member of a named [`Mesh`](archipelago_dataflow::Mesh)
//!   and [`ActorMesh::call_all`] calls them all at once, one future per member.
//! - [`Context::put`] keeps a tensor on its actor and hands out a [`TensorRef`];
//!   [`Context::fetch`] brings it from its owner straight to the actor that asks.
//!
//! # Guarantees
//! - **Order**: messages from one caller to one actor are handled in the order sent.
//! - **One at a time**: an actor handles one message at a time and each handler runs to
//!   completion, its `.await`s included; an actor's state is only seen between handlers. A
//!   handler that calls its own actor gets [`CallError::SelfCall`] instead of a deadlock.
//! - **Failures are named**: a panic fails that call and every call already sent to the actor
//!   (queued behind it) with an [`ActorFailure`](crate::ActorFailure) naming job, actor, type,
//!   host, device and message; with [`SpawnOptions::max_restarts`] the constructor runs again,
//!   otherwise the actor ends and [`ActorRef::ended`] resolves. Calls to an ended actor fail at
//!   once; calls it had queued are answered with its end, across processes too. On a cluster an
//!   actor with restarts left whose host is lost is re-placed on another host (see `cluster`).
//! - **Across processes** the order per caller holds (one connection per caller and host); a
//!   timeout or cancel reaches the host (a `Cancel` frame), which skips the message if it has
//!   not started; `queue_depth` and `restarts` of a remote reference are the caller's view (see
//!   the host's `actor_stats` for the actor's own).
//! - **Lifetimes**: an actor ends when the last clone of the reference its spawn returned is
//!   dropped (after the messages already sent to it), unless spawned
//!   [`SpawnOptions::detached`]; [`ActorRef::stop`] and [`ActorRef::kill`] end it at once (see
//!   `keeper` for the references that do not count).
//! - **Placement**: each device of the runtime is one OS thread running its actors; actors on
//!   different devices run in parallel, actors on one device take turns. Locally `spawn_with`
//!   places on the device named; on a cluster the device names a kind (CPU or GPU) and
//!   [`Placement`] picks the slot ([`RuntimeHandle::spawn_at`] places exactly; meshes follow
//!   [`MeshPlacement`]).

mod actor;
mod actor_ref;
mod actor_ref_wire;
mod call;
pub(crate) mod call_wire;
mod cell;
mod cluster;
mod collective_group;
pub mod compiled;
mod context;
mod dry_run;
mod envelope;
mod find;
mod keeper;
mod mesh;
mod placement;
pub mod remote;
pub(crate) mod supervision;
mod system;
mod tensor_store;

pub use actor::{Actor, Handler, Message};
pub use actor_ref::ActorRef;
pub use call::{Call, Pending, Waited, wait};
pub use cluster::Slot;
pub use collective_group::{CollectiveError, CollectiveGroup, DEFAULT_PATIENCE};
pub use context::Context;
pub use find::{FindError, PeerHosts};
pub use keeper::RELEASED;
pub use mesh::ActorMesh;
pub use placement::{MeshPlacement, Placement};
pub use remote::Registry;
pub use supervision::{ActorEnd, ActorInfo, ActorStats, CallError, SpawnOptions};
pub use system::{Runtime, RuntimeHandle, STRICT_REGISTRY_VAR, SpawnError, strict_registry_from_env};
pub use tensor_store::{BorrowKey, TensorError, TensorId, TensorRef};

#[cfg(test)]
mod collective_group_tests;
#[cfg(test)]
mod tests;

#[cfg(test)]
mod remote_tests;

#[cfg(test)]
mod lifetime_tests;

#[cfg(test)]
mod strict_tests;

#[cfg(test)]
mod restart_tests;

#[cfg(test)]
mod release_tests;

#[cfg(test)]
mod passed_call_tests;
