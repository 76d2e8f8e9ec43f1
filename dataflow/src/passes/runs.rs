//! Segment runs: where in a step's graph each segment's pass for one micro-batch sits.
//!
//! The pipeline pass ([`super::pipeline`]) emits a segment's forward (or backward, or weight
//! gradient) for one micro-batch as one contiguous run of nodes: the compute on every replica,
//! each followed by its loss or by its send to the next stage. The rewriting passes insert around
//! runs — ZeRO-3's gather before and drop after, the gradient reduction after a bucket's last
//! writer, offload's hand-off after its reduction — so they find them here, from the typed ids
//! and ops of the nodes, never from names.

use crate::graph::{Graph, NodeOp};
use crate::instruction::ComputeOp;
use crate::passes::layout::Layout;
use crate::passes::schedule::Pass;
use crate::tensor_id::TensorId;

/// One segment's pass for one micro-batch on one pipeline device: nodes `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Index of its first node.
    pub first: usize,
    /// Index of its last node.
    pub last: usize,
    /// Pipeline device.
    pub device: usize,
    /// Segment.
    pub segment: usize,
    /// Micro-batch.
    pub mb: usize,
    /// Which pass.
    pub pass: Pass,
    /// True when its computes write the segment's gradient bucket.
    pub writes_grads: bool,
}

/// The pass and micro-batch of a segment compute.
fn pass_of(op: &ComputeOp) -> Option<(Pass, usize, usize, usize)> {
    match *op {
        ComputeOp::Forward { start, end, mb } => Some((Pass::F, start, end, mb)),
        ComputeOp::Backward { start, end, mb } | ComputeOp::BackwardInput { start, end, mb } => {
            Some((Pass::B, start, end, mb))
        }
        ComputeOp::BackwardWeight { start, end, mb } => Some((Pass::W, start, end, mb)),
        _ => None,
    }
}

/// True when `node` belongs to the run of `segment`'s `op` for micro-batch `mb`: the same op on
/// another replica or tensor-parallel rank, a loss of that micro-batch, the send of the segment's
/// output or input gradient, a tensor-parallel all-reduce of either (Megatron's g and f), the
/// vocabulary-parallel loss's statistics, the tp group's sum of its replicated gradients, or a
/// gather of a partitioned checkpoint of the micro-batch (ZeRO-R's, which run one segment
/// ahead of their backward; the first replica's come before the run).
fn belongs(node: &NodeOp, op: &ComputeOp, segment: usize, mb: usize) -> bool {
    match node {
        NodeOp::Compute { op: other, .. } => {
            let blocks = pass_of(op).map(|(_, start, end, _)| (start, end));
            other == op
                || matches!(other, ComputeOp::Loss { mb: m } | ComputeOp::LossMax { mb: m }
                    | ComputeOp::LossSums { mb: m } if *m == mb)
                || matches!(other, ComputeOp::ReplicatedGrads { start, end }
                    if Some((*start, *end)) == blocks)
        }
        NodeOp::Transfer { tensor, .. } => {
            *tensor == TensorId::Activation { segment, mb }
                || *tensor == TensorId::ActivationGrad { segment, mb }
                || *tensor == TensorId::Residual { segment, mb }
                || *tensor == TensorId::ResidualGrad { segment, mb }
        }
        NodeOp::Collective { tensor, .. } => {
            *tensor == TensorId::Activation { segment, mb }
                || *tensor == TensorId::ActivationGrad { segment, mb }
                || *tensor == TensorId::LossMax { mb }
                || *tensor == TensorId::LossSums { mb }
                || *tensor == TensorId::TpGrads { segment }
                || (matches!(tensor, TensorId::Checkpoint { mb: m, .. } if *m == mb)
                    && matches!(pass_of(op), Some((Pass::B, ..))))
        }
    }
}

/// Every run of `graph`, in graph order.
pub fn segment_runs(graph: &Graph, layout: &Layout) -> Vec<Run> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < graph.nodes.len() {
        let NodeOp::Compute {
            actor, op, outputs, ..
        } = &graph.nodes[i]
        else {
            i += 1;
            continue;
        };
        let Some((pass, start, end, mb)) = pass_of(op) else {
            i += 1;
            continue;
        };
        let segment = layout
            .segment_of_blocks(start, end)
            .expect("the pipeline pass computes whole segments");
        let writes_grads = outputs.contains(&TensorId::GradBucket { segment });
        let mut last = i;
        while last + 1 < graph.nodes.len() && belongs(&graph.nodes[last + 1], op, segment, mb) {
            last += 1;
        }
        runs.push(Run {
            first: i,
            last,
            device: layout.coords_of(*actor).1,
            segment,
            mb,
            pass,
            writes_grads,
        });
        i = last + 1;
    }
    runs
}

