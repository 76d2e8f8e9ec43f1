//! Training jobs on the embedded controller: compile, start the gang, drive the steps, report.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use archipelago_actors::batch_file::BatchFile;
use archipelago_actors::checkpoint::{self, CheckpointReader, MANIFEST, Manifest};
use archipelago_actors::device_actor::ComputationFactory;
use archipelago_actors::executor::StepReport;
use archipelago_actors::fabric::InProcessFabric;
use archipelago_actors::offload::OffloadStats;
use archipelago_actors::trainer::Placement;
use archipelago_actors::weights_file::InitWeights;
use archipelago_actors::zoo::ModelBuilder;
use archipelago_actors::{Builders, CpuBackend};
use archipelago_dataflow::data::{DataSpec, TokenStream};
use archipelago_dataflow::memory::MemoryEstimate;
use archipelago_dataflow::{
    ActorId, DeviceSpec, InputKind, Instruction, ModelSpec, Plan, PlanError, Program, compile,
};

use crate::JobError;
use crate::actor_gang::ActorGang;
use crate::gang::Gang;
use crate::local::{Controller, DEFAULT_PATIENCE};
use crate::process_stats::{load_avg, peak_rss_bytes};
use crate::replay::replay;
use crate::report::{ActorRecord, InstructionRecord, OffloadRecord, StepRecord, TrainReport, median};
use crate::trace::TraceRecorder;

/// What the controller tells a progress callback after each step.
#[derive(Debug, Clone)]
pub struct StepProgress {
    /// The step just finished, from 1.
    pub step: u64,
    /// Steps in the run.
    pub steps: u64,
    /// Global loss of the step.
    pub loss: f32,
    /// Wall time of the step.
    pub time_s: f64,
}

/// Called after every step.
pub type ProgressFn = Arc<dyn Fn(&StepProgress) + Send + Sync>;

/// Options of a training run.
#[derive(Clone)]
pub struct TrainOptions {
    /// Steps to run.
    pub steps: u64,
    /// Job name (appears in every error).
    pub job: String,
    /// How long a receive may wait for a peer before it is reported as a hang.
    pub patience: Duration,
    /// The flags as given, copied into the report's `plan` key.
    pub flags: serde_json::Value,
    /// Progress callback.
    pub on_step: Option<ProgressFn>,
    /// Write a Chrome/Perfetto trace of the steps here.
    pub trace: Option<std::path::PathBuf>,
    /// Write checkpoints under this directory (`step-NNNNNNNN/`, manifest last).
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps (and always after the last); 0: only after the last.
    pub checkpoint_every: u64,
    /// Start from the newest complete checkpoint under `checkpoint_dir` (any layout).
    pub resume: bool,
    /// Several hosts: when a host dies, re-plan on the hosts that remain, load the last complete
    /// checkpoint (resharded) and go on.
    pub restart_on_failure: bool,
    /// Several hosts: how tensors travel between them (shared memory between processes of one
    /// machine and raw TCP between machines, unless a path is pinned).
    pub data_path: archipelago_actors::fabric::DataPath,
    /// A dashboard to feed with the job's steps (see [`crate::dashboard`]).
    pub dashboard: Option<Arc<crate::dashboard::Dashboard>>,
    /// A local run: how the devices' groups reduce — through each other's buffers (the
    /// default) or as rings of messages (as groups that span hosts do). Hosts of a cluster
    /// always use shared buffers among their own devices.
    pub collectives: archipelago_actors::collectives::Collectives,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            steps: 30,
            job: "train".into(),
            patience: DEFAULT_PATIENCE,
            flags: serde_json::Value::Null,
            on_step: None,
            trace: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            resume: false,
            restart_on_failure: false,
            data_path: archipelago_actors::fabric::DataPath::Auto,
            dashboard: None,
            collectives: archipelago_actors::collectives::Collectives::Shared,
        }
    }
}

impl Controller {
    /// Compiles and verifies `program` for this controller's devices, starting nothing.
    pub fn plan(&self, program: &Program) -> Result<Plan, PlanError> {
        let mut program = program.clone();
        if program.devices.is_empty() {
            program.devices = self.devices.clone();
        }
        compile(&program)
    }

    /// Trains a zoo model (`program.model.name` is its spec) and reports.
    pub fn train(&self, program: &Program, options: &TrainOptions) -> Result<TrainReport, JobError> {
        let spec = ModelSpec::parse(&program.model.name)?;
        if let Some(remote) = &self.remote {
            return self
                .runtime
                .block_on(crate::cluster::client::submit(remote, program, options));
        }
        self.train_blocks(program, Builders::zoo(spec), options)
    }

