//! The flags that describe a job, shared by `train` and `plan`, and the [`Program`] they make:
//! model, data, layout, optimizer and its schedule, devices.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::passes::partition::parse_stages;
use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{
    Compression, DeviceSpec, InputKind, LossScale, LrDecay, LrSchedule, ModelSpec, OptimizerSpec,
    ParallelPlan, ParamGroups, Precision, Program,
};

/// `--optimizer`'s name for 1-bit Adam (Adam with the exchange of `Compression::OneBitAdam`).
const ONEBIT_ADAM: &str = "onebit-adam";

/// The flags that describe a job (shared by `train` and `plan`).
#[derive(Debug, Clone, Args, Serialize)]
pub struct JobArgs {
    /// Model: `mlp-8x1024`, `gpt-tiny`, `gpt2`, `mlp:in=I,hidden=H,layers=L,out=O`,
    /// `gpt:vocab=V,ctx=C,d=D,layers=L,heads=H` or `gpt2:vocab=V,ctx=C,d=D,layers=L,heads=H`.
    #[arg(long, default_value = "mlp-8x1024")]
    pub model: String,
    /// The model from a `config.json` instead of --model: `transformers`' GPT2Config (a gpt2
    /// with its shapes; what it describes and is not built is refused by field) or one
    /// `archipelago export` wrote.
    #[arg(long, conflicts_with = "model")]
    pub model_config: Option<PathBuf>,
    /// Data-parallel replicas (one CPU device each).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Global batch per step (default: 64 rows for mlp, 16 sequences for gpt).
    #[arg(long)]
    pub batch: Option<usize>,
    /// The run's total steps, counted from its start: a `--resume` goes on from its checkpoint's
    /// step to this one (not this many more).
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// Learning rate (the peak under --lr-schedule; default 1e-3, and 0.03 for `ps --model
    /// sparse-lr`).
    #[arg(long)]
    pub lr: Option<f32>,
    /// Update rule: adam, adamw (decoupled weight decay), sgd (plain, or with --momentum and
    /// --nesterov), lamb (per-parameter trust ratio), each with PyTorch's defaults, or
    /// onebit-adam (1-bit Adam, Tang et al. 2021: Adam for --freeze-step steps, then the
    /// variance frozen and the momentum exchanged between replicas as 1 bit a value plus a scale
    /// per 2048, with error feedback on both sides; --dp 2 or more, --zero 0, no weight decay,
    /// no clipping, no offload, no loss scaling, no --compress).
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// 1-bit Adam's freeze: the last step of plain Adam (the learning-rate warmup is
    /// --warmup-steps). Needed by --optimizer onebit-adam, and below --steps.
    #[arg(long)]
    pub freeze_step: Option<u32>,
    /// SGD's momentum factor (default 0: plain SGD, `p -= lr·g`).
    #[arg(long)]
    pub momentum: Option<f32>,
    /// SGD with Nesterov momentum (needs --momentum > 0).
    #[arg(long)]
    pub nesterov: bool,
    /// Weight decay: an L2 term in the gradient for adam and sgd, decoupled for adamw and lamb
    /// (default: PyTorch's, 0 for adam and sgd, 0.01 for adamw and lamb). Biases and LayerNorm
    /// parameters take none unless --weight-decay-all.
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// Apply weight decay to every parameter, biases and LayerNorm included.
    #[arg(long)]
    pub weight_decay_all: bool,
    /// Clip the gradients to this global L2 norm (over every actor's gradients) before each
    /// update, as torch.nn.utils.clip_grad_norm_.
    #[arg(long)]
    pub clip_grad_norm: Option<f32>,
    /// The dtype forward and backward compute in: f32, bf16 or f16 (mixed precision: a 16-bit
    /// copy of the weights for compute, f32 master weights and optimizer state, the loss, softmax
    /// and LayerNorm statistics in f32, gradients accumulated in f32 and reduced in 16 bits, ZeRO
    /// gathers and pipeline activations in 16 bits; f16 scales its loss, see --loss-scale).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// The dtype gradients are reduced in between replicas: the compute dtype (the default: half
    /// the bytes of f32 on the wire under bf16) or f32.
    #[arg(long)]
    pub grad_reduce_dtype: Option<String>,
    /// Compress the data-parallel gradient all-reduce on the fabric: `int8` (block-wise absmax,
    /// 256 values a scale, deterministic: about a quarter of f32's bytes), `qsgd:BITS` (QSGD:
    /// stochastic, unbiased rounding to 2^BITS − 1 levels, BITS 1–8, a scale per 512 values),
    /// `terngrad` (three levels, a scale per 64) or `topk:RATIO` (the largest RATIO of each
    /// bucket, 0 < RATIO ≤ 1, as index-value pairs, the rest kept as an error-feedback residual
    /// on each replica for the next step; under SGD with --momentum the momentum moves into
    /// the exchange, as Deep Gradient Compression's momentum correction). Only at --zero 0 or 1,
    /// with --dp 2 or more.
    #[arg(long, default_value = "none")]
    pub compress: String,
    /// ZeRO++'s qgZ: ZeRO-2/3's gradient reduce-scatter crosses as block-wise int8 (`int8`; the
    /// default `none` keeps the reduce dtype). Only with --zero 2 or 3 (--compress int8 is the
    /// all-reduce's).
    #[arg(long, default_value = "none")]
    pub quantize_grads: String,
    /// ZeRO++'s qwZ: ZeRO-3's parameter all-gathers cross as block-wise int8 (`int8`; each owner
    /// keeps its own shard exact; the default `none` gathers in the compute dtype). Only with
    /// --zero 3.
    #[arg(long, default_value = "none")]
    pub quantize_weights: String,
    /// f16's loss scaling: dynamic (start at 2^16, halve on an overflow, double after 2000 clean
    /// steps; the default), dynamic:INIT, or static:S. A step whose gradients overflow on any
    /// actor is skipped by every actor. Only with --precision f16.
    #[arg(long)]
    pub loss_scale: Option<String>,
    /// Learning-rate schedule after the warmup: constant, cosine or linear (decaying to
    /// --lr-final-fraction of --lr at the last step).
    #[arg(long, default_value = "constant")]
    pub lr_schedule: String,
    /// Updates of linear warmup from lr/warmup to lr.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// The rate the cosine or linear decay ends at, as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub lr_final_fraction: f32,
    /// Seed of initialisation and synthetic data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Train on this file instead of the synthetic data: the bytes of a text file (a gpt), or a
    /// `.safetensors` file of `inputs` `[n, in]` f32 and `targets` `[n]` integers (an mlp) or
    /// `tokens` `[n, ctx+1]` integers (a gpt).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Turn the text of `--data FILE.txt` into token ids with this Hugging Face `tokenizer.json`
    /// (as `transformers` writes it; no special tokens added) instead of one token per byte; the
    /// gpt's vocab must hold the tokenizer's vocabulary.
    #[arg(long, requires = "data")]
    pub tokenizer: Option<PathBuf>,
    /// Start from the weights in this safetensors file (PyTorch's names and layouts, as
    /// `archipelago export` writes them) instead of the seeded initialisation.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Gradient bucket size in MiB (an all-reduce starts as each bucket's gradients are ready).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// Memory budget per device in bytes; plans that do not fit are refused.
    #[arg(long)]
    pub device_memory: Option<u64>,
    /// Pipeline stages (devices along the pp axis; the mesh is dp × pp).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Tensor-parallel ranks per replica and stage (Megatron-LM; the innermost mesh axis, so the
    /// mesh is dp × pp × tp): column- and row-parallel halves of each layer, a vocabulary-parallel
    /// embedding and loss. Composes with --dp, --pp, --zero, --checkpoint-activations, --clip-grad-norm,
    /// --state, --precision, --init and checkpoints (which reshard across tp); on a cluster each
    /// tp group takes devices of one host. Refused with heads or widths tp does not divide, a
    /// group across islands, LAMB, or a tp larger than every host's devices.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Micro-batches per step (each replica's batch is split into this many).
    #[arg(long, default_value_t = 1)]
    pub microbatches: usize,
    /// Model chunks per pipeline device (with --schedule interleaved).
    #[arg(long, default_value_t = 1)]
    pub virtual_stages: usize,
    /// Keep only segment inputs in forward; recompute the forward inside backward.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// With --checkpoint-activations and --tp 2 or more: each tp rank keeps 1/tp of every
    /// checkpointed input the group holds whole and the group all-gathers it before the
    /// recompute (ZeRO-R's partitioned activations; Megatron's --distribute-saved-activations).
    /// With --sequence-parallel alone: only the mixing blocks' gathered inputs are kept so (those
    /// blocks recomputed in the backward).
    #[arg(long)]
    pub partition_activations: bool,
    /// With --checkpoint-activations (or --sequence-parallel --partition-activations): keep the
    /// checkpointed inputs (or each tp rank's part of them) in host memory between the forward
    /// and the backward: `cpu`, or `none`.
    #[arg(long, default_value = "none")]
    pub offload_activations: String,
    /// With --tp 2 or more (gpt): cut the LayerNorm and residual regions along the sequence, the
    /// all-reduces becoming reduce-scatters and all-gathers (Korthikanti et al. 2022's sequence
    /// parallelism; Megatron's --sequence-parallel).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// ZeRO stage over the dp axis: 0 (replicated), 1 (optimizer state sharded), 2 (also
    /// gradients), 3 (also parameters; implies --checkpoint-activations).
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// ZeRO++'s hierarchical partitioning (hpZ): with --zero 3 on hosts of two islands or more,
    /// each replica keeps its island's slice of every segment the forward gathered, and the
    /// backward gathers inside the island only (never across); costs 1/k of the parameters per
    /// device for an island of k replicas (`plan` shows it).
    #[arg(long)]
    pub zero_hpz: bool,
    /// Keep the master parameter shard and the optimizer state off the device: `cpu` (host
    /// memory, optimizer on the CPU, ZeRO-Offload) or `nvme:DIR` (preallocated files under DIR,
    /// read ahead and written behind, ZeRO-Infinity).
    #[arg(long, default_value = "none")]
    pub offload: String,
    /// With --zero 3 and --offload: keep the parameter shards in the offload tier too.
    #[arg(long)]
    pub offload_params: bool,
    /// Where the master parameters, gradient buckets and optimizer state live when not
    /// offloaded: `host` (flat vectors, every step reads the gradients off the device and writes
    /// the parameters back), `device` (tensors on the device, updated there) or `auto`: decided
    /// when the plan is compiled for the devices its actors get — `device` when every one is a
    /// GPU and nothing is offloaded, else `host`. Each step's host ⇄ device bytes are in the
    /// report.
    #[arg(long, default_value = "auto")]
    pub state: String,
    /// Devices to place the actors on, in mesh order: e.g. `cuda:0,cuda:1` (a `cuda` build) or
    /// `cpu:0,cpu:1`; default `cpu:0..` (one per dp × pp × tp actor). `archipelago devices` lists them.
    #[arg(long)]
    pub devices: Option<String>,
    /// The island of each device, in mesh order (e.g. `a,a,b,b`): devices of one island are
    /// joined by a fast link, and collectives across islands are arranged to cross them less
    /// (the hierarchical all-reduce, --zero-hpz). On a cluster the hosts name their islands
    /// (`archipelago host --island`) and this flag is ignored; default: one island.
    #[arg(long)]
    pub islands: Option<String>,
    /// Pin the blocks of each chunk by hand: inclusive block ranges, e.g. `0-2,3-8`.
    #[arg(long)]
    pub stages: Option<String>,
    /// LoRA adapters (`--lora-rank`, `--lora-init`, …).
    #[command(flatten)]
    pub lora: super::lora_args::LoraArgs,
}

