//! The `archipelago` command line: `train`, `plan`, `ps`, `export`, `eval`, `serve`, `bench`,
//! `controller` and `host`.
//!
//! `plan` takes every flag of `train` (those that matter only while running are ignored), so it
//! shows exactly what `train` would run. The job's flags are [`JobArgs`]; `train` adds how to run
//! and report it ([`TrainArgs`]), `plan` how to show it ([`PlanArgs`]). The report's keys only
//! grow.

mod console;
pub mod job_args;
pub mod lora_args;
mod plan_cmd;
mod train_cmd;

use clap::{Parser, Subcommand};

pub use job_args::JobArgs;
pub use plan_cmd::{PlanArgs, plan};
pub use train_cmd::{TrainArgs, train};

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
    /// Compile and verify a job without starting any actor; print a summary (mesh, schedule,
    /// predicted step, memory and bytes per actor), the streams with --streams, or layouts side
    /// by side with --compare.
    Plan(Box<PlanArgs>),
    /// Train with a parameter server (Li et al., OSDI 2014): server actors hold the model's key
    /// ranges on a consistent-hash ring, workers pull and push under a consistency model.
    Ps(Box<crate::ps_job::cli::PsArgs>),
    /// Run the benchmarks: a summary table to stdout, every figure as JSON to --json FILE.
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
    /// The loss and perplexity of a model (weights from a safetensors file or a checkpoint) over a
    /// text file, on one CPU device.
    Eval(crate::eval::EvalArgs),
    /// Serve a model over OpenAI's HTTP API (completions and chat, streamed or not), with
    /// /v1/models, /health and Prometheus /metrics: continuous batching over a cache pool,
    /// --replicas behind one router.
    Serve(Box<crate::serve::ServeArgs>),
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
    /// The part of a slow-link run inside its network namespace (started by `bench` and the
    /// slow-link test as `unshare -n archipelago bench-slow-link …`).
    #[command(hide = true)]
    BenchSlowLink(crate::bench::slow_link::SlowLinkArgs),
}

#[cfg(test)]
mod tests;
