//! A training step as a [`Participant`] of the one stream interpreter ([`crate::interpret`]):
//! compute is the actor's [`Computation`](super::Computation) (a panic caught and named), sends
//! and receives go over the blocking fabric, collectives to the actor's collective worker, and
//! every instruction runs inside its `instruction` span, recorded in the heartbeat's progress
//! and timed.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use archipelago_dataflow::{ActorId, ComputeOp, DType, FabricKind, Instruction, TensorId};

use super::{Computation, Executor, InstructionTiming};
use crate::collectives::PendingCollective;
use crate::error::panic_message;
use crate::fabric::{FabricError, Tag};
use crate::interpret::{CollectiveStart, Participant};
use crate::progress::Waiting;
use crate::typed_tensor::TypedTensor;

/// What fails an instruction: the message, and whether it follows another actor's failure.
pub(super) type Failed = (String, bool);

/// One step of an executor's stream, walked.
pub(super) struct StepRun<'a> {
    pub(super) executor: &'a mut Executor,
    pub(super) step: u64,
    began: Instant,
    /// When the running instruction began, and its span (entered).
    started: Instant,
    span: Option<tracing::span::EnteredSpan>,
    pub(super) timings: Vec<InstructionTiming>,
    /// GPUs: the most live bytes of the device's pool seen at an instruction's end.
    pub(super) peak_in_use: u64,
}

impl<'a> StepRun<'a> {
    pub(super) fn new(
        executor: &'a mut Executor,
        step: u64,
        began: Instant,
        instructions: usize,
    ) -> StepRun<'a> {
        StepRun {
            executor,
            step,
            began,
            started: began,
            span: None,
            timings: Vec::with_capacity(instructions),
            peak_in_use: 0,
        }
    }

    /// The fabric's edge of `tag` in this step.
    fn edge(&self, tag: u64) -> u64 {
        (self.step << 32) | tag
    }

    /// A local tensor for a send (copied) or a collective (`take`n out of the table): from the
    /// table, or moved into host memory from the computation's device.
    fn local(&mut self, tensor: &TensorId, take: bool) -> Result<TypedTensor, Failed> {
        let table = &mut self.executor.table;
        let held = if take {
            table.remove(tensor)
        } else {
            table.get(tensor).cloned()
        };
        match held {
            Some(value) => Ok(value),
            None => exported(self.executor.computation.as_mut(), tensor),
        }
    }
}

/// A tensor the computation holds outside the table (on its device), moved into host memory
/// for a send or a collective.
fn exported(computation: &mut dyn Computation, tensor: &TensorId) -> Result<TypedTensor, Failed> {
    match catch_unwind(AssertUnwindSafe(|| computation.export(tensor))) {
        Ok(Some(result)) => result.map_err(|m| (m, false)),
        Ok(None) => Err((format!("`{tensor}` is not here"), false)),
        Err(payload) => Err((panic_message(payload.as_ref()), false)),
    }
}

fn fabric_failed(e: FabricError) -> Failed {
    let secondary = matches!(e, FabricError::Aborted(_));
    (e.to_string(), secondary)
}

/// Adds what was `read` from peers (`kind`: the receive's or the collective's) to the step's
/// fabric figures, and its part from peers on other islands to the crossing ones.
fn count_read(executor: &mut Executor, kind: Option<FabricKind>, read: crate::fabric::read_count::Read) {
    if let Some(kind) = kind {
        executor.fabric_read.add(kind, read.bytes);
        executor.fabric_crossing.add(kind, read.crossing);
    }
}

