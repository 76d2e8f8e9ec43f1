//! The fabric: how tensors move between actors, behind one trait.
//!
//! Collectives and the executor only see [`Fabric`]; whether a peer is a thread of this process or
//! an actor on another host is the implementation's business. Messages are matched by
//! `(sender, tag)`, so independent edges never block each other.

pub mod grpc;
mod in_process;
pub mod tcp;

pub use grpc::{GrpcFabric, Inbox, serve_fabric};
pub use in_process::InProcessFabric;
pub use tcp::{TcpFabric, serve_tcp_fabric};

use std::fmt;
use std::time::Duration;

use crate::host_tensor::HostTensor;
use archipelago_dataflow::ActorId;

/// Identifies one message: the edge's tag (a plan node) and a sequence number inside that edge
/// (chunks and ring steps of a collective).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag {
    /// The edge (instruction tag).
    pub edge: u64,
    /// The message within the edge.
    pub seq: u64,
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.edge, self.seq)
    }
}

/// Why a fabric operation failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum FabricError {
    /// The job was aborted (another actor failed); the reason is the first failure's.
    #[error("aborted because {0}")]
    Aborted(String),
    /// A receive waited longer than the fabric's patience.
    #[error(
        "waited {waited:?} for actor {from} to send tag {tag} to actor {me}; actor {from} never sent it (is it stuck or dead?)"
    )]
    Timeout {
        /// The waiting actor.
        me: ActorId,
        /// The peer it waits for.
        from: ActorId,
        /// The message.
        tag: Tag,
        /// How long it waited.
        waited: Duration,
    },
    /// An actor id outside the fabric.
    #[error("actor {0} is not on this fabric")]
    NoSuchActor(ActorId),
}

/// Moves tensors between actors.
pub trait Fabric: Send + Sync {
    /// Number of actors on the fabric.
    fn actors(&self) -> usize;
    /// Sends `tensor` from `from` to `to`; never waits for the receiver.
    fn send(&self, from: ActorId, to: ActorId, tag: Tag, tensor: HostTensor) -> Result<(), FabricError>;
    /// Waits for the message `tag` from `from` to `me`.
    fn recv(&self, me: ActorId, from: ActorId, tag: Tag) -> Result<HostTensor, FabricError>;
    /// Wakes every waiter with [`FabricError::Aborted`]; later calls fail the same way.
    fn abort(&self, reason: &str);
}

/// How tensors travel between hosts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DataPath {
    /// Long-lived gRPC streams (`Fabric.Push`) in 4 MiB chunks.
    #[default]
    Grpc,
    /// One raw TCP connection per pair of hosts, header + bytes per tensor.
    Tcp,
}

impl std::str::FromStr for DataPath {
    type Err = String;
    fn from_str(s: &str) -> Result<DataPath, String> {
        match s {
            "grpc" => Ok(DataPath::Grpc),
            "tcp" => Ok(DataPath::Tcp),
            other => Err(format!("the data path is `grpc` or `tcp`, not `{other}`")),
        }
    }
}

impl fmt::Display for DataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataPath::Grpc => "grpc",
            DataPath::Tcp => "tcp",
        })
    }
}
