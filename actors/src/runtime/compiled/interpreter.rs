//! One participant's interpreter: spawned once on its actor's device thread (in whichever
//! process holds the actor), it walks the participant's stream, lowered once into a
//! [`Plan`], every iteration — `Recv` waits for a value from a peer, `Compute` calls the actor's
//! handler (a local call on the same thread), `Send` hands the value to the next interpreter
//! (see [`routes`](super::routes)). A failed call travels down the stream as an error value, so
//! an iteration always ends, with the error naming the actor.

use std::collections::HashMap;
use std::sync::Arc;

use archipelago_dataflow::{ComputeOp, Instruction};

use super::direct::{Deliver, Direct, Onward};
use super::plan::{Plan, Resolve, Step, StreamCollectives, Table};
use super::routes::{self, Inbox, Outbox};
use super::{Invoke, Shared};
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
    executor.spawn(interpret(plan, inbox));
    Ok(())
}

/// One actor's interpreter: its plan, every iteration, until the program is dropped.
async fn interpret(plan: Plan, mut inbox: Inbox) {
    let mut table = Table::new(plan.slots);
    while iteration(&plan, &mut inbox, &mut table).await {
        table.clear();
    }
}

/// One iteration of a participant's plan; `false` once the program is dropped or broken.
async fn iteration(plan: &Plan, inbox: &mut Inbox, table: &mut Table) -> bool {
    for step in &plan.steps {
        match step {
            Step::Recv { slot, from, tag, .. } => {
                let Some(value) = inbox.take(*from, *tag).await else {
                    return false;
                };
                // A lost process ends the program: the program's own stream reports it,
                // interpreters stop instead of cycling on the error.
                if inbox.broken().is_some() {
                    return false;
                }
                table.put(*slot, value);
            }
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
                    (None, _) => continue,
                };
                table.put(*output, value);
            }
            Step::Send { value, tag, port } => {
                let Some(value) = table.read(*value) else {
                    continue;
                };
                if port.send(*tag, value).is_err() {
                    return false;
                }
            }
            Step::Alias { input, output } => {
                if let Some(value) = table.read(*input) {
                    table.put(*output, value);
                }
            }
            Step::Collective {
                slot,
                kind,
                group,
                me,
            } => {
                // A value that never came still takes part (as a failure), so the others do not
                // wait for this member.
                let value = table.take(*slot).unwrap_or_else(|| {
                    Err(CallError::Program {
                        reason: "a recorded all-reduce's value never came".into(),
                    })
                });
                table.put(*slot, collective(value, *kind, group, *me).await);
            }
            Step::Gather { .. } | Step::Return { .. } => {}
        }
    }
    true
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
