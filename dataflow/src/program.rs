//! The program a user declares: a model, a parallel plan, an optimizer, a data source, devices.
//!
//! Flags of `archipelago train`/`plan` map one to one onto these fields; later parallelisms add
//! fields with defaults, so programs written today keep compiling.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::data::DataSpec;
use crate::model_spec::{InputKind, ModelDesc, ModelSpec};
pub use crate::optimizer::OptimizerSpec;
use crate::optimizer::{LrSchedule, ParamGroups};
use crate::passes::schedule::Schedule;
use crate::{ActorId, DeviceSpec};

/// How the work is split over devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParallelPlan {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Global batch (rows or sequences) per step, over all replicas.
    pub batch: usize,
    /// Gradient bucket size in bytes: a bucket's all-reduce starts as soon as its gradients exist.
    pub bucket_bytes: u64,
    /// Memory budget per device in bytes; `None` means unchecked.
    pub device_memory: Option<u64>,
    /// Pipeline stages (devices along the `pp` axis).
    pub pp: usize,
    /// Micro-batches per step; each replica's batch is split into this many.
    pub microbatches: usize,
    /// The pipeline schedule.
    pub schedule: Schedule,
    /// Model chunks per pipeline device (interleaved 1F1B); 1 otherwise.
    pub virtual_stages: usize,
    /// Keep only segment inputs in forward and recompute the forward inside backward.
    pub checkpoint_activations: bool,
    /// ZeRO stage over the `dp` axis: 0 replicates everything; 1 shards the optimizer state;
    /// 2 also keeps only the own shard of the gradients (reduce-scatter); 3 also keeps the
    /// parameters as shards, gathered per segment (implies activation checkpointing).
    pub zero: u8,
    /// A hand-pinned split of the blocks into `pp × virtual_stages` chunks, as half-open block
    /// ranges in model order; `None` balances the chunks by parameter count.
    pub stages: Option<Vec<(usize, usize)>>,
    /// Where the f32 master shard and the optimizer state live: on the device (none), in host
    /// memory owned by an offload actor (ZeRO-Offload), or in files on a local disk
    /// (ZeRO-Infinity's NVMe tier).
    #[serde(default)]
    pub offload: Offload,
    /// Under ZeRO-3 with offload: keep the parameter shards in the offload tier too; the device
    /// holds parameters only between a segment's all-gather and its drop.
    #[serde(default)]
    pub offload_params: bool,
    /// Where an actor keeps its master parameters, gradient buckets and optimizer state when
    /// they are not offloaded (`--state host|device`).
    #[serde(default)]
    pub state: StatePlacement,
    /// Tensor-parallel ranks per replica and stage (Megatron-LM, `--tp`): the innermost mesh axis,
    /// so a tp group is consecutive actors; each rank holds a slice of every split parameter
    /// (`ParamDesc.split`).
    #[serde(default = "one")]
    pub tp: usize,
    /// ZeRO-R's partitioned activation checkpoints (Rajbhandari et al. 2019 §6;
    /// `--partition-activations`, Megatron's `--distribute-saved-activations`): under activation
    /// checkpointing with `tp` above 1, each tp rank keeps 1/tp of every checkpointed segment
    /// input the group holds whole, and the group all-gathers it before the backward recomputes.
    #[serde(default)]
    pub partition_activations: bool,
    /// `--offload-activations cpu`: the checkpointed segment inputs (or each rank's part of
    /// them) wait in host memory between the forward and the backward.
    #[serde(default)]
    pub offload_activations: bool,
    /// Sequence parallelism (Korthikanti et al. 2022, `--sequence-parallel`): with `tp` above 1,
    /// the LayerNorm and residual regions are cut along the tokens and the all-reduces become
    /// reduce-scatters and all-gathers ([`crate::sequence_parallel`]); the program's model is
    /// then in its sequence-parallel form ([`Program::sequence_parallel`]).
    #[serde(default)]
    pub sequence_parallel: bool,
    /// ZeRO++'s hierarchical partitioning (Wang et al. 2023, hpZ; `--zero-hpz`): under ZeRO-3
    /// with the dp group spread over islands, each replica keeps its island's slice of every
    /// segment the forward gathered (a secondary copy sharded inside the island), and the
    /// backward's all-gather reads it from the island's members only ([`crate::passes::zero`]).
    #[serde(default)]
    pub zero_hpz: bool,
}

fn one() -> usize {
    1
}

