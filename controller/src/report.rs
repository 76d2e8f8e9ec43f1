//! The training report: a stable JSON interface (keys are added, never renamed).

use serde::{Deserialize, Serialize};

/// One step as the controller saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Step number, from 1.
    pub step: u64,
    /// Global mean loss (NaN for a diverged step: JSON writes it `null`).
    #[serde(deserialize_with = "nan_if_null::one")]
    pub loss: f32,
    /// Wall time from the `RunStep` calls to the last reply.
    pub time_s: f64,
    /// The learning rate of the step's update (the schedule's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f32>,
    /// The global gradient norm before clipping (reported when the job clips).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f32>,
    /// The scale the step's loss was multiplied by (f16's loss scaling: the scale the step's
    /// backward used; an overflow halves it for the next step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    /// The step's gradients overflowed on some actor, and every actor skipped its update (the
    /// optimizer's step count and the learning-rate schedule stay).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Host ⇄ device bytes of the step, by kind, summed over actors (batches, activations,
    /// gradients, parameters, scalars; each `to_device` and `to_host`). Counted at every copy
    /// into or out of a burn tensor on every backend: on CPU the same calls that cross PCIe on a
    /// GPU.
    #[serde(default)]
    pub transfers: archipelago_actors::transfer::Transfers,
    /// Bytes the actors read from their peers on the fabric in the step, by kind (gradient
    /// reductions, parameter gathers, pipeline activations and their gradients, norms), summed
    /// over actors: counted where they arrive on every data path (`fabric::read_count`).
    #[serde(default)]
    pub fabric: archipelago_dataflow::FabricBytes,
    /// Of `fabric`, the bytes read from peers on another island (hosts, or the devices a
    /// program names as one), summed over actors: what crosses the slow links.
    #[serde(default)]
    pub fabric_crossing_islands: archipelago_dataflow::FabricBytes,
}

/// Memory of one actor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActorRecord {
    /// The actor.
    pub actor: usize,
    /// Its device.
    pub device: String,
    /// Its pipeline stage.
    pub stage: usize,
    /// Its data-parallel replica.
    pub replica: usize,
    /// Median over steps (after the first) of the share of the step not spent computing: the step
    /// runs from the first actor's stream start to the last one's end.
    pub bubble: f64,
    /// The step simulator's bubble for its stage.
    pub predicted_bubble: f64,
    /// The step simulator's bubble for its stage, replayed with the pass times measured in this
    /// run instead of the cost model's rates.
    pub replayed_bubble: f64,
    /// The most micro-batches whose activations it held at once.
    pub peak_microbatches_held: usize,
    /// The schedule's bound on that number.
    pub predicted_peak_microbatches_held: usize,
    /// The most bytes of activation checkpoints (segment inputs kept for the backward's
    /// recompute) it held at once in a step, on the device and in host memory (measured).
    #[serde(default)]
    pub activation_checkpoint_bytes: archipelago_dataflow::CheckpointBytes,
    /// The plan's estimate of `activation_checkpoint_bytes`.
    #[serde(default)]
    pub estimated_activation_checkpoint_bytes: archipelago_dataflow::CheckpointBytes,
    /// Parameters + gradients + optimizer state held at the end of the last step.
    pub model_state_bytes: u64,
    /// Of which the optimizer's state (measured; the adapters' alone under LoRA).
    #[serde(default)]
    pub optimizer_state_bytes: u64,
    /// The plan's estimate of `optimizer_state_bytes`.
    #[serde(default)]
    pub estimated_optimizer_state_bytes: u64,
    /// The most held during a step.
    pub peak_model_state_bytes: u64,
    /// The plan's estimate of its model state (parameters + gradients + optimizer).
    pub estimated_model_state_bytes: u64,
    /// The compute copy of the weights inside the burn modules, beside the f32 master copy
    /// counted in `model_state_bytes`.
    pub compute_weight_bytes: u64,
    /// The plan's estimate of `compute_weight_bytes` (in the compute dtype).
    #[serde(default)]
    pub estimated_compute_weight_bytes: u64,
    /// The plan's estimate of everything on its device (model state, activations, buffers).
    #[serde(default)]
    pub estimated_device_bytes: u64,
    /// Its GPU's memory pool at the last step's end (GPUs only): `reserved` is the high-water
    /// mark to set beside `estimated_device_bytes` (cubecl's pool of the actor's stream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_memory: Option<archipelago_actors::gpus::DeviceMemory>,
    /// Bytes it read from its peers on the fabric in the last step, by kind (measured).
    #[serde(default)]
    pub fabric_bytes_per_step: archipelago_dataflow::FabricBytes,
    /// The plan's prediction of `fabric_bytes_per_step` (`archipelago plan` prints it).
    #[serde(default)]
    pub predicted_fabric_bytes_per_step: archipelago_dataflow::FabricBytes,
    /// Of `fabric_bytes_per_step`, the bytes read from peers on another island (measured).
    #[serde(default)]
    pub fabric_crossing_islands_per_step: archipelago_dataflow::FabricBytes,
    /// ZeRO++ hpZ's secondary copy it held at the last step's end (measured).
    #[serde(default)]
    pub hpz_secondary_bytes: u64,
    /// The plan's estimate of `hpz_secondary_bytes`.
    #[serde(default)]
    pub estimated_hpz_secondary_bytes: u64,
    /// Bytes it moved to and from its offload tier in the last step (measured).
    #[serde(default)]
    pub offload_bytes_per_step: archipelago_dataflow::OffloadTraffic,
    /// The plan's prediction of `offload_bytes_per_step` (`archipelago plan` prints it).
    #[serde(default)]
    pub predicted_offload_bytes_per_step: archipelago_dataflow::OffloadTraffic,
    /// Its offload actor's state and traffic (with `--offload`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadRecord>,
    /// Median over steps of the time spent in compute instructions.
    pub compute_s: f64,
    /// Median over steps of the time spent waiting in receives and collectives.
    pub comm_wait_s: f64,
    /// Median time of each instruction of the actor's stream, in stream order.
    pub instructions: Vec<InstructionRecord>,
}

