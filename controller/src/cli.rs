//! The `archipelago` command line: `train`, `plan`, `ps`, `export`, `bench`, `controller` and `host`.
//!
//! `train` and `plan` share one flag set, so `plan` shows exactly what `train` would run. Later
//! parallelisms add flags here (`--pp`, `--schedule`, `--zero`, `--offload`, `--tp`,
//! `--controller`) and fields to the program; the report's keys only grow.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use serde::Serialize;

use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::passes::partition::parse_stages;
use archipelago_dataflow::passes::schedule::Schedule;
use archipelago_dataflow::{
    DeviceSpec, InputKind, LrDecay, LrSchedule, ModelSpec, OptimizerSpec, ParallelPlan, ParamGroups, Program,
};

use crate::train::{StepProgress, TrainOptions};

/// archipelago: one typed Rust program for a whole multi-device training job.
#[derive(Debug, Parser)]
#[command(name = "archipelago", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model on the embedded controller (this process, one CPU actor per device).
    Train(Box<TrainArgs>),
    /// Compile and verify a job without starting any actor; print mesh, streams and memory.
    Plan(Box<PlanArgs>),
    /// Train with a parameter server (Li et al., OSDI 2014): server actors hold the model's key
    /// ranges on a consistent-hash ring, workers pull and push under a consistency model.
    Ps(Box<crate::ps_job::cli::PsArgs>),
    /// Run the benchmarks and print JSON.
    Bench(crate::bench::BenchArgs),
    /// Serve the controller of a cluster: hosts register here, clients submit jobs here.
    Controller(crate::cluster::commands::ControllerArgs),
    /// Offer this machine's devices to a controller and run its part of each job.
    Host(crate::cluster::commands::HostArgs),
    /// List what this host can offer: CPU cores, GPUs and their memory, as device specs.
    Devices(crate::host_devices::DevicesArgs),
    /// Write the full model of a checkpoint (any layout) as one safetensors file with PyTorch's
    /// names and layouts.
    Export(crate::export::ExportArgs),
    /// Make a cluster CA and per-process certificates for mutual TLS (`--tls-cert`, `--tls-key`,
    /// `--tls-ca` of controller, host and train).
    Certs(crate::cluster::security::CertsArgs),
    /// Ask a controller's health endpoint (`--health`); exits 0 on 200 (for `exec` probes).
    Health(crate::cluster::health::HealthArgs),
    /// The other end of the cross-process benchmark (started by `bench`).
    #[command(hide = true)]
    BenchPeer(crate::bench::cross_process::PeerArgs),
    /// The host process of the runtime-API benchmark (started by `bench`).
    #[command(hide = true)]
    BenchActorHost(crate::bench::actor_api::ActorHostArgs),
}

/// The flags that describe a job (shared by `train` and `plan`).
#[derive(Debug, Clone, Args, Serialize)]
pub struct JobArgs {
    /// Model: `mlp-8x1024`, `gpt-tiny`, `mlp:in=I,hidden=H,layers=L,out=O` or
    /// `gpt:vocab=V,ctx=C,d=D,layers=L,heads=H`.
    #[arg(long, default_value = "mlp-8x1024")]
    pub model: String,
    /// Data-parallel replicas (one CPU device each).
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Global batch per step (default: 64 rows for mlp, 16 sequences for gpt).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Steps to train.
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// Learning rate (the peak under --lr-schedule).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f32,
    /// Update rule: adam, adamw (decoupled weight decay), sgd (plain, or with --momentum and
    /// --nesterov) or lamb (per-parameter trust ratio), each with PyTorch's defaults.
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
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
    /// ZeRO stage over the dp axis: 0 (replicated), 1 (optimizer state sharded), 2 (also
    /// gradients), 3 (also parameters; implies --checkpoint-activations).
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
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
    /// `cpu:0,cpu:1`; default `cpu:0..` (one per dp × pp actor). `archipelago devices` lists them.
    #[arg(long)]
    pub devices: Option<String>,
    /// Pin the blocks of each chunk by hand: inclusive block ranges, e.g. `0-2,3-8`.
    #[arg(long)]
    pub stages: Option<String>,
}

