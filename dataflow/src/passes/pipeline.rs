//! The pipeline pass: forward and backward of every segment on a `dp × pp × tp` mesh, joined by
//! send/recv edges between stages (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019;
//! interleaved, Narayanan et al. 2021; ZB-H1, Qi et al. 2024) and, inside a tensor-parallel
//! group, by Megatron-LM's conjugate all-reduces (Shoeybi et al. 2019): g after the forward of a
//! segment whose output is a partial sum, f after the backward of a segment whose input is
//! replicated (its input gradient is then a partial sum); under sequence parallelism
//! (Korthikanti et al. 2022) a reduce-scatter where a partial output meets an input cut along the
//! tokens, an all-gather where such an output meets a whole input, and their adjoints on the
//! gradients, with the residual stream a second tensor between segments. Every tp rank runs every compute of
//! its replica; the all-reduces are edges of the step, so the verifier, the simulator, the hang
//! report and the byte prediction see each one.
//!
//! The model is cut into `pp × V` chunks ([`super::partition`]); chunk `c` lives on pipeline
//! device `c % pp` of every replica, cut further into segments ([`super::layout`]). Each device
//! runs its passes in the order its schedule gives ([`super::schedule`]): a forward slot runs the
//! chunk's segments for one micro-batch and sends the output on; a backward slot runs them in
//! reverse and sends the input gradient back; each segment's backward adds into its gradient
//! bucket. The graph this pass builds is the whole step of one replica repeated on every replica
//! with no communication between replicas: gradient reductions ([`super::data_parallel`]), the
//! optimizer ([`super::optimizer`]), ZeRO ([`super::zero`]), offload ([`super::offload`]) and
//! islands ([`super::islands`]) are passes over it ([`super::step`] runs them in order).

use crate::graph::Graph;
use crate::instruction::{CollectiveKind, ComputeOp};
use crate::passes::data_parallel::Bucket;
pub use crate::passes::layout::Layout;
use crate::passes::schedule::{Pass, PipelineShape, Slot};
use crate::tensor_id::TensorId;
use crate::tensor_parallel::{TpEdge, TpHeld};

/// Builds the pipeline graph of one step: batches, then every device's slots in its order, each
/// slot the runs of its chunk's segments (one compute per replica, with its loss or its send).
pub fn build(layout: &Layout, batch: usize, orders: &[Vec<Slot>]) -> Graph {
    let PipelineShape { pp, m, .. } = layout.shape;
    let dp = layout.mesh.axis_size("dp");
    let mut graph = match &layout.built {
        Some(built) => Graph::built_for(built.clone()),
        None => Graph::new(layout.mesh.size()),
    };
    for b in &layout.segments {
        graph
            .tensor_bytes
            .insert(TensorId::GradBucket { segment: b.id }, b.bytes);
    }
    let per_replica = batch / dp;
    let per_mb = per_replica / m;
    let last_chunk = layout.chunks.len() - 1;
    let last_segment = layout.segments.len() - 1;
    let splits_backward = orders.iter().flatten().any(|s| s.pass == Pass::W);
    // The replicas with a built actor on each pipeline device.
    let replicas: Vec<Vec<usize>> = (0..pp)
        .map(|s| {
            (0..dp)
                .filter(|&r| builds_replica(&graph, layout, r, s))
                .collect()
        })
        .collect();
    // Batches: the first chunk's device feeds the inputs, the last chunk's device the targets.
    for (s, built) in replicas.iter().enumerate() {
        if s != layout.device_of_chunk(0) && s != layout.device_of_chunk(last_chunk) {
            continue;
        }
        for &r in built {
            for mb in 0..m {
                let start = r * per_replica + mb * per_mb;
                let op = ComputeOp::LoadBatch {
                    start,
                    end: start + per_mb,
                };
                graph.compute_each(&layout.tp_group(r, s), &op, &[], &[TensorId::Batch { mb }]);
            }
        }
    }
    for (s, order) in orders.iter().enumerate() {
        for slot in order {
            let mut segments = layout.segments_of(slot.chunk);
            if slot.pass != Pass::F {
                segments.reverse();
            }
            let mb = slot.mb;
            for (i, b) in segments.iter().enumerate() {
                for &r in &replicas[s] {
                    match slot.pass {
                        Pass::F => forward(&mut graph, layout, b, mb, r, s, last_segment),
                        Pass::B => {
                            // ZeRO-R's gathers run one segment ahead of the backward that reads
                            // them (the schedule is known), the slot's first at its start.
                            let group = layout.tp_group(r, s);
                            let ahead = segments.get(i + 1);
                            for k in (i == 0).then_some(*b).into_iter().chain(ahead.copied()) {
                                gather_checkpoint(&mut graph, layout, k, mb, &group);
                            }
                            backward(&mut graph, layout, b, mb, r, s, last_segment, splits_backward)
                        }
                        Pass::W => {
                            let op = ComputeOp::BackwardWeight {
                                start: b.start,
                                end: b.end,
                                mb,
                            };
                            let outputs = [TensorId::GradBucket { segment: b.id }];
                            graph.compute_each(&layout.tp_group(r, s), &op, &[], &outputs);
                        }
                    }
                }
            }
        }
    }
    graph
}