/// What an actor's offload actor held and moved over the whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OffloadRecord {
    /// Host memory it held (cpu: master shard and optimizer state; nvme: the peak of regions
    /// resident for read-ahead, update and write-behind).
    pub host_bytes: u64,
    /// The plan's estimate of `host_bytes`.
    pub estimated_host_bytes: u64,
    /// Bytes of its state file (nvme).
    pub disk_bytes: u64,
    /// The plan's estimate of `disk_bytes`.
    pub estimated_disk_bytes: u64,
    /// Bytes read from the state file.
    pub read_bytes: u64,
    /// Read throughput while reading (bytes / seconds inside reads), GB/s.
    pub read_gb_s: f64,
    /// Bytes written to the state file.
    pub written_bytes: u64,
    /// Write throughput while writing, GB/s.
    pub write_gb_s: f64,
    /// Seconds the optimizer waited for the tier (reads not ahead in time, write backlog).
    pub wait_s: f64,
    /// Seconds of optimizer updates on the host.
    pub optimizer_s: f64,
}

/// Median time of one instruction over the steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstructionRecord {
    /// The instruction, printed.
    pub instruction: String,
    /// Median seconds.
    pub median_s: f64,
}

/// What `archipelago train --report` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainReport {
    /// The model spec.
    pub model: String,
    /// The flags as given.
    pub plan: serde_json::Value,
    /// Parameter count.
    pub params: u64,
    /// Of which trained (the rest frozen: a LoRA run's base).
    #[serde(default)]
    pub trainable_params: u64,
    /// Every step.
    pub steps: Vec<StepRecord>,
    /// The last step's global mean loss on its batch, computed in its forward pass, before that
    /// step's update (not an evaluation of the final parameters).
    #[serde(deserialize_with = "nan_if_null::one")]
    pub final_loss: f32,
    /// L2 norm of all final parameters.
    #[serde(deserialize_with = "nan_if_null::one")]
    pub param_l2: f64,
    /// L2 norm of each block's final parameters, in block order.
    #[serde(deserialize_with = "nan_if_null::each")]
    pub block_l2: Vec<f64>,
    /// Every parameter every actor holds at the end, by actor, when
    /// [`TrainOptions::keep_params`](crate::TrainOptions::keep_params) asks for it (tests and
    /// small models; absent from the JSON otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_params: Vec<ActorParams>,
    /// Per-actor memory and time.
    pub actors: Vec<ActorRecord>,
    /// Peak RSS of this process.
    pub peak_rss_bytes: u64,
    /// Samples per second (median step time, after the first step).
    pub samples_per_s: f64,
    /// Tokens per second (token models only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Median step time in seconds (after the first step).
    pub median_step_s: f64,
    /// The step simulator's step time (cost model rates of this project's CPU machine).
    pub predicted_step_s: f64,
    /// The step simulator's step time replayed with the pass times measured in this run.
    pub replayed_step_s: f64,
    /// Load average (1, 5, 15 min) at the end.
    pub load_avg: [f64; 3],
    /// What multiplied f32 matrices on this process's CPU devices (`ARCHIPELAGO_CPU_MATMUL`):
    /// OpenBLAS's own description of itself, or `flex gemm`.
    #[serde(default)]
    pub cpu_matmul: String,
    /// Each restart after a lost host (cluster jobs with `--restart on-failure`), in order.
    #[serde(default)]
    pub restarts: Vec<RestartRecord>,
}