    /// Trains a model whose blocks `builder` makes (the user's own blocks, on CPU devices) and
    /// reports.
    pub fn train_with(
        &self,
        program: &Program,
        builder: Arc<dyn ModelBuilder<CpuBackend>>,
        options: &TrainOptions,
    ) -> Result<TrainReport, JobError> {
        self.train_blocks(program, Builders::cpu(builder), options)
    }

    /// Trains a model whose blocks `builders` make on each backend the devices need (the user's
    /// own blocks on GPUs: `Builders::cpu(..).with_cuda(..)` in a build with `cuda`) and reports.
    pub fn train_blocks(
        &self,
        program: &Program,
        builders: Builders,
        options: &TrainOptions,
    ) -> Result<TrainReport, JobError> {
        if self.remote.is_some() {
            return Err(JobError::Runtime(
                "a remote controller trains zoo models only (hosts build the blocks from the model spec); \
                 use Controller::train with a zoo spec, or a local controller for your own blocks"
                    .into(),
            ));
        }
        let plan = self.plan(program)?;
        self.run_plan(plan, builders, options)
    }

    /// Trains a zoo model from a plan already compiled by [`Controller::plan`] (nothing is
    /// compiled again) and reports.
    pub fn train_compiled(&self, plan: Plan, options: &TrainOptions) -> Result<TrainReport, JobError> {
        if self.remote.is_some() {
            return Err(JobError::Runtime(
                "a remote controller compiles the jobs it runs: submit the program with Controller::train"
                    .into(),
            ));
        }
        let spec = ModelSpec::parse(&plan.program.model.name)?;
        self.run_plan(plan, Builders::zoo(spec), options)
    }

    fn run_plan(
        &self,
        plan: Plan,
        builders: Builders,
        options: &TrainOptions,
    ) -> Result<TrainReport, JobError> {
        let result = self.runtime.block_on(run(plan, builders, options));
        if let Some(d) = &options.dashboard {
            d.job_ended(result.as_ref().err().map(|e| e.to_string()).as_deref());
        }
        result
    }

    /// Serves `dashboard` on `addr` (e.g. `127.0.0.1:8080`; port 0 picks one) from this
    /// controller's runtime; returns the address it listens on.
    pub fn serve_dashboard(
        &self,
        addr: &str,
        dashboard: Arc<crate::dashboard::Dashboard>,
    ) -> std::io::Result<std::net::SocketAddr> {
        self.runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind(addr).await?;
            crate::dashboard::serve(listener, dashboard)
        })
    }
}

async fn run(plan: Plan, builders: Builders, options: &TrainOptions) -> Result<TrainReport, JobError> {
    check_options(options)?;
    check_data(&plan.program)?;
    let devices: Vec<DeviceSpec> = plan.actors.iter().map(|a| a.device).collect();
    builders.check(&devices).map_err(JobError::Runtime)?;
    let (restore, first_step) = resume_point(&plan.program, options)?;
    let n = plan.actors.len();
    let fabric = Arc::new(InProcessFabric::with_collectives(
        n,
        options.patience,
        options.collectives,
    ));
    let all: Vec<ActorId> = (0..n).collect();
    let factories = trainer_factories(&plan, &builders, &all, restore);
    let mut streams: Vec<_> = plan.actors.iter().map(|a| a.stream.clone()).collect();
    crate::hang::inject_stream_fault(&mut streams, plan.program.test_fault);
    let watchdog = options.patience + Duration::from_secs(10);
    let mut gang = ActorGang::start(&options.job, streams, factories, fabric, watchdog).await?;
    let mut history = Vec::new();
    let result = drive(&mut gang, &plan, options, first_step, &mut history).await;
    gang.stop().await;
    result
}

/// Refuses option combinations that cannot work, before any actor starts.
pub(crate) fn check_options(options: &TrainOptions) -> Result<(), JobError> {
    if options.resume && options.checkpoint_dir.is_none() {
        return Err(JobError::Runtime(
            "resuming needs the checkpoint directory (--resume DIR)".into(),
        ));
    }
    Ok(())
}

