//! The program's own stream (the last), run once per [`CompiledProgram::run`](super::CompiledProgram::run)
//! on the caller's thread by the one interpreter of instruction streams: it sends the input to
//! the first actors, makes the gathers and takes the output. Its plan, inbox and table live as
//! long as the program; a run holds them (runs are handled in order).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use archipelago_dataflow::{ActorId, ComputeOp, Instruction, TensorId};
use tokio::sync::Mutex;

use super::Shared;
use super::plan::{Plan, Step, Table};
use super::routes::Inbox;
use crate::interpret::{CollectiveStart, Participant};
use crate::runtime::CallError;

/// The program's own stream, lowered, with what its runs share.
pub(crate) struct Own {
    stream: Vec<Instruction>,
    plan: Plan,
    /// The inbox and the table of values, held by one run at a time.
    state: Mutex<(Inbox, Table)>,
    /// Set when a run was dropped midway through a stream that sends after it receives: later
    /// runs would wait for a value that depends on an unsent one, so they fail instead.
    abandoned: AtomicBool,
    sends_after_recv: bool,
}

/// The error of a run whose interpreters are gone.
fn stopped() -> CallError {
    CallError::Program {
        reason: "its interpreters have stopped (the runtime shut down); compile it again on a live runtime"
            .into(),
    }
}

impl Own {
    /// The own stream `stream` (for the check of sends after receives) lowered into `plan`.
    pub(crate) fn new(stream: &[Instruction], plan: Plan, mut inbox: Inbox) -> Own {
        // A Send after a receive: a run dropped in between would leave a value unsent that a
        // later receive of this stream depends on, and the next run would wait for it.
        let first_recv = stream.iter().position(|i| matches!(i, Instruction::Recv { .. }));
        let sends_after_recv =
            first_recv.is_some_and(|r| (stream[r..].iter()).any(|i| matches!(i, Instruction::Send { .. })));
        inbox.unclaimed = vec![0; plan.counters];
        let table = Table::new(plan.slots);
        Own {
            stream: stream.to_vec(),
            plan,
            state: Mutex::new((inbox, table)),
            abandoned: AtomicBool::new(false),
            sends_after_recv,
        }
    }

    /// One run on `input`: the output, or the error that ended it.
    pub(crate) async fn run<R: Clone + Send + Sync + 'static>(&self, input: Shared) -> Result<R, CallError> {
        let mut state = self.state.lock().await;
        let (inbox, table) = &mut *state;
        if self.abandoned.load(Ordering::Acquire) {
            return Err(CallError::Program {
                reason: "an earlier run was abandoned between a receive and a later send; compile the program again".into(),
            });
        }
        // Marks the program abandoned unless this run reaches its end.
        let mut guard = AbandonGuard {
            flag: &self.abandoned,
            armed: self.sends_after_recv,
        };
        // Counted until this run's values are taken: a run whose future is dropped midway
        // leaves its values to be skipped by the next run.
        for step in &self.plan.steps {
            if let Step::Recv { counter, .. } = step {
                inbox.unclaimed[*counter] += 1;
            }
        }
        if let Some(error) = inbox.broken() {
            return Err(error.clone());
        }
        table.clear();
        if let Some(slot) = self.plan.input {
            table.put(slot, Ok(input));
        }
        let output = self.walk(inbox, table).await?;
        // The stream reached its end: every send of this run was made (a failed value is sent
        // on as its error).
        guard.armed = false;
        // Moved out when this run holds the only reference (a gathered value).
        let typed = output?.downcast::<R>().expect("the recorded output type");
        Ok(Arc::try_unwrap(typed).unwrap_or_else(|shared| (*shared).clone()))
    }

    /// Walks the stream (the one interpreter, [`crate::interpret`]): the output value (or the
    /// error it became); an error when the stream stopped before its return.
    async fn walk(
        &self,
        inbox: &mut Inbox,
        table: &mut Table,
    ) -> Result<Result<Shared, CallError>, CallError> {
        let mut run = OwnRun {
            plan: &self.plan,
            inbox,
            table,
            output: None,
        };
        crate::interpret::interpret(&self.stream, &mut run)
            .await
            .map_err(|(_, error)| error)?;
        run.output.ok_or_else(stopped)
    }
}

/// One run of the program's own stream, as a [`Participant`] of the one interpreter: sends of
/// the input, receives, gathers and the return (its stream has no calls or collectives).
struct OwnRun<'a> {
    plan: &'a Plan,
    inbox: &'a mut Inbox,
    table: &'a mut Table,
    output: Option<Result<Shared, CallError>>,
}

impl Participant for OwnRun<'_> {
    type Started = ();
    type Stop = CallError;

    async fn compute(
        &mut self,
        index: usize,
        _: &ComputeOp,
        _: &[TensorId],
        _: &[TensorId],
    ) -> Result<u64, CallError> {
        let table = &mut *self.table;
        match &self.plan.steps[index] {
            Step::Gather {
                inputs,
                output,
                gather,
            } => {
                let values: Result<Vec<Shared>, CallError> = (inputs.iter())
                    .map(|i| table.read(*i).unwrap_or_else(|| Err(stopped())))
                    .collect();
                let gather = gather.ok_or_else(stopped)?;
                table.put(*output, values.map(gather));
            }
            Step::Return { value } => {
                self.output = Some(table.read(*value).unwrap_or_else(|| Err(stopped())))
            }
            _ => {}
        }
        Ok(0)
    }

    async fn send(&mut self, index: usize, _: &TensorId, _: ActorId, _: u64) -> Result<u64, CallError> {
        let Step::Send { value, tag, port } = &self.plan.steps[index] else {
            return Ok(0);
        };
        let value = self.table.read(*value).unwrap_or_else(|| Err(stopped()));
        port.send(*tag, value).map(|()| 0)
    }

    async fn recv(&mut self, index: usize, _: &TensorId, _: ActorId, _: u64) -> Result<u64, CallError> {
        let Step::Recv {
            slot,
            from,
            tag,
            counter,
        } = &self.plan.steps[index]
        else {
            return Ok(0);
        };
        // Values of runs dropped midway are skipped: the last unclaimed one is this run's.
        let value = loop {
            let value = self.inbox.take(*from, *tag).await.ok_or_else(stopped)?;
            let unclaimed = &mut self.inbox.unclaimed[*counter];
            *unclaimed = unclaimed.saturating_sub(1);
            if *unclaimed == 0 {
                break value;
            }
        };
        self.table.put(*slot, value);
        Ok(0)
    }

    async fn start_collective(&mut self, _: usize, _: CollectiveStart<'_>) -> Result<((), u64), CallError> {
        Ok(((), 0))
    }

    async fn wait_collective(&mut self, _: usize, _: &TensorId, _: u64, (): ()) -> Result<u64, CallError> {
        Ok(0)
    }

    fn unstarted(&mut self, _: usize, _: u64) -> CallError {
        stopped()
    }
}

/// Sets its flag when dropped armed (see [`Own::abandoned`]).
struct AbandonGuard<'a> {
    flag: &'a AtomicBool,
    armed: bool,
}

impl Drop for AbandonGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Release);
        }
    }
}
