//! `archipelago ps`: a parameter-server job (Li et al., OSDI 2014) from the command line — train's
//! flags for the model, data, batch, seed, optimizer and learning rate, plus the servers, workers,
//! consistency (`--staleness`), replicas (chain replication, `--replicas`, default 2) and the sparse workload's sizes. It runs on this process
//! (one CPU device per server and per worker), or with `--controller ADDR` on the hosts of a
//! cluster — processes of `archipelago ps` started with `ARCHIPELAGO_ROLE=host` (and
//! `ARCHIPELAGO_CONTROLLER`, `ARCHIPELAGO_TOKEN_FILE`, `ARCHIPELAGO_DEVICES`), the runtime API's
//! host role — and writes a report of train's shape with the servers' figures. Bad input is
//! refused before any actor starts, with the fix named.

use std::path::PathBuf;

use clap::Args;

use archipelago_actors::ps::{BuiltinUpdate, Consistency, CtrSpec, Initializer, ServerUpdate};
use archipelago_actors::runtime::Runtime;
use archipelago_dataflow::{DeviceSpec, LrDecay, ModelSpec, OptimizerSpec};

use super::report::{PsReport, SparseSummary};
use super::{FinalModel, PsJob, PsModel, run};
use crate::cli::JobArgs;
use crate::cli::job_args::DEFAULT_LR;

/// `--lr` of `ps --model sparse-lr` when not given.
const SPARSE_LR_DEFAULT_LR: f32 = 0.03;

/// Flags of `archipelago ps`.
#[derive(Debug, Args)]
pub struct PsArgs {
    /// The model, data, global batch, steps (clocks), seed, optimizer and learning rate, as for
    /// `train` (`--model sparse-lr` for sparse logistic regression; data-parallel, pipeline and
    /// ZeRO flags do not apply and are refused).
    #[command(flatten)]
    pub job: JobArgs,
    /// Server actors (each holds the key ranges the ring gives it).
    #[arg(long, default_value_t = 2)]
    pub servers: usize,
    /// Worker actors (the global batch is split between them).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Consistency: 0 (sequential), K > 0 (bounded delay K) or inf (eventual).
    #[arg(long, default_value = "0", allow_hyphen_values = true)]
    pub staleness: String,
    /// Copies of each key range: a push walks the range's chain of this many servers and is
    /// acknowledged once the tail has it; a lost server's ranges fail over to the next copy
    /// (at most --servers; 1 = no copy, a lost server loses its ranges).
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Virtual nodes per server on the consistent-hash ring.
    #[arg(long, default_value_t = 64)]
    pub vnodes: usize,
    /// Values per key of a dense model (its flat parameters are cut into keys of this many).
    #[arg(long, default_value_t = 1024)]
    pub key_width: usize,
    /// sparse-lr: the L1 weight λ (the servers then take proximal steps; needs --optimizer sgd).
    #[arg(long, default_value_t = 0.0)]
    pub l1: f32,
    /// sparse-lr: features (keys).
    #[arg(long, default_value_t = 100_000)]
    pub features: u64,
    /// sparse-lr: feature draws per example.
    #[arg(long, default_value_t = 20)]
    pub draws: usize,
    /// sparse-lr: non-zero true weights.
    #[arg(long, default_value_t = 50)]
    pub support: usize,
    /// sparse-lr: held-out examples the objective is measured on.
    #[arg(long, default_value_t = 4000)]
    pub eval_examples: usize,
    /// Milliseconds each worker sleeps per clock, by rank, e.g. `0,0,20` (a slow worker).
    #[arg(long)]
    pub delay_ms: Option<String>,
    /// Write the servers' checkpoint (keys, state, clocks) here after the last clock.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Resume from the checkpoint in this directory and run up to --steps.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Print the ring (servers, shares, ranges) before running.
    #[arg(long)]
    pub print_ring: bool,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Key caching (Li et al. §3.5): a key list a worker already sent to a server goes as its
    /// hash (`--key-caching false` sends every list whole).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub key_caching: bool,
    /// The significantly-modified filter (Li et al. §3.4): a worker holds a key's gradient back,
    /// adding it up, until its magnitude exceeds this threshold (default: off).
    #[arg(long)]
    pub filter: Option<f32>,
    /// Run the servers and workers on the hosts of this controller (`archipelago controller`),
    /// which are `archipelago ps` processes started with `ARCHIPELAGO_ROLE=host`; `auto` in a
    /// Slurm job (examples/slurm/train.sbatch with ARCHIPELAGO_PROGRAM).
    #[arg(long, env = "ARCHIPELAGO_CONTROLLER")]
    pub controller: Option<String>,
    /// File holding the cluster token (with --controller).
    #[arg(long, env = "ARCHIPELAGO_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// With --controller: mutual TLS with it and its hosts.
    #[command(flatten)]
    pub tls: crate::cluster::security::TlsArgs,
}

/// The actor and message types a parameter-server job sends across processes.
pub fn registry() -> archipelago_actors::runtime::Registry {
    archipelago_actors::ps::registry::<BuiltinUpdate>()
}

