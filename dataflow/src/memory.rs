//! The memory estimate per actor: parameters, gradients, optimizer state, activations and
//! communication buffers, in bytes, computed from the plan alone. Model state comes from the
//! parameter descriptions ([`crate::ParamDesc`]): values in their dtype, gradients only for
//! trainable parameters (in the same dtype), optimizer state in f32 only for trainable ones (a
//! frozen LoRA base weight costs its values and nothing else). Activations are f32.
//!
//! Activations follow the schedule: a pipeline device holds those of every micro-batch in flight
//! (GPipe: all `m`; 1F1B: at most `pp − s`), or only chunk inputs under activation checkpointing
//! (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016).
//!
//! Model-state accounting follows ZeRO (Rajbhandari et al., SC 2020): with f32 and Adam, a
//! replica holding Ψ parameters keeps 4Ψ of parameters, 4Ψ of gradients and 8Ψ of optimizer state;
//! over N replicas ZeRO-1 keeps 8Ψ/N of optimizer state, ZeRO-2 also 4Ψ/N of gradients, ZeRO-3
//! also 4Ψ/N of parameters (plus the gathered parameters of two segments, counted as buffers).
//! Under mixed precision (`--precision bf16`) the master, the gradient buckets (which accumulate
//! in f32) and the optimizer state stay f32, so the model state is the same 16Ψ; the compute copy
//! of the weights (2Ψ, none between steps under ZeRO-3) is [`MemoryEstimate::compute_weights`],
//! and activations, gathers and backward temporaries are counted in the compute dtype. (The
//! paper's 2Ψ of 16-bit gradients would need buckets kept in 16 bits: not built.)

use serde::{Deserialize, Serialize};

use crate::DeviceSpec;
use crate::ZeroStage;
use crate::model_spec::{InputKind, ModelDesc};
use crate::passes::data_parallel::Bucket;
use crate::passes::partition::Chunk;
use crate::program::{Offload, Program, StatePlacement};
use crate::tensor_parallel::TpHeld;

/// Bytes one actor is expected to hold at its peak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryEstimate {
    /// The actor.
    pub actor: usize,
    /// f32 parameters.
    pub params: u64,
    /// f32 gradients (flat buckets).
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Activations kept for backward at the peak.
    pub activations: u64,
    /// Communication buffers in flight (a tie's gradient sum and values among them).
    pub buffers: u64,
    /// What a block's backward holds beyond the activations kept for it on a GPU: the gradients
    /// of its intermediates and the kernels' temporaries, counted as [`BACKWARD_TEMPORARIES`]
    /// times the largest block's activations for one micro-batch (0 on CPU devices).
    #[serde(default)]
    pub backward_temporaries: u64,
    /// Host memory of the training state kept off the device: the offload actor's (master shard
    /// and optimizer state under `--offload cpu`; read-ahead and write-behind buffers under
    /// `--offload nvme`), or with `--state host` on a GPU the master copy, gradient buckets and
    /// optimizer state (on CPU devices host memory is device memory: counted there).
    #[serde(default)]
    pub host: u64,
    /// Bytes of the offload files on disk (`--offload nvme`).
    #[serde(default)]
    pub disk: u64,
    /// The modules' weights, the compute copy beside the f32 master, in the compute dtype
    /// (`--precision`): every parameter of the blocks held whole between steps (none under
    /// ZeRO-3, whose gathers are counted in `buffers`). Reported beside the model state, as the
    /// trainer measures it (`compute_weight_bytes`), and not in [`MemoryEstimate::total`].
    #[serde(default)]
    pub compute_weights: u64,
    /// Of `activations`: the checkpointed segment inputs on the device at the peak (each tp
    /// rank's 1/tp of the whole ones under `--partition-activations`; none offloaded).
    #[serde(default)]
    pub activation_checkpoints: u64,
    /// The checkpointed segment inputs waiting in host memory at the peak
    /// (`--offload-activations cpu`; not in [`MemoryEstimate::total`]).
    #[serde(default)]
    pub activation_checkpoints_host: u64,
    /// What the compressed gradient exchange keeps from step to step on this replica, f32 by
    /// bucket: top-k's error-feedback residual (one copy of the gradients), 1-bit Adam's
    /// momentum, frozen variance and worker error (three) plus its server error (a shard).
    #[serde(default)]
    pub compression_state: u64,
    /// ZeRO++ hpZ's secondary copy: this replica's island slice of every segment's f32
    /// parameters, kept from the forward's gather for the backward's gather inside the island.
    #[serde(default)]
    pub secondary_params: u64,
}

