//! Fabric bytes: what each actor reads from its peers in one step, by kind — predicted here from
//! the plan's instruction streams, and measured by the actors where the bytes arrive (the
//! report sets the two side by side; `archipelago plan` prints the prediction).
//!
//! "Reads from its peers" is the same on every data path: a message received (in-process,
//! shared memory, raw TCP, gRPC), or, for the in-process shared-buffer collectives, the peers'
//! values summed into this member's shard plus the totals the peers write into its buffer. A
//! collective over `n` members of `len` elements in which member `i` owns shard
//! `shard_range(len, n, i)` reads (the ring of Patarasuk & Yuan 2009 moves the same amounts
//! with even shards; with uneven ones it differs by at most `n − 1` elements):
//!
//! | collective | elements member `i` reads |
//! | --- | --- |
//! | all-reduce | `(n − 1)·|shardᵢ| + len − |shardᵢ|` |
//! | reduce-scatter | `(n − 1)·|shardᵢ|` |
//! | all-gather | `len − |shardᵢ|` |
//! | hierarchical all-reduce | reduce-scatter in the island, all-reduce of the own shard across islands, all-gather in the island |
//! | all-reduce of the maximum | `(n − 1)·len` (an all-gather of every member's `len` values) |
//!
//! A compressed collective ([`Codec`]) reads each shard in the codec's wire size instead: the
//! int8 all-reduce `(n − 1)·wire(|shardᵢ|) + Σ_{j≠i} wire(|shardⱼ|)`, `wire(m) = m + 4·⌈m / block⌉`;
//! its reduce-scatter the first term, its all-gather the second; the stochastic codecs' all-reduce
//! (QSGD, TernGrad), which gathers every member's whole contribution, `(n − 1)·wire(len)`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::actor_training::shard_range;
use crate::codec::Codec;
use crate::instruction::{CollectiveKind, Instruction};
use crate::plan::{ActorPlan, Plan};
use crate::tensor_id::TensorId;
use crate::tensor_parallel::TpHeld;
use crate::{ActorId, ModelDesc};

/// Bytes one actor read from its peers in a step, by what they were.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricBytes {
    /// Gradient reductions (all-reduce, ZeRO-2/3's reduce-scatter, hierarchical all-reduce).
    pub gradients: u64,
    /// Parameter gathers (ZeRO-1/2's updated shards, ZeRO-3's gathers before each pass).
    pub parameters: u64,
    /// Pipeline activations received from the previous stage.
    pub activations: u64,
    /// Their gradients received from the next stage.
    pub activation_grads: u64,
    /// Global norms (clipping's sum of squares, LAMB's per-parameter sums).
    pub norms: u64,
    /// Tensor parallelism's all-reduces inside a tp group (Megatron's f and g).
    #[serde(default)]
    pub tensor_parallel: u64,
}

/// What a tensor on the fabric is, for [`FabricBytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricKind {
    /// A gradient bucket.
    Gradients,
    /// Parameters gathered.
    Parameters,
    /// A stage's output.
    Activations,
    /// The gradient of a stage's input.
    ActivationGrads,
    /// Sums of squares.
    Norms,
    /// A tensor-parallel group's collective on an activation or its gradient.
    TensorParallel,
}

impl FabricKind {
    /// The kind of `tensor`; `None` for what a training step does not move (user tensors count
    /// elsewhere).
    pub fn of(tensor: &TensorId) -> Option<FabricKind> {
        Some(match tensor {
            TensorId::GradBucket { .. } | TensorId::TiedGrads { .. } => FabricKind::Gradients,
            TensorId::UpdatedParams { .. }
            | TensorId::GatheredParams { .. }
            | TensorId::TiedValues { .. } => FabricKind::Parameters,
            TensorId::Activation { .. } | TensorId::Residual { .. } => FabricKind::Activations,
            TensorId::ActivationGrad { .. } | TensorId::ResidualGrad { .. } => FabricKind::ActivationGrads,
            TensorId::GradSquares | TensorId::TrustSquares => FabricKind::Norms,
            TensorId::LossMax { .. }
            | TensorId::LossSums { .. }
            | TensorId::TpGrads { .. }
            | TensorId::Checkpoint { .. } => FabricKind::TensorParallel,
            TensorId::Batch { .. } | TensorId::Loss { .. } | TensorId::Named(_) => return None,
        })
    }

