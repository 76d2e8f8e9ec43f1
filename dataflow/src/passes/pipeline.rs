//! The training step on a `dp × pp` mesh: pipeline stages joined by send/recv edges, replicas
//! joined by per-segment gradient all-reduce edges.
//!
//! The model is cut into `pp × V` chunks ([`super::partition`]); chunk `c` lives on pipeline
//! device `c % pp` of every replica. Each chunk is cut further into gradient buckets (segments,
//! as in DDP). Each device runs its passes in the order its schedule gives ([`super::schedule`]):
//! a forward slot runs the chunk's segments for one micro-batch and sends the output on; a
//! backward slot runs them in reverse and sends the input gradient back. Each segment's
//! gradient bucket accumulates over the micro-batches; after the device's last backward of the
//! segment its all-reduce over the `dp` group starts, overlapping what is left of the backward.
//! A pure data-parallel step is the one-stage, one-micro-batch case.

use std::collections::HashMap;

use crate::graph::Graph;
use crate::instruction::{CollectiveKind, ComputeOp};
use crate::mesh::Mesh;
use crate::model_spec::ModelDesc;
use crate::passes::data_parallel::{Bucket, buckets_in, grad_name};
use crate::passes::optimizer::StepNorms;
pub use crate::passes::optimizer::param_name;
use crate::passes::partition::Chunk;
use crate::passes::schedule::{Pass, PipelineShape, Slot};
use crate::{ActorId, ZeroStage};

/// Where every block and segment lives.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    /// The mesh (`dp`, and `pp` when there is more than one stage).
    pub mesh: Mesh,
    /// Pipeline shape.
    pub shape: PipelineShape,
    /// Chunks in model order.
    pub chunks: Vec<Chunk>,
    /// Segments (gradient buckets) in model order, numbered globally.
    pub segments: Vec<Bucket>,
    /// The chunk of each segment.
    pub segment_chunk: Vec<usize>,
    /// The island of each actor (empty: one island).
    pub islands: Vec<usize>,
}

impl Layout {
    /// The gradient all-reduce over dp group `group`: hierarchical when the group spans
    /// islands with the same number (≥ 2) of members in each, a flat ring otherwise.
    pub fn all_reduce(&self, group: &[ActorId]) -> (CollectiveKind, Vec<ActorId>) {
        let flat = (CollectiveKind::AllReduceSum, group.to_vec());
        if self.islands.is_empty() {
            return flat;
        }
        let mut by_island: Vec<(usize, Vec<ActorId>)> = Vec::new();
        for &a in group {
            let island = self.islands[a];
            match by_island.iter_mut().find(|(i, _)| *i == island) {
                Some((_, members)) => members.push(a),
                None => by_island.push((island, vec![a])),
            }
        }
        let size = by_island[0].1.len();
        if by_island.len() < 2 || size < 2 || by_island.iter().any(|(_, m)| m.len() != size) {
            return flat;
        }
        let ordered = by_island.into_iter().flat_map(|(_, m)| m).collect();
        (
            CollectiveKind::HierarchicalAllReduceSum { island_size: size },
            ordered,
        )
    }

    /// Cuts every chunk into buckets of about `bucket_bytes`.
    pub fn new(
        model: &ModelDesc,
        mesh: Mesh,
        shape: PipelineShape,
        chunks: Vec<Chunk>,
        bucket_bytes: u64,
    ) -> Layout {
        let mut segments = Vec::new();
        let mut segment_chunk = Vec::new();
        for (c, &(start, end)) in chunks.iter().enumerate() {
            let b = buckets_in(model, start..end, bucket_bytes, segments.len());
            segment_chunk.extend(std::iter::repeat_n(c, b.len()));
            segments.extend(b);
        }
        Layout {
            mesh,
            shape,
            chunks,
            segments,
            segment_chunk,
            islands: Vec::new(),
        }
    }

    /// The pipeline device (coordinate on `pp`) holding chunk `c`.
    pub fn device_of_chunk(&self, c: usize) -> usize {
        c % self.shape.pp
    }

    /// The pipeline device holding segment `k`.
    pub fn device_of_segment(&self, k: usize) -> usize {
        self.device_of_chunk(self.segment_chunk[k])
    }

    /// The actor of replica `r`, pipeline device `s`.
    pub fn actor(&self, r: usize, s: usize) -> usize {
        if self.shape.pp == 1 {
            self.mesh.rank(&[r])
        } else {
            self.mesh.rank(&[r, s])
        }
    }

    /// The chunks on pipeline device `s`, in model order.
    pub fn chunks_on(&self, s: usize) -> Vec<Chunk> {
        (0..self.chunks.len())
            .filter(|&c| self.device_of_chunk(c) == s)
            .map(|c| self.chunks[c])
            .collect()
    }