/// Where the training state (master parameters, gradient buckets, optimizer state) lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum StatePlacement {
    /// Flat `f32` vectors in host memory, updated by the flat-loop optimizer: every step reads
    /// the gradients off the device and writes the parameters back into the modules.
    Host,
    /// Tensors on the actor's own device, updated there by tensor ops; the modules take their
    /// parameters as slices of the master tensor. Nothing crosses between host and device on
    /// the optimizer path unless a collective needs a gradient in host memory (dp > 1, until
    /// collectives run on the device).
    Device,
    /// Decided when the plan is compiled, by [`StatePlacement::auto_for`] over the actors'
    /// devices: `Device` on GPUs, `Host` elsewhere or with offload. (Last, so that the wire
    /// indices of `Host` and `Device` stay what they were.)
    #[default]
    Auto,
}

impl fmt::Display for StatePlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StatePlacement::Auto => "auto",
            StatePlacement::Host => "host",
            StatePlacement::Device => "device",
        })
    }
}

impl StatePlacement {
    /// This placement, with `Auto` decided for the actors on `devices`.
    pub fn resolve(self, devices: &[DeviceSpec], offload: &Offload) -> Self {
        match self {
            StatePlacement::Auto => Self::auto_for(devices, offload),
            placed => placed,
        }
    }

    /// The placement `Auto` stands for: on the device when every actor's
    /// device is a GPU and nothing is offloaded — there the host path moves the whole model over
    /// PCIe and runs Adam on one CPU core each step (gpt-tiny on an H200: 0.037 s/step host,
    /// 0.014 s device) — and in host memory otherwise: on CPU devices both are the same memory
    /// and the flat loop over host vectors is the faster update, and offload keeps the state on
    /// the host by design.
    pub fn auto_for(devices: &[DeviceSpec], offload: &Offload) -> Self {
        let all_gpus = !devices.is_empty() && devices.iter().all(|d| d.cuda_ordinal().is_some());
        if all_gpus && !offload.is_some() {
            StatePlacement::Device
        } else {
            StatePlacement::Host
        }
    }
}

impl FromStr for StatePlacement {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(StatePlacement::Auto),
            "host" => Ok(StatePlacement::Host),
            "device" => Ok(StatePlacement::Device),
            _ => Err(format!("--state `{s}`: use `auto`, `host` or `device`")),
        }
    }
}

/// Where an actor's master parameters and optimizer state live.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Offload {
    /// On the device, beside the working parameters.
    #[default]
    None,
    /// In host memory, updated on the CPU by the actor's offload actor (`--offload cpu`).
    Cpu,
    /// In preallocated files under `dir`, read ahead and written behind (`--offload nvme:DIR`).
    Nvme {
        /// Directory for the state files (a fast local disk).
        dir: String,
    },
}

impl Offload {
    /// True unless the state stays on the device.
    pub fn is_some(&self) -> bool {
        *self != Offload::None
    }
}

impl fmt::Display for Offload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Offload::None => write!(f, "none"),
            Offload::Cpu => write!(f, "cpu"),
            Offload::Nvme { dir } => write!(f, "nvme:{dir}"),
        }
    }
}

impl FromStr for Offload {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Offload::None),
            "cpu" => Ok(Offload::Cpu),
            _ => match s.strip_prefix("nvme:") {
                Some(dir) if !dir.is_empty() => Ok(Offload::Nvme { dir: dir.to_string() }),
                _ => Err(format!(
                    "--offload `{s}`: use `cpu` (host memory) or `nvme:DIR` (files under DIR)"
                )),
            },
        }
    }
}

impl Default for ParallelPlan {
    fn default() -> Self {
        ParallelPlan {
            dp: 1,
            batch: 64,
            bucket_bytes: 25 << 20,
            device_memory: None,
            pp: 1,
            microbatches: 1,
            schedule: Schedule::OneFOneB,
            virtual_stages: 1,
            checkpoint_activations: false,
            stages: None,
            zero: 0,
            offload: Offload::None,
            offload_params: false,
            state: StatePlacement::Auto,
            tp: 1,
            partition_activations: false,
            offload_activations: false,
            sequence_parallel: false,
            zero_hpz: false,
        }
    }
}

impl ParallelPlan {
    /// Number of actors: `dp × pp × tp`.
    pub fn actors(&self) -> usize {
        self.dp * self.pp * self.tp
    }

    /// The ZeRO stage in force: `--zero` over the dp group (a one-member group shards nothing).
    /// The one place the plan's number becomes a stage; every pass and the actors read this.
    ///
    /// # Panics
    /// When `zero` is above 3 (`compile` refuses that first).
    pub fn zero_stage(&self) -> crate::ZeroStage {
        crate::ZeroStage::in_force(self.zero, self.dp)
    }
}