impl PsArgs {
    /// Train's flags that mean nothing to a parameter server, set to something else than their
    /// defaults.
    fn refuse_training_flags(&self) -> anyhow::Result<()> {
        let j = &self.job;
        let set: Vec<&str> = [
            (j.dp != 1, "--dp (use --workers)"),
            (j.pp != 1, "--pp"),
            (j.zero != 0, "--zero"),
            (j.offload != "none", "--offload"),
            (j.offload_params, "--offload-params"),
            (j.microbatches != 1, "--microbatches"),
            (j.virtual_stages != 1, "--virtual-stages"),
            (j.checkpoint_activations, "--checkpoint-activations"),
            (j.partition_activations, "--partition-activations"),
            (j.sequence_parallel, "--sequence-parallel"),
            (j.offload_activations != "none", "--offload-activations"),
            (j.stages.is_some(), "--stages"),
            (j.devices.is_some(), "--devices"),
            (j.init.is_some(), "--init"),
            (j.clip_grad_norm.is_some(), "--clip-grad-norm"),
            (j.warmup_steps != 0, "--warmup-steps"),
            (j.momentum.is_some() || j.nesterov, "--momentum/--nesterov"),
            (j.weight_decay.is_some(), "--weight-decay"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        if !set.is_empty() {
            anyhow::bail!(
                "`archipelago ps` does not take {}: a parameter server has servers and workers, not a training mesh; drop them",
                set.join(", ")
            );
        }
        let decay: LrDecay = j.lr_schedule.parse().map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            decay == LrDecay::Constant,
            "--lr-schedule {}: the parameter server's updates take a constant rate; drop --lr-schedule",
            j.lr_schedule
        );
        Ok(())
    }

    /// The job these flags describe, checked; `None` for eventual consistency's bound.
    pub fn job(&self) -> anyhow::Result<PsJob<BuiltinUpdate>> {
        self.refuse_training_flags()?;
        let consistency: Consistency = self.staleness.parse().map_err(anyhow::Error::msg)?;
        // Sparse logistic regression's updates touch each key rarely: at `train`'s 1e-3 it barely
        // moves in a run of the default length (held-out objective 0.693 → 0.683 in 30 clocks),
        // at 0.03 it goes to 0.532 (the true weights' 0.462).
        let default_lr = if self.job.model == "sparse-lr" {
            SPARSE_LR_DEFAULT_LR
        } else {
            DEFAULT_LR
        };
        let lr = self.job.lr.unwrap_or(default_lr);
        let spec = OptimizerSpec::named(&self.job.optimizer, lr).map_err(anyhow::Error::msg)?;
        let (model, batch) = if self.job.model == "sparse-lr" {
            anyhow::ensure!(
                self.job.data.is_none(),
                "--data trains a gpt; sparse-lr generates its own data"
            );
            let ctr = CtrSpec {
                seed: self.job.seed,
                features: self.features,
                draws: self.draws,
                support: self.support,
            };
            (PsModel::SparseLr(ctr), self.job.batch.unwrap_or(512))
        } else {
            anyhow::ensure!(self.l1 == 0.0, "--l1 is for --model sparse-lr");
            let program = self.job.program()?;
            let model = ModelSpec::parse(&self.job.model)?;
            let dense = PsModel::Dense {
                model,
                data: program.data.clone(),
                seed: self.job.seed,
                width: self.key_width,
            };
            (dense, program.plan.batch)
        };
        let update =
            BuiltinUpdate::from_spec(spec, self.l1, Initializer::Zeros).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            self.workers == 0 || batch.is_multiple_of(self.workers),
            "--batch {batch} does not split over --workers {}: give a multiple of the workers",
            self.workers
        );
        let delay_ms = match &self.delay_ms {
            Some(list) => list
                .split(',')
                .map(|d| d.trim().parse::<u64>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("--delay-ms takes milliseconds per rank, e.g. 0,0,20: {e}"))?,
            None => Vec::new(),
        };
        let first = match &self.resume {
            Some(dir) => {
                archipelago_actors::ps::checkpoint::read_manifest(dir)
                    .map_err(anyhow::Error::msg)?
                    .clock
            }
            None => 0,
        };
        anyhow::ensure!(
            first < self.job.steps,
            "the checkpoint is at clock {first}; --steps {} has nothing left to run: give more --steps",
            self.job.steps
        );
        let job = PsJob {
            model,
            update,
            servers: self.servers,
            workers: self.workers,
            replicas: self.replicas,
            vnodes: self.vnodes,
            consistency,
            local_batch: batch / self.workers.max(1),
            clocks: self.job.steps - first,
            delay_ms,
            checkpoint_dir: self.checkpoint_dir.clone().or_else(|| self.resume.clone()),
            resume: self.resume.clone(),
            log_clocks: false,
            key_caching: self.key_caching,
            filter: self.filter,
            fault: Default::default(),
            fail_at: None,
        };
        job.check().map_err(anyhow::Error::msg)?;
        Ok(job)
    }
}