    /// Segments of chunk `c`, in model order.
    fn segments_of(&self, c: usize) -> Vec<&Bucket> {
        self.segments
            .iter()
            .zip(&self.segment_chunk)
            .filter(|(_, sc)| **sc == c)
            .map(|(b, _)| b)
            .collect()
    }
}

/// Name of segment `k`'s output for micro-batch `mb`.
pub fn act_name(k: usize, mb: usize) -> String {
    format!("act.{k}.{mb}")
}

/// Name of the gradient of segment `k`'s input for micro-batch `mb`.
pub fn dact_name(k: usize, mb: usize) -> String {
    format!("dact.{k}.{mb}")
}

/// The micro-batch of an activation or activation-gradient name ([`act_name`], [`dact_name`]).
pub fn microbatch_of(tensor: &str) -> Option<usize> {
    let mut parts = tensor.split('.');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("act" | "dact"), Some(_), Some(mb), None) => mb.parse().ok(),
        _ => None,
    }
}

/// Builds the graph of one training step with the given per-device pass orders.
///
/// ZeRO (`zero` in force, Rajbhandari et al., SC 2020) over each stage's `dp` group: stage 1 keeps the
/// all-reduce and has each replica update only its shard of every bucket, then all-gathers the
/// updated parameters (`param.K`) and loads them; stage 2 reduce-scatters the gradients instead,
/// so each replica keeps only its gradient shard. Stage 3 keeps the parameters as shards too: each
/// forward and backward of a segment is preceded by an all-gather of its parameters (started one
/// segment ahead) and followed by their drop; it runs with activation checkpointing (burn's graph
/// would otherwise keep the gathered weights alive until the backward).
///
/// Offload (ZeRO-Offload, Ren et al., USENIX ATC 2021): each finished gradient bucket is handed
/// to the actor's offload actor (`OffloadGrads`) one segment after its reduction starts, so the
/// reduction still overlaps the next segment's backward and the host's optimizer update overlaps
/// the rest of it; the step's `OptimizerStep` only collects the updated parameters.
///
/// The step ends with every actor's optimizer update ([`super::optimizer::append_updates`]),
/// preceded by the reductions `norms` asks for (clipping's global norm, LAMB's parameter norms).
pub fn build_step(
    layout: &Layout,
    batch: usize,
    orders: &[Vec<Slot>],
    zero: ZeroStage,
    offload: bool,
    norms: StepNorms,
) -> Graph {
    let PipelineShape { pp, m, .. } = layout.shape;
    let dp = layout.mesh.axis_size("dp");
    let mut graph = Graph::new(layout.mesh.size());
    for b in &layout.segments {
        graph.tensor_bytes.insert(grad_name(b.id), b.bytes);
    }
    let per_replica = batch / dp;
    let per_mb = per_replica / m;
    let last_chunk = layout.chunks.len() - 1;
    let last_segment = layout.segments.len() - 1;
    let splits_backward = orders.iter().flatten().any(|s| s.pass == Pass::W);
    // Batches: the first chunk's device feeds the inputs, the last chunk's device the targets.
    for s in 0..pp {
        if s != layout.device_of_chunk(0) && s != layout.device_of_chunk(last_chunk) {
            continue;
        }
        for r in 0..dp {
            for mb in 0..m {
                let start = r * per_replica + mb * per_mb;
                let op = ComputeOp::LoadBatch {
                    start,
                    end: start + per_mb,
                };
                graph.compute(layout.actor(r, s), op, &[], &[&format!("batch.{mb}")]);
            }
        }
    }
    for (s, order) in orders.iter().enumerate() {
        // The slot after which each chunk's gradients are complete on this device.
        let mut last_grad_slot: HashMap<usize, usize> = HashMap::new();
        for (i, slot) in order.iter().enumerate() {
            if slot.pass == Pass::W || (slot.pass == Pass::B && !splits_backward) {
                last_grad_slot.insert(slot.chunk, i);
            }
        }
        for (i, slot) in order.iter().enumerate() {
            let mut segments = layout.segments_of(slot.chunk);
            if slot.pass != Pass::F {
                segments.reverse();
            }
            let finishes_grads = last_grad_slot.get(&slot.chunk) == Some(&i);
            let mb = slot.mb;
            // ZeRO-3: a segment's parameters exist only between its all-gather and its drop; the
            // next segment's all-gather is started before this one computes (prefetch).
            let gathers = zero.shards_parameters() && slot.pass != Pass::W;
            let group = layout.mesh.group(layout.actor(0, s), "dp");
            let gather_name = |b: &Bucket| format!("wparam.{}.{:?}{mb}", b.id, slot.pass);
            let gather = |graph: &mut Graph, b: &Bucket| {
                let name = gather_name(b);
                let op = ComputeOp::ShardParams {
                    start: b.start,
                    end: b.end,
                };
                for r in 0..dp {
                    graph.compute(layout.actor(r, s), op.clone(), &[], &[&name]);
                }
                graph.collective(CollectiveKind::AllGather, group.clone(), &name);
            };
            if gathers && let Some(first) = segments.first() {
                gather(&mut graph, first);
            }
            for (index, b) in segments.iter().enumerate() {
                if gathers {
                    if let Some(next) = segments.get(index + 1) {
                        gather(&mut graph, next);
                    }
                    let load = ComputeOp::LoadParams {
                        start: b.start,
                        end: b.end,
                    };
                    for r in 0..dp {
                        graph.compute(layout.actor(r, s), load.clone(), &[&gather_name(b)], &[]);
                    }
                }
                for r in 0..dp {
                    let actor = layout.actor(r, s);
                    match slot.pass {
                        Pass::F => forward(&mut graph, layout, b, mb, r, s, last_segment),
                        Pass::B => backward(&mut graph, layout, b, mb, r, s, last_segment, splits_backward),
                        Pass::W => {
                            let op = ComputeOp::BackwardWeight {
                                start: b.start,
                                end: b.end,
                                mb,
                            };
                            graph.compute(actor, op, &[], &[&grad_name(b.id)]);
                        }
                    }
                }
                if gathers {
                    let drop = ComputeOp::DropParams {
                        start: b.start,
                        end: b.end,
                    };
                    for r in 0..dp {
                        graph.compute(layout.actor(r, s), drop.clone(), &[], &[]);
                    }
                }
                if finishes_grads && dp > 1 {
                    let (kind, members) = if zero.shards_gradients() {
                        (CollectiveKind::ReduceScatterSum, group.clone())
                    } else {
                        layout.all_reduce(&group)
                    };
                    graph.collective(kind, members, &grad_name(b.id));
                }
                if finishes_grads && offload && index > 0 {
                    hand_off(&mut graph, layout, segments[index - 1], s);
                }
            }
            if finishes_grads
                && offload
                && let Some(last) = segments.last()
            {
                hand_off(&mut graph, layout, last, s);
            }
        }
    }
    super::optimizer::append_updates(&mut graph, layout, zero, offload, norms);
    graph
}

