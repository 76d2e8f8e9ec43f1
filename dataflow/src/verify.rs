//! The verifier: simulate every actor's stream before anything runs.
//!
//! Sends are buffered (they never block); a `Recv` blocks until its matching send happened; each
//! actor runs its collectives one at a time in the order it started them, and a collective
//! completes only when it is at the head of every member's queue — so members that enter
//! collectives in different orders deadlock here exactly as they would at run time. A tensor must
//! exist on an actor before an instruction reads it, and must not be read while a collective is
//! rewriting it. When no actor can move, the report names who waits for whom.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};

use crate::instruction::{CollectiveKind, Instruction};
use crate::tensor_id::TensorId;
use crate::{ActorId, PlanError};

struct ActorSim<'a> {
    stream: &'a [Instruction],
    pc: usize,
    defined: HashSet<&'a TensorId>,
    in_collective: HashSet<&'a TensorId>,
    comm_queue: VecDeque<u64>,
    completed: HashSet<u64>,
}

struct CollectiveFacts<'a> {
    group: &'a [ActorId],
    tensor: &'a TensorId,
    dtype: crate::DType,
    codec: crate::Codec,
}

/// Checks that `streams` (indexed by actor) run to completion without deadlock.
pub fn verify(streams: &[Vec<Instruction>]) -> Result<(), PlanError> {
    let mut actors: Vec<ActorSim> = streams
        .iter()
        .map(|s| ActorSim {
            stream: s,
            pc: 0,
            defined: HashSet::new(),
            in_collective: HashSet::new(),
            comm_queue: VecDeque::new(),
            completed: HashSet::new(),
        })
        .collect();
    let mut in_flight: BTreeSet<(ActorId, ActorId, u64)> = BTreeSet::new();
    let mut collectives: BTreeMap<u64, CollectiveFacts> = BTreeMap::new();
    loop {
        let mut progress = false;
        for me in 0..actors.len() {
            while advance(me, &mut actors, &mut in_flight, &mut collectives)? {
                progress = true;
            }
        }
        progress |= complete_collectives(&mut actors, &collectives);
        if !progress {
            break;
        }
    }
    let stuck: Vec<ActorId> = (0..actors.len())
        .filter(|&a| actors[a].pc < actors[a].stream.len() || !actors[a].comm_queue.is_empty())
        .collect();
    if !stuck.is_empty() {
        return Err(PlanError::Deadlock(explain(&stuck, &actors, &collectives)));
    }
    if let Some((from, to, tag)) = in_flight.iter().next() {
        return Err(PlanError::Malformed(format!(
            "actor {from} sends tag {tag} to actor {to}, which never receives it"
        )));
    }
    Ok(())
}

/// Runs `me`'s next instruction if it can run; `Ok(false)` when it is blocked or finished.
fn advance<'a>(
    me: ActorId,
    actors: &mut [ActorSim<'a>],
    in_flight: &mut BTreeSet<(ActorId, ActorId, u64)>,
    collectives: &mut BTreeMap<u64, CollectiveFacts<'a>>,
) -> Result<bool, PlanError> {
    let n = actors.len();
    let sim = &mut actors[me];
    let Some(instruction) = sim.stream.get(sim.pc) else {
        return Ok(false);
    };
    let at = |why: String| {
        PlanError::Malformed(format!(
            "actor {me}, instruction {} `{instruction}`: {why}",
            sim.pc
        ))
    };
    for read in instruction.reads() {
        if sim.in_collective.contains(read) {
            return Err(at(format!(
                "reads `{read}` while a collective is still rewriting it"
            )));
        }
        if !sim.defined.contains(read) {
            return Err(at(format!(
                "reads `{read}`, which no earlier instruction of this actor produced"
            )));
        }
    }
    match instruction {
        Instruction::Compute { outputs, .. } => {
            sim.defined.extend(outputs.iter());
        }
        Instruction::Send { to, tag, .. } => {
            if *to >= n {
                return Err(at(format!("actor {to} does not exist")));
            }
            in_flight.insert((me, *to, *tag));
        }
        Instruction::Recv { tensor, from, tag } => {
            if !in_flight.remove(&(*from, me, *tag)) {
                return Ok(false);
            }
            sim.defined.insert(tensor);
        }
        Instruction::StartCollective {
            kind,
            tensor,
            group,
            tag,
            dtype,
            codec,
        } => {
            let encodable = matches!(
                kind,
                CollectiveKind::AllReduceSum | CollectiveKind::ReduceScatterSum | CollectiveKind::AllGather
            );
            if *codec != crate::Codec::None && !(encodable && *dtype == crate::DType::F32) {
                return Err(at(format!(
                    "collective tag {tag} is {kind:?} of {dtype} compressed as {codec}: codecs encode f32 sums and gathers only"
                )));
            }
            if matches!(codec, crate::Codec::TopK { .. } | crate::Codec::OneBit { .. })
                && *kind != CollectiveKind::AllReduceSum
            {
                return Err(at(format!(
                    "collective tag {tag} is {kind:?} compressed as {codec}: top-k's pairs and 1-bit Adam's momentum are exchanged whole, an all-reduce only"
                )));
            }
            if !group.contains(&me) {
                return Err(at("this actor is not a member of the group".into()));
            }
            if let Some(&bad) = group.iter().find(|&&a| a >= n) {
                return Err(at(format!("group member {bad} does not exist")));
            }
            let facts = collectives.entry(*tag).or_insert(CollectiveFacts {
                group,
                tensor,
                dtype: *dtype,
                codec: *codec,
            });
            let same = (facts.group, facts.tensor, facts.dtype, facts.codec)
                == (group.as_slice(), tensor, *dtype, *codec);
            if !same {
                return Err(at(format!(
                    "members disagree on collective tag {tag}: group {:?} on {} `{}` (codec {}) elsewhere",
                    facts.group, facts.dtype, facts.tensor, facts.codec
                )));
            }
            sim.in_collective.insert(tensor);
            sim.comm_queue.push_back(*tag);
        }
        Instruction::WaitCollective { tensor, tag } => {
            if !sim.completed.contains(tag) {
                return Ok(false);
            }
            sim.in_collective.remove(tensor);
        }
    }
    sim.pc += 1;
    Ok(true)
}