    /// The kind of a collective on `tensor`: on an activation or its gradient it is a
    /// tensor-parallel group's (a pipeline moves those by send and receive, never collectively).
    pub fn of_collective(tensor: &TensorId) -> Option<FabricKind> {
        match FabricKind::of(tensor)? {
            FabricKind::Activations | FabricKind::ActivationGrads => Some(FabricKind::TensorParallel),
            kind => Some(kind),
        }
    }
}

impl FabricBytes {
    /// Adds `bytes` of `kind`.
    pub fn add(&mut self, kind: FabricKind, bytes: u64) {
        *self.of_kind_mut(kind) += bytes;
    }

    /// Adds every kind of `other`.
    pub fn add_all(&mut self, other: &FabricBytes) {
        for kind in FabricBytes::KINDS {
            self.add(kind, other.of_kind(kind));
        }
    }

    /// Every kind, in report order.
    pub const KINDS: [FabricKind; 6] = [
        FabricKind::Gradients,
        FabricKind::Parameters,
        FabricKind::Activations,
        FabricKind::ActivationGrads,
        FabricKind::Norms,
        FabricKind::TensorParallel,
    ];

    /// The bytes of `kind`.
    pub fn of_kind(&self, kind: FabricKind) -> u64 {
        match kind {
            FabricKind::Gradients => self.gradients,
            FabricKind::Parameters => self.parameters,
            FabricKind::Activations => self.activations,
            FabricKind::ActivationGrads => self.activation_grads,
            FabricKind::Norms => self.norms,
            FabricKind::TensorParallel => self.tensor_parallel,
        }
    }

    fn of_kind_mut(&mut self, kind: FabricKind) -> &mut u64 {
        match kind {
            FabricKind::Gradients => &mut self.gradients,
            FabricKind::Parameters => &mut self.parameters,
            FabricKind::Activations => &mut self.activations,
            FabricKind::ActivationGrads => &mut self.activation_grads,
            FabricKind::Norms => &mut self.norms,
            FabricKind::TensorParallel => &mut self.tensor_parallel,
        }
    }

    /// All kinds together.
    pub fn total(&self) -> u64 {
        FabricBytes::KINDS.iter().map(|k| self.of_kind(*k)).sum()
    }
}

impl std::fmt::Display for FabricBytes {
    /// `7.6 MiB (gradients 7.6 MiB, norms 4 B)`: the total, then each kind that moved.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = [
            "gradients",
            "parameters",
            "activations",
            "activation gradients",
            "norms",
            "tensor-parallel",
        ];
        let parts: Vec<String> = (FabricBytes::KINDS.iter().zip(names))
            .filter(|(k, _)| self.of_kind(**k) > 0)
            .map(|(k, name)| format!("{name} {}", human(self.of_kind(*k))))
            .collect();
        write!(f, "{} ({})", human(self.total()), parts.join(", "))
    }
}

/// `12 B`, `7.6 KiB`, `32.1 MiB`.
pub(crate) fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else if bytes >= 1 << 10 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// Elements member `me` of `group` reads from its peers in a collective `kind` of `len`
/// elements (the table of the module's doc).
pub fn collective_read_elems(kind: CollectiveKind, group: &[ActorId], me: ActorId, len: usize) -> u64 {
    let n = group.len();
    let Some(i) = group.iter().position(|&a| a == me) else {
        return 0;
    };
    if n < 2 || len == 0 {
        return 0;
    }
    let own = shard_range(len, n, i).len();
    let read = match kind {
        CollectiveKind::AllReduceSum => (n - 1) * own + len - own,
        CollectiveKind::ReduceScatterSum => (n - 1) * own,
        CollectiveKind::AllGather => len - own,
        // An all-gather of `n·len` elements in which member `i` brings the whole shard `i`.
        CollectiveKind::AllReduceMax => (n - 1) * len,
        CollectiveKind::HierarchicalAllReduceSum { island_size } => {
            let k = island_size.max(1);
            let (island, place) = (i / k, i % k);
            let mine = &group[island * k..((island + 1) * k).min(n)];
            let shard = shard_range(len, mine.len(), place).len();
            let peers: Vec<ActorId> = group.iter().skip(place).step_by(k).copied().collect();
            return collective_read_elems(CollectiveKind::ReduceScatterSum, mine, me, len)
                + collective_read_elems(CollectiveKind::AllReduceSum, &peers, me, shard)
                + collective_read_elems(CollectiveKind::AllGather, mine, me, len);
        }
    };
    read as u64
}

