//! The collective worker: one thread per actor that runs its collectives in the order they were
//! started, while the actor's compute thread goes on (DDP-style overlap of backward and
//! all-reduce).

use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use archipelago_dataflow::{ActorId, Codec, CollectiveKind};
use half::{bf16, f16};

use super::element::Reducible;
use super::hierarchical::{Islands, hierarchical_all_reduce};
use super::onebit::{OneBit, onebit_all_reduce};
use super::quantized::Wire;
use super::ring_all_reduce::{ChunkPool, shard_range};
use super::sparse::{Residuals, TopK, topk_all_reduce};
use super::{all_gather, all_reduce, all_reduce_max, reduce_scatter};
use crate::fabric::read_count::Read;
use crate::fabric::{Fabric, FabricError};
use crate::typed_tensor::{DType, Element, TypedTensor};

struct Job {
    kind: CollectiveKind,
    codec: Codec,
    edge: u64,
    group: Vec<ActorId>,
    tensor: TypedTensor,
    /// Which actors are on another island than this one (for the crossing bytes).
    far: Arc<[bool]>,
    done: mpsc::Sender<Finished>,
}

/// A collective's result, and the bytes this member read from its peers in it
/// ([`crate::fabric::read_count`]).
type Finished = (Result<TypedTensor, FabricError>, Read);

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
            (Err(stopped), Read::default())
        })
    }
}

/// Runs one actor's collectives on a thread of its own.
pub struct CollectiveWorker {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    /// Top-k's error-feedback residuals, by bucket (the worker's while a collective runs; read
    /// and written between steps for checkpoints).
    residuals: Arc<Mutex<Residuals>>,
    /// Which actors are on another island than this one (none by default).
    far: Arc<[bool]>,
}

impl CollectiveWorker {
    /// Starts the worker of actor `me`.
    pub fn spawn(me: ActorId, fabric: Arc<dyn Fabric>, chunk_elems: usize) -> CollectiveWorker {
        let (jobs, queue) = mpsc::channel::<Job>();
        let residuals = Arc::new(Mutex::new(Residuals::new()));
        let kept = residuals.clone();
        let thread = std::thread::Builder::new()
            .name(format!("collectives-{me}"))
            .spawn(move || {
                let mut pool = ChunkPool::default();
                for job in queue {
                    let Job {
                        kind,
                        codec,
                        edge,
                        group,
                        tensor,
                        far,
                        done,
                    } = job;
                    crate::fabric::read_count::set_far(far);
                    crate::fabric::read_count::take_read();
                    let call = Call {
                        kind,
                        codec,
                        edge,
                        group: &group,
                    };
                    let result = match (TopK::of(codec), OneBit::of(codec)) {
                        (Some(topk), _) => {
                            let mut residuals = kept.lock().unwrap_or_else(|p| p.into_inner());
                            f32_all_reduce(&call, tensor, |data| {
                                let call = (&group[..], edge);
                                topk_all_reduce(fabric.as_ref(), me, call, data, topk, &mut residuals)
                            })
                        }
                        (_, Some(onebit)) => {
                            let mut state = kept.lock().unwrap_or_else(|p| p.into_inner());
                            let f = fabric.as_ref();
                            let dense =
                                |d: &mut [f32]| all_reduce(f, me, &group, edge, d, chunk_elems, &mut pool);
                            f32_all_reduce(&call, tensor, |data| {
                                onebit_all_reduce(f, me, (&group, edge), data, onebit, &mut state, dense)
                            })
                        }
                        _ => run_job(fabric.as_ref(), me, chunk_elems, &mut pool, &call, tensor),
                    };
                    let _ = done.send((result, crate::fabric::read_count::take_read()));
                }
            })
            .expect("spawn collective worker");
        CollectiveWorker {
            jobs: Some(jobs),
            thread: Some(thread),
            residuals,
            far: Arc::from(Vec::new()),
        }
    }

    /// Counts bytes read from the actors marked in `far` (by id) as crossing islands.
    pub fn set_far(&mut self, far: Arc<[bool]>) {
        self.far = far;
    }

    /// Writes actor `me`'s top-k residuals into checkpoint directory `dir` (nothing when it
    /// keeps none); between steps, with no collective running.
    pub fn save_residuals(&self, dir: &Path, me: ActorId) -> Result<(), String> {
        let residuals = self.residuals.lock().unwrap_or_else(|p| p.into_inner());
        super::residual_file::write(dir, me, &residuals)
    }

    /// Takes actor `me`'s top-k residuals from checkpoint directory `dir` (none when it wrote
    /// none), before the first step.
    pub fn restore_residuals(&self, dir: &Path, me: ActorId) -> Result<(), String> {
        let restored = super::residual_file::read(dir, me)?;
        *self.residuals.lock().unwrap_or_else(|p| p.into_inner()) = restored;
        Ok(())
    }