/// A whole training job as the compiler sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// The model's blocks.
    pub model: ModelDesc,
    /// The parallel plan.
    pub plan: ParallelPlan,
    /// The optimizer's update rule.
    pub optimizer: OptimizerSpec,
    /// The learning rate over the steps, as a fraction of the optimizer's rate.
    #[serde(default)]
    pub lr_schedule: LrSchedule,
    /// Clip the gradients to this global L2 norm (over every gradient of the model, on every
    /// actor) before each update, as `torch.nn.utils.clip_grad_norm_`; `None`: no clipping.
    #[serde(default)]
    pub clip_grad_norm: Option<f32>,
    /// The compute dtype of forward and backward (the master and the optimizer state stay f32).
    #[serde(default)]
    pub precision: crate::precision::Precision,
    /// How gradients are compressed on the fabric (`--compress`; issue 43).
    #[serde(default)]
    pub compression: crate::codec::Compression,
    /// ZeRO-2/3's gradient reduce-scatter crosses as block-wise int8 (`--quantize-grads int8`,
    /// ZeRO++'s qgZ).
    #[serde(default)]
    pub quantize_grads: bool,
    /// ZeRO-3's parameter all-gathers cross as block-wise int8 (`--quantize-weights int8`,
    /// ZeRO++'s qwZ); each owner keeps its own shard exact.
    #[serde(default)]
    pub quantize_weights: bool,
    /// Which parameters take weight decay.
    #[serde(default)]
    pub param_groups: ParamGroups,
    /// Where samples come from.
    pub data: DataSpec,
    /// Seed of initialisation (and of the synthetic data unless the data spec says otherwise).
    pub seed: u64,
    /// Devices to run on, one per actor; empty means `cpu:0 .. cpu:N-1`.
    pub devices: Vec<DeviceSpec>,
    /// The island of each device (devices with a fast interconnect among them); empty: one
    /// island. A dp group spanning islands all-reduces hierarchically.
    #[serde(default)]
    pub islands: Vec<String>,
    /// Start from the weights in this safetensors file (read by each actor; PyTorch's names and
    /// layouts, see [`crate::param_names`]) instead of the seeded initialisation.
    #[serde(default)]
    pub init: Option<String>,
    /// Start a LoRA model's adapters from this PEFT adapter directory (`adapter_config.json`,
    /// `adapter_model.safetensors`) instead of the seeded initialisation.
    #[serde(default)]
    pub lora_init: Option<String>,
    /// The rates the step simulator predicts with ([`crate::CostModel::default`]: those measured on the
    /// project's 2-core CPU machine); `archipelago plan` measures them with a few real steps
    /// of the model on one actor (`controller/src/calibrate.rs`).
    #[serde(default)]
    pub cost_model: Option<crate::simulate::CostModel>,
    /// Test hook, not an option: a fault the trainer injects so that the equivalence tests can
    /// show their comparison catches it. `None` (always, outside those tests) costs nothing.
    #[doc(hidden)]
    #[serde(default)]
    pub test_fault: Option<TestFault>,
}