impl JobArgs {
    /// The model `--model-config` or `--model` names (before adapters).
    fn base_model(&self) -> anyhow::Result<ModelSpec> {
        match &self.model_config {
            Some(path) => crate::eval::model_from_config(path).map_err(anyhow::Error::msg),
            None => Ok(ModelSpec::parse(&self.model)?),
        }
    }

    /// The program these flags describe.
    pub fn program(&self) -> anyhow::Result<Program> {
        let spec = self.lora.apply(self.base_model()?, self.init.as_deref())?;
        let mut program = Program::new(spec.clone()).with_seed(self.seed);
        program.lora_init = self.lora.lora_init.as_ref().map(|p| p.display().to_string());
        if self.sequence_parallel {
            program.model = archipelago_dataflow::sequence_parallel::desc(&spec)?;
        }
        if let Some(path) = self.data.as_ref().filter(|p| is_safetensors(p)) {
            if self.tokenizer.is_some() {
                anyhow::bail!(
                    "--tokenizer turns a text file into token ids; --data {} is a safetensors file of ids already: \
                     drop --tokenizer",
                    path.display()
                );
            }
            program.data = DataSpec::TensorFile {
                path: path.display().to_string(),
            };
        } else if let Some(path) = &self.data {
            if !matches!(program.model.input, InputKind::Tokens { .. }) {
                anyhow::bail!(
                    "--data trains a gpt on text; `{}` is not a gpt model",
                    program.model.name
                );
            }
            program.data = DataSpec::TextFile {
                path: path.display().to_string(),
                tokenizer: self.tokenizer.as_ref().map(|t| t.display().to_string()),
            };
        }
        program.init = self.init.as_ref().map(|p| p.display().to_string());
        let blocks = program.model.blocks.len();
        program.plan = ParallelPlan {
            dp: self.dp,
            batch: self.batch.unwrap_or(program.plan.batch),
            bucket_bytes: (self.bucket_mb * (1u64 << 20) as f64).max(1.0) as u64,
            device_memory: self.device_memory,
            pp: self.pp,
            tp: self.tp,
            microbatches: self.microbatches,
            schedule: self.schedule.parse::<Schedule>().map_err(anyhow::Error::msg)?,
            virtual_stages: self.virtual_stages,
            checkpoint_activations: self.checkpoint_activations,
            partition_activations: self.partition_activations,
            sequence_parallel: self.sequence_parallel,
            offload_activations: match self.offload_activations.as_str() {
                "none" => false,
                "cpu" => true,
                other => anyhow::bail!(
                    "--offload-activations {other}: the tiers are `cpu` (host memory) and `none`"
                ),
            },
            zero: self.zero,
            zero_hpz: self.zero_hpz,
            offload: self.offload.parse().map_err(anyhow::Error::msg)?,
            offload_params: self.offload_params,
            state: self.state.parse().map_err(anyhow::Error::msg)?,
            stages: self
                .stages
                .as_deref()
                .map(|s| parse_stages(s, blocks))
                .transpose()?,
        };
        self.set_optimizer(&mut program)?;
        program.precision = Precision::parse(&self.precision).map_err(anyhow::Error::msg)?;
        if let Some(name) = &self.grad_reduce_dtype {
            let reduce = Precision::parse(name).map_err(|_| {
                anyhow::anyhow!("--grad-reduce-dtype {name}: expected f32 or the compute dtype")
            })?;
            program.precision = program.precision.with_grad_reduce(reduce.compute);
        }
        program.compression = self.compress.parse().map_err(anyhow::Error::msg)?;
        self.set_onebit(&mut program)?;
        let int8 = |flag: &str, value: &str| match value {
            "none" => Ok(false),
            "int8" => Ok(true),
            other => Err(anyhow::anyhow!(
                "{flag} {other}: the codecs are `int8` and `none`"
            )),
        };
        program.quantize_grads = int8("--quantize-grads", &self.quantize_grads)?;
        program.quantize_weights = int8("--quantize-weights", &self.quantize_weights)?;
        if let Some(text) = &self.loss_scale {
            let scale = LossScale::parse(text).map_err(anyhow::Error::msg)?;
            program.precision = program.precision.with_loss_scale(scale);
        }
        program.devices = match &self.devices {
            Some(list) => DeviceSpec::parse_list(list)?,
            None => DeviceSpec::cpus(program.plan.actors()),
        };
        program.islands = (self.islands.iter())
            .flat_map(|names| names.split(','))
            .map(|name| name.trim().to_string())
            .collect();
        if program.plan.device_memory.is_none() {
            program.plan.device_memory = archipelago_actors::gpus::smallest_memory(
                &program.devices[..program.devices.len().min(program.plan.actors())],
            );
        }
        Ok(program)
    }
}