/// Refuses `--data` a model cannot train on (bytes outside a gpt's vocabulary, too short; a
/// safetensors file without the tensors the model reads) and `--init` weights that are not
/// exactly the model's, before any actor starts. A file this process cannot read is left to the
/// hosts to read.
pub(crate) fn check_data(program: &Program) -> Result<(), JobError> {
    let path_here = |path: &str| std::path::Path::new(path).exists();
    match (&program.data, program.model.input) {
        (DataSpec::TextFile { path }, InputKind::Tokens { ctx, vocab }) => {
            if let Ok(bytes) = std::fs::read(path) {
                TokenStream::check_text(path, &bytes, ctx, vocab).map_err(JobError::Runtime)?;
            }
        }
        (DataSpec::TensorFile { path }, input) if path_here(path) => {
            BatchFile::open(std::path::Path::new(path), input).map_err(JobError::Runtime)?;
        }
        _ => {}
    }
    if let Some(path) = program.init.as_deref().filter(|p| path_here(p)) {
        InitWeights::open(std::path::Path::new(path), &program.model).map_err(JobError::Runtime)?;
    }
    Ok(())
}

/// The checkpoint to start from and the first step to run (1 when starting fresh).
pub(crate) fn resume_point(
    program: &Program,
    options: &TrainOptions,
) -> Result<(Option<Arc<CheckpointReader>>, u64), JobError> {
    let Some(root) = options.checkpoint_dir.as_ref().filter(|_| options.resume) else {
        return Ok((None, 1));
    };
    let (latest, skipped) = checkpoint::latest_complete(root);
    for why in &skipped {
        tracing::warn!("{why}");
        eprintln!("checkpoint {why}");
    }
    let Some((dir, manifest)) = latest else {
        return Err(JobError::Runtime(format!(
            "no complete checkpoint under {} to resume from{}",
            root.display(),
            if skipped.is_empty() {
                String::new()
            } else {
                format!(" ({})", skipped.join("; "))
            }
        )));
    };
    if manifest.model != program.model.name || manifest.seed != program.seed {
        return Err(JobError::Runtime(format!(
            "the checkpoint in {} is of model `{}` seed {}, this job trains `{}` seed {}",
            dir.display(),
            manifest.model,
            manifest.seed,
            program.model.name,
            program.seed
        )));
    }
    let reader = CheckpointReader::open(&dir).map_err(JobError::Runtime)?;
    Ok((Some(Arc::new(reader)), manifest.next_step))
}

/// One computation factory per actor in `actors`: each builds the actor's trainer on its device
/// and, when `restore` is given, loads its state from that checkpoint.
pub(crate) fn trainer_factories(
    plan: &Plan,
    builders: &Builders,
    actors: &[ActorId],
    restore: Option<Arc<CheckpointReader>>,
) -> Vec<ComputationFactory> {
    actors
        .iter()
        .map(|&id| {
            let a = &plan.actors[id];
            let placement = Placement::of(a);
            let (program, builders, actor, device, restore) = (
                plan.program.clone(),
                builders.clone(),
                a.actor,
                a.device,
                restore.clone(),
            );
            Box::new(move || builders.trainer(&program, actor, device, &placement, restore.as_deref()))
                as ComputationFactory
        })
        .collect()
}

/// Every actor writes its shard after `step`; then the manifest, which completes the checkpoint.
async fn save_checkpoint<G: Gang>(
    gang: &mut G,
    plan: &Plan,
    options: &TrainOptions,
    root: &std::path::Path,
    step: u64,
) -> Result<(), JobError> {
    let dir = checkpoint::step_dir(root, step);
    // A checkpoint of this step from before a restart is incomplete from the moment its shards
    // start to change.
    let _ = std::fs::remove_file(dir.join(MANIFEST));
    let files = gang.checkpoint(&dir, step).await?;
    let program = &plan.program;
    let manifest = Manifest {
        job: options.job.clone(),
        step,
        next_step: step + 1,
        model: program.model.name.clone(),
        seed: program.seed,
        layout: serde_json::to_value(&program.plan).unwrap_or_default(),
        files,
    };
    checkpoint::write_manifest(&dir, &manifest).map_err(JobError::Runtime)
}

