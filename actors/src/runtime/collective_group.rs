//! Collectives in the runtime API (issue 42): the members of an actor mesh along an axis form a
//! [`CollectiveGroup`] (NCCL's communicator, Ray's collective group — typed), and inside their
//! handlers all-reduce, reduce-scatter and all-gather [`TypedTensor`]s together
//! ([`Context::all_reduce`], [`Context::reduce_scatter`], [`Context::all_gather`]) with the very
//! implementations training's executor runs: the collective worker's typed dispatch
//! (`collectives::worker`) over a fabric's shared buffers (f32, bf16 and f16 sums accumulated in
//! f32; any type gathered).
//!
//! A group's members live in this process (one in-process fabric whose shared buffers they
//! meet at); a mesh whose members run on other hosts is refused when its groups are made. Every
//! member calls its group's collectives in the same order: each call's edge is the member's
//! count of calls, so members out of step fail naming the edge, and a member that never comes
//! fails the others after the group's patience, naming who is missing. A collective runs on a
//! thread of its own while the handler awaits it, so members sharing a device thread cannot
//! block each other.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use archipelago_dataflow::{ActorId, CollectiveKind};
use serde::{Deserialize, Serialize};

use super::actor::Actor;
use super::context::Context;
use super::mesh::ActorMesh;
use crate::collectives::Collectives;
use crate::collectives::worker::run_collective;
use crate::fabric::InProcessFabric;
use crate::typed_tensor::TypedTensor;

/// How long a member waits at a collective for the rest of its group, unless told.
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(60);

/// A group of actors that run collectives together; every member holds a copy (send it in a
/// message) and calls the same collectives in the same order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveGroup {
    id: u64,
    /// The process it was made in (a random number per process: pids repeat across containers).
    process: u64,
    members: Vec<ActorId>,
    names: Vec<String>,
}

/// Why a collective failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CollectiveError(pub String);

/// A group's meeting place: its fabric and each member's count of calls.
struct GroupState {
    fabric: Arc<InProcessFabric>,
    calls: Vec<AtomicU64>,
}

/// The groups of this process, by id.
fn groups() -> &'static Mutex<HashMap<u64, Arc<GroupState>>> {
    static GROUPS: OnceLock<Mutex<HashMap<u64, Arc<GroupState>>>> = OnceLock::new();
    GROUPS.get_or_init(Default::default)
}

impl CollectiveGroup {
    /// A group of `members` (their runtime ids and names, in rank order) meeting in this
    /// process; a member that does not come within `patience` fails the others.
    pub fn new(
        members: &[(ActorId, String)],
        patience: Duration,
    ) -> Result<CollectiveGroup, CollectiveError> {
        if members.is_empty() {
            return Err(CollectiveError("a collective group needs a member".into()));
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let n = members.len();
        let state = GroupState {
            fabric: Arc::new(InProcessFabric::with_collectives(
                n,
                patience,
                Collectives::Shared,
            )),
            calls: (0..n).map(|_| AtomicU64::new(0)).collect(),
        };
        (groups().lock().unwrap_or_else(|e| e.into_inner())).insert(id, Arc::new(state));
        Ok(CollectiveGroup {
            id,
            process: crate::runtime::remote::links::process_id(),
            members: members.iter().map(|(id, _)| *id).collect(),
            names: members.iter().map(|(_, name)| name.clone()).collect(),
        })
    }

    /// The members' runtime ids, in rank order.
    pub fn members(&self) -> &[ActorId] {
        &self.members
    }

    /// Forgets the group in this process (its members' later calls fail); groups otherwise live
    /// as long as the process.
    pub fn close(&self) {
        (groups().lock().unwrap_or_else(|e| e.into_inner())).remove(&self.id);
    }

    /// What a failure of member `me`'s call names.
    fn describe(&self, me: ActorId) -> String {
        let who = (self.members.iter().position(|&m| m == me))
            .map_or("an actor outside it".to_string(), |r| {
                format!("member {r} (`{}`)", self.names[r])
            });
        format!(
            "collective group {} of [{}], {who}",
            self.id,
            self.names.join(", ")
        )
    }

    /// Runs collective `kind` of member `me` over `tensor` on a thread of its own.
    pub(crate) async fn run(
        &self,
        me: ActorId,
        kind: CollectiveKind,
        tensor: TypedTensor,
    ) -> Result<TypedTensor, CollectiveError> {
        let fail = |why: String| CollectiveError(format!("{}: {why}", self.describe(me)));
        if self.process != crate::runtime::remote::links::process_id() {
            return Err(fail(format!(
                "the group was made in another process ({:x}); its members must all run there",
                self.process
            )));
        }
        let state = (groups()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&self.id)
            .cloned())
        .ok_or_else(|| fail("the group was closed".into()))?;
        let rank = (self.members.iter().position(|&m| m == me))
            .ok_or_else(|| fail(format!("actor {me} is not a member")))?;
        let edge = state.calls[rank].fetch_add(1, Ordering::SeqCst);
        let ranks: Vec<ActorId> = (0..self.members.len()).collect();
        let (done, result) = futures::channel::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("collective-{}-{rank}", self.id))
            .spawn(move || {
                let _ = done.send(run_collective(
                    state.fabric.as_ref(),
                    rank,
                    kind,
                    edge,
                    &ranks,
                    tensor,
                ));
            })
            .map_err(|e| fail(format!("cannot start its thread: {e}")))?;
        let outcome = result.await.map_err(|_| fail(format!("call {edge} stopped")))?;
        outcome.map_err(|e| fail(format!("call {edge}: {e}")))
    }
}

