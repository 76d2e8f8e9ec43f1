//! Lowering: split a dataflow graph into one instruction stream per actor (MPMD).
//!
//! Node order is kept per actor. A transfer becomes a `Send` on the sender and a `Recv` on the
//! receiver; a collective becomes a `StartCollective` on every member, and its `WaitCollective` is
//! placed as late as possible: right before the first instruction that reads the tensor (or at the
//! end of the stream), so communication overlaps whatever compute comes in between.

use std::collections::BTreeMap;

use crate::graph::{Graph, NodeOp};
use crate::instruction::Instruction;

/// Lowers `graph` to one instruction list per actor. Tags are node indices, unique in the graph.
pub fn lower(graph: &Graph) -> Vec<Vec<Instruction>> {
    let mut streams: Vec<Vec<Instruction>> = vec![Vec::new(); graph.actors];
    // Per actor: started collectives not yet waited for, tensor → tag.
    let mut pending: Vec<BTreeMap<String, u64>> = vec![BTreeMap::new(); graph.actors];
    let mut emit = |actor: usize, instruction: Instruction, pending: &mut Vec<BTreeMap<String, u64>>| {
        for read in instruction.reads() {
            if let Some(tag) = pending[actor].remove(read) {
                streams[actor].push(Instruction::WaitCollective {
                    tensor: read.to_string(),
                    tag,
                });
            }
        }
        streams[actor].push(instruction);
    };
    for (index, node) in graph.nodes.iter().enumerate() {
        let tag = index as u64;
        match node {
            NodeOp::Compute {
                actor,
                op,
                inputs,
                outputs,
            } => {
                let instruction = Instruction::Compute {
                    op: op.clone(),
                    inputs: inputs.clone(),
                    outputs: outputs.clone(),
                };
                emit(*actor, instruction, &mut pending);
            }
            NodeOp::Transfer {
                from,
                to,
                tensor,
                as_name,
            } => {
                emit(
                    *from,
                    Instruction::Send {
                        tensor: tensor.clone(),
                        to: *to,
                        tag,
                    },
                    &mut pending,
                );
                emit(
                    *to,
                    Instruction::Recv {
                        tensor: as_name.clone(),
                        from: *from,
                        tag,
                    },
                    &mut pending,
                );
            }
            NodeOp::Collective { kind, group, tensor } => {
                for &member in group {
                    let start = Instruction::StartCollective {
                        kind: *kind,
                        tensor: tensor.clone(),
                        group: group.clone(),
                        tag,
                    };
                    emit(member, start, &mut pending);
                    pending[member].insert(tensor.clone(), tag);
                }
            }
        }
    }
    for (actor, waits) in pending.into_iter().enumerate() {
        let mut waits: Vec<(String, u64)> = waits.into_iter().collect();
        waits.sort_by_key(|(_, tag)| *tag);
        for (tensor, tag) in waits {
            streams[actor].push(Instruction::WaitCollective { tensor, tag });
        }
    }
    streams
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instruction::{CollectiveKind, ComputeOp};

    #[test]
    fn waits_are_placed_before_the_first_reader() {
        let mut g = Graph::new(2);
        let user = |name: &str| ComputeOp::User { name: name.into() };
        for a in 0..2 {
            g.compute(a, user("make"), &[], &["x"]);
        }
        g.collective(CollectiveKind::AllReduceSum, vec![0, 1], "x");
        for a in 0..2 {
            g.compute(a, user("other"), &[], &["y"]);
            g.compute(a, user("use"), &["x"], &[]);
        }
        g.transfer(0, "y", 1, "y0");
        let s = lower(&g);
        assert!(matches!(s[0][1], Instruction::StartCollective { .. }));
        assert!(matches!(s[0][2], Instruction::Compute { .. }));
        assert!(matches!(s[0][3], Instruction::WaitCollective { tag: 2, .. }));
        assert!(matches!(s[0][5], Instruction::Send { to: 1, .. }));
        assert!(matches!(s[1][5], Instruction::Recv { from: 0, .. }));
    }
}
