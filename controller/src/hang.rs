//! Hangs named in seconds: from every actor's progress (step, instruction, what it blocks on,
//! a counter that moves with progress), the chain of who waits for whom.
//!
//! The controller samples the actors once per heartbeat. When no actor made progress across two
//! heartbeats and an actor is blocked, it follows each blocked actor's wait: a receive waits for
//! its sender; a collective for the first member that is not inside the same collective. A chain
//! that ends at an idle actor (between steps: it finished its stream without sending), at an
//! actor that is gone, or that closes a cycle, can never resolve: that is a hang, reported with
//! the whole chain. A chain that ends at an actor still computing is a slow step, not a hang
//! (the fabric's patience still bounds it). This is the wait-for graph of deadlock detection
//! (Chandy, Misra & Haas, "Distributed deadlock detection", TOCS 1983), taken from a global
//! snapshot, which one controller can afford.

use std::fmt;

use archipelago_actors::progress::{ProgressSnapshot, Waiting};
use archipelago_actors::proto::ActorState;
use archipelago_dataflow::{ActorId, ActorStream, Instruction, TensorId, TestFault};

/// One actor on a wait-for chain.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainLink {
    /// The actor.
    pub actor: ActorId,
    /// What it is doing: the instruction it blocks on or runs, `idle`, `gone`.
    pub doing: String,
    /// What it waits for (empty at the chain's end).
    pub waits_for: String,
}

/// Why a chain can never resolve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainEnd {
    /// It ends at an actor between steps (which will send nothing more this step).
    Idle,
    /// It ends at an actor that is gone.
    Gone,
    /// It comes back to an actor already on it.
    Cycle,
}

/// A hang: every chain of blocked actors that can never resolve.
#[derive(Debug, Clone, PartialEq)]
pub struct HangReport {
    /// The step.
    pub step: u64,
    /// The chains, one per blocked actor that starts one (in actor order).
    pub chains: Vec<(Vec<ChainLink>, ChainEnd)>,
}

impl fmt::Display for HangReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {}: no actor made progress; who waits for whom:",
            self.step
        )?;
        for (links, end) in &self.chains {
            write!(f, "\n  ")?;
            for (i, link) in links.iter().enumerate() {
                if i > 0 {
                    write!(f, " -> ")?;
                }
                write!(f, "actor {} ({})", link.actor, link.doing)?;
                if !link.waits_for.is_empty() {
                    write!(f, " waits for {}", link.waits_for)?;
                }
            }
            let end = match end {
                ChainEnd::Idle => "ends at an idle actor: the message it waits for was never sent",
                ChainEnd::Gone => "ends at an actor that is gone",
                ChainEnd::Cycle => "a cycle: each waits for the next",
            };
            write!(f, " [{end}]")?;
        }
        Ok(())
    }
}

/// The actor a blocked actor waits for, and how to say it.
fn next_in_chain(
    waiting: &Waiting,
    states: &[(ActorId, Option<ProgressSnapshot>)],
) -> Option<(ActorId, String)> {
    match waiting {
        Waiting::Nothing => None,
        Waiting::Recv { from, tag } => Some((*from, format!("tag {tag} from actor {from}"))),
        Waiting::Collective { tag, group } => {
            let inside = |a: ActorId| {
                states.iter().any(|(id, s)| {
                    *id == a
                        && matches!(s, Some(ProgressSnapshot { waiting: Waiting::Collective { tag: t, .. }, .. }) if t == tag)
                })
            };
            let missing = group.iter().copied().find(|&a| !inside(a))?;
            Some((
                missing,
                format!("collective {tag} over {group:?}, which actor {missing} has not joined"),
            ))
        }
    }
}

