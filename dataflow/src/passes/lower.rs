//! Lowering: split a dataflow graph into one instruction stream per actor (MPMD).
//!
//! Node order is kept per actor. A transfer becomes a `Send` on the sender, placed where the node
//! is, and a `Recv` on the receiver, placed right before the receiver's first instruction that
//! reads the tensor (sends are eager, so the data is usually waiting by then). A collective
//! becomes a `StartCollective` on every member, and its `WaitCollective` is likewise placed right
//! before the first reader (or at the end of the stream), so communication overlaps whatever
//! compute comes in between. A graph that builds some actors only ([`Graph::built`]) lowers to
//! their streams (the others' are empty).

use std::collections::{BTreeMap, VecDeque};

use crate::graph::{Graph, NodeOp};
use crate::instruction::Instruction;
use crate::tensor_id::TensorId;

/// Lowers `graph` to one instruction list per actor. Tags are node indices, unique in the graph.
pub fn lower(graph: &Graph) -> Vec<Vec<Instruction>> {
    let mut streams: Vec<Vec<Instruction>> = vec![Vec::new(); graph.actors];
    // Per actor: receives not yet placed (known up front, so a receive may be placed before its
    // send's node comes in graph order), and started collectives not yet waited for.
    let mut recvs: Vec<BTreeMap<TensorId, VecDeque<Instruction>>> = vec![BTreeMap::new(); graph.actors];
    for (index, node) in graph.nodes.iter().enumerate() {
        if let NodeOp::Transfer {
            from, to, as_name, ..
        } = node
            && graph.builds(*to)
        {
            recvs[*to]
                .entry(as_name.clone())
                .or_default()
                .push_back(Instruction::Recv {
                    tensor: as_name.clone(),
                    from: *from,
                    tag: index as u64,
                });
        }
    }
    let mut pending: Vec<BTreeMap<TensorId, Instruction>> = vec![BTreeMap::new(); graph.actors];
    let mut emit =
        |actor: usize, instruction: Instruction, pending: &mut Vec<BTreeMap<TensorId, Instruction>>| {
            for read in instruction.reads() {
                if let Some(recv) = recvs[actor].get_mut(read).and_then(VecDeque::pop_front) {
                    streams[actor].push(recv);
                }
                if let Some(waiting) = pending[actor].remove(read) {
                    streams[actor].push(waiting);
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
            // The receive was placed up front (see `recvs`).
            NodeOp::Transfer { from, to, tensor, .. } if graph.builds(*from) => {
                emit(
                    *from,
                    Instruction::Send {
                        tensor: tensor.clone(),
                        to: *to,
                        tag,
                    },
                    &mut pending,
                );
            }
            NodeOp::Collective {
                kind,
                group,
                tensor,
                dtype,
                codec,
            } => {
                for &member in group.iter().filter(|&&a| graph.builds(a)) {
                    let start = Instruction::StartCollective {
                        kind: *kind,
                        tensor: tensor.clone(),
                        group: group.clone(),
                        tag,
                        dtype: *dtype,
                        codec: *codec,
                    };
                    emit(member, start, &mut pending);
                    let wait = Instruction::WaitCollective {
                        tensor: tensor.clone(),
                        tag,
                    };
                    pending[member].insert(tensor.clone(), wait);
                }
            }
            NodeOp::Transfer { .. } => {}
        }
    }
    for (actor, left) in pending.into_iter().enumerate() {
        let mut left: Vec<Instruction> = left.into_values().collect();
        left.extend(std::mem::take(&mut recvs[actor]).into_values().flatten());
        left.sort_by_key(|i| match i {
            Instruction::Recv { tag, .. } => (0, *tag),
            Instruction::WaitCollective { tag, .. } => (1, *tag),
            _ => (2, 0),
        });
        streams[actor].extend(left);
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
            g.compute(a, user("make"), &[], &["x".into()]);
        }
        g.collective(CollectiveKind::AllReduceSum, vec![0, 1], &"x".into());
        for a in 0..2 {
            g.compute(a, user("other"), &[], &["y".into()]);
            g.compute(a, user("use"), &["x".into()], &[]);
        }
        g.transfer(0, &"y".into(), 1, &"y0".into());
        let s = lower(&g);
        assert!(matches!(s[0][1], Instruction::StartCollective { .. }));
        assert!(matches!(s[0][2], Instruction::Compute { .. }));
        assert!(matches!(s[0][3], Instruction::WaitCollective { tag: 2, .. }));
        assert!(matches!(s[0][5], Instruction::Send { to: 1, .. }));
        assert!(matches!(s[1][5], Instruction::Recv { from: 0, .. }));
    }
}