impl TrainReport {
    /// The plan's prediction of the fabric bytes of a step, summed over actors (what
    /// [`StepRecord::fabric`] measures).
    pub fn predicted_fabric_bytes_per_step(&self) -> archipelago_dataflow::FabricBytes {
        self.actors.iter().fold(Default::default(), |mut all, a| {
            all.add_all(&a.predicted_fabric_bytes_per_step);
            all
        })
    }
}

/// A copy of the parameters one actor holds at the end of a job (see
/// [`TrainReport::held_params`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActorParams {
    /// The actor.
    pub actor: archipelago_dataflow::ActorId,
    /// Its pipeline stage.
    pub stage: usize,
    /// Its position in its data-parallel group.
    pub replica: usize,
    /// What it holds: whole blocks, or the parts of blocks it owns under ZeRO-3.
    pub parts: Vec<archipelago_actors::executor::HeldParams>,
}

/// A restart of a cluster job after a host was lost: what ended the attempt, where it had got,
/// and where and how the next attempt went on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RestartRecord {
    /// The error that ended the attempt (names the lost host).
    pub lost: String,
    /// The last step the attempt finished.
    pub failed_after_step: u64,
    /// The step the next attempt started at (1 without a checkpoint).
    pub resumed_at_step: u64,
    /// The mesh the job was placed on again (e.g. `dp=1`, a smaller one on fewer devices).
    pub mesh: String,
}

/// The median of `values` (0 for none).
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// A diverged run's NaN losses and norms, which JSON writes as `null`, read back as NaN (a
/// report crossing from a controller to its client would be unreadable otherwise).
mod nan_if_null {
    use serde::{Deserialize, Deserializer};

    /// A float, NaN for `null`.
    pub fn one<'de, D: Deserializer<'de>, F: Deserialize<'de> + From<f32>>(d: D) -> Result<F, D::Error> {
        Ok(Option::<F>::deserialize(d)?.unwrap_or_else(|| F::from(f32::NAN)))
    }

    /// Floats, NaN for each `null`.
    pub fn each<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        let values = Vec::<Option<f64>>::deserialize(d)?;
        Ok(values.into_iter().map(|v| v.unwrap_or(f64::NAN)).collect())
    }
}

#[cfg(test)]
mod nan_tests {
    /// A diverged step's report survives the JSON round trip, its NaN loss read back as NaN.
    #[test]
    fn a_nan_loss_crosses_as_null_and_comes_back_nan() {
        let transfers = archipelago_actors::transfer::Transfers::default();
        let json = serde_json::json!({
            "step": 3, "loss": f32::NAN, "time_s": 0.5, "transfers": transfers,
            "fabric": archipelago_dataflow::FabricBytes::default(),
        });
        assert!(json["loss"].is_null());
        let step: super::StepRecord = serde_json::from_value(json).unwrap();
        assert!(step.loss.is_nan());
    }
}