impl MemoryEstimate {
    /// Parameters + gradients + optimizer state.
    pub fn model_state(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    /// Everything.
    pub fn total(&self) -> u64 {
        self.model_state()
            + self.activations
            + self.buffers
            + self.backward_temporaries
            + self.compression_state
            + self.secondary_params
    }

    /// `params 32.1 MiB + grads … `, for messages; then what is offloaded, if anything.
    pub fn breakdown(&self) -> String {
        let mut out = format!(
            "params {} + grads {} + optimizer {} + activations {} + buffers {} + backward temporaries {}",
            mib(self.params),
            mib(self.grads),
            mib(self.optimizer),
            mib(self.activations),
            mib(self.buffers),
            mib(self.backward_temporaries)
        );
        if self.compression_state > 0 {
            out.push_str(&format!(" + compression state {}", mib(self.compression_state)));
        }
        if self.secondary_params > 0 {
            out.push_str(&format!(" + hpZ secondary params {}", mib(self.secondary_params)));
        }
        if self.host > 0 || self.disk > 0 {
            out.push_str(&format!(
                "; off the device: host {}, disk {}",
                mib(self.host),
                mib(self.disk)
            ));
        }
        out
    }
}

/// A block's backward temporaries over its activations. Fitted on an H200 (2026-11-26, 151M gpt,
/// composed attention, docs/PERFORMANCE.md "GPUs"): the device's pool peaked 1.9–4.1 GB per
/// layer-sized segment above the live tensors, 2.4–3.8× one layer's activations at batch 4–16.
pub const BACKWARD_TEMPORARIES: u64 = 3;

/// Formats bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// What the estimate needs to know about one actor's place in the plan.
#[derive(Debug, Clone, Copy)]
pub struct ActorShare<'a> {
    /// The actor.
    pub actor: usize,
    /// The chunks of blocks it holds.
    pub chunks: &'a [Chunk],
    /// Its gradient buckets (segments).
    pub buckets: &'a [&'a Bucket],
    /// Samples per micro-batch.
    pub microbatch_rows: usize,
    /// The most micro-batches whose activations it holds at once (from its schedule).
    pub peak_in_flight: usize,
}

