//! Tensor parallelism's gradient pass (Megatron-LM, Shoeybi et al. 2019): a parameter every rank
//! holds whole (a LayerNorm, a bias or the positions only the first rank adds) gets a summand of
//! its gradient on each rank, so after a bucket's last backward each tp group all-reduces the
//! bucket's replicated gradients and writes the sum back, before the bucket's data-parallel
//! reduction. (f and g, the all-reduces of activations, are edges of the pipeline pass.)

use crate::graph::{Graph, NodeOp};
use crate::instruction::{CollectiveKind, ComputeOp};
use crate::passes::layout::Layout;
use crate::passes::runs::insert_before;
use crate::tensor_id::TensorId;

/// The last writer of every bucket names its replicated gradients as an output (the trainer
/// copies them out); after it, on each replica's tp group: the all-reduce of its
/// replicated gradients ([`TensorId::TpGrads`]) and, on every rank, the write back
/// ([`ComputeOp::ReplicatedGrads`]). Nothing without tensor parallelism, nor for a bucket with
/// no trainable replicated parameter.
pub fn reduce_replicated_grads(graph: &mut Graph, layout: &Layout) {
    if layout.tp() == 1 {
        return;
    }
    let dp = layout.mesh.axis_size("dp");
    let last = super::data_parallel::last_grad_writers(graph, layout);
    // The bucket's last writer copies the replicated gradients out (earlier micro-batches'
    // backwards add into the bucket, so the all-reduce reads the sum once).
    for run in last.values().filter(|run| layout.segment_replicated[run.segment]) {
        let (bucket, shared) = (
            TensorId::GradBucket { segment: run.segment },
            TensorId::TpGrads { segment: run.segment },
        );
        for node in &mut graph.nodes[run.first..=run.last] {
            if let NodeOp::Compute { outputs, .. } = node
                && outputs.contains(&bucket)
            {
                outputs.push(shared.clone());
            }
        }
    }
    let mut inserts = Vec::new();
    for run in last.values() {
        if !layout.segment_replicated[run.segment] {
            continue;
        }
        let b = &layout.segments[run.segment];
        let tensor = TensorId::TpGrads { segment: b.id };
        let write_back = ComputeOp::ReplicatedGrads {
            start: b.start,
            end: b.end,
        };
        for r in 0..dp {
            let group = layout.tp_group(r, run.device);
            let reduce = NodeOp::Collective {
                kind: CollectiveKind::AllReduceSum,
                group: group.clone(),
                tensor: tensor.clone(),
                dtype: crate::DType::F32,
                codec: crate::Codec::None,
            };
            inserts.push((run.last + 1, reduce));
            for actor in group {
                let node = NodeOp::Compute {
                    actor,
                    op: write_back.clone(),
                    inputs: vec![tensor.clone()],
                    outputs: vec![TensorId::GradBucket { segment: b.id }],
                };
                inserts.push((run.last + 1, node));
            }
        }
    }
    insert_before(graph, inserts);
}