/// Runs steps `first_step..=options.steps` on `gang`, checkpointing as asked; `steps` keeps the
/// step records (across restarts: records from `first_step` on are replaced).
pub(crate) async fn drive<G: Gang>(
    gang: &mut G,
    plan: &Plan,
    options: &TrainOptions,
    first_step: u64,
    steps: &mut Vec<StepRecord>,
) -> Result<TrainReport, JobError> {
    steps.retain(|s| s.step < first_step);
    if let Some(d) = &options.dashboard {
        d.job_started(plan, &options.job, options.steps);
    }
    let n = plan.actors.len();
    let mut last: Vec<StepReport> = Vec::new();
    let mut per_actor_compute: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut per_actor_wait: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut peaks = vec![0u64; n];
    let mut peak_held = vec![0usize; n];
    let mut per_actor_bubble: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut trace = options.trace.as_ref().map(|_| TraceRecorder::new());
    let mut per_instruction: Vec<Vec<Vec<f64>>> = plan
        .actors
        .iter()
        .map(|a| vec![Vec::new(); a.stream.instructions.len()])
        .collect();
    for step in first_step..=options.steps {
        let began = Instant::now();
        let span =
            tracing::info_span!("step", job = %options.job, step, actors = n, loss = tracing::field::Empty);
        let reports = tracing::Instrument::instrument(gang.step(step), span.clone()).await?;
        let time_s = began.elapsed().as_secs_f64();
        let loss: f32 = reports.iter().filter_map(|r| r.metrics.loss).sum();
        span.record("loss", loss);
        // The step as the actors saw it: from the first stream's start to the last one's end.
        let first = reports
            .iter()
            .map(|r| r.began_unix_s)
            .fold(f64::INFINITY, f64::min);
        let span = reports
            .iter()
            .map(|r| r.began_unix_s + r.seconds - first)
            .fold(0.0, f64::max);
        for r in &reports {
            let (compute, wait) = split_time(&plan.actors[r.actor].stream.instructions, r);
            push_recent(&mut per_actor_compute[r.actor], compute);
            push_recent(&mut per_actor_wait[r.actor], wait);
            if step > first_step || options.steps == first_step {
                push_recent(&mut per_actor_bubble[r.actor], 1.0 - compute / span.max(1e-12));
            }
            peaks[r.actor] = peaks[r.actor].max(r.metrics.peak_model_state_bytes);
            peak_held[r.actor] = peak_held[r.actor].max(r.metrics.peak_microbatches_held);
            for t in &r.timings {
                push_recent(&mut per_instruction[r.actor][t.index], t.seconds);
            }
        }
        if let Some(trace) = &mut trace {
            trace.record(plan, step, &reports);
        }
        if let Some(d) = &options.dashboard {
            d.step_done(plan, step, loss, time_s, &reports);
        }
        steps.push(StepRecord {
            step,
            loss,
            time_s,
            lr: reports.iter().find_map(|r| r.metrics.lr),
            grad_norm: reports.iter().find_map(|r| r.metrics.grad_norm),
            transfers: reports.iter().fold(Default::default(), |mut all, r| {
                all.add(&r.metrics.transfers);
                all
            }),
        });
        if let Some(callback) = &options.on_step {
            callback(&StepProgress {
                step,
                steps: options.steps,
                loss,
                time_s,
            });
        }
        last = reports;
        let preempted = crate::preemption::requested() && step < options.steps;
        if let Some(root) = &options.checkpoint_dir {
            let every = options.checkpoint_every;
            if (every > 0 && step.is_multiple_of(every)) || step == options.steps || preempted {
                save_checkpoint(gang, plan, options, root, step).await?;
            }
        }
        if preempted {
            let checkpoint = match &options.checkpoint_dir {
                Some(root) => format!(
                    "resume with --resume {} (checkpoint {})",
                    root.display(),
                    archipelago_actors::checkpoint::step_dir(root, step).display()
                ),
                None => "no checkpoint (no --checkpoint-dir)".into(),
            };
            return Err(JobError::Preempted {
                job: options.job.clone(),
                step,
                checkpoint,
            });
        }
    }
    let instruction_medians: Vec<Vec<f64>> = per_instruction
        .iter_mut()
        .map(|actor| actor.iter_mut().map(|times| median(times)).collect())
        .collect();
    let replayed = replay(plan, &instruction_medians);
    if let (Some(trace), Some(path)) = (&trace, &options.trace) {
        let text =
            serde_json::to_string(&trace.to_json(plan)).map_err(|e| JobError::Runtime(e.to_string()))?;
        std::fs::write(path, text)
            .map_err(|e| JobError::Runtime(format!("cannot write the trace to {}: {e}", path.display())))?;
    }
    let mut squares = vec![0.0f64; plan.program.model.blocks.len()];
    for (block, sq) in gang.block_squares().await? {
        squares[block] += sq;
    }
    let mut times: Vec<f64> = steps
        .iter()
        .skip(usize::from(steps.len() > 1))
        .map(|s| s.time_s)
        .collect();
    let median_step_s = median(&mut times);
    let program = &plan.program;
    let samples_per_s = if median_step_s > 0.0 {
        program.plan.batch as f64 / median_step_s
    } else {
        0.0
    };
    let tokens = program.model.input.tokens_per_sample();
    Ok(TrainReport {
        model: program.model.name.clone(),
        plan: options.flags.clone(),
        params: program.model.params(),
        final_loss: steps.last().map_or(f32::NAN, |s| s.loss),
        restarts: Vec::new(),
        steps: steps.clone(),
        param_l2: squares.iter().sum::<f64>().sqrt(),
        block_l2: squares.iter().map(|s| s.sqrt()).collect(),
        actors: last
            .iter()
            .map(|r| ActorRecord {
                actor: r.actor,
                device: plan.actors[r.actor].device.to_string(),
                model_state_bytes: r.metrics.model_state_bytes,
                peak_model_state_bytes: peaks[r.actor],
                estimated_model_state_bytes: plan.memory[r.actor].model_state(),
                compute_weight_bytes: r.metrics.compute_weight_bytes,
                estimated_device_bytes: plan.memory[r.actor].total(),
                device_memory: r.metrics.device_memory,
                offload: r
                    .metrics
                    .offload
                    .map(|o| offload_record(&o, &plan.memory[r.actor])),
                stage: plan.actors[r.actor].stage,
                replica: plan.actors[r.actor].replica,
                bubble: median(&mut per_actor_bubble[r.actor]),
                predicted_bubble: plan.prediction.bubble[plan.actors[r.actor].stage],
                replayed_bubble: replayed.bubble[plan.actors[r.actor].stage],
                peak_microbatches_held: peak_held[r.actor],
                predicted_peak_microbatches_held: plan.prediction.peak_in_flight[plan.actors[r.actor].stage],
                compute_s: median(&mut per_actor_compute[r.actor]),
                comm_wait_s: median(&mut per_actor_wait[r.actor]),
                instructions: plan.actors[r.actor]
                    .stream
                    .instructions
                    .iter()
                    .zip(&instruction_medians[r.actor])
                    .map(|(i, &median_s)| InstructionRecord {
                        instruction: i.to_string(),
                        median_s,
                    })
                    .collect(),
            })
            .collect(),
        // The largest process: this one, or a host's (multi-host jobs).
        peak_rss_bytes: last
            .iter()
            .map(|r| r.host_peak_rss_bytes)
            .fold(peak_rss_bytes(), u64::max),
        samples_per_s,
        tokens_per_s: (tokens > 1).then_some(samples_per_s * tokens as f64),
        median_step_s,
        predicted_step_s: plan.prediction.step_s,
        replayed_step_s: replayed.step_s,
        load_avg: load_avg(),
        cpu_matmul: archipelago_actors::kernels::describe(),
    })
}