/// Estimates one actor's memory. Activations: without checkpointing, every micro-batch in flight
/// keeps its chunk's activations; with it (under sequence parallelism's `gathered_only`, for the
/// mixing blocks only; the others keep their activations), only its segments' inputs per micro-batch in flight
/// (ZeRO-R's parts of them; none offloaded, but on CPU devices, whose host memory is the
/// device's), plus one segment's activations while it is recomputed and, partitioned, two whole
/// gathered inputs (the one read and the one gathered ahead).
pub fn estimate(program: &Program, model: &ModelDesc, share: ActorShare) -> MemoryEstimate {
    let dp = program.plan.dp.max(1) as u64;
    let rows = share.microbatch_rows as u64;
    let held = |of: fn(&crate::BlockInfo) -> u64| -> u64 {
        share
            .chunks
            .iter()
            .map(|&(s, e)| model.blocks[s..e].iter().map(of).sum::<u64>())
            .sum()
    };
    let params = held(crate::BlockInfo::param_bytes);
    // Frozen parameters stay whole on every actor holding their block (never sharded).
    let frozen = held(crate::BlockInfo::frozen_bytes);
    let grads = held(crate::BlockInfo::grad_bytes);
    let optimized = held(crate::BlockInfo::trained_params);
    let acts = |s: usize, e: usize| -> u64 {
        model.blocks[s..e]
            .iter()
            .map(|b| b.activation_floats_per_sample)
            .sum()
    };
    let in_flight = share.peak_in_flight.max(1) as u64;
    // Activations, their gradients and the modules' weights are in the compute dtype.
    let c = program.precision.compute.bytes();
    let on_gpu = matches!(program.devices.get(share.actor), Some(DeviceSpec::Cuda(_)));
    let kept = kept_inputs(program, model, &share);
    let checkpoints = crate::ActivationCheckpoints::of(&program.plan);
    let activations = if checkpoints.checkpoint {
        let checkpointed = |b: &&&Bucket| {
            checkpoints.checkpoints(b.start, model.blocks[b.start].tp.unwrap_or_default().input)
        };
        let recompute = (share.buckets.iter().filter(checkpointed))
            .map(|b| acts(b.start, b.end))
            .max()
            .unwrap_or(0);
        let on_host = if on_gpu { 0 } else { kept.host };
        c * rows
            * (in_flight * (kept.batch + kept.device + on_host + kept.graphs) + recompute + 2 * kept.gathered)
    } else {
        let largest = share.chunks.iter().map(|&(s, e)| acts(s, e)).max().unwrap_or(0);
        c * rows * in_flight * largest
    };
    let largest_block = share
        .chunks
        .iter()
        .flat_map(|&(s, e)| model.blocks[s..e].iter())
        .map(|b| b.activation_floats_per_sample)
        .max()
        .unwrap_or(0);
    // Counted on GPUs, where burn composes attention from materialised scores; on CPU devices
    // the fused attention keeps only the probabilities, and the activation term (written for
    // the composed one) already covers the backward (measured in `activation_memory.rs`: peak
    // 30.3 MiB checkpointed, 81.6 plain, against 35.9 and 136.4 estimated).
    let backward_temporaries = if on_gpu {
        BACKWARD_TEMPORARIES * c * rows * largest_block
    } else {
        0
    };
    let largest_bucket = share.buckets.iter().map(|b| b.bytes).max().unwrap_or(0);
    let zero = program.plan.zero_stage();
    let sharded = |bytes: u64, from_stage: ZeroStage| {
        if zero >= from_stage {
            bytes.div_ceil(dp)
        } else {
            bytes
        }
    };
    // ZeRO-3 gathers one segment's parameters while the previous one computes.
    let gathered = if zero.shards_parameters() {
        2 * largest_bucket * c / 4
    } else {
        0
    };
    let optimizer = sharded(
        4 * optimized * program.update_rule().state_floats_per_param(),
        ZeroStage::ShardedOptimizer,
    );
    // A tie ([`crate::ties`]) moves its mirror's f32 gradient sum one way and the table's values
    // the other: two buffers of the mirror's length on each actor of the pair.
    let holds = |block: usize| share.chunks.iter().any(|&(s, e)| (s..e).contains(&block));
    let tied: u64 = (model.ties().iter())
        .filter(|t| holds(t.mirror.0) || holds(t.target.0))
        .map(|t| 2 * 4 * model.blocks[t.mirror.0].param_descs[t.mirror.1].len() as u64)
        .sum();
    let mut estimate = MemoryEstimate {
        actor: share.actor,
        params: sharded(params - frozen, ZeroStage::ShardedParameters) + frozen,
        grads: sharded(grads, ZeroStage::ShardedGradients),
        optimizer,
        activations,
        activation_checkpoints: c * rows * in_flight * kept.device,
        activation_checkpoints_host: c * rows * in_flight * kept.host,
        buffers: tied
            + if dp > 1 {
                largest_bucket / dp * 2 + gathered
            } else {
                0
            },
        backward_temporaries,
        host: 0,
        disk: 0,
        compression_state: if dp > 1 {
            compression_state(program, grads)
        } else {
            0
        },
        secondary_params: 0, // the plan sets it from the actor's island (`plan::actor_plans`)
        compute_weights: if zero.shards_parameters() {
            0
        } else {
            params / 4 * c
        },
    };
    if program.plan.offload.is_some() {
        offload(&mut estimate, program, share, largest_bucket, zero);
    } else if program.plan.state == StatePlacement::Host
        && matches!(program.devices.get(share.actor), Some(DeviceSpec::Cuda(_)))
    {
        // `--state host` on a GPU: the master copy, the gradient buckets and the optimizer state
        // are host vectors; the device keeps the modules' weights and one segment's gradients
        // until they are read off.
        estimate.host = estimate.params + estimate.grads + estimate.optimizer;
        estimate.grads = estimate.grads.min(largest_bucket);
        estimate.optimizer = 0;
    }
    estimate
}

