//! The fabric: how tensors move between actors, behind one trait.
//!
//! Collectives and the executor only see [`Fabric`]; whether a peer is a thread of this process or
//! an actor on another host is the implementation's business. Messages are matched by
//! `(sender, tag)`, so independent edges never block each other. Actors of one process may also
//! meet at each other's buffers ([`SharedBuffers`]), which the shared-buffer collectives build
//! on; the fabric knows nothing of collectives.

pub mod assembly;
pub mod grpc;
mod in_process;
mod link_bytes;
pub mod read_count;
pub mod shared_buffers;
pub mod shm;
pub mod tcp;

pub use grpc::{GrpcFabric, Inbox, serve_fabric};
pub use in_process::InProcessFabric;
pub use link_bytes::{DRIVER, LinkBytes, OTHER_PROCESS};
pub use shared_buffers::SharedBuffers;
pub use tcp::{TcpFabric, serve_tcp_fabric};

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::typed_tensor::TypedTensor;
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
    /// A shared-buffer collective waited longer than the fabric's patience for members.
    #[error(
        "actor {me} waited {waited:?} in collective {edge} for actors {missing:?}, which never joined it (are they stuck or dead?)"
    )]
    GroupTimeout {
        /// The waiting actor.
        me: ActorId,
        /// The members that never arrived.
        missing: Vec<ActorId>,
        /// The collective.
        edge: u64,
        /// How long it waited.
        waited: Duration,
    },
}

/// Moves tensors between actors.
pub trait Fabric: Send + Sync {
    /// Number of actors on the fabric.
    fn actors(&self) -> usize;
    /// Sends `tensor` from `from` to `to`; never waits for the receiver.
    fn send(&self, from: ActorId, to: ActorId, tag: Tag, tensor: TypedTensor) -> Result<(), FabricError>;
    /// Waits for the message `tag` from `from` to `me`.
    fn recv(&self, me: ActorId, from: ActorId, tag: Tag) -> Result<TypedTensor, FabricError>;
    /// Wakes every waiter with [`FabricError::Aborted`]; later calls fail the same way.
    fn abort(&self, reason: &str);
    /// Payload bytes sent so far from this side of the fabric, per `(from, to)` link.
    fn link_bytes(&self) -> &LinkBytes;
    /// Where the members of `group` meet at each other's buffers, when every member of it lives
    /// in this process and the fabric offers [`SharedBuffers`] (`None`: the group exchanges
    /// messages only).
    fn shared_buffers(&self, group: &[ActorId]) -> Option<&SharedBuffers> {
        let _ = group;
        None
    }
}

/// One outgoing connection to another host's fabric, shared by every actor of that host.
pub trait Link: Send + Sync {
    /// Sends `tensor` from `from` (here) to `to` (on the link's host); never waits for the
    /// receiver.
    fn push(&self, from: ActorId, to: ActorId, tag: Tag, tensor: TypedTensor) -> Result<(), FabricError>;
    /// What carries the link's tensors (`Grpc`, `Tcp` or `Shm`).
    fn path(&self) -> DataPath;
}

/// A job's fabric seen from one host: its own actors send and receive through in-process
/// mailboxes (`local`, which the host's server also delivers into); a tensor for an actor on
/// another host leaves on that host's [`Link`]. The gRPC and raw-TCP data paths differ only in
/// their links.
pub struct HostRoutes<L> {
    local: Arc<InProcessFabric>,
    /// The link towards each actor's host (`None` for actors of this host).
    routes: Vec<Option<Arc<L>>>,
}