    /// Queues a collective; it runs after every collective started before it.
    pub fn start(
        &self,
        kind: CollectiveKind,
        edge: u64,
        group: Vec<ActorId>,
        tensor: TypedTensor,
    ) -> PendingCollective {
        self.start_encoded(kind, Codec::None, edge, group, tensor)
    }

    /// Queues a collective whose payload crosses as `codec` says (issue 43's compression).
    pub fn start_encoded(
        &self,
        kind: CollectiveKind,
        codec: Codec,
        edge: u64,
        group: Vec<ActorId>,
        tensor: TypedTensor,
    ) -> PendingCollective {
        let (done, result) = mpsc::channel();
        let job = Job {
            kind,
            codec,
            edge,
            group,
            tensor,
            far: self.far.clone(),
            done,
        };
        if let Some(jobs) = &self.jobs
            && let Err(mpsc::SendError(job)) = jobs.send(job)
        {
            let stopped = FabricError::Aborted("the collective worker stopped".into());
            let _ = job.done.send((Err(stopped), Read::default()));
        }
        PendingCollective { done: result }
    }
}

/// Runs collective `kind` over `tensor` on `me`'s side at once, on this thread (what the worker
/// runs, for callers with a thread of their own: the runtime API's collective groups).
pub(crate) fn run_collective(
    fabric: &dyn Fabric,
    me: ActorId,
    kind: CollectiveKind,
    edge: u64,
    group: &[ActorId],
    tensor: TypedTensor,
) -> Result<TypedTensor, FabricError> {
    let call = Call {
        kind,
        codec: Codec::None,
        edge,
        group,
    };
    let mut pool = ChunkPool::default();
    run_job(fabric, me, super::DEFAULT_CHUNK_ELEMS, &mut pool, &call, tensor)
}

/// What one collective is, but its tensor.
struct Call<'a> {
    kind: CollectiveKind,
    codec: Codec,
    edge: u64,
    group: &'a [ActorId],
}

/// Runs collective `job` over `tensor` on `me`'s side: f32 on every collective (in place,
/// without copies, but for the maximum's gather buffer), bf16 and f16 on the flat sums and the
/// gather (sums accumulated in f32), and any other dtype gathered only; a maximum of other than
/// f32 is refused.
fn run_job(
    fabric: &dyn Fabric,
    me: ActorId,
    chunk_elems: usize,
    pool: &mut ChunkPool,
    job: &Call,
    tensor: TypedTensor,
) -> Result<TypedTensor, FabricError> {
    if let Some(wire) = Wire::of(job.codec) {
        return run_quantized(fabric, me, job, tensor, wire);
    }
    match tensor.dtype() {
        DType::F32 => run_f32(fabric, me, chunk_elems, pool, job, tensor),
        DType::BF16 => run_reducible::<bf16>(fabric, me, chunk_elems, pool, job, tensor),
        DType::F16 => run_reducible::<f16>(fabric, me, chunk_elems, pool, job, tensor),
        DType::I8 => run_gather::<i8>(fabric, me, chunk_elems, pool, job, tensor),
        DType::U8 => run_gather::<u8>(fabric, me, chunk_elems, pool, job, tensor),
        DType::I32 => run_gather::<i32>(fabric, me, chunk_elems, pool, job, tensor),
        DType::I64 => run_gather::<i64>(fabric, me, chunk_elems, pool, job, tensor),
    }
}

/// This member's shard of a reduce-scattered buffer (ZeRO-2 keeps no more).
fn own_shard<T: Element>(job: &Call, me: ActorId, data: &[T]) -> TypedTensor {
    let i = job.group.iter().position(|&a| a == me).unwrap_or(0);
    let own = shard_range(data.len(), job.group.len().max(1), i);
    TypedTensor::from_values(vec![own.len()], &data[own])
}

fn run_f32(
    fabric: &dyn Fabric,
    me: ActorId,
    chunk_elems: usize,
    pool: &mut ChunkPool,
    job: &Call,
    tensor: TypedTensor,
) -> Result<TypedTensor, FabricError> {
    let shape = tensor.shape().to_vec();
    let mut data = tensor.into_f32_vec();
    let (group, edge) = (job.group, job.edge);
    match job.kind {
        CollectiveKind::AllReduceSum => all_reduce(fabric, me, group, edge, &mut data, chunk_elems, pool)?,
        CollectiveKind::ReduceScatterSum => {
            reduce_scatter(fabric, me, group, edge, &mut data, chunk_elems, pool)?;
            return Ok(own_shard(job, me, &data));
        }
        CollectiveKind::AllGather => all_gather(fabric, me, group, edge, &mut data, chunk_elems, pool)?,
        CollectiveKind::HierarchicalAllReduceSum { island_size } => {
            let islands = Islands {
                members: group,
                size: island_size,
            };
            hierarchical_all_reduce(fabric, me, islands, edge, &mut data, chunk_elems, pool)?
        }
        CollectiveKind::AllReduceMax => {
            all_reduce_max(fabric, me, group, edge, &mut data, chunk_elems, pool)?
        }
    }
    Ok(TypedTensor::new(shape, data))
}

