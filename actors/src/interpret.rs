//! The one interpreter of instruction streams (Pathways' single runtime for training steps and
//! compiled programs; Barham et al. 2022): [`interpret`] walks one participant's stream in
//! order, pairs every `WaitCollective` with the `StartCollective` of its tag, and hands each
//! instruction to the [`Participant`] that carries it out — a training step
//! ([`crate::executor`]: tensors by id, the blocking fabric, the collective worker) or an
//! iteration of a compiled program (`runtime::compiled`: the slots its lowering gave, async
//! routes, collective groups). What only one of them does (spans, progress, timings) sits in
//! the hooks around each instruction.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use archipelago_dataflow::{ActorId, Codec, CollectiveKind, ComputeOp, DType, Instruction, TensorId};

/// A `StartCollective` as the walker hands it over.
pub(crate) struct CollectiveStart<'a> {
    /// Which collective.
    pub(crate) kind: CollectiveKind,
    /// The local tensor it replaces.
    pub(crate) tensor: &'a TensorId,
    /// Members in ring order.
    pub(crate) group: &'a [ActorId],
    /// Identifies it across members.
    pub(crate) tag: u64,
    /// The element type every member brings.
    pub(crate) dtype: DType,
    /// How its payload crosses the fabric.
    pub(crate) codec: Codec,
}

/// What carries out a stream's instructions. Every instruction returns the bytes it moved
/// (sends, receives, collectives; 0 for compute) or what stops the walk.
#[allow(async_fn_in_trait)]
pub(crate) trait Participant {
    /// A collective started and not yet waited for.
    type Started;
    /// What stops the walk (an error, or the end of the program).
    type Stop;

    /// Before instruction `index` runs.
    fn begin(&mut self, index: usize, instruction: &Instruction) {
        let _ = (index, instruction);
    }
    /// After instruction `index` ran, having moved `bytes`.
    fn end(&mut self, index: usize, instruction: &Instruction, bytes: u64) {
        let _ = (index, instruction, bytes);
    }
    /// Local compute.
    async fn compute(
        &mut self,
        index: usize,
        op: &ComputeOp,
        inputs: &[TensorId],
        outputs: &[TensorId],
    ) -> Result<u64, Self::Stop>;
    /// Sends a local tensor to a peer (without waiting for it).
    async fn send(
        &mut self,
        index: usize,
        tensor: &TensorId,
        to: ActorId,
        tag: u64,
    ) -> Result<u64, Self::Stop>;
    /// Waits for a tensor from a peer.
    async fn recv(
        &mut self,
        index: usize,
        tensor: &TensorId,
        from: ActorId,
        tag: u64,
    ) -> Result<u64, Self::Stop>;
    /// Starts a collective; what it returns is handed to the wait of the same tag.
    async fn start_collective(
        &mut self,
        index: usize,
        start: CollectiveStart<'_>,
    ) -> Result<(Self::Started, u64), Self::Stop>;
    /// Waits for the started collective of `tag` and puts its result under `tensor`.
    async fn wait_collective(
        &mut self,
        index: usize,
        tensor: &TensorId,
        tag: u64,
        started: Self::Started,
    ) -> Result<u64, Self::Stop>;
    /// What stops the walk at a wait whose collective (`tag`) was never started.
    fn unstarted(&mut self, index: usize, tag: u64) -> Self::Stop;
}

/// Walks `stream` once with `participant`: `Err((index, stop))` names the instruction that
/// stopped it. A collective started and never waited for is dropped with the walk.
pub(crate) async fn interpret<P: Participant>(
    stream: &[Instruction],
    participant: &mut P,
) -> Result<(), (usize, P::Stop)> {
    let mut pending: HashMap<u64, P::Started> = HashMap::new();
    for (index, instruction) in stream.iter().enumerate() {
        participant.begin(index, instruction);
        let at = |stop| (index, stop);
        let bytes = match instruction {
            Instruction::Compute { op, inputs, outputs } => {
                participant.compute(index, op, inputs, outputs).await
            }
            Instruction::Send { tensor, to, tag } => participant.send(index, tensor, *to, *tag).await,
            Instruction::Recv { tensor, from, tag } => participant.recv(index, tensor, *from, *tag).await,
            Instruction::StartCollective {
                kind,
                tensor,
                group,
                tag,
                dtype,
                codec,
            } => {
                let start = CollectiveStart {
                    kind: *kind,
                    tensor,
                    group,
                    tag: *tag,
                    dtype: *dtype,
                    codec: *codec,
                };
                let (started, bytes) = participant.start_collective(index, start).await.map_err(at)?;
                pending.insert(*tag, started);
                Ok(bytes)
            }
            Instruction::WaitCollective { tensor, tag } => match pending.remove(tag) {
                Some(started) => participant.wait_collective(index, tensor, *tag, started).await,
                None => Err(participant.unstarted(index, *tag)),
            },
        }
        .map_err(at)?;
        participant.end(index, instruction, bytes);
    }
    Ok(())
}

