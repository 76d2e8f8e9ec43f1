//! The dataflow graph IR: compute nodes placed on actors, joined by edges that move tensors.
//!
//! A training step, a pipeline schedule and a user's map-reduce are all graphs of this one type.
//! Node order is the schedule: lowering keeps it per actor. Edges are transfers (send ↔ recv) and
//! collectives (all-reduce, whose adjoint is the identity on the reduced gradient).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::instruction::{CollectiveKind, ComputeOp};
use crate::tensor_id::TensorId;
use crate::{ActorId, DType};

/// What a node does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeOp {
    /// Local compute on one actor: reads `inputs`, writes `outputs` (names local to the actor).
    Compute {
        /// Where it runs.
        actor: ActorId,
        /// What it runs.
        op: ComputeOp,
        /// Tensors read.
        inputs: Vec<TensorId>,
        /// Tensors written.
        outputs: Vec<TensorId>,
    },
    /// A point-to-point edge: `tensor` on `from` arrives as `as_name` on `to`.
    Transfer {
        /// Sender.
        from: ActorId,
        /// Receiver.
        to: ActorId,
        /// The sender's tensor.
        tensor: TensorId,
        /// The receiver's name for it.
        as_name: TensorId,
    },
    /// A collective edge over `group`: every member's `tensor` is replaced by the result.
    Collective {
        /// Which collective.
        kind: CollectiveKind,
        /// Members, in ring order.
        group: Vec<ActorId>,
        /// The tensor (same name on every member).
        tensor: TensorId,
        /// Its element type on the wire (sums accumulate in f32 whatever it is).
        dtype: DType,
        /// How its payload is compressed on the wire ([`crate::passes::compress`]).
        codec: crate::codec::Codec,
    },
}

/// A dataflow graph over `actors` actors.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Graph {
    /// Number of actors.
    pub actors: usize,
    /// Nodes in schedule order.
    pub nodes: Vec<NodeOp>,
    /// Size in bytes of tensors whose size is known, by name (for memory and bandwidth estimates).
    pub tensor_bytes: BTreeMap<TensorId, u64>,
    /// The actors whose nodes are built (every actor when empty): a plan builds one actor per
    /// stream class ([`crate::stream_class`]) and derives the others' streams from it, so nodes
    /// on no built actor are dropped as they are added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub built: Vec<bool>,
}

impl Graph {
    /// An empty graph over `actors` actors.
    pub fn new(actors: usize) -> Graph {
        Graph {
            actors,
            ..Graph::default()
        }
    }

    /// A graph that builds only the nodes touching `built` actors (see [`Graph::built`]).
    pub fn built_for(built: Vec<bool>) -> Graph {
        Graph {
            actors: built.len(),
            built,
            ..Graph::default()
        }
    }

    /// Whether `actor`'s nodes are built.
    pub fn builds(&self, actor: ActorId) -> bool {
        self.built.is_empty() || self.built.get(actor).copied().unwrap_or(false)
    }

    /// Whether `node` touches a built actor (a compute on one, a transfer from or to one, a
    /// collective with one as a member).
    pub fn keeps(&self, node: &NodeOp) -> bool {
        match node {
            NodeOp::Compute { actor, .. } => self.builds(*actor),
            NodeOp::Transfer { from, to, .. } => self.builds(*from) || self.builds(*to),
            NodeOp::Collective { group, .. } => {
                self.built.is_empty() || group.iter().any(|&a| self.builds(a))
            }
        }
    }

    /// Appends `node` when it touches a built actor.
    pub fn push(&mut self, node: NodeOp) {
        if self.keeps(&node) {
            self.nodes.push(node);
        }
    }

    /// Appends a compute node (when `actor` is built).
    pub fn compute(&mut self, actor: ActorId, op: ComputeOp, inputs: &[TensorId], outputs: &[TensorId]) {
        if !self.builds(actor) {
            return;
        }
        self.nodes.push(NodeOp::Compute {
            actor,
            op,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
        });
    }

    /// Appends the same compute node on each of `actors` (a tensor-parallel group's ranks).
    pub fn compute_each(
        &mut self,
        actors: &[ActorId],
        op: &ComputeOp,
        inputs: &[TensorId],
        outputs: &[TensorId],
    ) {
        for &actor in actors {
            self.compute(actor, op.clone(), inputs, outputs);
        }
    }

    /// Appends a transfer edge.
    pub fn transfer(&mut self, from: ActorId, tensor: &TensorId, to: ActorId, as_name: &TensorId) {
        self.push(NodeOp::Transfer {
            from,
            to,
            tensor: tensor.clone(),
            as_name: as_name.clone(),
        });
    }

    /// Appends a collective edge over an f32 tensor (what training reduces today).
    pub fn collective(&mut self, kind: CollectiveKind, group: Vec<ActorId>, tensor: &TensorId) {
        self.push(NodeOp::Collective {
            kind,
            group,
            tensor: tensor.clone(),
            dtype: DType::F32,
            codec: crate::codec::Codec::None,
        });
    }
}