impl<L: Link> HostRoutes<L> {
    /// The distinct hosts other than `here` among the actors' addresses, in first-seen order:
    /// the hosts to open a link to.
    pub fn peers<'a>(addrs: &'a [String], here: &str) -> Vec<&'a str> {
        let mut peers: Vec<&str> = Vec::new();
        for addr in addrs {
            if addr != here && !peers.contains(&addr.as_str()) {
                peers.push(addr);
            }
        }
        peers
    }

    /// The routes of a job whose actor `a` is served at `addrs[a]`, given one link per peer
    /// host (see [`HostRoutes::peers`]); actors without a link are local.
    pub fn new(addrs: &[String], local: Arc<InProcessFabric>, links: HashMap<String, L>) -> HostRoutes<L> {
        let links: HashMap<String, Arc<L>> = links.into_iter().map(|(a, l)| (a, Arc::new(l))).collect();
        let routes = addrs.iter().map(|a| links.get(a).cloned()).collect();
        HostRoutes { local, routes }
    }

    /// What carries tensors to each actor: `None` for this host's own, else its link's path
    /// (under `--data-path auto`, this says which hosts got shared memory).
    pub fn paths(&self) -> Vec<Option<DataPath>> {
        self.routes.iter().map(|r| r.as_ref().map(|l| l.path())).collect()
    }
}

impl<L: Link> Fabric for HostRoutes<L> {
    fn actors(&self) -> usize {
        self.routes.len()
    }

    fn send(&self, from: ActorId, to: ActorId, tag: Tag, tensor: TypedTensor) -> Result<(), FabricError> {
        match self.routes.get(to).ok_or(FabricError::NoSuchActor(to))? {
            None => self.local.send(from, to, tag, tensor),
            Some(link) => {
                self.local.link_bytes().record(from, to, tensor.byte_len() as u64);
                link.push(from, to, tag, tensor)
            }
        }
    }

    fn recv(&self, me: ActorId, from: ActorId, tag: Tag) -> Result<TypedTensor, FabricError> {
        self.local.recv(me, from, tag)
    }

    fn abort(&self, reason: &str) {
        self.local.abort(reason);
    }

    fn link_bytes(&self) -> &LinkBytes {
        self.local.link_bytes()
    }

    fn shared_buffers(&self, group: &[ActorId]) -> Option<&SharedBuffers> {
        let all_here = group.iter().all(|&a| matches!(self.routes.get(a), Some(None)));
        if all_here {
            self.local.shared_buffers(group)
        } else {
            None
        }
    }
}

/// How tensors travel between hosts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DataPath {
    /// Long-lived gRPC streams (`Fabric.Push`) in 4 MiB chunks.
    #[default]
    Grpc,
    /// One raw TCP connection per pair of hosts, header + bytes per tensor.
    Tcp,
    /// A shared-memory ring per pair of hosts, all of them processes of one machine (set up
    /// over an authenticated raw-TCP connection; an error where a peer is on another machine).
    Shm,
    /// Shared memory to the hosts of this machine, raw TCP to the others.
    Auto,
}

impl DataPath {
    /// Whether the path runs over the raw-TCP tensor port (the ring's handshake does too).
    pub fn uses_tcp_port(self) -> bool {
        self != DataPath::Grpc
    }
}

impl std::str::FromStr for DataPath {
    type Err = String;
    fn from_str(s: &str) -> Result<DataPath, String> {
        match s {
            "grpc" => Ok(DataPath::Grpc),
            "tcp" => Ok(DataPath::Tcp),
            "shm" => Ok(DataPath::Shm),
            "auto" => Ok(DataPath::Auto),
            other => Err(format!(
                "the data path is `auto`, `shm`, `tcp` or `grpc`, not `{other}`"
            )),
        }
    }
}

impl fmt::Display for DataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataPath::Grpc => "grpc",
            DataPath::Tcp => "tcp",
            DataPath::Shm => "shm",
            DataPath::Auto => "auto",
        })
    }
}

/// What the data paths' tests share.
#[cfg(test)]
pub(crate) mod testing {
    use std::sync::Arc;

    use archipelago_dataflow::ActorId;

    use super::{Fabric, Tag};
    use crate::typed_tensor::TypedTensor;

    /// The ring the exchange runs on: it crosses between the two hosts both ways.
    const RING: [ActorId; 4] = [0, 2, 1, 3];

    /// Value `k` of what actor `a` sends.
    fn sent(a: ActorId, k: usize) -> f32 {
        ((a + 1) * (k % 1000)) as f32
    }