/// Wakes the thread that blocks on a walk.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `walk` to its end on this thread (a training step, whose participant blocks inside its
/// instructions, finishes at its first poll). Not `futures::executor::block_on`: a computation
/// that blocks on a future of its own (a GPU read-back) must not meet "an executor inside an
/// executor".
pub(crate) fn block_on<F: Future>(walk: F) -> F::Output {
    let mut walk = std::pin::pin!(walk);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut context = Context::from_waker(&waker);
    loop {
        match walk.as_mut().poll(&mut context) {
            Poll::Ready(output) => return output,
            Poll::Pending => std::thread::park(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes down what it is handed; fails a send to actor 9.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl Participant for Log {
        type Started = u64;
        type Stop = String;
        fn end(&mut self, index: usize, _: &Instruction, bytes: u64) {
            self.0.push(format!("end {index} {bytes}"));
        }
        async fn compute(
            &mut self,
            i: usize,
            _: &ComputeOp,
            _: &[TensorId],
            _: &[TensorId],
        ) -> Result<u64, String> {
            self.0.push(format!("compute {i}"));
            Ok(0)
        }
        async fn send(&mut self, i: usize, _: &TensorId, to: ActorId, _: u64) -> Result<u64, String> {
            if to == 9 {
                return Err(format!("no actor {to}"));
            }
            self.0.push(format!("send {i}"));
            Ok(4)
        }
        async fn recv(&mut self, i: usize, _: &TensorId, _: ActorId, _: u64) -> Result<u64, String> {
            self.0.push(format!("recv {i}"));
            Ok(4)
        }
        async fn start_collective(
            &mut self,
            i: usize,
            start: CollectiveStart<'_>,
        ) -> Result<(u64, u64), String> {
            self.0.push(format!("start {i}"));
            Ok((start.tag * 10, 8))
        }
        async fn wait_collective(
            &mut self,
            i: usize,
            _: &TensorId,
            tag: u64,
            started: u64,
        ) -> Result<u64, String> {
            self.0.push(format!("wait {i} tag {tag} started {started}"));
            Ok(8)
        }
        fn unstarted(&mut self, index: usize, tag: u64) -> String {
            format!("wait {index}: collective {tag} was not started")
        }
    }

    fn start(tag: u64) -> Instruction {
        Instruction::StartCollective {
            kind: CollectiveKind::AllReduceSum,
            tensor: TensorId::named("g"),
            group: vec![0, 1],
            tag,
            dtype: DType::F32,
            codec: Codec::None,
        }
    }

    fn wait(tag: u64) -> Instruction {
        Instruction::WaitCollective {
            tensor: TensorId::named("g"),
            tag,
        }
    }

    fn send(to: ActorId) -> Instruction {
        Instruction::Send {
            tensor: TensorId::named("x"),
            to,
            tag: 1,
        }
    }

    #[test]
    fn walks_in_order_and_pairs_each_wait_with_its_start() {
        let stream = vec![
            Instruction::Recv {
                tensor: TensorId::named("x"),
                from: 1,
                tag: 1,
            },
            start(5),
            start(6),
            send(1),
            wait(6),
            wait(5),
        ];
        let mut log = Log::default();
        block_on(interpret(&stream, &mut log)).unwrap();
        let seen: Vec<&str> = log.0.iter().map(String::as_str).collect();
        assert_eq!(
            seen,
            [
                "recv 0",
                "end 0 4",
                "start 1",
                "end 1 8",
                "start 2",
                "end 2 8",
                "send 3",
                "end 3 4",
                "wait 4 tag 6 started 60",
                "end 4 8",
                "wait 5 tag 5 started 50",
                "end 5 8"
            ]
        );
    }

    #[test]
    fn names_the_instruction_that_stopped_the_walk() {
        let mut log = Log::default();
        let stopped = block_on(interpret(&[start(5), wait(5), wait(5)], &mut log));
        assert_eq!(stopped, Err((2, "wait 2: collective 5 was not started".into())));
        let mut log = Log::default();
        let stopped = block_on(interpret(&[send(1), send(9), send(1)], &mut log));
        assert_eq!(stopped, Err((1, "no actor 9".into())));
        assert_eq!(
            log.0,
            ["send 0", "end 0 4"],
            "nothing after the failed instruction runs"
        );
    }
}