impl JobArgs {
    /// The flags with every default that `program` (made from them) resolved filled in: the
    /// batch, the weight decay, SGD's momentum, the devices and the memory budget. What stays
    /// `None` is a setting that is off (no clipping, no `--data`, no `--init`, no `--stages`).
    pub fn resolved(&self, program: &Program) -> JobArgs {
        let mut flags = self.clone();
        flags.batch = Some(program.plan.batch);
        flags.lr = Some(program.optimizer.lr());
        flags.weight_decay = Some(program.optimizer.weight_decay());
        if let OptimizerSpec::Sgd { momentum, .. } = program.optimizer {
            flags.momentum = Some(momentum);
        }
        let actors = program.plan.actors().min(program.devices.len());
        flags.devices = Some(
            (program.devices[..actors].iter())
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
        flags.device_memory = program.plan.device_memory;
        flags
    }
}

/// `--lr` when not given (a model may have its own: see `ps`).
pub const DEFAULT_LR: f32 = 1e-3;

/// Whether `path` names a safetensors file (by its extension).
fn is_safetensors(path: &std::path::Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

impl JobArgs {
    /// The optimizer, its schedule, clipping and parameter groups from the flags.
    /// `--optimizer onebit-adam --freeze-step W`: Adam whose gradient all-reduce is 1-bit Adam's
    /// exchange after step W (`Compression::OneBitAdam`; the plan refuses what it does not
    /// combine with).
    fn set_onebit(&self, program: &mut Program) -> anyhow::Result<()> {
        let onebit = self.optimizer == ONEBIT_ADAM;
        match (onebit, self.freeze_step) {
            (false, None) => Ok(()),
            (false, Some(w)) => anyhow::bail!(
                "--freeze-step {w} is 1-bit Adam's: use it with --optimizer onebit-adam (the learning-rate warmup is --warmup-steps)"
            ),
            (true, None) => anyhow::bail!(
                "--optimizer onebit-adam needs --freeze-step W: the steps of plain Adam before the variance freezes and the momentum crosses in 1 bit (the paper: about 15-25% of training)"
            ),
            (true, Some(w)) if u64::from(w) >= self.steps => anyhow::bail!(
                "--freeze-step {w} is not below --steps {}: the 1-bit exchange runs after the freeze, so it would never run; use a smaller --freeze-step, or --optimizer adam",
                self.steps
            ),
            (true, Some(_)) if self.compress != "none" => anyhow::bail!(
                "--optimizer onebit-adam compresses the exchange itself (1 bit a value): drop --compress {}",
                self.compress
            ),
            (true, Some(freeze_step)) => {
                let OptimizerSpec::Adam {
                    beta1, beta2, eps, ..
                } = program.optimizer
                else {
                    anyhow::bail!("--optimizer onebit-adam: the update rule is not Adam");
                };
                program.compression = Compression::OneBitAdam {
                    freeze_step,
                    beta1,
                    beta2,
                    eps,
                };
                Ok(())
            }
        }
    }

    fn set_optimizer(&self, program: &mut Program) -> anyhow::Result<()> {
        let lr = self.lr.unwrap_or(DEFAULT_LR);
        let rule = if self.optimizer == ONEBIT_ADAM {
            "adam"
        } else {
            &self.optimizer
        };
        let mut spec = OptimizerSpec::named(rule, lr).map_err(anyhow::Error::msg)?;
        if self.momentum.is_some() || self.nesterov {
            spec = spec
                .with_momentum(self.momentum.unwrap_or(0.0), self.nesterov)
                .map_err(anyhow::Error::msg)?;
        }
        if let Some(wd) = self.weight_decay {
            spec = spec.with_weight_decay(wd);
        }
        spec.check().map_err(anyhow::Error::msg)?;
        let decay: LrDecay = self.lr_schedule.parse().map_err(anyhow::Error::msg)?;
        program.optimizer = spec;
        program.lr_schedule = LrSchedule {
            warmup_steps: self.warmup_steps,
            decay,
            total_steps: self.steps,
            final_fraction: if decay == LrDecay::Constant {
                1.0
            } else {
                self.lr_final_fraction
            },
        };
        program.clip_grad_norm = self.clip_grad_norm;
        program.param_groups = if self.weight_decay_all {
            ParamGroups::DecayAll
        } else {
            ParamGroups::NoDecayForVectors
        };
        Ok(())
    }
}