/// Parses `args` (the words after `archipelago ps`) and runs them, as the binary would; returns
/// the report.
pub fn run_command_line(args: &[&str]) -> anyhow::Result<PsReport> {
    use clap::Parser;
    let words = ["archipelago", "ps"].into_iter().chain(args.iter().copied());
    let cli = crate::cli::Cli::try_parse_from(words).map_err(|e| anyhow::anyhow!("{e}"))?;
    match cli.command {
        crate::cli::Command::Ps(args) => ps(&args),
        _ => unreachable!("parsed as `ps`"),
    }
}

/// Runs `archipelago ps` and returns its report (in a process started with
/// `ARCHIPELAGO_ROLE=host`, serves as a host of the job's servers and workers instead, until the
/// controller goes away).
pub fn ps(args: &PsArgs) -> anyhow::Result<PsReport> {
    if std::env::var(crate::runtime::ROLE_ENV).as_deref() == Ok("host") {
        crate::runtime::init(registry(), Vec::new())?;
        unreachable!("a host serves until its controller goes away, then exits");
    }
    let job = args.job()?;
    // The types a cluster needs, installed in one process too, where strict registration mode
    // (ARCHIPELAGO_STRICT_REGISTRY=1) checks every spawn and message against them.
    registry().install();
    let runtime = match &args.controller {
        Some(addr) => {
            let Some(token_file) = &args.token_file else {
                anyhow::bail!("--controller needs --token-file (the cluster's token)");
            };
            let credentials = args.tls.credentials(token_file)?;
            let addr = crate::cluster::commands::controller_addr(addr)?;
            crate::runtime::connect(&addr, credentials, job.devices())?
        }
        None => Runtime::local(DeviceSpec::cpus(job.devices())),
    };
    let ring = archipelago_actors::ps::Ring::new(0..job.servers, job.vnodes)?;
    println!(
        "parameter server: {} on {} servers ({} replicas per range), {} workers, {}, {}, global batch {}, {} clocks",
        args.job.model,
        job.servers,
        job.replicas,
        job.workers,
        job.consistency,
        job.update.describe(),
        job.global_batch(),
        job.clocks
    );
    if args.print_ring {
        print!("{}", ring.describe());
    }
    let outcome = run(&runtime, &job)?;
    if args.controller.is_some() {
        let hosts: std::collections::BTreeSet<&str> =
            outcome.placement.iter().map(|(h, _)| h.as_str()).collect();
        println!("servers and workers ran on hosts {hosts:?}");
    }
    let every = (outcome.losses.len() / 10).max(1);
    for (c, loss) in outcome.losses.iter().enumerate() {
        if c % every == 0 || c + 1 == outcome.losses.len() {
            println!("clock {:>5}  loss {loss:.5}", outcome.first_clock + c as u64 + 1);
        }
    }
    let blocks: Vec<usize> = match &job.model {
        PsModel::Dense { model, .. } => model.desc().blocks.iter().map(|b| b.params as usize).collect(),
        PsModel::SparseLr(_) => Vec::new(),
    };
    let mut report = PsReport::new(
        args.job.model.clone(),
        serde_json::to_value(&args.job)?,
        &outcome,
        &blocks,
        job.global_batch(),
        job.update.describe(),
        job.consistency.to_string(),
    );
    if let (PsModel::SparseLr(spec), FinalModel::Sparse(weights)) = (&job.model, &outcome.model) {
        let summary = SparseSummary::of(spec, weights, args.l1, args.eval_examples);
        println!(
            "objective (log-loss + L1 on {} held-out examples): {:.5} at start → {:.5} at the end (true weights: {:.5})",
            summary.eval_examples, summary.objective_start, summary.objective_end, summary.objective_true
        );
        let r = summary.recovery;
        println!(
            "support: {} non-zero weights, {} of the {} true features among them, {} with the true sign",
            r.nonzero, r.true_found, r.support, r.sign_agree
        );
        report.sparse = Some(summary);
    }
    for s in &report.servers {
        println!(
            "server {}: {} keys, {} pushes, {} pulls ({} refused), {:.1} MB in, {:.1} MB out",
            s.index,
            s.keys,
            s.pushes,
            s.pulls,
            s.refused,
            s.bytes_in as f64 / 1e6,
            s.bytes_out as f64 / 1e6
        );
    }
    for f in &report.failovers {
        println!(
            "failover: server {} (host {}) lost; its ranges back on {} servers {:.3} s after the loss was seen, {} keys copied",
            f.server, f.host, job.replicas, f.restore_s, f.keys_copied
        );
    }
    if let Some(r) = &report.replication {
        println!(
            "replication: {} keys on {}..{} live servers each, copies differ by at most {:.2e}, {} keys whose copies' range versions differ",
            r.keys, r.min_copies, r.max_copies, r.max_diff, r.version_mismatches
        );
    }
    println!(
        "done: final loss {:.5}, parameter L2 {:.6}, {:.1} samples/s, most clocks ahead of the slowest worker {}",
        report.final_loss, report.param_l2, report.samples_per_s, report.max_lead
    );
    if let Some(path) = &args.report {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
        println!("report written to {}", path.display());
    }
    Ok(report)
}
