//! The ZeRO rewrite (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
//! Parameter Models", SC 2020) over each pipeline stage's `dp` group, on a step built by the
//! pipeline, data-parallel and optimizer passes.
//!
//! - Stage 1 keeps the all-reduce; each replica updates only its shard of every bucket (the
//!   runtime reads the shard from the actor's plan), and the update is followed by an all-gather
//!   of the updated parameters (`UpdatedParams`) and their load.
//! - Stage 2 also reduce-scatters the gradients instead of all-reducing them, so each replica
//!   keeps only its gradient shard.
//! - Stage 3 keeps the parameters as shards too: each forward and backward run of a segment is
//!   preceded by an all-gather of its parameters (started one segment ahead, as DeepSpeed's
//!   prefetch does) and their load, and followed by their drop; the update needs no gather.
//! - With hpZ (ZeRO++, Wang et al. 2023 §3.2: hierarchical partitioning) each forward's gathered
//!   parameters also leave this replica's island slice behind (`KeepSecondary`: a secondary copy
//!   sharded over the dp group's members on its island), and each backward gathers from those
//!   slices over the island's members only (`SecondaryShard`, then an all-gather inside the
//!   island): the backward's gathers never cross islands.

use crate::ZeroStage;
use crate::graph::{Graph, NodeOp};
use crate::instruction::{CollectiveKind, ComputeOp, UpdateScope};
use crate::passes::layout::Layout;
use crate::passes::runs::{Run, insert_before, segment_runs};
use crate::passes::schedule::Pass;
use crate::tensor_id::{GatherFor, TensorId};

/// Rewrites `graph` for ZeRO stage `zero` (nothing when replicated).
pub fn apply(graph: &mut Graph, layout: &Layout, zero: ZeroStage) {
    if zero.shards_gradients() {
        reduce_scatter_gradients(graph);
    }
    if zero.shards_parameters() {
        set_scope(graph, UpdateScope::ShardKept);
        gather_around_runs(graph, layout);
    } else if zero.shards_optimizer() {
        set_scope(graph, UpdateScope::ShardThenGather);
        gather_after_update(graph, layout);
    }
}

/// Every update that works on whole buckets now works on this replica's shard (an offloaded
/// update keeps its scope: the offload actor holds the shard).
fn set_scope(graph: &mut Graph, to: UpdateScope) {
    for node in &mut graph.nodes {
        if let NodeOp::Compute {
            op: ComputeOp::OptimizerStep { scope, .. },
            ..
        } = node
            && *scope == UpdateScope::Whole
        {
            *scope = to;
        }
    }
}

/// Stage ≥ 2: every gradient all-reduce becomes a reduce-scatter over the same group.
fn reduce_scatter_gradients(graph: &mut Graph) {
    for node in &mut graph.nodes {
        if let NodeOp::Collective { kind, tensor, .. } = node
            && matches!(tensor, TensorId::GradBucket { .. })
            && *kind == CollectiveKind::AllReduceSum
        {
            *kind = CollectiveKind::ReduceScatterSum;
        }
    }
}

/// The same op on every replica of pipeline device `s`.
fn on_replicas(
    layout: &Layout,
    s: usize,
    op: ComputeOp,
    inputs: &[TensorId],
    outputs: &[TensorId],
) -> Vec<NodeOp> {
    layout
        .stage_actors(s)
        .into_iter()
        .map(|actor| NodeOp::Compute {
            actor,
            op: op.clone(),
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
        })
        .collect()
}

/// Stage 1/2: each device's update writes its shards of the updated parameters; they are
/// all-gathered (one collective per bucket) and loaded on every replica after the update.
fn gather_after_update(graph: &mut Graph, layout: &Layout) {
    let mut inserts = Vec::new();
    for s in 0..layout.shape.pp {
        let actors = layout.stage_actors(s);
        let buckets: Vec<_> = layout
            .segments
            .iter()
            .filter(|b| layout.device_of_segment(b.id) == s)
            .collect();
        let params: Vec<TensorId> = buckets
            .iter()
            .map(|b| TensorId::UpdatedParams { segment: b.id })
            .collect();
        let mut last_update = None;
        for (i, node) in graph.nodes.iter_mut().enumerate() {
            if let NodeOp::Compute {
                actor,
                op: ComputeOp::OptimizerStep { .. },
                outputs,
                ..
            } = node
                && actors.contains(actor)
            {
                outputs.clone_from(&params);
                last_update = Some(i);
            }
        }
        let Some(at) = last_update.map(|i| i + 1) else {
            continue;
        };
        for tensor in &params {
            for group in layout.dp_groups(s) {
                let gather = NodeOp::Collective {
                    kind: CollectiveKind::AllGather,
                    group,
                    tensor: tensor.clone(),
                    dtype: crate::DType::F32,
                    codec: crate::Codec::None,
                };
                inserts.push((at, gather));
            }
        }
        for (b, tensor) in buckets.iter().zip(&params) {
            let load = ComputeOp::LoadParams {
                start: b.start,
                end: b.end,
            };
            let loads = on_replicas(layout, s, load, std::slice::from_ref(tensor), &[]);
            inserts.extend(loads.into_iter().map(|n| (at, n)));
        }
    }
    insert_before(graph, inserts);
}

