//! The step's side of a tie ([`crate::ties`]; Press & Wolf 2017, GPT-2's head): the mirror's
//! gradient joins its target's before the target's bucket is reduced, and each step starts by
//! copying the target's values into the mirror. Megatron-LM keeps a copy of the word embeddings
//! on the last stage and all-reduces the two copies' gradients over its "embedding group"; here
//! the parameter is one (one optimizer state, one ZeRO shard, one checkpoint piece): the last
//! stage's summand travels to the first stage and the updated values travel back, the same bytes
//! a two-member all-reduce moves. Every replica and tensor-parallel rank carries its own tie
//! (rank `t` of the last stage holds the same vocabulary rows as rank `t` of the first).

use crate::graph::{Graph, NodeOp};
use crate::instruction::ComputeOp;
use crate::passes::layout::Layout;
use crate::passes::runs::insert_before;
use crate::tensor_id::TensorId;
use crate::ties::Tie;

/// The segment holding block `block`.
fn segment_of(layout: &Layout, block: usize) -> Option<usize> {
    (layout.segments.iter()).position(|s| (s.start..s.end).contains(&block))
}

/// Every (mirror's actor, target's actor) pair of the mesh, one per replica and rank.
fn actor_pairs(layout: &Layout, mirror_segment: usize, target_segment: usize) -> Vec<(usize, usize)> {
    let (m, t) = (
        layout.device_of_segment(mirror_segment),
        layout.device_of_segment(target_segment),
    );
    let dp = layout.mesh.axis_size("dp");
    (0..dp)
        .flat_map(|r| (0..layout.tp()).map(move |rank| (r, rank)))
        .map(|(r, rank)| (layout.actor_at(r, m, rank), layout.actor_at(r, t, rank)))
        .collect()
}

/// The mirror's last gradient writer names [`TensorId::TiedGrads`] as an output (the trainer
/// hands out the micro-batches' sum of the mirror's gradient there); it travels to the target's
/// actor (when another), where [`ComputeOp::AddTiedGrads`] adds it into the target's bucket
/// right after that bucket's last writer, ahead of its reduction. Run after
/// [`super::data_parallel::reduce_gradients`]: the add goes in before the reduction placed there.
pub fn sum_gradients(graph: &mut Graph, layout: &Layout, ties: &[Tie]) {
    let last = super::data_parallel::last_grad_writers(graph, layout);
    let mut inserts = Vec::new();
    for tie in ties {
        let block = tie.mirror.0;
        let (Some(ms), Some(ts)) = (segment_of(layout, block), segment_of(layout, tie.target.0)) else {
            continue;
        };
        let (Some(mirror_run), Some(target_run)) = (last.get(&ms), last.get(&ts)) else {
            continue;
        };
        let (bucket, tied) = (
            TensorId::GradBucket { segment: ms },
            TensorId::TiedGrads { block },
        );
        for node in &mut graph.nodes[mirror_run.first..=mirror_run.last] {
            if let NodeOp::Compute { outputs, .. } = node
                && outputs.contains(&bucket)
            {
                outputs.push(tied.clone());
            }
        }
        for (from, to) in actor_pairs(layout, ms, ts) {
            if from != to {
                let transfer = NodeOp::Transfer {
                    from,
                    to,
                    tensor: tied.clone(),
                    as_name: tied.clone(),
                };
                inserts.push((mirror_run.last + 1, transfer));
            }
            let add = NodeOp::Compute {
                actor: to,
                op: ComputeOp::AddTiedGrads { block },
                inputs: vec![tied.clone()],
                outputs: vec![TensorId::GradBucket { segment: ts }],
            };
            inserts.push((target_run.last + 1, add));
        }
    }
    insert_before(graph, inserts);
}

/// The index of `actor`'s first forward of `segment` in the step.
fn first_forward(graph: &Graph, layout: &Layout, actor: usize, segment: usize) -> Option<usize> {
    let s = &layout.segments[segment];
    graph.nodes.iter().position(|n| {
        matches!(n, NodeOp::Compute { actor: a, op: ComputeOp::Forward { start, end, .. }, .. }
            if *a == actor && *start == s.start && *end == s.end)
    })
}