/// Test hook: a training fault for the equivalence suite's negative controls (see
/// `integration-tests/tests/sgd_matrix.rs`). Never set outside tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TestFault {
    /// One gradient all-reduce (the first bucket updated in the first step) is skipped: every
    /// replica updates that bucket with its own gradient.
    SkipAllReduce,
    /// Replica 1's gradient is dropped: it contributes zeros to every all-reduce.
    DropReplicaGrad,
    /// The micro-batches' gradients are averaged where the code sums them.
    AverageMicrobatches,
    /// A ZeRO shard is updated with the gradient one element off its offset.
    ShiftZeroShard,
    /// Replica `replica` applies a zero gradient in optimizer step `step` (1-based) while the
    /// others apply the all-reduced one: from then on its parameters differ from the other
    /// replicas' (under SGD they stay where step `step − 1` left them), and nothing but its own
    /// parameters shows it — the replica check's control.
    SkipReplicaUpdate {
        /// The replica (position in the dp group).
        replica: usize,
        /// The optimizer step.
        step: u64,
    },
    /// `actor`'s last send of every step is left out of its stream: its peer waits for a
    /// message that never comes while `actor` finishes the step (the hang tests).
    SkipLastSend {
        /// The actor.
        actor: ActorId,
    },
    /// Mixed precision without its refresh: the modules (the compute copy) are never reloaded
    /// from the master after an update, so they compute with the initial weights all along.
    StaleComputeCopy,
    /// Mixed precision without an f32 master: after each update the master is rounded to the
    /// compute dtype (a 16-bit weight updated in place), so updates below half its last place
    /// vanish (Micikevicius et al. 2018, §3.1).
    RoundedMaster,
    /// Compression's control: `--compress int8` without its scales ([`crate::Codec::Int8`] with
    /// `block` 0): every gradient value is rounded to an integer in [−127, 127], so the small
    /// ones vanish and the run barely learns.
    UnscaledInt8,
    /// Top-k's control: `--compress topk:RATIO` without error feedback (each replica's leftover
    /// dropped instead of kept for the next step): what is never among the largest is never
    /// sent, and the run ends farther from the uncompressed one.
    TopKWithoutFeedback,
    /// 1-bit Adam's control: its exchange without error feedback (each member's and each
    /// shard owner's rounding error dropped instead of added to the next step's momentum):
    /// the signs' bias accumulates, and the run ends farther from Adam.
    OneBitWithoutFeedback,
    /// hpZ's control: each replica keeps its secondary copy from the first step's forward and
    /// never refreshes it, so every later backward recomputes with the first step's parameters.
    HpzStaleSecondary,
    /// Loss scaling's fault: `actor` writes an inf into the first element of each gradient
    /// bucket it computes in step `step` (from 1), before any collective reads it; the other
    /// actors' own gradients stay finite.
    InfGradient {
        /// The actor.
        actor: ActorId,
        /// The job's step.
        step: u64,
    },
    /// `InfGradient` with loss scaling deciding without the vote: each actor skips a step when
    /// the sum of squares of its *own* share of the reduced gradients is not finite, ignoring the
    /// other actors' (the overflow test's negative control).
    LocalOverflowDecision {
        /// The actor whose gradients get the inf.
        actor: ActorId,
        /// The job's step.
        step: u64,
    },
    /// `actor`'s first receive is moved before its first send: with a pipeline, two stages each
    /// wait for the other (the hang tests).
    RecvBeforeSend {
        /// The actor.
        actor: ActorId,
    },
    /// Tensor parallelism without Megatron's f: the all-reduces of the gradients of replicated
    /// segment inputs are left out of every stream, so each rank's backward goes on with its
    /// own summand.
    SkipTpInputGradReduce,
    /// Tensor parallelism without Megatron's g: the all-reduces of partial segment outputs are
    /// left out of every stream, so the next segment reads this rank's partial sum.
    SkipTpOutputReduce,
    /// The vocabulary-parallel cross-entropy forgetting the other ranks' maximum: each rank's
    /// exponential sums are taken against its own slice's maximum, then summed over the group.
    LocalLossMax,
    /// The fused qkv projection cut contiguously (rank 0 holding all of q and half of k) where
    /// the modules compute attention on per-head slices.
    ContiguousQkv,
    /// ZeRO-R without its all-gather: a partitioned checkpoint's recompute reads this rank's own
    /// part with zeros in the others' places (the gather still runs, so streams and fabric
    /// bytes are unchanged).
    SkipCheckpointGather,
    /// Tensor parallelism without the sum of the replicated parameters' gradients over the group
    /// (`TensorId::TpGrads` left out of every stream): each rank updates its LayerNorms, and the
    /// biases only the first rank adds, with its own summand (under sequence parallelism, its
    /// own tokens' share).
    SkipTpGradsReduce,
    /// Sequence parallelism with the residual stream's gradient dropped: a segment that passed
    /// the residual on back-propagates only its own output's gradient.
    DropResidualGrad,
    /// A tie ([`crate::ties`]) without its gradient sum: `AddTiedGrads` drops the mirror's
    /// gradient, so the tied parameter is updated with its first use's gradient alone.
    SkipTiedGrads,
    /// A tie without its values: `LoadTied` ignores them, so the mirror keeps the values it
    /// started with while the parameter it mirrors trains.
    StaleTiedValues,
}