    /// Four actors, 2 on each of two hosts (`fabrics[h]` is host `h`'s fabric, actor `a` on host
    /// `a / 2`), each send `len` values in messages of `chunk` values to the next actor on the
    /// ring 0 → 2 → 1 → 3 → 0 and receive the previous one's: every value arrives, in order. The
    /// collectives' tests run a ring all-reduce on the same hosts.
    pub(crate) fn ring_exchange_across_two_hosts(fabrics: [Arc<dyn Fabric>; 2], len: usize, chunk: usize) {
        let handles: Vec<_> = (0..RING.len())
            .map(|at| {
                let (me, next, prev) = (RING[at], RING[(at + 1) % 4], RING[(at + 3) % 4]);
                let fabric = fabrics[me / 2].clone();
                std::thread::spawn(move || {
                    let chunks: Vec<_> = (0..len).step_by(chunk).map(|s| s..(s + chunk).min(len)).collect();
                    for (seq, range) in chunks.iter().enumerate() {
                        let values = range.clone().map(|k| sent(me, k)).collect();
                        let tag = Tag {
                            edge: 5,
                            seq: seq as u64,
                        };
                        fabric.send(me, next, tag, TypedTensor::flat(values)).unwrap();
                    }
                    for (seq, range) in chunks.into_iter().enumerate() {
                        let tag = Tag {
                            edge: 5,
                            seq: seq as u64,
                        };
                        let got = fabric.recv(me, prev, tag).unwrap();
                        let expected: Vec<f32> = range.map(|k| sent(prev, k)).collect();
                        assert!(
                            *got.f32s() == expected,
                            "actor {me}: message {seq} from actor {prev}"
                        );
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    /// One tensor of every dtype, odd lengths and awkward bit patterns (NaN payloads, −0,
    /// extremes), and an empty one.
    pub(crate) fn every_dtype() -> Vec<TypedTensor> {
        use half::{bf16, f16};
        vec![
            TypedTensor::from_values(
                vec![5],
                &[1.5f32, -0.0, f32::from_bits(0x7fc0_1234), f32::MAX, 1e-45],
            ),
            TypedTensor::from_values(
                vec![3],
                &[bf16::from_bits(0x7fc1), bf16::from_f32(-2.5), bf16::MIN],
            ),
            TypedTensor::from_values(
                vec![1, 3],
                &[f16::from_bits(0x7e01), f16::from_f32(65504.0), f16::NEG_ZERO],
            ),
            TypedTensor::from_values(vec![7], &[-128i8, -1, 0, 1, 2, 3, 127]),
            TypedTensor::from_values(vec![3, 1], &[0u8, 128, 255]),
            TypedTensor::from_values(vec![3], &[i32::MIN, -7, i32::MAX]),
            TypedTensor::from_values(vec![2], &[i64::MIN, i64::MAX]),
            TypedTensor::from_values::<half::bf16>(vec![0], &[]),
        ]
    }

    /// Actor 0 (host 0) sends a tensor of every dtype to actor 2 (host 1, across the data path)
    /// and to actor 1 (its own host): each arrives with its dtype, shape and bytes, bit for bit.
    pub(crate) fn every_dtype_round_trips(fabrics: [Arc<dyn Fabric>; 2]) {
        let sent = every_dtype();
        for (seq, tensor) in sent.iter().enumerate() {
            for to in [2, 1] {
                let tag = Tag {
                    edge: 11,
                    seq: seq as u64,
                };
                fabrics[0].send(0, to, tag, tensor.clone()).unwrap();
            }
        }
        for (seq, tensor) in sent.iter().enumerate() {
            for to in [2, 1] {
                let tag = Tag {
                    edge: 11,
                    seq: seq as u64,
                };
                let got = fabrics[to / 2].recv(to, 0, tag).unwrap();
                let what = format!("{} {:?} to actor {to}", tensor.dtype(), tensor.shape());
                assert_eq!(
                    (got.dtype(), got.shape()),
                    (tensor.dtype(), tensor.shape()),
                    "{what}"
                );
                assert_eq!(got.bytes(), tensor.bytes(), "{what}");
            }
        }
    }
}
