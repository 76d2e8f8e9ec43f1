//! One participant's interpreter: spawned once on its actor's device thread (in whichever
//! process holds the actor), it walks the participant's stream with the one interpreter of
//! instruction streams ([`crate::interpret`], which training steps use too), each instruction
//! doing what the stream's [`Plan`] (lowered once) says, every iteration — `Recv` waits for a value from a peer, `Compute` calls the actor's
//! handler (a local call on the same thread), `Send` hands the value to the next interpreter
//! (see [`routes`](super::routes)). A failed call travels down the stream as an error value, so
//! an iteration always ends, with the error naming the actor.

use std::collections::HashMap;
use std::sync::Arc;

use archipelago_dataflow::{ActorId, ComputeOp, Instruction, TensorId};

use super::direct::{Deliver, Direct, Onward};
use super::plan::{Plan, Resolve, Step, StreamCollectives, Table};
use super::routes::{self, Inbox, Outbox};
use super::{Invoke, Shared};
use crate::interpret::{CollectiveStart, Participant};
use crate::runtime::CallError;
use crate::typed_tensor::TypedTensor;

/// The node a `node:{i}` compute names.
pub(crate) fn node_of(op: &ComputeOp) -> Option<usize> {
    match op {
        ComputeOp::User { name } => name.strip_prefix("node:")?.parse().ok(),
        _ => None,
    }
}

/// Runs `invoke` with panics (in the message constructor or the value's type check) caught
/// and turned into the run's error, so the interpreter lives on.
async fn invoke_caught(invoke: &Invoke, value: Shared, node: usize) -> Result<Shared, CallError> {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| invoke(value)));
    let failed = |text: String| CallError::Program {
        reason: format!("recorded call {node} (building its message or reading its input) {text}"),
    };
    match outcome {
        Ok(call) => futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(call))
            .await
            .unwrap_or_else(|p| Err(failed(crate::error::panic_message(p.as_ref())))),
        Err(p) => Err(failed(crate::error::panic_message(p.as_ref()))),
    }
}

/// Starts participant `me` of `program` (its stream `stream`, sending through `outbox`, its
/// calls `invokers`): on the [`direct`](super::direct) path when its stream has that shape and
/// `bind` gives its call's [`Deliver`], else as an interpreter on `executor` (the actor's
/// thread). Fails when the participant was started already.
pub(crate) fn start(
    (program, me): (u64, usize),
    stream: &[Instruction],
    outbox: &Outbox,
    (invokers, collectives): (&HashMap<usize, Invoke>, &StreamCollectives),
    bind: impl FnOnce(usize) -> Option<Deliver>,
    executor: &tokio::runtime::Handle,
) -> Result<(), String> {
    let resolve = Resolve {
        invokers: Some(invokers),
        gathers: None,
        collectives: Some(collectives),
    };
    let plan = Plan::lower(stream, outbox, resolve);
    let direct = plan.shape_node().and_then(bind);
    let inbox = routes::claim_inbox(program, me)
        .ok_or_else(|| format!("participant {me} of program {program} was installed twice"))?;
    let plan = match direct {
        Some(deliver) => match plan.into_shape() {
            Ok(shape) => {
                let onward = Arc::new(Onward(shape.onward));
                let (from, tag) = (shape.from, shape.tag);
                routes::set_direct(
                    program,
                    me,
                    Direct {
                        from,
                        tag,
                        deliver,
                        onward,
                    },
                );
                return Ok(());
            }
            Err(plan) => plan,
        },
        None => plan,
    };
    executor.spawn(iterations(stream.to_vec(), plan, inbox));
    Ok(())
}

/// One actor's interpreter: its stream, walked by the one interpreter of instruction streams
/// every iteration, until the program is dropped or broken.
async fn iterations(stream: Vec<Instruction>, plan: Plan, mut inbox: Inbox) {
    let mut table = Table::new(plan.slots);
    loop {
        let mut member = Member {
            plan: &plan,
            inbox: &mut inbox,
            table: &mut table,
        };
        if crate::interpret::interpret(&stream, &mut member).await.is_err() {
            return;
        }
        table.clear();
    }
}

/// One iteration of a participant's plan, as a [`Participant`] of the one interpreter: each
/// instruction does what the plan's step of the same index says.
struct Member<'a> {
    plan: &'a Plan,
    inbox: &'a mut Inbox,
    table: &'a mut Table,
}

/// The program was dropped, or a process it spans was lost (its own stream reports that).
struct Ended;

