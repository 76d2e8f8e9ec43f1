//! Where an actor's training state lives — one small abstraction over the three stores the plan
//! can give it (`ActorTraining::state`, `offload`): host memory, the device (`--state device`), or
//! an offload tier (`--offload cpu|nvme`, ZeRO-Offload/Infinity: Ren et al., USENIX ATC 2021;
//! Rajbhandari et al., SC 2021).
//!
//! What the trainer keeps of each segment is the plan's data ([`SegmentPlan`]: the part it holds,
//! updates, receives and saves); a store answers for where those parts' values and optimizer
//! state are. The trainer asks it for a segment's held parameters, for a region's parameters and
//! state (checkpoints), to take a region back (restore), for the shard an all-gather starts from,
//! and for its bytes and step count — the same questions whatever the ZeRO stage, answered here
//! per store. The update itself is each store's own: `zero.rs` (host), `store_device.rs` with
//! `device_state.rs` and `device_lamb.rs` (device), `store_offload.rs` (offload).

use std::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use std::borrow::Cow;
use std::collections::HashMap;

use archipelago_dataflow::{ActorId, ActorTraining, OffloadTraffic, OptimizerSpec, SegmentPlan, TensorId};

use super::Sharding;
use super::device_state::DeviceState;
use crate::offload::OffloadActor;
use crate::optim::{FlatOptimizer, ParamLayout};
use crate::typed_tensor::TypedTensor;

/// The optimizer state (and, for some, the parameters) of an actor, by where it lives.
pub(super) enum Store<B: Backend> {
    /// Host memory: the trainer's held vector and the flat optimizer's state.
    Host,
    /// The device: each segment's master, moments and gradient bucket as tensors there
    /// (authoritative; the held vector and the optimizer's moments are host copies brought up to
    /// date by `sync_host` before anything reads them).
    Device(DeviceState<B>),
    /// An offload tier (its own actor, with pinned CPU memory or NVMe files).
    Offload(OffloadStore),
}

/// The offload store: the offload actor and what the trainer tracks of it.
pub(super) struct OffloadStore {
    pub(super) actor: OffloadActor,
    /// ZeRO-3 with `--offload-params`: the parameter shards live in the tier too (the held
    /// vector is empty).
    pub(super) params_in_tier: bool,
    /// Segments (by first block) handed to the offload actor this step, in order.
    pub(super) handed_off: Vec<usize>,
    /// Optimizer steps taken (the offload actor's Adam step counter is this + 1).
    pub(super) steps_done: i32,
}

/// Where a segment's gathered parameters went ([`Store::take_gathered`]).
pub(super) enum Gathered<B: Backend> {
    /// Onto the device, as the segment's new master (for its modules).
    OnDevice(Tensor<B, 1>),
    /// Nowhere yet: the trainer keeps its held part and loads the modules from them.
    OnHost(TypedTensor),
}

/// What spawning an offload actor takes beside the plan: the actor it serves, the optimizer,
/// and each segment's parameter layout over its updated part.
pub(super) type OffloadSpawn<'a> = (
    ActorId,
    OptimizerSpec,
    &'a dyn Fn(&SegmentPlan) -> Result<ParamLayout, String>,
);

impl<B: Backend> Store<B> {
    /// The store the plan (`training`) gives an actor whose held parameters are `held`, as
    /// initialised: the offload tier (its actor spawned with each segment's updated part; the
    /// held vector emptied when the parameters live there too), or host memory — which the
    /// trainer moves onto the device next where the plan says (`upload_state`).
    pub(super) fn of_plan(
        training: &ActorTraining,
        sharding: &Sharding,
        held: &mut Vec<f32>,
        (actor, optimizer, layout): OffloadSpawn<'_>,
    ) -> Result<Store<B>, String> {
        if !training.offload.is_some() {
            return Ok(Store::Host);
        }
        let mut shards = HashMap::new();
        let mut layouts = HashMap::new();
        for s in sharding.segments.values() {
            layouts.insert(s.start, layout(s)?);
            shards.insert(s.start, held[s.in_held(&s.updated)].to_vec());
        }
        let actor = OffloadActor::spawn(&training.offload, actor, optimizer, shards, layouts)?;
        let params_in_tier = training.offload_params;
        if params_in_tier {
            *held = Vec::new();
        }
        Ok(Store::Offload(OffloadStore {
            actor,
            params_in_tier,
            handed_off: Vec::new(),
            steps_done: 0,
        }))
    }

    /// Elements of optimizer state the trainer's flat optimizer keeps (none where the offload
    /// actor keeps it).
    pub(super) fn optimizer_state_len(&self, sharding: &Sharding) -> usize {
        match self {
            Store::Offload(_) => 0,
            _ => sharding.state_len(),
        }
    }

