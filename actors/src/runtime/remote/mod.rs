//! Actors on other hosts: the registry of types that may cross processes, the frames of the
//! actor port, a host's side of it and a caller's connection to it.
//!
//! A program's own binary serves as a host (as Monarch's hosts run the program's binary): it
//! installs the same [`Registry`] as the driver, starts a runtime on its devices and serves
//! [`serve_actor_port`]; the driver spawns registered actor types there by name and calls them
//! with bincode messages (the one [`codec`](crate::codec)). Messages of one caller keep their
//! order; a host that dies or falls silent fails every pending call on its actors with an error
//! naming the host.

pub mod connection;
pub mod host_port;
pub(crate) mod links;
pub mod registry;
pub mod wire;

pub use connection::{HostConnection, Liveness};
pub use host_port::{ActorPort, serve_actor_port, wire_bytes_out};
pub use registry::{ErasedActor, Registry};