/// The hang in `states` (each actor's progress, `None` for an actor that is gone), if one of
/// its blocked actors can never resume. Call it only when nothing progressed for two heartbeats.
/// A chain that reaches an actor missing from `states` proves nothing (a host sees only its
/// own actors; the controller sees them all). `instruction_of` gives an actor's launched
/// instruction at an index (to name the instruction it blocks on), without copying the plan.
pub fn find_hang(
    states: &[(ActorId, Option<ProgressSnapshot>)],
    instruction_of: impl Fn(ActorId, usize) -> Option<Instruction>,
) -> Option<HangReport> {
    let describe = |actor: ActorId, state: &Option<ProgressSnapshot>| match state {
        None => "gone".to_string(),
        Some(ProgressSnapshot { index: None, .. }) => "idle".to_string(),
        Some(ProgressSnapshot { index: Some(i), .. }) => {
            let instruction = instruction_of(actor, *i);
            instruction.map_or(format!("instruction {i}"), |x| format!("instruction {i} `{x}`"))
        }
    };
    // `None`: not one of `states` (another host's actor, when a host looks at its own).
    let state_of = |actor: ActorId| states.iter().find(|(id, _)| *id == actor).map(|(_, s)| s.clone());
    let step = states
        .iter()
        .filter_map(|(_, s)| s.as_ref())
        .map(|s| s.step)
        .max()
        .unwrap_or(0);
    let mut chains = Vec::new();
    for (start, state) in states {
        let Some(first) = state else { continue };
        if first.waiting == Waiting::Nothing {
            continue;
        }
        let (mut links, mut at, mut current) = (Vec::new(), *start, state.clone());
        let end = loop {
            if links.iter().any(|l: &ChainLink| l.actor == at) {
                break Some(ChainEnd::Cycle);
            }
            let doing = describe(at, &current);
            let Some(now) = &current else {
                links.push(ChainLink {
                    actor: at,
                    doing,
                    waits_for: String::new(),
                });
                break Some(ChainEnd::Gone);
            };
            match next_in_chain(&now.waiting, states) {
                Some((next, waits_for)) => {
                    links.push(ChainLink {
                        actor: at,
                        doing,
                        waits_for,
                    });
                    let Some(next_state) = state_of(next) else {
                        break None; // waits for an actor it cannot see: no conclusion
                    };
                    at = next;
                    current = next_state;
                }
                None if now.index.is_none() => {
                    links.push(ChainLink {
                        actor: at,
                        doing,
                        waits_for: String::new(),
                    });
                    break Some(ChainEnd::Idle);
                }
                // Computing, or inside a collective every member has joined: it may still end.
                None => break None,
            }
        };
        if let Some(end) = end {
            chains.push((links, end));
        }
    }
    (!chains.is_empty()).then_some(HangReport { step, chains })
}

/// An actor's progress as a host's heartbeat carries it.
pub(crate) fn actor_state(actor: ActorId, progress: &ProgressSnapshot) -> ActorState {
    let (wait_kind, wait_from, wait_tag, wait_group) = match &progress.waiting {
        Waiting::Nothing => (0, 0, 0, Vec::new()),
        Waiting::Recv { from, tag } => (1, *from as u32, *tag, Vec::new()),
        Waiting::Collective { tag, group } => (2, 0, *tag, group.iter().map(|&a| a as u32).collect()),
    };
    ActorState {
        actor: actor as u32,
        step: progress.step,
        index: progress.index.map_or(-1, |i| i as i64),
        beats: progress.beats,
        wait_kind,
        wait_from,
        wait_tag,
        wait_group,
    }
}

/// An actor's progress from a heartbeat (an unknown wait kind reads as none).
pub(crate) fn progress_of(state: &ActorState) -> (ActorId, ProgressSnapshot) {
    let waiting = match state.wait_kind {
        1 => Waiting::Recv {
            from: state.wait_from as ActorId,
            tag: state.wait_tag,
        },
        2 => Waiting::Collective {
            tag: state.wait_tag,
            group: state.wait_group.iter().map(|&a| a as ActorId).collect(),
        },
        _ => Waiting::Nothing,
    };
    let snapshot = ProgressSnapshot {
        step: state.step,
        index: usize::try_from(state.index).ok(),
        beats: state.beats,
        waiting,
    };
    (state.actor as ActorId, snapshot)
}

/// Applies the stream faults of the hang tests (`TestFault::SkipLastSend`,
/// `TestFault::RecvBeforeSend`) to the streams about to be launched; other faults are the
/// trainer's.
pub(crate) fn inject_stream_fault(streams: &mut [ActorStream], fault: Option<TestFault>) {
    let is_send = |x: &Instruction| matches!(x, Instruction::Send { .. });
    let is_recv = |x: &Instruction| matches!(x, Instruction::Recv { .. });
    match fault {
        Some(TestFault::SkipLastSend { actor }) => {
            if let Some(stream) = streams.iter_mut().find(|s| s.actor == actor)
                && let Some(at) = stream.instructions.iter().rposition(is_send)
            {
                stream.instructions.remove(at);
            }
        }
        Some(TestFault::RecvBeforeSend { actor }) => {
            if let Some(stream) = streams.iter_mut().find(|s| s.actor == actor)
                && let (Some(send), Some(recv)) = (
                    stream.instructions.iter().position(is_send),
                    stream.instructions.iter().position(is_recv),
                )
                && recv > send
            {
                let moved = stream.instructions.remove(recv);
                stream.instructions.insert(send, moved);
            }
        }
        Some(TestFault::SkipTpInputGradReduce) => {
            drop_all_reduces(streams, |t| matches!(t, TensorId::ActivationGrad { .. }))
        }
        Some(TestFault::SkipTpOutputReduce) => {
            drop_all_reduces(streams, |t| matches!(t, TensorId::Activation { .. }))
        }
        Some(TestFault::SkipTpGradsReduce) => {
            drop_all_reduces(streams, |t| matches!(t, TensorId::TpGrads { .. }))
        }
        _ => {}
    }
}

