//! The device actor: a ractor actor that owns one device and runs its instruction stream.
//!
//! The actor receives control messages (`Step`, queries, `Stop`) and hands the work to a
//! dedicated OS thread that owns the burn module and the executor — compute never blocks the
//! async runtime, and one thread per device keeps kernels single-threaded (one actor per core).
//! Results go straight to the controller's event channel as [`ActorEvent`]s.

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc::UnboundedSender;

use archipelago_dataflow::{ActorId, DeviceSpec, Instruction};

use crate::error::ActorFailure;
use crate::executor::{Computation, Executor, StepReport};
use crate::fabric::Fabric;

/// Builds an actor's computation on its own thread (so the burn module is made where it lives).
pub type ComputationFactory = Box<dyn FnOnce() -> Result<Box<dyn Computation>, String> + Send>;

/// What actors tell the controller.
#[derive(Debug)]
pub enum ActorEvent {
    /// The actor built its computation and waits for steps.
    Ready {
        /// The actor.
        actor: ActorId,
    },
    /// A step finished on this actor.
    StepDone(Box<StepReport>),
    /// The actor failed (while starting or in a step).
    Failed(Box<ActorFailure>),
}

/// Control messages of a device actor.
pub enum DeviceMsg {
    /// Run the stream once as step `n`.
    Step(u64),
    /// Reply with the sums of squares of the parameters this actor answers for, by block index
    /// (summed over all actors they give each block's squared norm once).
    BlockSquares(RpcReplyPort<Vec<(usize, f64)>>),
    /// Reply with a copy of the parameters of each block held, by block index (tests and
    /// debugging; copies the bytes).
    BlockParams(RpcReplyPort<Vec<(usize, Vec<f32>)>>),
    /// Write this actor's shard of the trainable state into the checkpoint directory given and
    /// reply with the file written (`None` when another replica saves the same state).
    Checkpoint(std::path::PathBuf, RpcReplyPort<CheckpointResult>),
}

/// What a device actor answers to [`DeviceMsg::Checkpoint`].
pub type CheckpointResult = Result<Option<crate::checkpoint::ShardFile>, String>;

/// Everything a device actor needs to start.
pub struct DeviceActorArgs {
    /// The job's name.
    pub job: String,
    /// The actor's id.
    pub actor: ActorId,
    /// Its device.
    pub device: DeviceSpec,
    /// Its instruction stream.
    pub stream: Vec<Instruction>,
    /// Builds its computation.
    pub computation: ComputationFactory,
    /// The fabric to its peers.
    pub fabric: Arc<dyn Fabric>,
    /// Where to send events.
    pub events: UnboundedSender<ActorEvent>,
    /// Where the executor records the instruction it runs.
    pub progress: Arc<crate::progress::ActorProgress>,
    /// The executor thread's queue (made by [`work_queue`]; the gang keeps a [`WorkQueue`] to
    /// dispatch steps straight to the thread).
    pub inbox: WorkInbox,
    /// The sending end of `inbox`, for the actor's own messages.
    pub queue: WorkQueue,
}

/// Sends work to a device actor's executor thread directly (a step costs one channel send and
/// one thread wake-up, no actor-mailbox hop).
#[derive(Clone)]
pub struct WorkQueue(mpsc::Sender<Work>);

impl WorkQueue {
    /// Asks for step `n`; false when the executor thread has ended (after a failure it reported).
    pub fn step(&self, n: u64) -> bool {
        self.0.send(Work::Step(n)).is_ok()
    }
}

/// The executor thread's end of its [`WorkQueue`].
pub struct WorkInbox(mpsc::Receiver<Work>);

/// A queue to one device actor's executor thread.
pub fn work_queue() -> (WorkQueue, WorkInbox) {
    let (send, receive) = mpsc::channel();
    (WorkQueue(send), WorkInbox(receive))
}

/// What a device actor's executor thread is asked to do.
enum Work {
    Step(u64),
    Squares(RpcReplyPort<Vec<(usize, f64)>>),
    Params(RpcReplyPort<Vec<(usize, Vec<f32>)>>),
    Checkpoint(std::path::PathBuf, RpcReplyPort<CheckpointResult>),
}

/// The actor's state: the channel to its executor thread.
pub struct DeviceState {
    work: Option<WorkQueue>,
    thread: Option<JoinHandle<()>>,
}

/// The device actor.
pub struct DeviceActor;

impl Actor for DeviceActor {
    type Msg = DeviceMsg;
    type State = DeviceState;
    type Arguments = DeviceActorArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<DeviceMsg>,
        args: DeviceActorArgs,
    ) -> Result<DeviceState, ActorProcessingErr> {
        let work = args.queue.clone();
        let name = format!("actor-{}-{}", args.actor, args.device);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || executor_thread(args))?;
        Ok(DeviceState {
            work: Some(work),
            thread: Some(thread),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<DeviceMsg>,
        message: DeviceMsg,
        state: &mut DeviceState,
    ) -> Result<(), ActorProcessingErr> {
        let work = match message {
            DeviceMsg::Step(n) => Work::Step(n),
            DeviceMsg::BlockSquares(reply) => Work::Squares(reply),
            DeviceMsg::BlockParams(reply) => Work::Params(reply),
            DeviceMsg::Checkpoint(dir, reply) => Work::Checkpoint(dir, reply),
        };
        if let Some(queue) = &state.work {
            // A closed queue means the executor thread ended after a failure it already reported.
            let _ = queue.0.send(work);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DeviceMsg>,
        state: &mut DeviceState,
    ) -> Result<(), ActorProcessingErr> {
        state.work.take();
        if let Some(thread) = state.thread.take() {
            tokio::task::spawn_blocking(move || thread.join()).await?.ok();
        }
        Ok(())
    }
}

fn executor_thread(args: DeviceActorArgs) {
    let DeviceActorArgs {
        job,
        actor,
        device,
        stream,
        computation,
        fabric,
        events,
        progress,
        inbox,
        queue,
    } = args;
    // Only the actor and the gang send; the thread ends when both have let go.
    drop(queue);
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(computation))
        .unwrap_or_else(|p| Err(crate::error::panic_message(p.as_ref())));
    let computation = match built {
        Ok(c) => c,
        Err(message) => {
            fabric.abort(&format!("actor {actor} failed to start"));
            let failure = ActorFailure {
                job,
                step: 0,
                actor,
                device,
                index: None,
                instruction: "building its blocks".into(),
                message,
                secondary: false,
                actor_type: String::new(),
                host: String::new(),
            };
            let _ = events.send(ActorEvent::Failed(Box::new(failure)));
            return;
        }
    };
    let mut executor =
        Executor::new(&job, actor, device, stream, computation, fabric).with_progress(progress);
    let _ = events.send(ActorEvent::Ready { actor });
    for work in inbox.0 {
        match work {
            Work::Step(n) => match executor.run_step(n) {
                Ok(report) => {
                    let _ = events.send(ActorEvent::StepDone(Box::new(report)));
                }
                Err(failure) => {
                    let _ = events.send(ActorEvent::Failed(failure));
                }
            },
            Work::Squares(reply) => {
                let _ = reply.send(executor.block_squares());
            }
            Work::Params(reply) => {
                let _ = reply.send(executor.block_params());
            }
            Work::Checkpoint(dir, reply) => {
                let _ = reply.send(executor.save_checkpoint(&dir));
            }
        }
    }
}