/// Bytes the compressed all-reduce keeps per replica for `grads` bytes of f32 gradient buckets
/// (the codecs that keep state run at ZeRO 0 and 1 only, where the buckets are whole): top-k's
/// residual, and its velocity when it takes SGD's momentum (whose state the optimizer drops).
fn compression_state(program: &Program, grads: u64) -> u64 {
    let dp = program.plan.dp.max(1) as u64;
    match program.compression {
        c @ crate::Compression::TopK { .. } => match c.moved_momentum(program.optimizer) {
            Some(_) => 2 * grads,
            None => grads,
        },
        crate::Compression::OneBitAdam { .. } => 3 * grads + grads.div_ceil(dp),
        _ => 0,
    }
}

/// Moves the offloaded state off the device (ZeRO-Offload; ZeRO-Infinity for NVMe). The offload
/// actor keeps the master shard and the optimizer state (`12Ψ/N` with Adam, `N` = dp under
/// ZeRO ≥ 1, else 1); the device keeps its working parameters (none between gathers under
/// ZeRO-3 with `--offload-params`) and, with one micro-batch, only the bucket being produced
/// plus the one waiting to be handed off (gradient accumulation over micro-batches keeps every
/// bucket until the last micro-batch).
fn offload(
    estimate: &mut MemoryEstimate,
    program: &Program,
    share: ActorShare,
    bucket: u64,
    zero: ZeroStage,
) {
    let dp = if zero.shards_optimizer() {
        program.plan.dp.max(1) as u64
    } else {
        1
    };
    let full_params: u64 = share.buckets.iter().map(|b| b.bytes).sum();
    let floats = 1 + program.update_rule().state_floats_per_param();
    let offloaded = (full_params * floats).div_ceil(dp);
    if program.plan.offload_params {
        estimate.params = 0;
    }
    if program.plan.microbatches <= 1 {
        // The bucket being produced, and the one before it (its shard under ZeRO-2/3).
        let waiting = if zero.shards_gradients() {
            bucket.div_ceil(dp)
        } else {
            bucket
        };
        estimate.grads = estimate.grads.min(bucket + waiting);
    } else {
        estimate.grads = full_params;
    }
    estimate.optimizer = 0;
    match program.plan.offload {
        Offload::Cpu => estimate.host = offloaded,
        Offload::Nvme { .. } => {
            // The segment being updated, one read ahead, one being written behind, and the
            // I/O thread's spare buffer.
            let region = (bucket * floats).div_ceil(dp);
            estimate.host = (4 * region).min(offloaded + region);
            estimate.disk = offloaded;
        }
        Offload::None => {}
    }
}

/// Values per sample activation checkpointing keeps for one micro-batch (all zero without it).
#[derive(Debug, Default)]
struct KeptInputs {
    /// The model's input (the batch, which the first segment reads), where this actor holds
    /// the first block.
    batch: u64,
    /// Every other segment's input on the device, in the chunk that keeps most: whole, this
    /// rank's slice of a sharded one, or ZeRO-R's 1/tp part of a partitioned one.
    device: u64,
    /// The same in host memory (`--offload-activations cpu`).
    host: u64,
    /// The largest input the tp group all-gathers whole before a recompute (partitioned).
    gathered: u64,
    /// Sequence parallelism checkpointing only the mixing blocks: the activations the other
    /// segments keep with their graphs, in the chunk that keeps most.
    graphs: u64,
}