impl Program {
    /// A program for a zoo model with its workload's data, batch and Adam at lr 1e-3.
    pub fn new(model: ModelSpec) -> Program {
        let desc = model.desc();
        let data = DataSpec::synthetic_for(desc.input);
        let batch = match desc.input {
            InputKind::Dense { .. } => 64,
            InputKind::Tokens { .. } => 16,
        };
        Program {
            model: desc,
            plan: ParallelPlan {
                batch,
                ..ParallelPlan::default()
            },
            optimizer: OptimizerSpec::adam(1e-3),
            lr_schedule: LrSchedule::constant(),
            clip_grad_norm: None,
            precision: Default::default(),
            compression: Default::default(),
            quantize_grads: false,
            quantize_weights: false,
            param_groups: ParamGroups::default(),
            data,
            seed: 0,
            devices: Vec::new(),
            islands: Vec::new(),
            init: None,
            lora_init: None,
            cost_model: None,
            test_fault: None,
        }
    }

    /// The same program with sequence parallelism (`--sequence-parallel`): the model `spec` in
    /// its sequence-parallel form ([`crate::sequence_parallel::desc`]; gpt only). Call it after
    /// [`Program::with_plan`], which sets the whole plan.
    pub fn sequence_parallel(mut self, spec: &ModelSpec) -> Result<Program, crate::PlanError> {
        self.model = crate::sequence_parallel::desc(spec)?;
        self.plan.sequence_parallel = true;
        Ok(self)
    }

    /// The same program for a user-described model (the caller provides the blocks at run time).
    pub fn custom(model: ModelDesc, data: DataSpec) -> Program {
        Program {
            model,
            plan: ParallelPlan::default(),
            optimizer: OptimizerSpec::adam(1e-3),
            lr_schedule: LrSchedule::constant(),
            clip_grad_norm: None,
            precision: Default::default(),
            compression: Default::default(),
            quantize_grads: false,
            quantize_weights: false,
            param_groups: ParamGroups::default(),
            data,
            seed: 0,
            devices: Vec::new(),
            islands: Vec::new(),
            init: None,
            lora_init: None,
            cost_model: None,
            test_fault: None,
        }
    }

    /// Replaces the parallel plan.
    pub fn with_plan(mut self, plan: ParallelPlan) -> Program {
        self.plan = plan;
        self
    }

    /// Replaces the seed (initialisation and synthetic data alike).
    pub fn with_seed(mut self, seed: u64) -> Program {
        self.seed = seed;
        match &mut self.data {
            DataSpec::Clusters { seed: s } | DataSpec::SyntheticBytes { seed: s } => *s = seed,
            DataSpec::TextFile { .. } | DataSpec::TensorFile { .. } => {}
        }
        self
    }

    /// Replaces the optimizer's update rule.
    pub fn with_optimizer(mut self, optimizer: OptimizerSpec) -> Program {
        self.optimizer = optimizer;
        self
    }

    /// Replaces the learning-rate schedule.
    pub fn with_lr_schedule(mut self, schedule: LrSchedule) -> Program {
        self.lr_schedule = schedule;
        self
    }

    /// The rule each actor's optimizer applies: the program's optimizer, less the momentum its
    /// compression moves into the exchange (`Compression::update_rule`).
    pub fn update_rule(&self) -> crate::OptimizerSpec {
        self.compression.update_rule(self.optimizer)
    }

    /// Clips the gradients to global L2 norm `max_norm` before each update (`None`: no clipping).
    pub fn with_clip_grad_norm(mut self, max_norm: Option<f32>) -> Program {
        self.clip_grad_norm = max_norm;
        self
    }

    /// Compresses the data-parallel gradient reductions as `compression` says (`--compress`).
    pub fn with_compression(mut self, compression: crate::codec::Compression) -> Program {
        self.compression = compression;
        self
    }

    /// Computes forward and backward in `precision`'s dtype, with f32 master weights.
    pub fn with_precision(mut self, precision: crate::precision::Precision) -> Program {
        self.precision = precision;
        self
    }

    /// Replaces the parameter groups (which parameters take weight decay).
    pub fn with_param_groups(mut self, groups: ParamGroups) -> Program {
        self.param_groups = groups;
        self
    }

    /// This program with `plan.state` decided for its actors' devices (`Auto` resolved).
    pub fn with_state_resolved(&self) -> Program {
        let mut program = self.clone();
        let actors = self.plan.actors().max(1);
        let devices = self.devices_for(actors);
        let actors = &devices[..devices.len().min(actors)];
        program.plan.state = self.plan.state.resolve(actors, &self.plan.offload);
        program
    }

    /// The device of each actor of a mesh of `n` actors.
    pub fn devices_for(&self, n: usize) -> Vec<DeviceSpec> {
        if self.devices.is_empty() {
            DeviceSpec::cpus(n)
        } else {
            self.devices.clone()
        }
    }
}
