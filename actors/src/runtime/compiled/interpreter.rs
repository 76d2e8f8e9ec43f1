//! One participant's interpreter: spawned once on its actor's device thread (in whichever
//! process holds the actor), it walks the participant's stream every iteration — `Recv` waits
//! for a value from a peer, `Compute` calls the actor's handler (a local call on the same
//! thread), `Send` hands the value to the next interpreter (see [`routes`](super::routes)). A
//! failed call travels down the stream as an error value, so an iteration always ends, with the
//! error naming the actor.

use archipelago_dataflow::TensorId;
use std::collections::HashMap;

use archipelago_dataflow::{ComputeOp, Instruction};

use super::routes::{Inbox, Outbox};
use super::{Invoke, Shared};
use crate::runtime::CallError;

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

/// One actor's interpreter: its stream, every iteration, until the program is dropped.
pub(crate) async fn interpret(
    stream: Vec<Instruction>,
    mut inbox: Inbox,
    outbox: Outbox,
    invokers: HashMap<usize, Invoke>,
) {
    loop {
        let mut table: HashMap<&TensorId, Result<Shared, CallError>> = HashMap::new();
        for instruction in &stream {
            match instruction {
                Instruction::Recv { tensor, from, tag } => {
                    let Some(value) = inbox.take(*from, *tag).await else {
                        return;
                    };
                    // A lost process ends the program: the program's own stream reports it,
                    // interpreters stop instead of cycling on the error.
                    if inbox.broken().is_some() {
                        return;
                    }
                    table.insert(tensor, value);
                }
                Instruction::Compute { op, inputs, outputs } => {
                    let (Some(node), Some(input), Some(output)) =
                        (node_of(op), inputs.first(), outputs.first())
                    else {
                        continue;
                    };
                    let value = match (table.get(input).cloned(), invokers.get(&node)) {
                        (Some(Ok(value)), Some(invoke)) => invoke_caught(invoke, value, node).await,
                        (Some(Err(error)), _) => Err(error),
                        (Some(Ok(_)), None) => Err(CallError::Program {
                            reason: format!("recorded call {node} has no handler in this stream"),
                        }),
                        (None, _) => continue,
                    };
                    table.insert(output, value);
                }
                Instruction::Send { tensor, to, tag } => {
                    let Some(value) = table.get(tensor).cloned() else {
                        continue;
                    };
                    if outbox.send(tensor, *to, *tag, value).is_err() {
                        return;
                    }
                }
                _ => {}
            }
        }
    }
}