impl JobArgs {
    /// The program these flags describe.
    pub fn program(&self) -> anyhow::Result<Program> {
        let spec = ModelSpec::parse(&self.model)?;
        let mut program = Program::new(spec).with_seed(self.seed);
        if let Some(path) = self.data.as_ref().filter(|p| is_safetensors(p)) {
            program.data = DataSpec::TensorFile {
                path: path.display().to_string(),
            };
        } else if let Some(path) = &self.data {
            if !matches!(program.model.input, InputKind::Tokens { .. }) {
                anyhow::bail!("--data trains a gpt on text; `{}` is not a gpt model", self.model);
            }
            program.data = DataSpec::TextFile {
                path: path.display().to_string(),
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
            microbatches: self.microbatches,
            schedule: self.schedule.parse::<Schedule>().map_err(anyhow::Error::msg)?,
            virtual_stages: self.virtual_stages,
            checkpoint_activations: self.checkpoint_activations,
            zero: self.zero,
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
        program.devices = match &self.devices {
            Some(list) => DeviceSpec::parse_list(list)?,
            None => DeviceSpec::cpus(self.dp * self.pp),
        };
        if program.plan.device_memory.is_none() {
            program.plan.device_memory = archipelago_actors::gpus::smallest_memory(
                &program.devices[..program.devices.len().min(self.dp * self.pp)],
            );
        }
        Ok(program)
    }
}

/// Whether `path` names a safetensors file (by its extension).
fn is_safetensors(path: &std::path::Path) -> bool {
    path.extension().is_some_and(|e| e == "safetensors")
}

impl JobArgs {
    /// The optimizer, its schedule, clipping and parameter groups from the flags.
    fn set_optimizer(&self, program: &mut Program) -> anyhow::Result<()> {
        let mut spec = OptimizerSpec::named(&self.optimizer, self.lr).map_err(anyhow::Error::msg)?;
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

/// Flags of `train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Seconds a receive may wait for a peer before the run stops with a hang report.
    #[arg(long, default_value_t = 120)]
    pub patience_s: u64,
    /// Print only the summary.
    #[arg(long)]
    pub quiet: bool,
    /// Write a Chrome/Perfetto trace (one track per actor) of the steps to this file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write sharded checkpoints under this directory (every actor its own shard, the manifest
    /// with checksums last); with several hosts it must be the same path on every host.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (and after the last step); 0: only after the last.
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Resume from the newest complete checkpoint under this directory, with any dp/pp/zero
    /// layout (checkpoints go on being written there unless --checkpoint-dir says otherwise).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Settings --resume may change from the checkpoint's run, comma-separated: optimizer,
    /// lr-schedule, clip, steps, data, precision (any other difference refuses the resume,
    /// naming it). `steps` lets a run go on past the --steps it was started with.
    #[arg(long, value_delimiter = ',', requires = "resume")]
    pub resume_override: Vec<String>,
    /// With --controller: `on-failure` re-plans on the hosts left when one dies and goes on from
    /// the last complete checkpoint; `never` stops the job.
    #[arg(long, default_value = "never")]
    pub restart: String,
    /// Submit the job to this controller (`archipelago controller`) instead of running it here;
    /// `auto` in a Slurm job: the job's first node at the job's port.
    #[arg(long, env = "ARCHIPELAGO_CONTROLLER")]
    pub controller: Option<String>,
    /// With --controller: how tensors travel between hosts: `auto` (shared memory between host
    /// processes of one machine, raw TCP to the others), `shm` (shared memory only: an error
    /// where a host is on another machine), `tcp` (raw TCP) or `grpc` (gRPC streams).
    #[arg(long, default_value = "auto")]
    pub data_path: archipelago_actors::fabric::DataPath,
    /// How the devices of this process reduce gradients: `shared` (through each other's
    /// buffers, no messages: the faster) or `ring` (the chunked message ring that groups across
    /// hosts run). Hosts of a cluster use shared buffers among their own devices.
    #[arg(long, default_value = "shared")]
    pub collectives: archipelago_actors::collectives::Collectives,
    /// Serve the live dashboard (job, loss curve, timeline per actor, failures) on this address,
    /// e.g. `127.0.0.1:8080` or just `8080` (= `127.0.0.1:8080`; port 0 picks one; the address
    /// is printed). Any address other than loopback (`0.0.0.0:8080`, an interface's address)
    /// needs --token-file: every request must then carry that token.
    #[arg(long)]
    pub dashboard: Option<String>,
    /// Keep serving the dashboard this many seconds after the job ends.
    #[arg(long, default_value_t = 0.0)]
    pub dashboard_linger_s: f64,
    /// File holding the cluster token (with --controller; and for a --dashboard on an address
    /// other than loopback, whose requests must carry it).
    #[arg(long, env = "ARCHIPELAGO_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// With --controller: mutual TLS with it (the cluster's CA and this client's certificate).
    #[command(flatten)]
    pub tls: crate::cluster::security::TlsArgs,
}

/// Flags of `plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// Print the plan as JSON instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// Runs `archipelago train`.
pub fn train(args: &TrainArgs) -> anyhow::Result<()> {
    let program = args.job.program()?;
    let restart_on_failure = match args.restart.as_str() {
        "on-failure" => true,
        "never" => false,
        other => anyhow::bail!("--restart takes `on-failure` or `never`, not `{other}`"),
    };
    let local = crate::Controller::local(program.devices.clone());
    // Compiled here too, so a plan that cannot work is refused before anything is submitted.
    let plan = local.plan(&program)?;
    if args.controller.is_none() {
        // Refused here, before anything starts: a `cuda:N` this process cannot run.
        let devices: Vec<DeviceSpec> = plan.actors.iter().map(|a| a.device).collect();
        archipelago_actors::check_devices(&devices).map_err(anyhow::Error::msg)?;
    }
    let controller = match &args.controller {
        Some(addr) => {
            let Some(token_file) = &args.token_file else {
                anyhow::bail!("--controller needs --token-file (the cluster's token)");
            };
            let addr = crate::cluster::commands::controller_addr(addr)?;
            crate::Controller::connect(&addr, args.tls.credentials(token_file)?)
        }
        None => local,
    };
    let steps = args.job.steps;
    let batch = program.plan.batch as f64;
    let every = (steps / 10).max(1);
    let quiet = args.quiet;
    println!(
        "training {} ({} parameters) on {} actor(s) [{}], global batch {}, {} steps",
        program.model.name,
        program.model.params(),
        plan.actors.len(),
        plan.mesh,
        program.plan.batch,
        steps
    );
    if args.controller.is_none() && plan.actors.iter().any(|a| a.device.cuda_ordinal().is_none()) {
        println!("cpu matmul: {}", archipelago_actors::kernels::describe());
    }
    // A progress bar on a terminal, plain lines otherwise (logs, CI, pipes).
    let bar = (!quiet && std::io::IsTerminal::is_terminal(&std::io::stdout())).then(|| {
        let bar = indicatif::ProgressBar::new(steps);
        let style = indicatif::ProgressStyle::with_template(
            "{bar:30.cyan/blue} step {pos}/{len}  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .expect("a valid template");
        bar.set_style(style);
        bar
    });
    let shown = bar.clone();
    let on_step = Arc::new(move |p: &StepProgress| {
        if let Some(bar) = &shown {
            bar.set_position(p.step);
            bar.set_message(format!(
                "loss {:.4}  {:.1} samples/s  {:.3} s/step",
                p.loss,
                batch / p.time_s.max(1e-9),
                p.time_s
            ));
        } else if !quiet && (p.step.is_multiple_of(every) || p.step == 1 || p.step == p.steps) {
            println!(
                "step {:>5}/{}  loss {:.4}  {:.3} s/step  {:.1} samples/s",
                p.step,
                p.steps,
                p.loss,
                p.time_s,
                batch / p.time_s.max(1e-9)
            );
        }
    });
    let options = TrainOptions {
        steps,
        job: format!("train-{}", program.model.name),
        patience: std::time::Duration::from_secs(args.patience_s),
        flags: serde_json::to_value(&args.job)?,
        on_step: Some(on_step),
        trace: args.trace.clone(),
        checkpoint_dir: args.resume.clone().or_else(|| args.checkpoint_dir.clone()),
        checkpoint_every: args.checkpoint_every,
        resume: args.resume.is_some(),
        resume_override: args.resume_override.clone(),
        restart_on_failure,
        data_path: args.data_path,
        dashboard: None,
        collectives: args.collectives,
        keep_params: false,
    };
    let mut options = options;
    if let Some(addr) = &args.dashboard {
        if args.controller.is_some() {
            anyhow::bail!(
                "with --controller the dashboard is the controller's: start it with `archipelago controller --dashboard ADDR`"
            );
        }
        // Nothing listens openly: refused here, before the job, when the address needs a token.
        crate::dashboard::access::check_bind(addr, args.token_file.is_some())?;
        let dashboard = crate::dashboard::Dashboard::new();
        if let Some(token_file) = &args.token_file {
            dashboard.require_token(&crate::cluster::read_token(token_file)?);
        }
        let addr = crate::dashboard::access::bind_address(addr);
        let bound = controller
            .serve_dashboard(&addr, dashboard.clone())
            .map_err(|e| anyhow::anyhow!("cannot serve the dashboard on {addr}: {e}"))?;
        dashboard.set_cluster(vec![crate::dashboard::HostView {
            name: "local".into(),
            island: "local".into(),
            devices: program.devices.iter().map(|d| d.to_string()).collect(),
            device_memory: program.plan.device_memory.unwrap_or(0),
        }]);
        println!("dashboard at http://{bound}/");
        options.dashboard = Some(dashboard);
    }
    if args.resume.is_some() && args.checkpoint_dir.is_some() && args.checkpoint_dir != args.resume {
        anyhow::bail!(
            "--resume DIR writes its checkpoints into DIR; drop --checkpoint-dir or make it the same"
        );
    }
    // A local run trains the plan compiled above (compiled once); a controller compiles its own.
    let result = match args.controller {
        Some(_) => controller.train(&program, &options),
        None => controller.train_compiled(plan, &options),
    };
    if let Some(bar) = bar {
        bar.finish();
    }
    if options.dashboard.is_some() && args.dashboard_linger_s > 0.0 {
        println!("the dashboard stays up for {} s", args.dashboard_linger_s);
        std::thread::sleep(std::time::Duration::from_secs_f64(args.dashboard_linger_s));
    }
    let report = result?;
    println!(
        "done: final loss {:.4}, parameter L2 {:.6}, {:.1} samples/s{}, peak RSS {:.0} MiB",
        report.final_loss,
        report.param_l2,
        report.samples_per_s,
        report
            .tokens_per_s
            .map(|t| format!(" ({t:.0} tokens/s)"))
            .unwrap_or_default(),
        report.peak_rss_bytes as f64 / (1u64 << 20) as f64
    );
    for a in &report.actors {
        if let Some(memory) = a.device_memory {
            let gb = |b: u64| b as f64 / 1e9;
            println!(
                "actor {} on {}: device memory pool {:.2} GB at its high-water mark, live tensors {:.2} GB \
                 at most between instructions; the plan estimated {:.2} GB",
                a.actor,
                a.device,
                gb(memory.reserved),
                gb(memory.peak_in_use),
                gb(a.estimated_device_bytes)
            );
        }
    }
    if program.plan.pp > 1 || program.plan.microbatches > 1 {
        for a in report.actors.iter().filter(|a| a.replica == 0) {
            println!(
                "stage {}: bubble {:.3} measured, {:.3} predicted by the cost model, {:.3} replayed with the measured \
                 pass times; micro-batches held at peak {} (schedule bound {})",
                a.stage,
                a.bubble,
                a.predicted_bubble,
                a.replayed_bubble,
                a.peak_microbatches_held,
                a.predicted_peak_microbatches_held
            );
        }
    }
    if let Some(path) = &args.trace {
        println!(
            "trace written to {} (open in https://ui.perfetto.dev)",
            path.display()
        );
    }
    if let Some(path) = &args.report {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("report written to {}", path.display());
    }
    Ok(())
}

/// Runs `archipelago plan`.
pub fn plan(args: &PlanArgs) -> anyhow::Result<()> {
    let program = args.job.program()?;
    let controller = crate::Controller::local(program.devices.clone());
    let plan = controller.plan(&program)?;
    if args.json {
        println!("{}", plan.to_json());
    } else {
        print!("{}", plan.summary());
    }
    Ok(())
}

#[cfg(test)]
#[path = "cli_tests.rs"]
mod tests;