/// Inserts nodes into `graph`: each `(at, node)` goes before the node now at index `at`
/// (`at == len` appends); nodes with the same `at` keep their order in `inserts`. Nodes on no
/// built actor ([`Graph::built`]) are dropped.
pub fn insert_before(graph: &mut Graph, mut inserts: Vec<(usize, NodeOp)>) {
    inserts.retain(|(_, node)| graph.keeps(node));
    inserts.sort_by_key(|(at, _)| *at);
    let old = std::mem::take(&mut graph.nodes);
    let mut inserts = inserts.into_iter().peekable();
    let mut nodes = Vec::with_capacity(old.len() + inserts.len());
    for (index, node) in old.into_iter().enumerate() {
        while let Some((_, new)) = inserts.next_if(|(at, _)| *at <= index) {
            nodes.push(new);
        }
        nodes.push(node);
    }
    nodes.extend(inserts.map(|(_, new)| new));
    graph.nodes = nodes;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::passes::schedule::{self, PipelineShape, Schedule};
    use crate::{Mesh, ModelSpec};

    pub(crate) fn layout(
        dp: usize,
        pp: usize,
        m: usize,
    ) -> (Layout, Vec<Vec<crate::passes::schedule::Slot>>) {
        let model = ModelSpec::parse("mlp:in=8,hidden=16,layers=6,out=3")
            .unwrap()
            .desc();
        let mesh = if pp > 1 {
            Mesh::new(&[("dp", dp), ("pp", pp)]).unwrap()
        } else {
            Mesh::new(&[("dp", dp)]).unwrap()
        };
        let shape = PipelineShape { pp, v: 1, m };
        let chunks = crate::passes::partition::balanced(&model, pp);
        let layout = Layout::new(&model, mesh, shape, chunks, 600);
        let costs = crate::simulate::CostModel::default().pass_costs(&model, &layout.chunks, 1);
        let orders = schedule::orders(Schedule::OneFOneB, shape, &costs);
        (layout, orders)
    }

    /// Every segment has one forward and one backward run per micro-batch on its device, each
    /// run holds one compute per replica, and runs tile the step's compute exactly (batches are
    /// no run).
    #[test]
    fn runs_cover_each_segments_passes_once_per_microbatch() {
        let (layout, orders) = layout(2, 2, 3);
        let graph = super::super::pipeline::build(&layout, 12, &orders);
        let runs = segment_runs(&graph, &layout);
        assert!(layout.segments.len() > 2, "several segments per stage");
        assert_eq!(runs.len(), 2 * 3 * layout.segments.len());
        for run in &runs {
            let computes = graph.nodes[run.first..=run.last]
                .iter()
                .filter(|n| matches!(n, NodeOp::Compute { op, .. } if pass_of(op).is_some()))
                .count();
            assert_eq!(computes, 2, "{run:?}");
            assert_eq!(run.device, layout.device_of_segment(run.segment));
            assert_eq!(run.writes_grads, run.pass == Pass::B);
        }
        let in_runs: usize = runs.iter().map(|r| r.last - r.first + 1).sum();
        let batches = graph
            .nodes
            .iter()
            .filter(|n| {
                matches!(
                    n,
                    NodeOp::Compute {
                        op: ComputeOp::LoadBatch { .. },
                        ..
                    }
                )
            })
            .count();
        assert_eq!(in_runs + batches, graph.nodes.len());
    }

    #[test]
    fn inserts_go_before_their_index_in_order() {
        let mut g = Graph::new(1);
        let node = |name: &str| NodeOp::Compute {
            actor: 0,
            op: ComputeOp::User { name: name.into() },
            inputs: vec![],
            outputs: vec![],
        };
        g.nodes = vec![node("a"), node("b")];
        insert_before(
            &mut g,
            vec![(2, node("z")), (1, node("x")), (1, node("y")), (0, node("w"))],
        );
        let names: Vec<String> = g
            .nodes
            .iter()
            .map(|n| match n {
                NodeOp::Compute {
                    op: ComputeOp::User { name },
                    ..
                } => name.clone(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(names, ["w", "a", "x", "y", "b", "z"]);
    }
}