/// The bytes member `me` reads in collective `c`: its elements in the dtype, or, compressed,
/// each shard it receives in the codec's wire size (the int8 all-reduce's direct reduce-scatter
/// brings it every other member's copy of its own shard, its all-gather every other shard once;
/// the reduce-scatter is the first half, the all-gather the second).
fn collective_read_bytes(c: &Sized, me: ActorId) -> u64 {
    let (n, len) = (c.group.len(), c.elems);
    let i = c.group.iter().position(|&a| a == me);
    let wire = |k: usize| {
        c.codec
            .wire_bytes(shard_range(len, n, k).len() as u64, c.dtype_size)
    };
    match (c.codec, c.kind, i) {
        (Codec::None, ..) | (_, _, None) => c.dtype_size * collective_read_elems(c.kind, c.group, me, len),
        _ if n < 2 => 0,
        (codec, CollectiveKind::AllReduceSum, Some(_)) if codec.gathers_contributions() => {
            (n as u64 - 1) * codec.wire_bytes(len as u64, c.dtype_size)
        }
        (_, CollectiveKind::AllReduceSum, Some(i)) => {
            (n as u64 - 1) * wire(i) + (0..n).filter(|&j| j != i).map(wire).sum::<u64>()
        }
        (_, CollectiveKind::ReduceScatterSum, Some(i)) => (n as u64 - 1) * wire(i),
        (_, CollectiveKind::AllGather, Some(i)) => (0..n).filter(|&j| j != i).map(wire).sum::<u64>(),
        _ => c.dtype_size * collective_read_elems(c.kind, c.group, me, len),
    }
}

/// Each actor's predicted fabric bytes per step, from its instruction stream: every collective
/// it takes part in and every tensor it receives, with the sizes the layout gives (a segment's
/// parameters for its bucket and gathers, in the collective's dtype; a micro-batch of the boundary
/// block's output for an activation and its gradient, in the compute dtype; one f32 value for
/// clipping's sum of squares and two per parameter tensor for LAMB's). The streams are read once
/// per class ([`crate::stream_class`]): an actor's receives are its class's, and what it reads of
/// a collective depends only on its place in the group, computed once per place.
pub fn predict(plan: &Plan) -> Vec<FabricBytes> {
    let mut classes: HashMap<ActorId, ClassTraffic> = HashMap::new();
    (plan.actors.iter())
        .map(|actor| {
            let class = (classes.entry(plan.streams.representative(actor.actor)))
                .or_insert_with(|| ClassTraffic::of(plan, actor));
            class.of_actor(plan, actor.actor)
        })
        .collect()
}

/// One collective of a class's stream, sized.
struct Sized<'a> {
    fabric: FabricKind,
    kind: CollectiveKind,
    group: &'a [ActorId],
    elems: usize,
    dtype_size: u64,
    codec: Codec,
}

/// A class's traffic: its receives, and its collectives by the axes their groups span, with what
/// each place in them reads (filled as actors ask).
struct ClassTraffic<'a> {
    received: FabricBytes,
    collectives: Vec<(u64, Vec<Sized<'a>>)>,
    by_place: HashMap<(u64, ActorId), FabricBytes>,
}