impl<A: Actor> ActorMesh<A> {
    /// The collective groups along `axis`, one per member (by rank; members of one group get
    /// equal copies): e.g. each member's `tp` group. Refused when a member runs in another
    /// process.
    pub fn collective_groups(
        &self,
        axis: &str,
        patience: Duration,
    ) -> Result<Vec<CollectiveGroup>, CollectiveError> {
        if let Some(remote) = self.members().iter().find(|m| m.is_remote()) {
            return Err(CollectiveError(format!(
                "{} runs on host `{}`: collective groups meet in one process (a mesh on this host's devices)",
                remote.info().name,
                remote.info().host
            )));
        }
        if !self.mesh().axes.iter().any(|(a, _)| a == axis) {
            return Err(CollectiveError(format!(
                "the mesh {} has no axis `{axis}`",
                self.mesh()
            )));
        }
        let mut made: HashMap<Vec<usize>, CollectiveGroup> = HashMap::new();
        (0..self.members().len())
            .map(|rank| {
                let ranks = self.mesh().group(rank, axis);
                if let Some(group) = made.get(&ranks) {
                    return Ok(group.clone());
                }
                let members: Vec<(ActorId, String)> = (ranks.iter())
                    .map(|&r| (self.members()[r].info().id, self.members()[r].info().name.clone()))
                    .collect();
                let group = CollectiveGroup::new(&members, patience)?;
                made.insert(ranks, group.clone());
                Ok(group)
            })
            .collect()
    }
}

impl<A: Actor> Context<A> {
    /// This actor's `tensor` summed with every other member's of `group` (f32, bf16, f16).
    pub async fn all_reduce(
        &self,
        group: &CollectiveGroup,
        tensor: TypedTensor,
    ) -> Result<TypedTensor, CollectiveError> {
        group
            .run(self.info().id, CollectiveKind::AllReduceSum, tensor)
            .await
    }

    /// This actor's shard (`shard_range(len, n, rank)`) of the sum of every member's `tensor`
    /// (ZeRO's reduce-scatter).
    pub async fn reduce_scatter(
        &self,
        group: &CollectiveGroup,
        tensor: TypedTensor,
    ) -> Result<TypedTensor, CollectiveError> {
        group
            .run(self.info().id, CollectiveKind::ReduceScatterSum, tensor)
            .await
    }

    /// Every member's `tensor` (all of one shape) side by side, `[members, ..shape]`, in rank
    /// order (any element type).
    pub async fn all_gather(
        &self,
        group: &CollectiveGroup,
        tensor: TypedTensor,
    ) -> Result<TypedTensor, CollectiveError> {
        let me = self.info().id;
        let n = group.members.len();
        let rank = group.members.iter().position(|&m| m == me).unwrap_or(0);
        let shard = tensor.byte_len();
        let mut shape = vec![n];
        shape.extend_from_slice(tensor.shape());
        let mut gathered = (TypedTensor::zeros(tensor.dtype(), shape))
            .map_err(|e| CollectiveError(format!("{}: {e}", group.describe(me))))?;
        gathered.bytes_mut()[rank * shard..(rank + 1) * shard].copy_from_slice(tensor.bytes());
        group.run(me, CollectiveKind::AllGather, gathered).await
    }
}