/// Right before the target's first forward of the step (after whatever loaded its parameters:
/// ZeRO-3's gather, ZeRO-1/2's or offload's updated shards), [`ComputeOp::TiedValues`] reads the
/// target's values; they travel to the mirror's actor (when another) and
/// [`ComputeOp::LoadTied`] writes them into the mirror before its first forward. Run after
/// the ZeRO and offload passes, which place those loads.
pub fn share_values(graph: &mut Graph, layout: &Layout, ties: &[Tie]) {
    let mut inserts = Vec::new();
    for tie in ties {
        let block = tie.mirror.0;
        let (Some(ms), Some(ts)) = (segment_of(layout, block), segment_of(layout, tie.target.0)) else {
            continue;
        };
        let values = TensorId::TiedValues { block };
        for (mirror, target) in actor_pairs(layout, ms, ts) {
            let (Some(read_at), Some(load_at)) = (
                first_forward(graph, layout, target, ts),
                first_forward(graph, layout, mirror, ms),
            ) else {
                continue; // an actor this graph does not build
            };
            let read = NodeOp::Compute {
                actor: target,
                op: ComputeOp::TiedValues { block },
                inputs: Vec::new(),
                outputs: vec![values.clone()],
            };
            inserts.push((read_at, read));
            if mirror != target {
                let transfer = NodeOp::Transfer {
                    from: target,
                    to: mirror,
                    tensor: values.clone(),
                    as_name: values.clone(),
                };
                inserts.push((read_at, transfer));
            }
            let load = NodeOp::Compute {
                actor: mirror,
                op: ComputeOp::LoadTied { block },
                inputs: vec![values.clone()],
                outputs: Vec::new(),
            };
            inserts.push((load_at, load));
        }
    }
    insert_before(graph, inserts);
}

#[cfg(test)]
mod tests {
    use crate::instruction::{ComputeOp, Instruction};
    use crate::{ModelSpec, ParallelPlan, Program, TensorId, compile};

    const GPT2: &str = "gpt2:vocab=96,ctx=8,d=16,layers=2,heads=2";

    fn plan(spec: &str, dp: usize, pp: usize) -> crate::Plan {
        let program = Program::new(ModelSpec::parse(spec).unwrap()).with_plan(ParallelPlan {
            dp,
            pp,
            batch: 8,
            microbatches: pp,
            ..ParallelPlan::default()
        });
        compile(&program).unwrap()
    }

    /// What an actor's stream does with a tie, in order: its tie computes, and its sends and
    /// receives of the tie's tensors, and its gradient all-reduces.
    fn tie_steps(plan: &crate::Plan, actor: usize) -> Vec<String> {
        let tied = |t: &TensorId| matches!(t, TensorId::TiedGrads { .. } | TensorId::TiedValues { .. });
        (plan.stream(actor).instructions.iter())
            .filter_map(|i| match i {
                Instruction::Compute { op, outputs, .. } => match op {
                    ComputeOp::TiedValues { .. }
                    | ComputeOp::LoadTied { .. }
                    | ComputeOp::AddTiedGrads { .. } => Some(op.to_string()),
                    ComputeOp::Forward { mb: 0, .. } => Some("Forward".into()),
                    _ if outputs.iter().any(tied) => Some(format!("{op} → {}", outputs.last().unwrap())),
                    _ => None,
                },
                Instruction::Send { tensor, to, .. } if tied(tensor) => {
                    Some(format!("send {tensor} to {to}"))
                }
                Instruction::Recv { tensor, from, .. } if tied(tensor) => {
                    Some(format!("recv {tensor} from {from}"))
                }
                Instruction::StartCollective { tensor, .. }
                    if matches!(tensor, TensorId::GradBucket { .. }) =>
                {
                    Some(format!("reduce {tensor}"))
                }
                _ => None,
            })
            .collect()
    }

    /// At dp=2 × pp=2 the first stage reads the table before its first forward and sends it to
    /// the last stage, which loads it into the mirror before its own; the last stage's final
    /// backward hands out the mirror's gradient and sends it back, and the first stage adds it
    /// into the table's bucket before that bucket's all-reduce. Each side holds the two buffers
    /// in its estimate. A gpt2 whose table is frozen (LoRA's base) carries no tie.
    #[test]
    fn a_trained_tie_crosses_the_pipeline_both_ways() {
        let tied = plan(GPT2, 2, 2);
        let (first, last) = (tied.actors[0].actor, tied.actors[1].actor);
        let first_steps = tie_steps(&tied, first);
        let last_steps = tie_steps(&tied, last);
        let index = |steps: &[String], what: &str| {
            steps
                .iter()
                .position(|s| s.starts_with(what))
                .unwrap_or_else(|| panic!("`{what}` not in {steps:#?}"))
        };
        assert!(index(&first_steps, "TiedValues") < index(&first_steps, "Forward"));
        assert!(index(&first_steps, "send tiedval") < index(&first_steps, "Forward"));
        assert!(index(&last_steps, "LoadTied") < index(&last_steps, "Forward"));
        assert!(index(&last_steps, "recv tiedval") < index(&last_steps, "LoadTied"));
        assert!(index(&last_steps, "Backward") < index(&last_steps, "send tiedgrad"));
        let add = index(&first_steps, "AddTiedGrads");
        assert!(index(&first_steps, "recv tiedgrad") < add);
        assert!(add < index(&first_steps, "reduce grad.0"), "{first_steps:#?}");
        let mirror = 4 * 96 * 16;
        let frozen = plan(&format!("{GPT2}/lora:r=2,alpha=4,targets=c_attn"), 2, 2);
        for a in 0..2 {
            assert_eq!(
                tie_steps(&frozen, a)
                    .iter()
                    .filter(|s| s.contains("Tied"))
                    .count(),
                0
            );
            assert!(tied.memory[a].buffers >= 2 * mirror, "{:?}", tied.memory[a]);
        }
    }
}