/// The report's view of an offload actor's figures.
fn offload_record(o: &OffloadStats, estimate: &MemoryEstimate) -> OffloadRecord {
    let rate = |bytes: u64, s: f64| if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 };
    OffloadRecord {
        host_bytes: o.tier.host_bytes,
        estimated_host_bytes: estimate.host,
        disk_bytes: o.tier.disk_bytes,
        estimated_disk_bytes: estimate.disk,
        read_bytes: o.tier.read_bytes,
        read_gb_s: rate(o.tier.read_bytes, o.tier.read_s),
        written_bytes: o.tier.written_bytes,
        write_gb_s: rate(o.tier.written_bytes, o.tier.write_s),
        wait_s: o.tier.wait_s,
        optimizer_s: o.optimizer_s,
    }
}

/// Seconds in compute and seconds waiting for peers (receives and collective waits) in a step.
fn split_time(stream: &[Instruction], report: &StepReport) -> (f64, f64) {
    let mut compute = 0.0;
    let mut wait = 0.0;
    for t in &report.timings {
        match stream.get(t.index) {
            Some(Instruction::Compute { .. }) => compute += t.seconds,
            Some(Instruction::Recv { .. } | Instruction::WaitCollective { .. }) => wait += t.seconds,
            _ => {}
        }
    }
    (compute, wait)
}

/// Steps whose timings the medians of a report cover at least (the last 1,024 to 2,047): a
/// job of a million steps holds no more timings than one of two thousand.
const RECENT_STEPS: usize = 1024;

/// Appends a step's timing, forgetting the oldest [`RECENT_STEPS`] once twice as many are held.
fn push_recent(times: &mut Vec<f64>, value: f64) {
    times.push(value);
    if times.len() >= 2 * RECENT_STEPS {
        times.drain(..RECENT_STEPS);
    }
}