/// A collective whose values cross quantized ([`super::quantized`]): f32 all-reduces,
/// reduce-scatters and all-gathers only (what the compression pass writes; the verifier refuses
/// others).
fn run_quantized(
    fabric: &dyn Fabric,
    me: ActorId,
    job: &Call,
    tensor: TypedTensor,
    wire: Wire,
) -> Result<TypedTensor, FabricError> {
    if tensor.dtype() != DType::F32 {
        return Err(FabricError::Aborted(format!(
            "a {}-compressed {:?} encodes f32 values; this one brought {}",
            job.codec,
            job.kind,
            tensor.dtype()
        )));
    }
    let shape = tensor.shape().to_vec();
    let mut data = tensor.into_f32_vec();
    let call = (job.group, job.edge);
    super::quantized::quantized_collective(fabric, me, job.kind, call, &mut data, wire)?;
    if job.kind == CollectiveKind::ReduceScatterSum {
        return Ok(own_shard(job, me, &data));
    }
    Ok(TypedTensor::new(shape, data))
}

/// A top-k all-reduce with error feedback ([`super::sparse`]), the residuals this actor keeps
/// by bucket in `residuals`: f32 all-reduces only.
/// A compressed all-reduce that runs on the bucket's f32 values (top-k's, 1-bit Adam's):
/// `reduce` gets them in place; any other kind or dtype is refused.
fn f32_all_reduce(
    job: &Call,
    tensor: TypedTensor,
    reduce: impl FnOnce(&mut [f32]) -> Result<(), FabricError>,
) -> Result<TypedTensor, FabricError> {
    if tensor.dtype() != DType::F32 || job.kind != CollectiveKind::AllReduceSum {
        return Err(FabricError::Aborted(format!(
            "a {}-compressed collective is an all-reduce of f32 values; this one is {:?} of {}",
            job.codec,
            job.kind,
            tensor.dtype()
        )));
    }
    let shape = tensor.shape().to_vec();
    let mut data = tensor.into_f32_vec();
    reduce(&mut data)?;
    Ok(TypedTensor::new(shape, data))
}

fn run_reducible<T: Reducible>(
    fabric: &dyn Fabric,
    me: ActorId,
    chunk_elems: usize,
    pool: &mut ChunkPool,
    job: &Call,
    mut tensor: TypedTensor,
) -> Result<TypedTensor, FabricError> {
    let (group, edge) = (job.group, job.edge);
    let data = tensor.values_mut::<T>();
    match job.kind {
        CollectiveKind::AllReduceSum => all_reduce(fabric, me, group, edge, data, chunk_elems, pool)?,
        CollectiveKind::ReduceScatterSum => {
            reduce_scatter(fabric, me, group, edge, data, chunk_elems, pool)?;
            return Ok(own_shard(job, me, data));
        }
        CollectiveKind::AllGather => all_gather(fabric, me, group, edge, data, chunk_elems, pool)?,
        CollectiveKind::HierarchicalAllReduceSum { .. } => {
            return Err(FabricError::Aborted(format!(
                "a hierarchical all-reduce runs on f32; this one brought {}",
                T::DTYPE
            )));
        }
        CollectiveKind::AllReduceMax => return Err(max_runs_on_f32(T::DTYPE)),
    }
    Ok(tensor)
}

fn run_gather<T: Element>(
    fabric: &dyn Fabric,
    me: ActorId,
    chunk_elems: usize,
    pool: &mut ChunkPool,
    job: &Call,
    mut tensor: TypedTensor,
) -> Result<TypedTensor, FabricError> {
    if job.kind == CollectiveKind::AllReduceMax {
        return Err(max_runs_on_f32(T::DTYPE));
    }
    if job.kind != CollectiveKind::AllGather {
        return Err(FabricError::Aborted(format!(
            "{:?} sums, and {} elements are only gathered (sums run on f32, bf16 and f16)",
            job.kind,
            T::DTYPE
        )));
    }
    let data = tensor.values_mut::<T>();
    all_gather(fabric, me, job.group, job.edge, data, chunk_elems, pool)?;
    Ok(tensor)
}

/// The refusal of an all-reduce of the maximum over `dtype` elements (the loss statistics it
/// serves are f32; every member brings the same dtype, so every member refuses alike).
fn max_runs_on_f32(dtype: DType) -> FabricError {
    FabricError::Aborted(format!(
        "an all-reduce of the maximum runs on f32 only; this one brought {dtype}"
    ))
}

impl Drop for CollectiveWorker {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