fn kept_inputs(program: &Program, model: &ModelDesc, share: &ActorShare) -> KeptInputs {
    let checkpoints = crate::ActivationCheckpoints::of(&program.plan);
    if !checkpoints.checkpoint {
        return KeptInputs::default();
    }
    let tp = program.plan.tp.max(1) as u64;
    let mut kept = KeptInputs {
        batch: match share.chunks.iter().any(|&(start, _)| start == 0) {
            true => chunk_input_floats(model, 0),
            false => 0,
        },
        ..KeptInputs::default()
    };
    for &(start, end) in share.chunks {
        let (mut device, mut host) = (0, 0);
        let later = |b: &&&Bucket| b.start >= start.max(1) && b.end <= end;
        let checkpointed = |b: &&&Bucket| {
            checkpoints.checkpoints(b.start, model.blocks[b.start].tp.unwrap_or_default().input)
        };
        let in_chunk = |b: &&&Bucket| b.start >= start && b.end <= end;
        let graphs = (share.buckets.iter().filter(in_chunk).filter(|b| !checkpointed(b)))
            .map(|b| {
                model.blocks[b.start..b.end]
                    .iter()
                    .map(|k| k.activation_floats_per_sample)
                    .sum::<u64>()
            })
            .sum();
        kept.graphs = kept.graphs.max(graphs);
        for b in share.buckets.iter().filter(later).filter(checkpointed) {
            // The model's width: a rank holds its slice of an input tp cuts.
            let whole = chunk_input_floats(model, b.start);
            let input = model.blocks[b.start].tp.unwrap_or_default().input;
            let held = match (checkpoints.kept_input(tp as usize, b.start, input), input) {
                (Some(k), _) if k.partitioned => {
                    kept.gathered = kept.gathered.max(whole);
                    (whole.div_ceil(tp), k.offloaded)
                }
                (k, TpHeld::Sharded | TpHeld::SeqSharded) => (whole / tp, k.is_some_and(|k| k.offloaded)),
                (k, _) => (whole, k.is_some_and(|k| k.offloaded)),
            };
            *(if held.1 { &mut host } else { &mut device }) += held.0;
        }
        kept.device = kept.device.max(device);
        kept.host = kept.host.max(host);
    }
    kept
}