/// Leaves the collectives of the tensors `of` picks out of every stream (all ranks of each group
/// alike, so nothing waits: the tp faults' controls).
fn drop_all_reduces(streams: &mut [ActorStream], of: impl Fn(&TensorId) -> bool) {
    for stream in streams {
        stream.instructions.retain(|x| match x {
            Instruction::StartCollective { tensor, .. } | Instruction::WaitCollective { tensor, .. } => {
                !of(tensor)
            }
            _ => true,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64, index: Option<usize>, waiting: Waiting) -> Option<ProgressSnapshot> {
        Some(ProgressSnapshot {
            step,
            index,
            beats: 0,
            waiting,
        })
    }

    #[test]
    fn a_receive_from_an_idle_actor_is_a_hang_ending_there() {
        let states = vec![
            (0, at(2, Some(5), Waiting::Recv { from: 1, tag: 7 })),
            (1, at(2, None, Waiting::Nothing)),
        ];
        let report = find_hang(&states, |_, _| None).expect("a hang");
        assert_eq!(report.chains.len(), 1);
        assert_eq!(report.chains[0].1, ChainEnd::Idle);
        let text = report.to_string();
        assert!(
            text.contains("actor 0 (instruction 5) waits for tag 7 from actor 1 -> actor 1 (idle)"),
            "{text}"
        );
    }

    #[test]
    fn two_actors_waiting_for_each_other_close_a_cycle() {
        let states = vec![
            (0, at(0, Some(1), Waiting::Recv { from: 1, tag: 3 })),
            (1, at(0, Some(0), Waiting::Recv { from: 0, tag: 2 })),
        ];
        let report = find_hang(&states, |_, _| None).expect("a hang");
        assert!(report.chains.iter().all(|(_, end)| *end == ChainEnd::Cycle));
    }

    #[test]
    fn a_chain_ending_at_a_computing_actor_is_not_a_hang() {
        // Actor 1 runs a long forward; actor 0 waits for its output: slow, not stuck.
        let states = vec![
            (0, at(1, Some(4), Waiting::Recv { from: 1, tag: 3 })),
            (1, at(1, Some(2), Waiting::Nothing)),
        ];
        assert_eq!(find_hang(&states, |_, _| None), None);
        // Every member inside the same collective: it may still finish.
        let group = vec![0, 1];
        let inside = Waiting::Collective { tag: 9, group };
        let states = vec![(0, at(1, Some(4), inside.clone())), (1, at(1, Some(6), inside))];
        assert_eq!(find_hang(&states, |_, _| None), None);
    }

    #[test]
    fn a_wait_for_an_actor_out_of_sight_proves_nothing() {
        let states = vec![(0, at(1, Some(4), Waiting::Recv { from: 5, tag: 3 }))];
        assert_eq!(find_hang(&states, |_, _| None), None);
    }

    #[test]
    fn a_collective_waits_for_the_member_that_never_joined_and_a_gone_actor_ends_a_chain() {
        let group = vec![0, 1, 2];
        let inside = Waiting::Collective { tag: 9, group };
        let states = vec![
            (0, at(1, Some(4), inside.clone())),
            (1, at(1, Some(4), inside)),
            (2, at(1, Some(3), Waiting::Recv { from: 3, tag: 1 })),
            (3, None),
        ];
        let report = find_hang(&states, |_, _| None).expect("a hang");
        let text = report.to_string();
        assert!(text.contains("which actor 2 has not joined -> actor 2"), "{text}");
        assert!(
            report.chains.iter().all(|(_, end)| *end == ChainEnd::Gone),
            "{text}"
        );
    }
}
