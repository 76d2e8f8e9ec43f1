//! Instructions: the entries of an actor's stream, the unit the runtime executes and reports.
//!
//! Tensors are named per actor by typed ids ([`TensorId`]: `act.0.1`, `grad.1`, `batch.0` when
//! printed); an instruction reads and writes ids, so a stream is plain data that can be printed,
//! diffed and simulated.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::tensor_id::TensorId;
use crate::{ActorId, DType, DeviceSpec};

/// Local compute on one actor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ComputeOp {
    /// Build this actor's slice (rows `start..end` of the global batch) of the step's batch.
    LoadBatch {
        /// First row of the global batch.
        start: usize,
        /// One past the last row.
        end: usize,
    },
    /// Forward of blocks `start..end` (a segment) on micro-batch `mb`; keeps what backward needs.
    Forward {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// Loss of the last segment's output against the batch's targets. Under tensor parallelism
    /// with vocabulary-parallel logits it also reads the group's [`ComputeOp::LossMax`] and
    /// [`ComputeOp::LossSums`] (all-reduced), so no rank ever holds the whole logits.
    Loss {
        /// Micro-batch.
        mb: usize,
    },
    /// Vocabulary-parallel cross-entropy, first statistic: each token's largest logit in this
    /// rank's slice of the vocabulary (then all-reduced to the maximum over the group).
    LossMax {
        /// Micro-batch.
        mb: usize,
    },
    /// Vocabulary-parallel cross-entropy, second statistics: each token's `Σ exp(z − max)` over
    /// this rank's slice and its target's logit where the target falls in the slice (then
    /// all-reduced to the sums over the group).
    LossSums {
        /// Micro-batch.
        mb: usize,
    },
    /// Backward of blocks `start..end`: parameter gradients into the segment's gradient bucket and
    /// the input gradient for the segment before.
    Backward {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// ZB-H1's `B`: the backward of blocks `start..end` for the input gradient only (sent on to
    /// the stage before); the weight gradients are kept for the matching [`ComputeOp::BackwardWeight`].
    BackwardInput {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// ZB-H1's `W`: the weight gradients of blocks `start..end` for micro-batch `mb`, added into
    /// the segment's gradient bucket.
    BackwardWeight {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
        /// Micro-batch.
        mb: usize,
    },
    /// Offload (ZeRO-Offload): hand the gradient bucket of blocks `start..end` (this replica's
    /// shard of it under ZeRO) to the actor's offload actor, which updates the master shard on
    /// the host while the device goes on with its backward.
    OffloadGrads {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// Tensor parallelism: writes the group's sum of the replicated parameters' gradients of
    /// blocks `start..end` (LayerNorms, the biases and positions only the first rank adds), read
    /// from [`crate::TensorId::TpGrads`] after its all-reduce, back into the segment's bucket, so
    /// that every rank holds the whole gradient of what it holds whole.
    ReplicatedGrads {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// A tie ([`crate::ties`]): the values of the parameter the mirror in block `block`
    /// mirrors, read from the module about to run its first forward of the step, into
    /// [`crate::TensorId::TiedValues`].
    TiedValues {
        /// The mirror's block.
        block: usize,
    },
    /// A tie: [`crate::TensorId::TiedValues`] written into the mirror in block `block` before
    /// its first forward of the step.
    LoadTied {
        /// The mirror's block.
        block: usize,
    },
    /// A tie: the mirror's gradient ([`crate::TensorId::TiedGrads`], the micro-batches' sum)
    /// added into its target's place in the target's gradient bucket, before that bucket's
    /// reduction: the update sees the sum of both uses.
    AddTiedGrads {
        /// The mirror's block.
        block: usize,
    },
    /// Gradient clipping's first phase (`torch.nn.utils.clip_grad_norm_`): the sum of squares of
    /// this actor's share of the reduced gradients of blocks `start..end` (its shard of each
    /// bucket, so that every element counts once over the dp group) into a one-value tensor;
    /// summed over every actor it is the squared global norm the update is clipped by.
    GradNorm {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// LAMB's first phase (You et al., 2020) for blocks `start..end`: start the optimizer step
    /// (clipped by the reduced global norm when clipping), update this actor's moments and write,
    /// per parameter of the stage, the partial sums of squares of the parameter and of its update
    /// direction over the elements this actor owns; summed over the dp group they are the whole
    /// parameters' norms the trust ratios take.
    TrustNorms {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// Optimizer step on the flat parameters of blocks `start..end`, over what `scope` says and
    /// followed by what it says. Besides the gradient buckets it may read the reduced global
    /// gradient norm (clipping) or LAMB's reduced per-parameter norms.
    OptimizerStep {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
        /// What it updates and what follows.
        scope: UpdateScope,
    },
    /// Load the gathered parameters of blocks `start..end` (ZeRO: after the all-gather of the
    /// shards each replica updated) into the master copy and the compute modules.
    LoadParams {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// ZeRO-3: this replica's shard of the parameters of blocks `start..end`, in a buffer of the
    /// segment's full length, ready for the all-gather.
    ShardParams {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// ZeRO++ hpZ: keep this replica's island slice of the gathered parameters of blocks
    /// `start..end` (its input, left in the table for the load that follows) as its secondary
    /// copy, read by the backward's gather inside the island.
    KeepSecondary {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// ZeRO++ hpZ: this replica's slice of the secondary copy of blocks `start..end`, in a buffer
    /// of the segment's full length, ready for the all-gather inside its island.
    SecondaryShard {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// ZeRO-3: drop the gathered parameters of blocks `start..end` from the compute modules.
    DropParams {
        /// First block.
        start: usize,
        /// One past the last block.
        end: usize,
    },
    /// A user computation, named by whoever built the graph (a compiled program's recorded call
    /// is `node:{i}`; its input and output are `input` and `return`).
    User {
        /// The computation's name.
        name: String,
    },
    /// Hand the input tensor to the caller under `key` ([`FlowGraph::output`](crate::flow::FlowGraph::output)).
    Output {
        /// The key the caller reads it under.
        key: String,
    },
}

/// What an optimizer step updates, and what becomes of the result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateScope {
    /// Every bucket whole (replicated state); the compute modules reload the updated blocks.
    Whole,
    /// This replica's shard of every bucket (ZeRO-1/2); the updated shard is written, in a
    /// buffer of the bucket's length, to the step's output for the all-gather that follows.
    ShardThenGather,
    /// This replica's shard of every bucket (ZeRO-3), kept as the only copy until the next
    /// forward gathers it.
    ShardKept,
    /// The buckets went to the offload actor during the backward; collect its updated parameters
    /// (ZeRO-Offload).
    CollectOffloaded,
}

impl fmt::Display for UpdateScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UpdateScope::Whole => "whole",
            UpdateScope::ShardThenGather => "shard, then gather",
            UpdateScope::ShardKept => "shard, kept",
            UpdateScope::CollectOffloaded => "collect offloaded",
        })
    }
}

/// A collective operation over a group of actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// Element-wise sum; every member ends with the total.
    AllReduceSum,
    /// Element-wise sum, scattered: member `i` of the group ends with the total of shard `i`
    /// (the ZeRO layout); the adjoint of [`CollectiveKind::AllGather`].
    ReduceScatterSum,
    /// Member `i` brings shard `i`; every member ends with all shards.
    AllGather,
    /// Element-wise sum over a group spanning islands, hierarchically: reduce-scatter inside
    /// each island, all-reduce of each shard across islands (among the members at the same
    /// place in their island), all-gather inside each island. The group is listed island by
    /// island, `island_size` members each.
    HierarchicalAllReduceSum {
        /// Members per island.
        island_size: usize,
    },
    /// Element-wise maximum; every member ends with the maximum over the group (f32 only: the
    /// row maxima of tensor parallelism's vocab-parallel cross-entropy). The worker gathers
    /// every member's values and takes the maximum locally, so member `i` reads `(n − 1)·len`.
    AllReduceMax,
}

/// One entry of an actor's instruction stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Instruction {
    /// Local compute.
    Compute {
        /// What to run.
        op: ComputeOp,
        /// Tensors read.
        inputs: Vec<TensorId>,
        /// Tensors written.
        outputs: Vec<TensorId>,
    },
    /// Send a local tensor to a peer (does not wait for the peer).
    Send {
        /// Local tensor.
        tensor: TensorId,
        /// Receiving actor.
        to: ActorId,
        /// Matches the peer's `Recv`.
        tag: u64,
    },
    /// Receive a tensor from a peer into a local name (waits for it).
    Recv {
        /// Local name of the received tensor.
        tensor: TensorId,
        /// Sending actor.
        from: ActorId,
        /// Matches the peer's `Send`.
        tag: u64,
    },
    /// Start a collective on a local tensor; it runs while the stream goes on.
    StartCollective {
        /// Which collective.
        kind: CollectiveKind,
        /// The local tensor, replaced by the result.
        tensor: TensorId,
        /// Members in ring order.
        group: Vec<ActorId>,
        /// Identifies the collective across members.
        tag: u64,
        /// The tensor's element type (every member brings the same; f32 in plans written
        /// before collectives were typed).
        #[serde(default)]
        dtype: DType,
        /// How the payload is compressed on the wire (none in plans written before issue 43).
        #[serde(default)]
        codec: crate::codec::Codec,
    },
    /// Wait until a started collective has finished on this actor.
    WaitCollective {
        /// The tensor the collective replaces.
        tensor: TensorId,
        /// The collective's tag.
        tag: u64,
    },
}

impl Instruction {
    /// Tensors this instruction needs to exist locally before it runs.
    pub fn reads(&self) -> Vec<&TensorId> {
        match self {
            Instruction::Compute { inputs, .. } => inputs.iter().collect(),
            Instruction::Send { tensor, .. } | Instruction::StartCollective { tensor, .. } => {
                vec![tensor]
            }
            Instruction::Recv { .. } | Instruction::WaitCollective { .. } => vec![],
        }
    }

    /// The micro-batch this instruction works on, when it works on one.
    pub fn microbatch(&self) -> Option<usize> {
        match self {
            Instruction::Compute { op, .. } => match op {
                ComputeOp::Forward { mb, .. }
                | ComputeOp::Backward { mb, .. }
                | ComputeOp::BackwardInput { mb, .. }
                | ComputeOp::BackwardWeight { mb, .. }
                | ComputeOp::Loss { mb }
                | ComputeOp::LossMax { mb }
                | ComputeOp::LossSums { mb } => Some(*mb),
                _ => None,
            },
            Instruction::Send { tensor, .. } | Instruction::Recv { tensor, .. } => tensor.microbatch(),
            Instruction::StartCollective { .. } | Instruction::WaitCollective { .. } => None,
        }
    }
}

impl fmt::Display for ComputeOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ComputeOp::LoadBatch { start, end } => write!(f, "LoadBatch(rows {start}..{end})"),
            ComputeOp::Forward { start, end, mb } => write!(f, "Forward(blocks {start}..{end}, mb {mb})"),
            ComputeOp::Loss { mb } => write!(f, "Loss(mb {mb})"),
            ComputeOp::LossMax { mb } => write!(f, "LossMax(mb {mb})"),
            ComputeOp::LossSums { mb } => write!(f, "LossSums(mb {mb})"),
            ComputeOp::Backward { start, end, mb } => write!(f, "Backward(blocks {start}..{end}, mb {mb})"),
            ComputeOp::BackwardInput { start, end, mb } => {
                write!(f, "BackwardInput(blocks {start}..{end}, mb {mb})")
            }
            ComputeOp::BackwardWeight { start, end, mb } => {
                write!(f, "BackwardWeight(blocks {start}..{end}, mb {mb})")
            }
            ComputeOp::OffloadGrads { start, end } => write!(f, "OffloadGrads(blocks {start}..{end})"),
            ComputeOp::ReplicatedGrads { start, end } => write!(f, "ReplicatedGrads(blocks {start}..{end})"),
            ComputeOp::TiedValues { block } => write!(f, "TiedValues(mirror in block {block})"),
            ComputeOp::LoadTied { block } => write!(f, "LoadTied(mirror in block {block})"),
            ComputeOp::AddTiedGrads { block } => write!(f, "AddTiedGrads(mirror in block {block})"),
            ComputeOp::GradNorm { start, end } => write!(f, "GradNorm(blocks {start}..{end})"),
            ComputeOp::TrustNorms { start, end } => write!(f, "TrustNorms(blocks {start}..{end})"),
            ComputeOp::OptimizerStep { start, end, scope } => {
                write!(f, "OptimizerStep(blocks {start}..{end}, {scope})")
            }
            ComputeOp::LoadParams { start, end } => write!(f, "LoadParams(blocks {start}..{end})"),
            ComputeOp::ShardParams { start, end } => write!(f, "ShardParams(blocks {start}..{end})"),
            ComputeOp::DropParams { start, end } => write!(f, "DropParams(blocks {start}..{end})"),
            ComputeOp::KeepSecondary { start, end } => write!(f, "KeepSecondary(blocks {start}..{end})"),
            ComputeOp::SecondaryShard { start, end } => write!(f, "SecondaryShard(blocks {start}..{end})"),
            ComputeOp::User { name } => write!(f, "Run({name})"),
            ComputeOp::Output { key } => write!(f, "Output({key})"),
        }
    }
}

impl fmt::Display for Instruction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Instruction::Compute { op, .. } => write!(f, "{op}"),
            Instruction::Send { tensor, to, tag } => write!(f, "Send({tensor} → actor {to}, tag {tag})"),
            Instruction::Recv { tensor, from, tag } => write!(f, "Recv({tensor} ← actor {from}, tag {tag})"),
            Instruction::StartCollective {
                kind,
                tensor,
                group,
                tag,
                dtype,
                codec,
            } => {
                write!(f, "{kind:?}({tensor}")?;
                if *dtype != DType::F32 {
                    write!(f, " {dtype}")?;
                }
                if *codec != crate::codec::Codec::None {
                    write!(f, " {codec}")?;
                }
                write!(f, ", group {group:?}, tag {tag})")
            }
            Instruction::WaitCollective { tensor, tag } => write!(f, "Wait({tensor}, tag {tag})"),
        }
    }
}

/// One actor's instruction stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorStream {
    /// The actor.
    pub actor: ActorId,
    /// Its device.
    pub device: DeviceSpec,
    /// Instructions in execution order.
    pub instructions: Vec<Instruction>,
}
