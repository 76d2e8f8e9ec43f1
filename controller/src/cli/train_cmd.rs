//! `archipelago train`: checks the job before anything starts (flags, devices, data, the
//! checkpoint to resume), prints what it will run, runs it here or on a controller, and prints and
//! writes what it measured.

use std::path::PathBuf;

use clap::Args;

use archipelago_dataflow::{DeviceSpec, Plan, Program};

use super::JobArgs;
use super::console::{self, Start};
use crate::Controller;
use crate::report::TrainReport;
use crate::train::TrainOptions;

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
    /// Print no progress lines: the banner and the summary only.
    #[arg(long)]
    pub quiet: bool,
    /// Print a progress line every this many steps (and at the first and the last); 0: a tenth
    /// of the run's steps.
    #[arg(long, default_value_t = 0)]
    pub log_every: u64,
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
    /// lr-schedule, clip, steps, data, precision, compress (any other difference refuses the
    /// resume, naming it). `steps` lets a run go on past the --steps it was started with.
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

/// Runs `archipelago train`.
pub fn train(args: &TrainArgs) -> anyhow::Result<()> {
    let program = args.job.program()?;
    let restart_on_failure = match args.restart.as_str() {
        "on-failure" => true,
        "never" => false,
        other => anyhow::bail!("--restart takes `on-failure` or `never`, not `{other}`"),
    };
    check_paths(args)?;
    let local = Controller::local(program.devices.clone());
    // Compiled here too, so a plan that cannot work is refused before anything is submitted.
    let plan = local.plan(&program)?;
    if args.controller.is_none() {
        // Refused here, before anything starts: a `cuda:N` this process cannot run.
        let devices: Vec<DeviceSpec> = plan.actors.iter().map(|a| a.device).collect();
        archipelago_actors::check_devices(&devices).map_err(anyhow::Error::msg)?;
        archipelago_actors::backend::check_precision(&devices, program.precision.compute)
            .map_err(anyhow::Error::msg)?;
    }
    let controller = match &args.controller {
        Some(addr) => {
            let Some(token_file) = &args.token_file else {
                anyhow::bail!("--controller needs --token-file (the cluster's token)");
            };
            let addr = crate::cluster::commands::controller_addr(addr)?;
            Controller::connect(&addr, args.tls.credentials(token_file)?)
        }
        None => local,
    };
    print_banner(args, &program, &plan);
    let steps = args.job.steps;
    let every = if args.log_every > 0 {
        args.log_every
    } else {
        (steps / 10).max(1)
    };
    let (on_step, bar) = console::progress(steps, program.plan.batch as f64, every, args.quiet);
    let mut options = TrainOptions {
        steps,
        job: format!("train-{}", program.model.name),
        patience: std::time::Duration::from_secs(args.patience_s),
        flags: serde_json::to_value(args.job.resolved(&program))?,
        on_step: Some(on_step),
        trace: args.trace.clone(),
        // `--lora-out` reads the adapters from the last checkpoint (written after the last step).
        checkpoint_dir: (args.resume.clone().or_else(|| args.checkpoint_dir.clone())).or_else(|| {
            args.job
                .lora
                .lora_out
                .as_deref()
                .map(super::lora_args::checkpoints_beside)
        }),
        checkpoint_every: args.checkpoint_every,
        resume: args.resume.is_some(),
        resume_override: args.resume_override.clone(),
        restart_on_failure,
        data_path: args.data_path,
        dashboard: None,
        collectives: args.collectives,
        keep_params: false,
    };
    if let Some(addr) = &args.dashboard {
        options.dashboard = Some(serve_dashboard(args, addr, &controller, &program)?);
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
    if let Some(dir) = &args.job.lora.lora_out {
        let base = args
            .job
            .init
            .as_ref()
            .map_or("seeded random base".into(), |p| p.display().to_string());
        // The checkpoint of this run's last step (not the newest under the directory: another
        // run's may be there).
        let root = options.checkpoint_dir.as_deref().expect("--lora-out checkpoints");
        let last = archipelago_actors::checkpoint::step_dir(root, options.steps);
        super::lora_args::write_adapters(dir, &last, &base).map_err(anyhow::Error::msg)?;
        println!("adapters written to {} (PEFT's format)", dir.display());
    }
    print_outcome(args, &program, &report)
}

/// Refuses what cannot work before anything starts: `--dashboard` with `--controller`,
/// `--checkpoint-dir` beside a different `--resume`, a `--resume` that is not a directory, and
/// (for a job run here) a `--data` or `--init` file that does not exist.
fn check_paths(args: &TrainArgs) -> anyhow::Result<()> {
    if args.resume.is_some() && args.checkpoint_dir.is_some() && args.checkpoint_dir != args.resume {
        anyhow::bail!(
            "--resume DIR writes its checkpoints into DIR; drop --checkpoint-dir or make it the same"
        );
    }
    if args.controller.is_some() && args.dashboard.is_some() {
        anyhow::bail!(
            "with --controller the dashboard is the controller's: start it with `archipelago controller --dashboard ADDR`"
        );
    }
    if let Some(dir) = args.resume.as_ref().filter(|d| !d.is_dir()) {
        anyhow::bail!(
            "--resume {}: no such directory (pass the --checkpoint-dir of the run to go on from)",
            dir.display()
        );
    }
    if args.controller.is_some() {
        // The hosts read these files: they need not exist on the client.
        return Ok(());
    }
    for (flag, path) in [("--data", &args.job.data), ("--init", &args.job.init)] {
        if let Some(path) = path.as_ref().filter(|p| !p.is_file()) {
            anyhow::bail!("{flag} {}: no such file", path.display());
        }
    }
    Ok(())
}

/// The banner, the warning when a local job's actors outnumber the cores, and the CPU matmul.
fn print_banner(args: &TrainArgs, program: &Program, plan: &Plan) {
    let start = match &args.resume {
        Some(dir) => Start::Resume(dir),
        None => Start::Fresh,
    };
    for line in console::banner(program, plan, args.job.steps, start) {
        println!("{line}");
    }
    if args.controller.is_none() && console::cpu_actors(plan) > 0 {
        if let Some(warning) = console::cores_warning(plan) {
            println!("{warning}");
        }
        println!("cpu matmul: {}", archipelago_actors::kernels::describe());
    }
}

/// Serves this job's dashboard on `addr` (a job run here; a controller serves its own).
fn serve_dashboard(
    args: &TrainArgs,
    addr: &str,
    controller: &Controller,
    program: &Program,
) -> anyhow::Result<std::sync::Arc<crate::dashboard::Dashboard>> {
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
    Ok(dashboard)
}

/// The summary lines, the pipeline's bubbles, and where the trace and the report went.
fn print_outcome(args: &TrainArgs, program: &Program, report: &TrainReport) -> anyhow::Result<()> {
    for line in console::summary(report) {
        println!("{line}");
    }
    if program.plan.pp > 1 || program.plan.microbatches > 1 {
        for line in console::pipeline_lines(report) {
            println!("{line}");
        }
    }
    if let Some(path) = &args.trace {
        println!(
            "trace written to {} (open in https://ui.perfetto.dev)",
            path.display()
        );
    }
    if let Some(path) = &args.report {
        std::fs::write(path, serde_json::to_string_pretty(report)?)?;
        println!("report written to {}", path.display());
    }
    Ok(())
}