    /// At a step's end: a host mirror of the device's moments made for a checkpoint is freed.
    pub(super) fn end_step(&self, optimizer: &mut FlatOptimizer) {
        if let Store::Device(_) = self {
            optimizer.release_state();
        }
    }

    /// The held vector's elements `range` to write into — `None` where the offload tier keeps
    /// the parameters (`--offload-params`: the held vector is empty).
    pub(super) fn held_mut<'h>(&self, held: &'h mut [f32], range: Range<usize>) -> Option<&'h mut [f32]> {
        self.holds_params_on_host().then(move || &mut held[range])
    }

    /// The offload store, or an error naming the plan's want of one.
    pub(super) fn offload(&self) -> Result<&OffloadStore, String> {
        match self {
            Store::Offload(o) => Ok(o),
            _ => Err("this actor has no offload actor (the plan has no --offload)".into()),
        }
    }

    /// As [`Store::offload`], mutably.
    pub(super) fn offload_mut(&mut self) -> Result<&mut OffloadStore, String> {
        match self {
            Store::Offload(o) => Ok(o),
            _ => Err("this actor has no offload actor (the plan has no --offload)".into()),
        }
    }

    /// The offload actor's figures, when the state lives in an offload tier.
    pub(super) fn offload_stats(&self) -> Option<crate::offload::OffloadStats> {
        self.offload().ok().map(|o| o.actor.stats())
    }

    /// The device state, when the state lives on the device.
    pub(super) fn device(&self) -> Option<&DeviceState<B>> {
        match self {
            Store::Device(d) => Some(d),
            _ => None,
        }
    }

    /// As [`Store::device`], mutably.
    pub(super) fn device_mut(&mut self) -> Option<&mut DeviceState<B>> {
        match self {
            Store::Device(d) => Some(d),
            _ => None,
        }
    }

    /// Optimizer steps taken (the offload actor counts its own).
    pub(super) fn steps(&self, optimizer: &FlatOptimizer) -> i32 {
        match self {
            Store::Offload(o) => o.steps_done,
            _ => optimizer.steps(),
        }
    }

    /// Sets the step count (a restore).
    pub(super) fn set_steps(&mut self, optimizer: &mut FlatOptimizer, steps: i32) {
        optimizer.set_steps(steps);
        if let Store::Offload(o) = self {
            o.steps_done = steps;
        }
    }

    /// Bytes of model state this actor holds: `held` parameters and `frozen` values (elements)
    /// and the optimizer's state — on the device, the device's own count.
    /// Bytes of the optimizer's state alone (moments; none for plain SGD).
    pub(super) fn optimizer_bytes(&self, optimizer: &FlatOptimizer) -> u64 {
        match self {
            Store::Device(d) => d.optimizer_bytes(),
            _ => optimizer.state_bytes(),
        }
    }

    pub(super) fn state_bytes(&self, held: usize, frozen: usize, optimizer: &FlatOptimizer) -> u64 {
        match self {
            Store::Device(d) => d.bytes() + 4 * frozen as u64,
            _ => 4 * (held + frozen) as u64 + optimizer.state_bytes(),
        }
    }

    /// The gradient bucket `name` as it leaves the actor for a collective, when the store keeps
    /// the buckets (on the device); `None` when the bucket is in the tensor table.
    pub(super) fn export_bucket(&mut self, name: &TensorId) -> Option<Vec<f32>> {
        self.device_mut()?.export_bucket(name)
    }

    /// Takes a micro-batch's gradients `parts` of bucket `name` when the store keeps buckets
    /// (on the device, summed there); gives them back for a bucket in host memory.
    pub(super) fn keep_grads(
        &mut self,
        name: &TensorId,
        parts: Vec<Tensor<B, 1>>,
        first: bool,
    ) -> Option<Vec<Tensor<B, 1>>> {
        match self {
            Store::Device(d) => {
                d.add_grads(name, parts, first);
                None
            }
            _ => Some(parts),
        }
    }

    /// Σx² over `own` of bucket `name` where the store keeps it; `None` when it is in the table.
    pub(super) fn grad_squares(&self, name: &TensorId, own: Range<usize>) -> Option<Result<f64, String>> {
        self.device()?.squares(name, own)
    }

    /// The held parameters of `segment` (its held part, in order): borrowed from the held
    /// vector, or read from the offload tier.
    pub(super) fn held_values<'h>(
        &self,
        held: &'h [f32],
        segment: &SegmentPlan,
    ) -> Result<Cow<'h, [f32]>, String> {
        match self {
            Store::Offload(o) if o.params_in_tier => {
                let len = segment.held.len();
                let values = o.actor.read_params(segment.start, vec![0.0; len], 0..len)?;
                Ok(Cow::Owned(values))
            }
            _ => Ok(Cow::Borrowed(&held[segment.in_held(&segment.held)])),
        }
    }

    /// `full` (a buffer of the segment's length) with this replica's updated part of `segment`
    /// written at its place, for the all-gather of a ZeRO-3 segment; counts what came from the
    /// tier in `traffic`.
    pub(super) fn shard_for_gather(
        &self,
        held: &[f32],
        segment: &SegmentPlan,
        mut full: Vec<f32>,
        traffic: &mut OffloadTraffic,
    ) -> Result<Vec<f32>, String> {
        let own = segment.updated.clone();
        match self {
            Store::Offload(o) if o.params_in_tier => {
                traffic.from_tier += 4 * own.len() as u64;
                o.actor.read_params(segment.start, full, own)
            }
            Store::Device(d) => {
                let (at, values) = d.updated_shard(segment.start)?;
                full[at].copy_from_slice(&values);
                Ok(full)
            }
            _ => {
                full[own.clone()].copy_from_slice(&held[segment.in_held(&own)]);
                Ok(full)
            }
        }
    }

    /// The parameters and each optimizer state tensor (`names`, in order) of `range` (within
    /// the updated part) of `segment`.
    pub(super) fn region(
        &self,
        held: &[f32],
        optimizer: &FlatOptimizer,
        segment: &SegmentPlan,
        range: &Range<usize>,
        names: &[&str],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), String> {
        let in_updated = range.start - segment.updated.start..range.end - segment.updated.start;
        match self {
            Store::Offload(o) => {
                let len = segment.updated.len();
                let region = o.actor.read_state(segment.start)?;
                // `[params | state 1 | state 2]`: as many parts as the rule keeps tensors, + 1.
                let kept = (region.len() / len.max(1)).saturating_sub(1);
                if kept != names.len() {
                    return Err(format!(
                        "the offload actor keeps {kept} state tensors per parameter, the optimizer {names:?}"
                    ));
                }
                let part = |k: usize| region[k * len + in_updated.start..k * len + in_updated.end].to_vec();
                Ok((part(0), (1..=names.len()).map(part).collect()))
            }
            // The device's state was read into the host copies first (`sync_host`).
            _ => {
                let params = held[segment.in_held(range)].to_vec();
                let at = segment.state_at + in_updated.start..segment.state_at + in_updated.end;
                let (m, v) = optimizer.state(at);
                let state = [m, v]
                    .into_iter()
                    .take(names.len())
                    .map(<[f32]>::to_vec)
                    .collect();
                Ok((params, state))
            }
        }
    }

    /// Takes back the whole updated part of `segment` from a checkpoint: its parameters (the
    /// held vector has them already, but the offload tier keeps its own) and state tensors.
    pub(super) fn restore_region(
        &mut self,
        optimizer: &mut FlatOptimizer,
        segment: &SegmentPlan,
        params: Vec<f32>,
        state: Vec<Vec<f32>>,
    ) -> Result<(), String> {
        match self {
            Store::Offload(o) => {
                let region = std::iter::once(params).chain(state).flatten().collect();
                o.actor.write_state(segment.start, region)
            }
            // The device's state is rebuilt from the host copies after the restore.
            _ => {
                let empty = Vec::new();
                let (m, v) = (state.first().unwrap_or(&empty), state.get(1).unwrap_or(&empty));
                optimizer.set_state(segment.state_at, m, v);
                Ok(())
            }
        }
    }

    /// Takes the gathered parameters of `segment` (every replica's updated shard): on the
    /// device, a segment held whole becomes its master there (keeping this replica's own f32
    /// shard where `keep_own`: a 16-bit gather carries rounded values); otherwise they are given
    /// back.
    pub(super) fn take_gathered(
        &mut self,
        segment: &SegmentPlan,
        params: TypedTensor,
        keep_own: bool,
        device: &B::Device,
    ) -> Result<Gathered<B>, String> {
        match self {
            Store::Device(d) if segment.held.len() == segment.params => {
                let master = d.load_gathered(segment.start, params.into_f32_vec(), keep_own, device)?;
                Ok(Gathered::OnDevice(master))
            }
            _ => Ok(Gathered::OnHost(params)),
        }
    }

    /// Whether the parameters of the held parts live in the trainer's held vector (not in the
    /// offload tier).
    fn holds_params_on_host(&self) -> bool {
        !matches!(self, Store::Offload(o) if o.params_in_tier)
    }
}