impl<'a> ClassTraffic<'a> {
    fn of(plan: &'a Plan, actor: &ActorPlan) -> ClassTraffic<'a> {
        let program = &plan.program;
        let rows = program.plan.batch / program.plan.dp.max(1) / program.plan.microbatches.max(1);
        // A tensor-parallel rank's buckets and gathers hold its slice of the parameters.
        let local = crate::tensor_parallel::local_model(&program.model, program.plan.tp);
        let trust_len = 2
            * (actor.chunks.iter())
                .flat_map(|&(start, end)| &program.model.blocks[start..end])
                .map(|b| b.param_descs.iter().filter(|p| p.trainable).count())
                .sum::<usize>();
        let elems = |t: &TensorId| tensor_elems(&program.model, &local, plan, rows, trust_len, t);
        let mut class = ClassTraffic {
            received: FabricBytes::default(),
            collectives: Vec::new(),
            by_place: HashMap::new(),
        };
        for instruction in plan.class_stream(actor.actor) {
            match instruction {
                // A collective names its dtype.
                Instruction::StartCollective {
                    kind,
                    tensor,
                    group,
                    dtype,
                    codec,
                    ..
                } => {
                    let Some(fabric) = FabricKind::of_collective(tensor) else {
                        continue;
                    };
                    let spanned = plan.streams.spanned(group);
                    let sized = Sized {
                        fabric,
                        kind: *kind,
                        group,
                        elems: elems(tensor),
                        dtype_size: dtype.size() as u64,
                        codec: *codec,
                    };
                    match class.collectives.iter_mut().find(|(s, _)| *s == spanned) {
                        Some((_, all)) => all.push(sized),
                        None => class.collectives.push((spanned, vec![sized])),
                    }
                }
                // Received activations and their gradients are in the compute dtype.
                Instruction::Recv { tensor, .. } => {
                    if let Some(kind) = FabricKind::of(tensor) {
                        let read = (elems(tensor) / received_share(plan, tensor)) as u64;
                        class
                            .received
                            .add(kind, program.precision.compute.size() as u64 * read);
                    }
                }
                _ => {}
            }
        }
        class
    }

    fn of_actor(&mut self, plan: &Plan, actor: ActorId) -> FabricBytes {
        let mut bytes = self.received;
        for (spanned, collectives) in &self.collectives {
            let me = plan.streams.as_member(actor, *spanned);
            let read = self.by_place.entry((*spanned, me)).or_insert_with(|| {
                let mut read = FabricBytes::default();
                for c in collectives {
                    read.add(c.fabric, collective_read_bytes(c, me));
                }
                read
            });
            bytes.add_all(read);
        }
        bytes
    }
}

/// Of an activation `tensor` as [`tensor_elems`] counts it, the part a stage receives: each
/// rank's share of the tokens where a reduce-scatter cut it before it crosses (sequence
/// parallelism), else all of it.
fn received_share(plan: &Plan, tensor: &TensorId) -> usize {
    let program = &plan.program;
    let TensorId::Activation { segment, .. } = tensor else {
        return 1;
    };
    let form = |k: usize| program.model.blocks.get(k).and_then(|b| b.tp);
    let (Some(this), Some(next)) = (plan.buckets.get(*segment), plan.buckets.get(segment + 1)) else {
        return 1;
    };
    match (form(this.end - 1), form(next.start)) {
        (Some(out), Some(next)) if out.output == TpHeld::Partial && next.input == TpHeld::SeqSharded => {
            program.plan.tp.max(1)
        }
        _ => 1,
    }
}

/// Elements of a training tensor that crosses the fabric (`local`: the model as one
/// tensor-parallel rank holds it; activations are whole).
fn tensor_elems(
    model: &ModelDesc,
    local: &ModelDesc,
    plan: &Plan,
    rows: usize,
    trust_len: usize,
    tensor: &TensorId,
) -> usize {
    let segment_params = |segment: usize| {
        plan.buckets.get(segment).map_or(0, |b| {
            local.blocks[b.start..b.end]
                .iter()
                .map(|x| x.trained_params() as usize)
                .sum()
        })
    };
    let output_of = |block: usize| rows * model.blocks[block].output_floats_per_sample as usize;
    // Under tensor parallelism an activation held sharded crosses as each rank's shard (the
    // widths tp cuts, which it divides); one held whole (after g, or f's sum) crosses whole.
    let tp = plan.program.plan.tp.max(1);
    let per_rank = |elems: usize, held: Option<TpHeld>| match held {
        Some(TpHeld::Sharded) => elems / tp,
        _ => elems,
    };
    match tensor {
        TensorId::GradBucket { segment }
        | TensorId::UpdatedParams { segment }
        | TensorId::GatheredParams { segment, .. } => segment_params(*segment),
        TensorId::Activation { segment, .. } => plan.buckets.get(*segment).map_or(0, |b| {
            let held = model.blocks[b.end - 1].tp.map(|t| t.output_after_g());
            per_rank(output_of(b.end - 1), held)
        }),
        TensorId::ActivationGrad { segment, .. } => (plan.buckets.get(*segment))
            .filter(|b| b.start > 0)
            .map_or(0, |b| {
                per_rank(output_of(b.start - 1), model.blocks[b.start].tp.map(|t| t.input))
            }),
        // A partitioned checkpoint is gathered whole: the segment input the group holds whole.
        TensorId::Checkpoint { segment, .. } => (plan.buckets.get(*segment))
            .filter(|b| b.start > 0)
            .map_or(0, |b| output_of(b.start - 1)),
        // Sequence parallelism's residual stream and its gradient: each rank's tokens.
        TensorId::Residual { segment, .. } | TensorId::ResidualGrad { segment, .. } => {
            (plan.buckets.get(*segment)).map_or(0, |b| output_of(b.end - 1) / tp)
        }
        TensorId::GradSquares => 1,
        TensorId::TrustSquares => trust_len,
        TensorId::LossMax { .. } => rows * model.input.tokens_per_sample(),
        TensorId::LossSums { .. } => 2 * rows * model.input.tokens_per_sample(),
        TensorId::TpGrads { segment } => plan.buckets.get(*segment).map_or(0, |b| {
            crate::tensor_parallel::replicated_trained(&local.blocks[b.start..b.end])
        }),
        // A tie's mirror, this rank's part of it.
        TensorId::TiedGrads { block } | TensorId::TiedValues { block } => (local.blocks.get(*block))
            .and_then(|b| b.param_descs.iter().find(|p| p.tied_to.is_some()))
            .map_or(0, |p| p.len()),
        TensorId::Batch { .. } | TensorId::Loss { .. } | TensorId::Named(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With even shards every member reads 2(n−1)/n of an all-reduce and (n−1)/n of a
    /// reduce-scatter or an all-gather — the ring's figures; a hierarchical all-reduce over two
    /// islands of two reads (n−1)/n·len inside the island twice and half of the shard across.
    #[test]
    fn collective_reads_are_the_rings_with_even_shards() {
        let group = [0, 1, 2, 3];
        for me in group {
            assert_eq!(
                collective_read_elems(CollectiveKind::AllReduceSum, &group, me, 400),
                600
            );
            assert_eq!(
                collective_read_elems(CollectiveKind::ReduceScatterSum, &group, me, 400),
                300
            );
            assert_eq!(
                collective_read_elems(CollectiveKind::AllGather, &group, me, 400),
                300
            );
            let islands = CollectiveKind::HierarchicalAllReduceSum { island_size: 2 };
            assert_eq!(collective_read_elems(islands, &group, me, 400), 200 + 200 + 200);
        }
        assert_eq!(
            collective_read_elems(CollectiveKind::AllReduceSum, &[5], 5, 400),
            0
        );
        assert_eq!(
            collective_read_elems(CollectiveKind::AllReduceSum, &group, 9, 400),
            0
        );
    }

    /// An all-reduce of the maximum gathers every member's values: each member reads all of
    /// its peers' `len` values, whatever the length (odd ones included), and a lone member or
    /// an outsider reads nothing.
    #[test]
    fn a_max_reads_every_peers_values() {
        let max = CollectiveKind::AllReduceMax;
        for (group, len) in [(&[0, 1][..], 7), (&[4, 2, 9][..], 400), (&[0, 1, 2, 3][..], 1001)] {
            for &me in group {
                let expected = ((group.len() - 1) * len) as u64;
                assert_eq!(
                    collective_read_elems(max, group, me, len),
                    expected,
                    "{group:?} {len}"
                );
            }
        }
        assert_eq!(collective_read_elems(max, &[3], 3, 400), 0);
        assert_eq!(collective_read_elems(max, &[0, 1], 5, 400), 0);
        assert_eq!(collective_read_elems(max, &[0, 1], 0, 0), 0);
    }
}
