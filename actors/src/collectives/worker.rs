//! The collective worker: one thread per actor that runs its collectives in the order they were
//! started, while the actor's compute thread goes on (DDP-style overlap of backward and
//! all-reduce).

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use archipelago_dataflow::{ActorId, CollectiveKind};

use super::hierarchical::{Islands, hierarchical_all_reduce};
use super::ring_all_reduce::{ChunkPool, shard_range};
use super::{all_gather, all_reduce, reduce_scatter};
use crate::fabric::{Fabric, FabricError};
use crate::typed_tensor::TypedTensor;

struct Job {
    kind: CollectiveKind,
    edge: u64,
    group: Vec<ActorId>,
    tensor: TypedTensor,
    done: mpsc::Sender<Finished>,
}

/// A collective's result, and the bytes this member read from its peers in it
/// ([`crate::fabric::read_count`]).
type Finished = (Result<TypedTensor, FabricError>, u64);

/// A started collective; [`PendingCollective::wait`] returns its result.
pub struct PendingCollective {
    done: mpsc::Receiver<Finished>,
}

impl PendingCollective {
    /// Blocks until the collective finished on this actor; its result, and the bytes this
    /// member read from its peers in it.
    pub fn wait(self) -> Finished {
        self.done.recv().unwrap_or_else(|_| {
            let stopped = FabricError::Aborted("the collective worker stopped".into());
            (Err(stopped), 0)
        })
    }
}

/// Runs one actor's collectives on a thread of its own.
pub struct CollectiveWorker {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl CollectiveWorker {
    /// Starts the worker of actor `me`.
    pub fn spawn(me: ActorId, fabric: Arc<dyn Fabric>, chunk_elems: usize) -> CollectiveWorker {
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("collectives-{me}"))
            .spawn(move || {
                let mut pool = ChunkPool::default();
                for job in queue {
                    crate::fabric::read_count::take();
                    let shape = job.tensor.shape().to_vec();
                    let mut data = job.tensor.into_f32_vec();
                    let (fabric, group, edge) = (fabric.as_ref(), &job.group, job.edge);
                    let result = match job.kind {
                        CollectiveKind::AllReduceSum => {
                            all_reduce(fabric, me, group, edge, &mut data, chunk_elems, &mut pool)
                        }
                        CollectiveKind::ReduceScatterSum => {
                            reduce_scatter(fabric, me, group, edge, &mut data, chunk_elems, &mut pool)
                        }
                        CollectiveKind::AllGather => {
                            all_gather(fabric, me, group, edge, &mut data, chunk_elems, &mut pool)
                        }
                        CollectiveKind::HierarchicalAllReduceSum { island_size } => hierarchical_all_reduce(
                            fabric,
                            me,
                            Islands {
                                members: group,
                                size: island_size,
                            },
                            edge,
                            &mut data,
                            chunk_elems,
                            &mut pool,
                        ),
                    }
                    .map(|()| match job.kind {
                        // A reduce-scatter leaves this member only its shard (ZeRO-2 keeps no more).
                        CollectiveKind::ReduceScatterSum => {
                            let i = job.group.iter().position(|&a| a == me).unwrap_or(0);
                            let own = shard_range(data.len(), job.group.len().max(1), i);
                            TypedTensor::flat(data[own].to_vec())
                        }
                        _ => TypedTensor::new(shape, data),
                    });
                    let _ = job.done.send((result, crate::fabric::read_count::take()));
                }
            })
            .expect("spawn collective worker");
        CollectiveWorker {
            jobs: Some(jobs),
            thread: Some(thread),
        }
    }

    /// Queues a collective; it runs after every collective started before it.
    pub fn start(
        &self,
        kind: CollectiveKind,
        edge: u64,
        group: Vec<ActorId>,
        tensor: TypedTensor,
    ) -> PendingCollective {
        let (done, result) = mpsc::channel();
        let job = Job {
            kind,
            edge,
            group,
            tensor,
            done,
        };
        if let Some(jobs) = &self.jobs
            && let Err(mpsc::SendError(job)) = jobs.send(job)
        {
            let stopped = FabricError::Aborted("the collective worker stopped".into());
            let _ = job.done.send((Err(stopped), 0));
        }
        PendingCollective { done: result }
    }
}

impl Drop for CollectiveWorker {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