/// f32 values per sample entering the chunk that starts at block `start`.
fn chunk_input_floats(model: &ModelDesc, start: usize) -> u64 {
    match (start, model.input) {
        (0, InputKind::Dense { features, .. }) => features as u64,
        (0, InputKind::Tokens { ctx, .. }) => ctx as u64,
        (s, _) => model.blocks[s - 1].output_floats_per_sample,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelSpec;
    use crate::optimizer::OptimizerSpec;
    use crate::param_desc::DType;
    use crate::passes::data_parallel::buckets;

    /// One actor holding the whole model, with Adam (two state values per parameter).
    fn whole_model(model: &ModelDesc) -> MemoryEstimate {
        let program = Program::new(ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap())
            .with_optimizer(OptimizerSpec::adam(1e-3));
        let all = buckets(model, u64::MAX);
        let refs: Vec<&Bucket> = all.iter().collect();
        estimate(
            &program,
            model,
            ActorShare {
                actor: 0,
                chunks: &[(0, model.blocks.len())],
                buckets: &refs,
                microbatch_rows: 1,
                peak_in_flight: 1,
            },
        )
    }

    /// Model state is counted from the descriptions: f32 values, gradients and Adam's `m`, `v`
    /// for every trainable parameter; a bf16 parameter costs half its values and gradient; a
    /// frozen one costs its values only (no gradient, no optimizer state), and leaves the
    /// gradient buckets.
    #[test]
    fn model_state_follows_dtype_and_frozen_parameters() {
        let mut model = ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3")
            .unwrap()
            .desc();
        let n = model.params();
        let base = whole_model(&model);
        assert_eq!((base.params, base.grads, base.optimizer), (4 * n, 4 * n, 8 * n));

        // Block 1's weight `[8, 8]` (64 elements) in bf16.
        let w = &mut model.blocks[1].param_descs[0];
        assert_eq!((w.name.as_str(), w.len()), ("layers.1.weight", 64));
        w.dtype = DType::BF16;
        let half = whole_model(&model);
        assert_eq!((half.params, half.grads), (4 * n - 128, 4 * n - 128));
        assert_eq!(half.optimizer, 8 * n, "optimizer state stays f32");

        // The same weight frozen (back in f32).
        let w = &mut model.blocks[1].param_descs[0];
        w.dtype = DType::F32;
        w.trainable = false;
        let frozen = whole_model(&model);
        assert_eq!(frozen.params, 4 * n);
        assert_eq!(frozen.grads, 4 * (n - 64));
        assert_eq!(frozen.optimizer, 8 * (n - 64));
        let bytes: u64 = buckets(&model, u64::MAX).iter().map(|b| b.bytes).sum();
        assert_eq!(
            bytes,
            4 * (n - 64),
            "a frozen parameter has no gradient to reduce"
        );
    }

    /// On a GPU, `--state host` keeps the master copy, the gradient buckets and the optimizer
    /// state in host memory (the device: weights and one segment's gradients); `--state device`
    /// keeps all of it on the device. On CPU devices both count on the device (host memory is
    /// device memory).
    #[test]
    fn the_state_counts_where_it_lives() {
        let spec = ModelSpec::parse("mlp:in=4,hidden=8,layers=4,out=3").unwrap();
        let model = spec.desc();
        let n = model.params();
        let all = buckets(&model, 64);
        let refs: Vec<&Bucket> = all.iter().collect();
        let largest = all.iter().map(|b| b.bytes).max().unwrap();
        assert!(largest < 4 * n, "several buckets");
        let on = |device: DeviceSpec, state: StatePlacement| {
            let mut program = Program::new(spec.clone()).with_optimizer(OptimizerSpec::adam(1e-3));
            program.devices = vec![device];
            program.plan.state = state;
            estimate(
                &program,
                &model,
                ActorShare {
                    actor: 0,
                    chunks: &[(0, model.blocks.len())],
                    buckets: &refs,
                    microbatch_rows: 1,
                    peak_in_flight: 1,
                },
            )
        };
        let gpu_host = on(DeviceSpec::Cuda(0), StatePlacement::Host);
        assert_eq!(
            (gpu_host.params, gpu_host.grads, gpu_host.optimizer),
            (4 * n, largest, 0)
        );
        assert_eq!(gpu_host.host, 4 * n + 4 * n + 8 * n);
        let gpu_device = on(DeviceSpec::Cuda(0), StatePlacement::Device);
        assert_eq!(
            (
                gpu_device.params,
                gpu_device.grads,
                gpu_device.optimizer,
                gpu_device.host
            ),
            (4 * n, 4 * n, 8 * n, 0)
        );
        // A GPU's backward holds temporaries beyond the activations (burn's composed kernels);
        // the CPU's fused kernels stay inside the activation term.
        let largest_block = model
            .blocks
            .iter()
            .map(|b| b.activation_floats_per_sample)
            .max()
            .unwrap();
        assert_eq!(
            gpu_device.backward_temporaries,
            BACKWARD_TEMPORARIES * 4 * largest_block
        );
        assert_eq!(
            gpu_device.total(),
            gpu_device.model_state()
                + gpu_device.activations
                + gpu_device.buffers
                + gpu_device.backward_temporaries
        );
        let without_temporaries = MemoryEstimate {
            backward_temporaries: 0,
            ..gpu_device
        };
        for state in [StatePlacement::Host, StatePlacement::Device] {
            assert_eq!(on(DeviceSpec::Cpu(0), state), without_temporaries, "CPU, {state}");
        }
    }

    /// Top-k keeps one f32 residual per gradient, 1-bit Adam three copies and a shard.
    #[test]
    fn compressed_exchanges_count_what_they_keep() {
        let plan = crate::ParallelPlan {
            dp: 4,
            batch: 8,
            ..crate::ParallelPlan::default()
        };
        let program = Program::new(crate::ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3").unwrap())
            .with_plan(plan);
        let with = |c| super::compression_state(&program.clone().with_compression(c), 4000);
        assert_eq!(with(crate::Compression::None), 0);
        assert_eq!(with(crate::Compression::Int8), 0);
        assert_eq!(with(crate::Compression::TopK { ratio: 0.01 }), 4000);
        let momentum = crate::OptimizerSpec::sgd(0.1).with_momentum(0.9, false).unwrap();
        let corrected = program.clone().with_optimizer(momentum);
        let topk = corrected.with_compression(crate::Compression::TopK { ratio: 0.01 });
        assert_eq!(super::compression_state(&topk, 4000), 2 * 4000);
        assert_eq!(
            topk.update_rule().state_floats_per_param(),
            0,
            "the momentum moved"
        );
        let onebit = crate::Compression::OneBitAdam {
            freeze_step: 5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        };
        assert_eq!(with(onebit), 3 * 4000 + 1000);
    }
}