/// The tensor the all-gather of `run`'s parameters fills.
fn gathered(run: &Run) -> TensorId {
    TensorId::GatheredParams {
        segment: run.segment,
        pass: if run.pass == Pass::F {
            GatherFor::Forward
        } else {
            GatherFor::Backward
        },
        mb: run.mb,
    }
}

/// Stage 3: around every forward and backward run (weight-gradient runs reuse what the backward
/// kept), the parameters are gathered one run ahead within the slot, loaded before and dropped
/// after.
fn gather_around_runs(graph: &mut Graph, layout: &Layout) {
    let runs: Vec<Run> = segment_runs(graph, layout)
        .into_iter()
        .filter(|r| r.pass != Pass::W)
        .collect();
    // A slot: consecutive runs of one device, pass, micro-batch and chunk.
    let slot_of = |r: &Run| (r.device, r.pass, r.mb, layout.segment_chunk[r.segment]);
    let mut inserts = Vec::new();
    for (i, run) in runs.iter().enumerate() {
        let b = &layout.segments[run.segment];
        let gather = |run: &Run| {
            let tensor = gathered(run);
            let b = &layout.segments[run.segment];
            let (start, end) = (b.start, b.end);
            let from_secondary = layout.hpz && run.pass != Pass::F;
            let (shard, groups) = if from_secondary {
                let groups = (layout.dp_groups(run.device).iter())
                    .flat_map(|g| layout.island_subgroups(g))
                    .collect();
                (ComputeOp::SecondaryShard { start, end }, groups)
            } else {
                (
                    ComputeOp::ShardParams { start, end },
                    layout.dp_groups(run.device),
                )
            };
            let mut nodes = on_replicas(layout, run.device, shard, &[], std::slice::from_ref(&tensor));
            for group in groups {
                nodes.push(NodeOp::Collective {
                    kind: CollectiveKind::AllGather,
                    group,
                    tensor: tensor.clone(),
                    dtype: crate::DType::F32,
                    codec: crate::Codec::None,
                });
            }
            nodes
        };
        let starts_slot = i == 0 || slot_of(&runs[i - 1]) != slot_of(run);
        let mut before = if starts_slot { gather(run) } else { Vec::new() };
        if let Some(next) = runs.get(i + 1).filter(|n| slot_of(n) == slot_of(run)) {
            before.extend(gather(next));
        }
        if layout.hpz && run.pass == Pass::F {
            let keep = ComputeOp::KeepSecondary {
                start: b.start,
                end: b.end,
            };
            before.extend(on_replicas(layout, run.device, keep, &[gathered(run)], &[]));
        }
        let load = ComputeOp::LoadParams {
            start: b.start,
            end: b.end,
        };
        before.extend(on_replicas(layout, run.device, load, &[gathered(run)], &[]));
        inserts.extend(before.into_iter().map(|n| (run.first, n)));
        let drop = ComputeOp::DropParams {
            start: b.start,
            end: b.end,
        };
        let after = on_replicas(layout, run.device, drop, &[], &[]);
        inserts.extend(after.into_iter().map(|n| (run.last + 1, n)));
    }
    insert_before(graph, inserts);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::optimizer::{StepNorms, append_updates};
    use crate::passes::runs::tests::layout;
    use crate::passes::{data_parallel, pipeline};

    fn step(zero: ZeroStage) -> (Layout, Graph) {
        let (layout, orders) = layout(2, 2, 2);
        let mut graph = pipeline::build(&layout, 8, &orders);
        data_parallel::reduce_gradients(&mut graph, &layout);
        append_updates(&mut graph, &layout, StepNorms::default());
        apply(&mut graph, &layout, zero);
        (layout, graph)
    }

    fn collectives(graph: &Graph) -> Vec<(CollectiveKind, &TensorId)> {
        graph
            .nodes
            .iter()
            .filter_map(|n| match n {
                NodeOp::Collective { kind, tensor, .. } => Some((*kind, tensor)),
                _ => None,
            })
            .collect()
    }

    /// Off: nothing changes. Stage 1: all-reduces stay, one all-gather and one load per replica
    /// per bucket follow the update. Stage 2: the same with reduce-scatters.
    #[test]
    fn stages_one_and_two_gather_the_updated_shards_after_the_update() {
        let (layout, off) = step(ZeroStage::Replicated);
        let (_, one) = step(ZeroStage::ShardedOptimizer);
        let (_, two) = step(ZeroStage::ShardedGradients);
        let n = layout.segments.len();
        let count = |g: &Graph, k: CollectiveKind| collectives(g).iter().filter(|(c, _)| *c == k).count();
        assert_eq!(count(&off, CollectiveKind::AllReduceSum), n);
        assert_eq!(count(&off, CollectiveKind::AllGather), 0);
        assert_eq!(count(&one, CollectiveKind::AllReduceSum), n);
        assert_eq!(count(&one, CollectiveKind::AllGather), n);
        assert_eq!(count(&two, CollectiveKind::AllReduceSum), 0);
        assert_eq!(count(&two, CollectiveKind::ReduceScatterSum), n);
        let scopes = |g: &Graph| -> Vec<UpdateScope> {
            g.nodes
                .iter()
                .filter_map(|n| match n {
                    NodeOp::Compute {
                        op: ComputeOp::OptimizerStep { scope, .. },
                        ..
                    } => Some(*scope),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(scopes(&off), [UpdateScope::Whole; 4]);
        assert_eq!(scopes(&one), [UpdateScope::ShardThenGather; 4]);
        assert_eq!(scopes(&two), [UpdateScope::ShardThenGather; 4]);
        assert_eq!(
            scopes(&step(ZeroStage::ShardedParameters).1),
            [UpdateScope::ShardKept; 4]
        );
        for g in [&one, &two] {
            for (i, node) in g.nodes.iter().enumerate() {
                let NodeOp::Collective {
                    kind: CollectiveKind::AllGather,
                    tensor,
                    ..
                } = node
                else {
                    continue;
                };
                let TensorId::UpdatedParams { segment } = tensor else {
                    panic!("{tensor}")
                };
                let update = g.nodes[..i].iter().any(|n| matches!(n, NodeOp::Compute { op: ComputeOp::OptimizerStep { .. }, outputs, .. } if outputs.contains(tensor)));
                assert!(
                    update,
                    "segment {segment}: the all-gather follows the update writing it"
                );
                let loads = g.nodes[i..]
                    .iter()
                    .filter(|n| matches!(n, NodeOp::Compute { op: ComputeOp::LoadParams { .. }, inputs, .. } if inputs.contains(tensor)))
                    .count();
                assert_eq!(loads, 2, "one load per replica");
            }
        }
    }

    /// Stage 3: every forward and backward compute of a segment runs between a load of that
    /// segment's gathered parameters and their drop on the same actor, and each gather is
    /// started before the load of the run before it (prefetch one ahead); the update gathers
    /// nothing. Negative control: stage 2's graph fails the same check.
    #[test]
    fn stage_three_computes_only_between_load_and_drop() {
        let check = |layout: &Layout, g: &Graph| -> Result<(), String> {
            let mut loaded: std::collections::HashSet<(usize, usize)> = Default::default();
            for node in &g.nodes {
                let NodeOp::Compute { actor, op, .. } = node else {
                    continue;
                };
                match *op {
                    ComputeOp::LoadParams { start, .. } => {
                        loaded.insert((*actor, start));
                    }
                    ComputeOp::DropParams { start, .. } => {
                        loaded.remove(&(*actor, start));
                    }
                    ComputeOp::Forward { start, .. } | ComputeOp::Backward { start, .. }
                        if !loaded.contains(&(*actor, start)) =>
                    {
                        return Err(format!("{op} on actor {actor} without its parameters"));
                    }
                    _ => {}
                }
            }
            assert!(loaded.is_empty() || layout.segments.is_empty());
            Ok(())
        };
        let (layout, three) = step(ZeroStage::ShardedParameters);
        check(&layout, &three).unwrap();
        let (_, two) = step(ZeroStage::ShardedGradients);
        assert!(
            check(&layout, &two).is_err(),
            "the check must catch missing gathers"
        );
        // Prefetch: in a slot of several runs, the second run's gather starts before the first
        // run's compute.
        let gathers: Vec<usize> = three
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| {
                matches!(
                    n,
                    NodeOp::Collective {
                        kind: CollectiveKind::AllGather,
                        ..
                    }
                )
            })
            .map(|(i, _)| i)
            .collect();
        let second_gather = gathers[1];
        let first_compute = three
            .nodes
            .iter()
            .position(|n| {
                matches!(
                    n,
                    NodeOp::Compute {
                        op: ComputeOp::Forward { .. },
                        ..
                    }
                )
            })
            .unwrap();
        assert!(
            second_gather < first_compute,
            "the next segment's gather is started ahead"
        );
        assert!(!three.nodes.iter().any(|n| matches!(
            n,
            NodeOp::Collective {
                tensor: TensorId::UpdatedParams { .. },
                ..
            }
        )));
    }
}