impl Participant for Member<'_> {
    /// The collective's slot and its result.
    type Started = (usize, Result<Shared, CallError>);
    type Stop = Ended;

    async fn compute(
        &mut self,
        index: usize,
        _: &ComputeOp,
        _: &[TensorId],
        _: &[TensorId],
    ) -> Result<u64, Ended> {
        let table = &mut *self.table;
        match &self.plan.steps[index] {
            Step::Call {
                node,
                input,
                output,
                invoke,
            } => {
                let value = match (table.read(*input), invoke) {
                    (Some(Ok(value)), Some(invoke)) => invoke_caught(invoke, value, *node).await,
                    (Some(Err(error)), _) => Err(error),
                    (Some(Ok(_)), None) => Err(CallError::Program {
                        reason: format!("recorded call {node} has no handler in this stream"),
                    }),
                    (None, _) => return Ok(0),
                };
                table.put(*output, value);
            }
            Step::Alias { input, output } => {
                if let Some(value) = table.read(*input) {
                    table.put(*output, value);
                }
            }
            _ => {}
        }
        Ok(0)
    }

    async fn send(&mut self, index: usize, _: &TensorId, _: ActorId, _: u64) -> Result<u64, Ended> {
        let Step::Send { value, tag, port } = &self.plan.steps[index] else {
            return Ok(0);
        };
        match self.table.read(*value) {
            Some(value) => port.send(*tag, value).map(|()| 0).map_err(|_| Ended),
            None => Ok(0),
        }
    }

    async fn recv(&mut self, index: usize, _: &TensorId, _: ActorId, _: u64) -> Result<u64, Ended> {
        let Step::Recv { slot, from, tag, .. } = &self.plan.steps[index] else {
            return Ok(0);
        };
        let value = self.inbox.take(*from, *tag).await.ok_or(Ended)?;
        // A lost process ends the program: the program's own stream reports it, interpreters
        // stop instead of cycling on the error.
        if self.inbox.broken().is_some() {
            return Err(Ended);
        }
        self.table.put(*slot, value);
        Ok(0)
    }

    async fn start_collective(
        &mut self,
        index: usize,
        start: CollectiveStart<'_>,
    ) -> Result<(Self::Started, u64), Ended> {
        let Step::Collective {
            slot,
            kind,
            group,
            me,
        } = &self.plan.steps[index]
        else {
            return Err(Ended);
        };
        // A value that never came still takes part (as a failure), so the others do not wait
        // for this member.
        let value = self.table.take(*slot).unwrap_or_else(|| {
            Err(CallError::Program {
                reason: "a recorded all-reduce's value never came".into(),
            })
        });
        let reduced = match group {
            Some(group) => collective(value, *kind, group, *me).await,
            None => Err(CallError::Program {
                reason: format!("recorded collective {} has no group in this stream", start.tag),
            }),
        };
        Ok(((*slot, reduced), 0))
    }

    async fn wait_collective(
        &mut self,
        _: usize,
        _: &TensorId,
        _: u64,
        (slot, reduced): Self::Started,
    ) -> Result<u64, Ended> {
        self.table.put(slot, reduced);
        Ok(0)
    }

    fn unstarted(&mut self, _: usize, _: u64) -> Ended {
        Ended
    }
}

/// A recorded collective of this stream's actor `me` over `value` (a [`TypedTensor`]). The
/// members first gather whether each brings a tensor and of how many elements, so that a member
/// whose value failed (its call's error, which stays its stream's) fails the others' runs
/// naming it — without a wrong total, a wait, or a group left broken for the next run.
async fn collective(
    value: Result<Shared, CallError>,
    kind: archipelago_dataflow::CollectiveKind,
    group: &crate::runtime::CollectiveGroup,
    me: archipelago_dataflow::ActorId,
) -> Result<Shared, CallError> {
    let failed = |reason: String| CallError::Program { reason };
    let tensor = match value {
        Ok(shared) => match shared.downcast::<TypedTensor>() {
            Ok(tensor) => Ok(Arc::try_unwrap(tensor).unwrap_or_else(|shared| (*shared).clone())),
            Err(_) => Err(failed(
                "a recorded collective's value is not a TypedTensor".into(),
            )),
        },
        Err(error) => Err(error),
    };
    let members = group.members();
    let rank = members.iter().position(|&m| m == me).unwrap_or(0);
    let brought = tensor.as_ref().map_or(-1, |t| t.elements() as i64);
    let mut status = vec![0i64; members.len()];
    status[rank] = brought;
    let gather = archipelago_dataflow::CollectiveKind::AllGather;
    let status = (group
        .run(me, gather, TypedTensor::from_values(vec![members.len()], &status))
        .await)
        .map_err(|e| failed(e.to_string()))?;
    let status = status.values::<i64>();
    let tensor = tensor?;
    if let Some(r) = status.iter().position(|&n| n < 0) {
        return Err(failed(format!(
            "the recorded all-reduce's member {r} (actor {}) has no value: its call failed",
            members[r]
        )));
    }
    if let Some(r) = status.iter().position(|&n| n != brought) {
        return Err(failed(format!(
            "the recorded all-reduce's members bring {brought} and {} elements (actors {me} and {}): every member must bring the same shape",
            status[r], members[r]
        )));
    }
    let reduced = group
        .run(me, kind, tensor)
        .await
        .map_err(|e| failed(e.to_string()))?;
    Ok(Arc::new(reduced))
}
