//! The offload pass (ZeRO-Offload, Ren et al., USENIX ATC 2021): gradients go to the host as soon
//! as they are reduced, and the host's optimizer update overlaps the rest of the backward.
//!
//! Each finished gradient bucket is handed to the actor's offload actor (`OffloadGrads`) one
//! bucket after its reduction is started: the hand-off of bucket `k` waits for its reduction,
//! so placing it after the next bucket's reduction keeps that reduction overlapping the
//! backward; the slot's last bucket is handed off at the end of its slot. The step's
//! `OptimizerStep` no longer reads the buckets: it only collects the updated parameters.
//! With clipping, `GradNorm` reads no bucket either: the runtime summed each bucket's squares
//! when it staged it, and the offloaded update waits for the reduced norm (deferred). LAMB is
//! refused with offload ([`super::optimizer::check`]).

use std::collections::BTreeMap;

use crate::graph::{Graph, NodeOp};
use crate::instruction::{ComputeOp, UpdateScope};
use crate::passes::layout::Layout;
use crate::passes::runs::{insert_before, segment_runs};
use crate::tensor_id::TensorId;

/// Rewrites `graph` so that every bucket is handed to the host after its reduction.
pub fn apply(graph: &mut Graph, layout: &Layout) {
    // Each bucket's last writer, and the node after which it is complete: the last that writes
    // or reduces it (a backward, tp's replicated sum, a tie's add, the data-parallel reduction).
    let mut last_writer = BTreeMap::new();
    for run in segment_runs(graph, layout).into_iter().filter(|r| r.writes_grads) {
        last_writer.insert(run.segment, run);
    }
    let complete = |segment: usize| {
        let grad = TensorId::GradBucket { segment };
        let reduced = graph.nodes.iter().rposition(|n| match n {
            NodeOp::Collective { tensor, .. } => *tensor == grad,
            NodeOp::Compute { outputs, .. } => outputs.contains(&grad),
            NodeOp::Transfer { .. } => false,
        });
        reduced.unwrap_or(last_writer[&segment].last)
    };
    // Buckets finished by the same slot (device, chunk, micro-batch), in completion order.
    let mut slots: BTreeMap<(usize, usize, usize), Vec<(usize, usize)>> = BTreeMap::new();
    for run in last_writer.values() {
        let slot = (run.device, layout.segment_chunk[run.segment], run.mb);
        slots
            .entry(slot)
            .or_default()
            .push((complete(run.segment), run.segment));
    }
    let mut inserts = Vec::new();
    for finished in slots.values_mut() {
        finished.sort();
        for pair in finished.windows(2) {
            inserts.extend(hand_off(layout, pair[0].1, pair[1].0 + 1));
        }
        if let Some(&(done, segment)) = finished.last() {
            inserts.extend(hand_off(layout, segment, done + 1));
        }
    }
    insert_before(graph, inserts);
    for node in &mut graph.nodes {
        if let NodeOp::Compute { op, inputs, .. } = node
            && matches!(
                op,
                ComputeOp::OptimizerStep { .. } | ComputeOp::TrustNorms { .. } | ComputeOp::GradNorm { .. }
            )
        {
            inputs.retain(|t| !matches!(t, TensorId::GradBucket { .. }));
            if let ComputeOp::OptimizerStep { scope, .. } = op {
                *scope = UpdateScope::CollectOffloaded;
            }
        }
    }
}

/// Every replica of the bucket's device hands `segment`'s gradients to its host, at `at`.
fn hand_off(layout: &Layout, segment: usize, at: usize) -> Vec<(usize, NodeOp)> {
    let b = &layout.segments[segment];
    let op = ComputeOp::OffloadGrads {
        start: b.start,
        end: b.end,
    };
    layout
        .stage_actors(layout.device_of_segment(segment))
        .into_iter()
        .map(|actor| {
            let node = NodeOp::Compute {
                actor,
                op: op.clone(),
                inputs: vec![TensorId::GradBucket { segment }],
                outputs: vec![],
            };
            (at, node)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::optimizer::{StepNorms, append_updates};
    use crate::passes::runs::tests::layout;
    use crate::passes::{data_parallel, pipeline};

    /// dp = 2 × pp = 2: every bucket is handed off once per replica, after its reduction and
    /// after the next bucket's reduction of the same slot (overlap), never after the update;
    /// the update reads no bucket.
    #[test]
    fn buckets_go_to_the_host_one_reduction_behind() {
        let (layout, orders) = layout(2, 2, 2);
        let mut graph = pipeline::build(&layout, 8, &orders);
        data_parallel::reduce_gradients(&mut graph, &layout);
        append_updates(&mut graph, &layout, StepNorms::default());
        apply(&mut graph, &layout);
        let position = |pred: &dyn Fn(&NodeOp) -> bool| graph.nodes.iter().position(pred).unwrap();
        let first_update = position(&|n| {
            matches!(
                n,
                NodeOp::Compute {
                    op: ComputeOp::OptimizerStep { .. },
                    ..
                }
            )
        });
        for b in &layout.segments {
            let grad = TensorId::GradBucket { segment: b.id };
            let reduced = position(&|n| matches!(n, NodeOp::Collective { tensor, .. } if *tensor == grad));
            let handed: Vec<usize> = graph
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| matches!(n, NodeOp::Compute { op: ComputeOp::OffloadGrads { .. }, inputs, .. } if inputs.contains(&grad)))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(handed.len(), 2, "one hand-off per replica of bucket {}", b.id);
            assert!(handed.iter().all(|&h| reduced < h && h < first_update));
            // The bucket reduced next on the same device (same chunk) is started before this
            // hand-off.
            let next_reduced = graph.nodes[reduced + 1..handed[0]]
                .iter()
                .any(|n| matches!(n, NodeOp::Collective { .. }));
            let last_of_chunk = layout
                .segments_of(layout.segment_chunk[b.id])
                .first()
                .map(|s| s.id)
                == Some(b.id);
            assert!(
                next_reduced || last_of_chunk,
                "bucket {} handed off without overlap",
                b.id
            );
        }
        for node in &graph.nodes {
            if let NodeOp::Compute {
                op: ComputeOp::OptimizerStep { .. },
                inputs,
                ..
            } = node
            {
                assert!(inputs.is_empty(), "{inputs:?}");
            }
        }
    }
}