/// Whether replica `r` has a built actor on pipeline device `s` (see [`Graph::built`]).
fn builds_replica(graph: &Graph, layout: &Layout, r: usize, s: usize) -> bool {
    (0..layout.tp()).any(|t| graph.builds(layout.actor_at(r, s, t)))
}

fn forward(graph: &mut Graph, layout: &Layout, b: &Bucket, mb: usize, r: usize, s: usize, last: usize) {
    let input = if b.id == 0 {
        TensorId::Batch { mb }
    } else {
        TensorId::Activation {
            segment: b.id - 1,
            mb,
        }
    };
    let output = TensorId::Activation { segment: b.id, mb };
    let op = ComputeOp::Forward {
        start: b.start,
        end: b.end,
        mb,
    };
    let group = layout.tp_group(r, s);
    let mut inputs = vec![input];
    if let Some(from) = layout.residual_source[b.id] {
        // Sequence parallelism: the residual stream a segment before passed on, added here.
        inputs.push(TensorId::Residual { segment: from, mb });
    }
    let mut outputs = vec![output.clone()];
    if layout.segment_tp[b.id].residual_out {
        outputs.push(TensorId::Residual { segment: b.id, mb });
    }
    if layout.kept_input(b.id).is_some() {
        // What activation checkpointing keeps of the input for the backward, named.
        outputs.push(TensorId::Checkpoint { segment: b.id, mb });
    }
    graph.compute_each(&group, &op, &inputs, &outputs);
    if group.len() > 1 {
        // The loss reads a partial output summed, as a block that takes it whole would.
        let next = layout.segment_tp.get(b.id + 1).filter(|_| b.id != last);
        let edge = TpEdge::between(
            layout.segment_tp[b.id].output,
            next.map_or(TpHeld::Replicated, |t| t.input),
        );
        let kind = match edge {
            // g: the partial sums of a row-parallel output become the activation on every rank.
            Ok(Some(TpEdge::AllReduce)) => Some(CollectiveKind::AllReduceSum),
            // Sequence parallelism: each rank's tokens of the sum, or every rank's tokens.
            Ok(Some(TpEdge::ReduceScatter)) => Some(CollectiveKind::ReduceScatterSum),
            Ok(Some(TpEdge::AllGather)) => Some(CollectiveKind::AllGather),
            _ => None,
        };
        if let Some(kind) = kind {
            graph.collective(kind, group, &output);
        }
    }
    if let Some(reader) = layout
        .residual_reader(b.id)
        .filter(|&k| layout.device_of_segment(k) != s)
    {
        // The residual stream to the stage that adds it (its tokens, no collective).
        let residual = TensorId::Residual { segment: b.id, mb };
        send_group(graph, layout, r, (s, layout.device_of_segment(reader)), &residual);
    }
    if b.id == last {
        loss(graph, layout, &output, mb, r, s);
    } else if layout.device_of_segment(b.id + 1) != s {
        send_group(graph, layout, r, (s, layout.device_of_segment(b.id + 1)), &output);
    }
}

/// ZeRO-R: every rank of `group` kept 1/tp of segment `b`'s input for micro-batch `mb`; its
/// recompute needs all of it (nothing for a segment whose input is not partitioned).
fn gather_checkpoint(graph: &mut Graph, layout: &Layout, b: &Bucket, mb: usize, group: &[usize]) {
    if layout.kept_input(b.id).is_some_and(|k| k.partitioned) {
        let checkpoint = TensorId::Checkpoint { segment: b.id, mb };
        graph.collective(CollectiveKind::AllGather, group.to_vec(), &checkpoint);
    }
}