/// Offload: every replica of pipeline device `s` hands segment `b`'s gradients to its host.
fn hand_off(graph: &mut Graph, layout: &Layout, b: &Bucket, s: usize) {
    let op = ComputeOp::OffloadGrads {
        start: b.start,
        end: b.end,
    };
    for r in 0..layout.mesh.axis_size("dp") {
        graph.compute(layout.actor(r, s), op.clone(), &[&grad_name(b.id)], &[]);
    }
}

fn forward(graph: &mut Graph, layout: &Layout, b: &Bucket, mb: usize, r: usize, s: usize, last: usize) {
    let actor = layout.actor(r, s);
    let input = if b.id == 0 {
        format!("batch.{mb}")
    } else {
        act_name(b.id - 1, mb)
    };
    let output = act_name(b.id, mb);
    let op = ComputeOp::Forward {
        start: b.start,
        end: b.end,
        mb,
    };
    graph.compute(actor, op, &[&input], &[&output]);
    if b.id == last {
        let batch = format!("batch.{mb}");
        let loss = format!("loss.{mb}");
        graph.compute(actor, ComputeOp::Loss { mb }, &[&output, &batch], &[&loss]);
    } else if layout.device_of_segment(b.id + 1) != s {
        let to = layout.actor(r, layout.device_of_segment(b.id + 1));
        graph.transfer(actor, &output, to, &output);
    }
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
    let actor = layout.actor(r, s);
    let upstream = if b.id == last {
        format!("loss.{mb}")
    } else {
        dact_name(b.id + 1, mb)
    };
    let dact = dact_name(b.id, mb);
    let grad = grad_name(b.id);
    let (start, end) = (b.start, b.end);
    let (op, mut outputs) = if splits_backward {
        (ComputeOp::BackwardInput { start, end, mb }, vec![])
    } else {
        (ComputeOp::Backward { start, end, mb }, vec![grad.as_str()])
    };
    if b.id > 0 {
        outputs.push(dact.as_str());
    }
    graph.compute(actor, op, &[&upstream], &outputs);
    if b.id > 0 && layout.device_of_segment(b.id - 1) != s {
        let to = layout.actor(r, layout.device_of_segment(b.id - 1));
        graph.transfer(actor, &dact, to, &dact);
    }
}