impl Participant for StepRun<'_> {
    /// The worker's pending collective, its group and the dtype the tensor is held in.
    type Started = (PendingCollective, Vec<ActorId>, DType);
    type Stop = Failed;

    fn begin(&mut self, index: usize, instruction: &Instruction) {
        self.started = Instant::now();
        let executor = &*self.executor;
        executor.progress.set(self.step, Some(index));
        let span = tracing::info_span!(
            "instruction",
            job = %executor.job,
            step = self.step,
            actor = executor.actor,
            device = %executor.device,
            index,
            instruction = %instruction,
            mb = instruction.microbatch().map_or(-1, |m| m as i64),
            bytes = tracing::field::Empty,
        );
        self.span = Some(span.entered());
    }

    fn end(&mut self, index: usize, instruction: &Instruction, bytes: u64) {
        if let Some(span) = self.span.take() {
            span.record("bytes", bytes);
        }
        if let Some(memory) = crate::gpus::memory_usage(self.executor.device) {
            self.peak_in_use = self.peak_in_use.max(memory.in_use);
        }
        self.timings.push(InstructionTiming {
            index,
            label: instruction.to_string(),
            start_s: (self.started - self.began).as_secs_f64(),
            seconds: self.started.elapsed().as_secs_f64(),
        });
    }

    async fn compute(
        &mut self,
        _index: usize,
        op: &ComputeOp,
        inputs: &[TensorId],
        outputs: &[TensorId],
    ) -> Result<u64, Failed> {
        let (step, executor) = (self.step, &mut *self.executor);
        let (computation, table) = (&mut executor.computation, &mut executor.table);
        match catch_unwind(AssertUnwindSafe(|| {
            computation.compute(step, op, inputs, outputs, table)
        })) {
            Ok(result) => result.map(|()| 0).map_err(|m| (m, false)),
            Err(payload) => Err((panic_message(payload.as_ref()), false)),
        }
    }

    async fn send(&mut self, _index: usize, tensor: &TensorId, to: ActorId, tag: u64) -> Result<u64, Failed> {
        let value = self.local(tensor, false)?;
        let bytes = value.byte_len() as u64;
        let tag = Tag {
            edge: self.edge(tag),
            seq: 0,
        };
        let executor = &*self.executor;
        executor
            .fabric
            .send(executor.actor, to, tag, value)
            .map(|()| bytes)
            .map_err(fabric_failed)
    }

    async fn recv(
        &mut self,
        _index: usize,
        tensor: &TensorId,
        from: ActorId,
        tag: u64,
    ) -> Result<u64, Failed> {
        let edge = self.edge(tag);
        let executor = &mut *self.executor;
        executor.progress.wait_on(Waiting::Recv { from, tag });
        crate::fabric::read_count::take_read();
        let received = executor.fabric.recv(executor.actor, from, Tag { edge, seq: 0 });
        executor.progress.wait_on(Waiting::Nothing);
        let value = received.map_err(fabric_failed)?;
        let read = crate::fabric::read_count::take_read();
        count_read(executor, FabricKind::of(tensor), read);
        let bytes = value.byte_len() as u64;
        executor.table.insert(tensor.clone(), value);
        Ok(bytes)
    }

    async fn start_collective(
        &mut self,
        _index: usize,
        start: CollectiveStart<'_>,
    ) -> Result<(Self::Started, u64), Failed> {
        let CollectiveStart {
            kind,
            tensor,
            group,
            tag,
            dtype,
            codec,
        } = start;
        let value = self.local(tensor, true)?;
        // Mixed precision: an f32 buffer crosses in the edge's 16 bits and is widened back when
        // the collective ends (masters and buckets stay f32).
        let held = value.dtype();
        let value = match value.cast_float(dtype) {
            Ok(cast) if held == DType::F32 || held == dtype => cast,
            _ => {
                return Err((
                    format!("`{tensor}` is {held} here, the plan reduces it as {dtype} (tag {tag})"),
                    false,
                ));
            }
        };
        let bytes = value.byte_len() as u64;
        let edge = self.edge(tag);
        let started = (self.executor.collectives).start_encoded(kind, codec, edge, group.to_vec(), value);
        Ok(((started, group.to_vec(), held), bytes))
    }

    async fn wait_collective(
        &mut self,
        _index: usize,
        tensor: &TensorId,
        tag: u64,
        (started, group, held): Self::Started,
    ) -> Result<u64, Failed> {
        let executor = &mut *self.executor;
        executor.progress.wait_on(Waiting::Collective { tag, group });
        let (finished, read) = started.wait();
        executor.progress.wait_on(Waiting::Nothing);
        let value = finished.map_err(fabric_failed)?;
        count_read(executor, FabricKind::of_collective(tensor), read);
        let bytes = value.byte_len() as u64;
        let value = value.cast_float(held).map_err(|value| {
            let why = format!(
                "collective {tag} gave `{tensor}` as {}, not a float",
                value.dtype()
            );
            (why, false)
        })?;
        executor.table.insert(tensor.clone(), value);
        Ok(bytes)
    }

    fn unstarted(&mut self, _index: usize, tag: u64) -> Failed {
        (format!("collective {tag} was not started"), false)
    }
}