/// The loss of replica `r`'s micro-batch `mb` on every tp rank. Logits sharded over the
/// vocabulary take the vocabulary-parallel cross-entropy (Megatron-LM): each rank's row maxima,
/// all-reduced to the maximum; its sums of `exp(z − max)` and target logits, all-reduced to the
/// sums; then the loss from those, so no rank holds the whole logits.
fn loss(graph: &mut Graph, layout: &Layout, logits: &TensorId, mb: usize, r: usize, s: usize) {
    let group = layout.tp_group(r, s);
    let batch = TensorId::Batch { mb };
    let mut inputs = vec![logits.clone(), batch.clone()];
    let last = layout.segments.len() - 1;
    if group.len() > 1 && layout.segment_tp[last].output == TpHeld::Sharded {
        let (max, sums) = (TensorId::LossMax { mb }, TensorId::LossSums { mb });
        let statistics = [
            (ComputeOp::LossMax { mb }, max, CollectiveKind::AllReduceMax),
            (ComputeOp::LossSums { mb }, sums, CollectiveKind::AllReduceSum),
        ];
        for (op, statistic, kind) in statistics {
            graph.compute_each(&group, &op, &inputs, std::slice::from_ref(&statistic));
            graph.collective(kind, group.clone(), &statistic);
            inputs.push(statistic);
        }
    }
    graph.compute_each(&group, &ComputeOp::Loss { mb }, &inputs, &[TensorId::Loss { mb }]);
}

#[allow(clippy::too_many_arguments)]
fn backward(
    graph: &mut Graph,
    layout: &Layout,
    b: &Bucket,
    mb: usize,
    r: usize,
    s: usize,
    last: usize,
    splits_backward: bool,
) {
    let upstream = if b.id == last {
        TensorId::Loss { mb }
    } else {
        TensorId::ActivationGrad {
            segment: b.id + 1,
            mb,
        }
    };
    let dact = TensorId::ActivationGrad { segment: b.id, mb };
    let (start, end) = (b.start, b.end);
    let (op, mut outputs) = if splits_backward {
        (ComputeOp::BackwardInput { start, end, mb }, vec![])
    } else {
        (
            ComputeOp::Backward { start, end, mb },
            vec![TensorId::GradBucket { segment: b.id }],
        )
    };
    if b.id > 0 {
        outputs.push(dact.clone());
    }
    if layout.residual_source[b.id].is_some() {
        outputs.push(TensorId::ResidualGrad { segment: b.id, mb });
    }
    let group = layout.tp_group(r, s);
    let mut inputs = vec![upstream];
    if let Some(reader) = layout.residual_reader(b.id) {
        // The residual stream passed on has its own gradient, a second upstream.
        inputs.push(TensorId::ResidualGrad { segment: reader, mb });
    }
    if layout.kept_input(b.id).is_some() {
        inputs.push(TensorId::Checkpoint { segment: b.id, mb });
    }
    graph.compute_each(&group, &op, &inputs, &outputs);
    if group.len() > 1 && b.id > 0 {
        let input = layout.segment_tp[b.id].input;
        let kind = match TpEdge::between(layout.segment_tp[b.id - 1].output, input) {
            // The adjoints of sequence parallelism's reduce-scatter and all-gather.
            Ok(Some(TpEdge::ReduceScatter)) => Some(CollectiveKind::AllGather),
            Ok(Some(TpEdge::AllGather)) => Some(CollectiveKind::ReduceScatterSum),
            // f: every rank's gradient of the replicated input is a summand of the whole.
            _ if input == TpHeld::Replicated => Some(CollectiveKind::AllReduceSum),
            _ => None,
        };
        if let Some(kind) = kind {
            graph.collective(kind, group.clone(), &dact);
        }
    }
    if let Some(source) = layout.residual_source[b.id].filter(|&k| layout.device_of_segment(k) != s) {
        let dres = TensorId::ResidualGrad { segment: b.id, mb };
        send_group(graph, layout, r, (s, layout.device_of_segment(source)), &dres);
    }
    if b.id > 0 && layout.device_of_segment(b.id - 1) != s {
        send_group(graph, layout, r, (s, layout.device_of_segment(b.id - 1)), &dact);
    }
}

/// `tensor` from replica `r`'s tp group on pipeline device `stages.0` to its group on `stages.1`,
/// rank to rank.
fn send_group(graph: &mut Graph, layout: &Layout, r: usize, stages: (usize, usize), tensor: &TensorId) {
    let (from, to) = (layout.tp_group(r, stages.0), layout.tp_group(r, stages.1));
    for (a, b) in from.into_iter().zip(to) {
        graph.transfer(a, tensor, b, tensor);
    }
}