/// Completes every collective that is at the head of all its members' queues.
fn complete_collectives(actors: &mut [ActorSim], collectives: &BTreeMap<u64, CollectiveFacts>) -> bool {
    let mut progress = false;
    loop {
        let ready = (0..actors.len()).find_map(|a| {
            let tag = *actors[a].comm_queue.front()?;
            let group = collectives[&tag].group;
            group
                .iter()
                .all(|&m| actors[m].comm_queue.front() == Some(&tag))
                .then_some((tag, group))
        });
        let Some((tag, group)) = ready else {
            return progress;
        };
        for &m in group {
            actors[m].comm_queue.pop_front();
            actors[m].completed.insert(tag);
        }
        progress = true;
    }
}

fn explain(stuck: &[ActorId], actors: &[ActorSim], collectives: &BTreeMap<u64, CollectiveFacts>) -> String {
    let mut lines = Vec::new();
    for &a in stuck.iter().take(8) {
        let sim = &actors[a];
        let waiting = match sim.stream.get(sim.pc) {
            Some(Instruction::Recv { from, tag, .. }) => {
                format!("waits for actor {from} to send tag {tag}")
            }
            Some(Instruction::WaitCollective { tag, .. }) => {
                format!("waits for collective tag {tag} to finish")
            }
            Some(other) => format!("is blocked at `{other}`"),
            None => "finished its stream".to_string(),
        };
        let mut line = match sim.stream.get(sim.pc) {
            Some(i) => format!("actor {a} at instruction {} `{i}` {waiting}", sim.pc),
            None => format!("actor {a} {waiting}"),
        };
        if let Some(tag) = sim.comm_queue.front() {
            let others: Vec<String> = collectives[tag]
                .group
                .iter()
                .filter(|&&m| actors[m].comm_queue.front() != Some(tag))
                .map(|&m| match actors[m].comm_queue.front() {
                    Some(t) => format!("actor {m} is in collective tag {t} (entered in a different order)"),
                    None => format!("actor {m} has not started it"),
                })
                .collect();
            line.push_str(&format!(
                "; its collective tag {tag} waits: {}",
                others.join(", ")
            ));
        }
        lines.push(line);
    }
    if stuck.len() > 8 {
        lines.push(format!("… and {} more actors", stuck.len() - 8));
    }
    lines.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instruction::{CollectiveKind, ComputeOp};

    fn make(name: &str) -> Instruction {
        Instruction::Compute {
            op: ComputeOp::User { name: "f".into() },
            inputs: vec![],
            outputs: vec![name.into()],
        }
    }
    fn start(tensor: &str, tag: u64) -> Instruction {
        Instruction::StartCollective {
            kind: CollectiveKind::AllReduceSum,
            tensor: tensor.into(),
            group: vec![0, 1],
            tag,
            dtype: crate::DType::F32,
            codec: crate::Codec::None,
        }
    }
    fn wait(tensor: &str, tag: u64) -> Instruction {
        Instruction::WaitCollective {
            tensor: tensor.into(),
            tag,
        }
    }

    /// Members that bring one collective in different dtypes are refused before anything runs;
    /// control: the same streams in one dtype pass.
    #[test]
    fn members_of_a_collective_must_agree_on_its_dtype() {
        let mut bf16 = start("g", 1);
        if let Instruction::StartCollective { dtype, .. } = &mut bf16 {
            *dtype = crate::DType::BF16;
        }
        let streams = vec![
            vec![make("g"), start("g", 1), wait("g", 1)],
            vec![make("g"), bf16, wait("g", 1)],
        ];
        let error = verify(&streams).unwrap_err().to_string();
        assert!(error.contains("disagree") && error.contains("f32"), "{error}");
        let same = vec![vec![make("g"), start("g", 1), wait("g", 1)]; 2];
        verify(&same).unwrap();
    }

    /// Members must agree on a collective's codec, and a codec encodes f32 sums only; control:
    /// both members compressing an f32 all-reduce alike pass.
    #[test]
    fn members_of_a_collective_must_agree_on_its_codec() {
        let compressed = |dtype| {
            let mut start = start("g", 1);
            if let Instruction::StartCollective { codec, dtype: d, .. } = &mut start {
                *codec = crate::Codec::Int8 { block: 256 };
                *d = dtype;
            }
            start
        };
        let streams = vec![
            vec![make("g"), start("g", 1), wait("g", 1)],
            vec![make("g"), compressed(crate::DType::F32), wait("g", 1)],
        ];
        let error = verify(&streams).unwrap_err().to_string();
        assert!(
            error.contains("disagree") && error.contains("codec none"),
            "{error}"
        );
        let bf16 = vec![vec![make("g"), compressed(crate::DType::BF16), wait("g", 1)]; 2];
        let error = verify(&bf16).unwrap_err().to_string();
        assert!(error.contains("f32 sums and gathers only"), "{error}");
        let same = vec![vec![make("g"), compressed(crate::DType::F32), wait("g", 1)]; 2];
        verify(&same).unwrap();
        let mut scattered = compressed(crate::DType::F32);
        if let Instruction::StartCollective { codec, kind, .. } = &mut scattered {
            *codec = crate::Codec::TopK {
                per_million: 10_000,
                feedback: true,
                momentum_bits: 0,
            };
            *kind = CollectiveKind::ReduceScatterSum;
        }
        let error = verify(&vec![vec![make("g"), scattered, wait("g", 1)]; 2])
            .unwrap_err()
            .to_string();
        assert!(error.contains("an all-reduce only"), "{error}");
    }

    #[test]
    fn matched_streams_pass() {
        let s = vec![
            vec![
                make("a"),
                make("b"),
                start("a", 1),
                start("b", 2),
                wait("a", 1),
                wait("b", 2),
            ],
            vec![
                make("a"),
                make("b"),
                start("a", 1),
                start("b", 2),
                wait("b", 2),
                wait("a", 1),
            ],
        ];
        verify(&s).unwrap();
    }

    #[test]
    fn collectives_in_different_orders_deadlock_and_are_named() {
        let s = vec![
            vec![
                make("a"),
                make("b"),
                start("a", 1),
                start("b", 2),
                wait("a", 1),
                wait("b", 2),
            ],
            vec![
                make("a"),
                make("b"),
                start("b", 2),
                start("a", 1),
                wait("a", 1),
                wait("b", 2),
            ],
        ];
        let err = verify(&s).unwrap_err().to_string();
        assert!(
            err.contains("deadlock") && err.contains("different order"),
            "{err}"
        );
    }

    #[test]
    fn recv_cycle_deadlocks_and_unmatched_send_is_refused() {
        let recv = |from, tag| Instruction::Recv {
            tensor: "x".into(),
            from,
            tag,
        };
        let send = |to, tag| Instruction::Send {
            tensor: "y".into(),
            to,
            tag,
        };
        let cycle = vec![
            vec![recv(1, 1), make("y"), send(1, 2)],
            vec![recv(0, 2), make("y"), send(0, 1)],
        ];
        let err = verify(&cycle).unwrap_err().to_string();
        assert!(
            err.contains("actor 0") && err.contains("waits for actor 1"),
            "{err}"
        );
        let unmatched = vec![vec![make("y"), send(1, 5)], vec![]];
        assert!(
            verify(&unmatched)
                .unwrap_err()
                .to_string()
                .contains("never receives")
        );
    }

    #[test]
    fn use_before_definition_is_refused() {
        let read = Instruction::Send {
            tensor: "nope".into(),
            to: 1,
            tag: 0,
        };
        let err = verify(&[vec![read], vec![]]).unwrap_err().to_string();
        assert!(err.contains("nope"), "{err}");
    }
}
