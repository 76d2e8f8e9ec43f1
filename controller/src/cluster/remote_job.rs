//! A job on the cluster: place the program's actors on the registered hosts, launch, drive the
//! steps with the same loop as a local job, and with `--restart on-failure` re-plan on the hosts
//! that remain after a loss and go on from the last complete checkpoint (resharded).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;
use tonic::Status;

use archipelago_actors::checkpoint;
use archipelago_actors::fabric::DataPath;
use archipelago_actors::proto::{JobEvent, StepProgress as ProgressEvent, job_event};
use archipelago_actors::trust::Credentials;
use archipelago_dataflow::{DeviceSpec, Plan, Program, compile};

use super::registry::{ClusterConfig, HostInfo, Registry};
use super::remote_gang::{LaunchSpec, RemoteGang};
use crate::JobError;
use crate::report::{RestartRecord, StepRecord, TrainReport};
use crate::train::preflight::preflight;
use crate::train::step_loop::drive;
use crate::train::{ProgressFn, StepProgress, TrainOptions};

/// How often a job waiting for devices tells its client so.
const WAIT_REPORT: Duration = Duration::from_secs(5);

/// How many times a job is restarted after host losses before it gives up.
const MAX_RESTARTS: usize = 3;

/// The run options a client sends with its program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemoteOptions {
    /// Steps to run.
    pub steps: u64,
    /// Job name.
    pub job: String,
    /// Receive patience in milliseconds.
    pub patience_ms: u64,
    /// The flags as given (copied into the report).
    pub flags: serde_json::Value,
    /// Checkpoint directory (must be reachable by every host at the same path).
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps.
    pub checkpoint_every: u64,
    /// Start from the newest complete checkpoint.
    pub resume: bool,
    /// What that resume may change from the checkpoint's run.
    #[serde(default)]
    pub resume_override: Vec<String>,
    /// Restart after a host loss.
    pub restart_on_failure: bool,
    /// How tensors travel between hosts.
    #[serde(default)]
    pub data_path: DataPath,
    /// Send the Perfetto trace of the steps back before the report.
    #[serde(default)]
    pub trace: bool,
    /// Copy every actor's parameters into the report (see [`TrainOptions::keep_params`]).
    #[serde(default)]
    pub keep_params: bool,
}

impl RemoteOptions {
    /// The options of `options` that travel to the controller.
    pub fn from_train(options: &TrainOptions) -> RemoteOptions {
        RemoteOptions {
            steps: options.steps,
            job: options.job.clone(),
            patience_ms: options.patience.as_millis() as u64,
            flags: options.flags.clone(),
            checkpoint_dir: options.checkpoint_dir.clone(),
            checkpoint_every: options.checkpoint_every,
            resume: options.resume,
            resume_override: options.resume_override.clone(),
            restart_on_failure: options.restart_on_failure,
            data_path: options.data_path,
            trace: options.trace.is_some(),
            keep_params: options.keep_params,
        }
    }

    fn to_train(&self) -> TrainOptions {
        TrainOptions {
            steps: self.steps,
            job: self.job.clone(),
            patience: Duration::from_millis(self.patience_ms),
            flags: self.flags.clone(),
            on_step: None,
            trace: None,
            checkpoint_dir: self.checkpoint_dir.clone(),
            checkpoint_every: self.checkpoint_every,
            resume: self.resume,
            resume_override: self.resume_override.clone(),
            restart_on_failure: self.restart_on_failure,
            data_path: self.data_path,
            dashboard: None,
            collectives: Default::default(),
            keep_params: self.keep_params,
        }
    }
}

/// Runs `program` on the registered hosts, telling the client through `events`.
pub async fn run_job(
    registry: Arc<Registry>,
    program: Program,
    options: RemoteOptions,
    config: ClusterConfig,
    credentials: Credentials,
    events: UnboundedSender<Result<JobEvent, Status>>,
) -> Result<TrainReport, JobError> {
    let mut train = options.to_train();
    train.dashboard = config.dashboard.clone();
    // The trace is written here, then sent to the client (which writes it where it was asked).
    let trace_file = options.trace.then(|| {
        let name = format!(
            "archipelago-trace-{}-{}.json",
            std::process::id(),
            options.job.replace('/', "_")
        );
        std::env::temp_dir().join(name)
    });
    train.trace = trace_file.clone();
    let job = ClusterJob {
        registry: &registry,
        program,
        config: &config,
        credentials: &credentials,
        events: &events,
    };
    let result = job.run(&mut train).await;
    if let Some(path) = trace_file {
        if result.is_ok() {
            match std::fs::read(&path) {
                Ok(json) => {
                    let _ = events.send(Ok(JobEvent {
                        kind: Some(job_event::Kind::Trace(json.into())),
                    }));
                }
                Err(e) => tracing::error!("the trace of job {} is lost: {e}", options.job),
            }
        }
        let _ = std::fs::remove_file(&path);
    }
    if let Some(d) = &config.dashboard {
        d.job_ended(result.as_ref().err().map(|e| e.to_string()).as_deref());
    }
    result
}

/// What every attempt of one job on the cluster shares.
struct ClusterJob<'a> {
    registry: &'a Arc<Registry>,
    program: Program,
    config: &'a ClusterConfig,
    credentials: &'a Credentials,
    /// Where the client hears of the job.
    events: &'a UnboundedSender<Result<JobEvent, Status>>,
}

impl ClusterJob<'_> {
    fn tell(&self, kind: job_event::Kind) {
        let _ = self.events.send(Ok(JobEvent { kind: Some(kind) }));
    }

    /// Launches and drives the job, again after each host loss when restarts are asked for.
    async fn run(&self, train: &mut TrainOptions) -> Result<TrainReport, JobError> {
        train.on_step = Some(progress_events(self.events.clone()));
        let mut history = Vec::new();
        let mut restart_log: Vec<RestartRecord> = Vec::new();
        loop {
            match self.attempt(train, &mut history, &mut restart_log).await {
                Err(lost @ JobError::HostLost(_))
                    if train.restart_on_failure && restart_log.len() < MAX_RESTARTS =>
                {
                    self.prepare_restart(lost, train, &history, &mut restart_log)?;
                }
                Ok(mut report) => {
                    report.restarts = restart_log;
                    return Ok(report);
                }
                other => return other,
            }
        }
    }

    /// The hosts registered once they offer `needed` devices, or when the controller's wait for
    /// hosts runs out; every [`WAIT_REPORT`] until then the client is told how many devices the
    /// job waits for and how many the hosts offer.
    async fn wait_for_devices(&self, job: &str, needed: usize) -> Vec<HostInfo> {
        let began = std::time::Instant::now();
        let deadline = began + self.config.wait_for_hosts;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let hosts = (self.registry)
                .wait_for_devices(needed, left.min(WAIT_REPORT), false)
                .await;
            let offered: usize = hosts.iter().map(|h| h.devices.len()).sum();
            if offered >= needed || left <= WAIT_REPORT {
                return hosts;
            }
            let line = format!(
                "job {job}: waiting for {needed} devices; {} {offered} ({:.0} s of the controller's \
                 --wait-for-hosts-s {:.0} s)",
                match hosts.len() {
                    1 => "1 host offers".to_string(),
                    n => format!("{n} hosts offer"),
                },
                began.elapsed().as_secs_f64(),
                self.config.wait_for_hosts.as_secs_f64()
            );
            tracing::info!("{line}");
            self.tell(job_event::Kind::Info(line));
        }
    }

    /// One launch: places the job on the hosts registered now, checks it, starts every host's
    /// part and drives the steps (`history` keeps the step records across launches).
    async fn attempt(
        &self,
        train: &TrainOptions,
        history: &mut Vec<StepRecord>,
        restart_log: &mut [RestartRecord],
    ) -> Result<TrainReport, JobError> {
        let restarts = restart_log.len();
        let needed = self.program.plan.actors();
        let hosts = self.wait_for_devices(&train.job, needed).await;
        let (plan, placement) = place(&self.program, &hosts, restarts > 0)?;
        let plan = Arc::new(plan);
        let line = format!(
            "job {}: {} actors [{}] on {}",
            train.job,
            plan.actors.len(),
            plan.mesh,
            describe(&placement)
        );
        tracing::info!("{line}");
        self.tell(job_event::Kind::Info(line));
        let start = preflight(&plan.program, train)?;
        for note in &start.notes {
            self.tell(job_event::Kind::Info(note.clone()));
        }
        if let Some(last) = restart_log.last_mut() {
            last.resumed_at_step = start.first_step;
            last.mesh = plan.mesh.to_string();
        }
        // Each launch has its own name, so that nothing of an earlier one is taken for it.
        let launch = if restarts == 0 {
            train.job.clone()
        } else {
            format!("{}#restart{restarts}", train.job)
        };
        let spec = LaunchSpec {
            placement: &placement,
            restore: start.restore.as_ref().map(|r| r.dir()),
            data_path: train.data_path,
            patience: train.patience,
            grace: self.config.host_timeout + Duration::from_secs(1),
            credentials: self.credentials,
        };
        if let Some(d) = &self.config.dashboard {
            d.set_actor_hosts(placement.iter().map(|h| h.name.clone()).collect());
        }
        let mut gang = RemoteGang::launch(&launch, self.registry.clone(), plan.clone(), spec).await?;
        let result = drive(&mut gang, &plan, train, start.first_step, history).await;
        gang.stop();
        result
    }

    /// Records the loss of a host and sets the next launch up to go on from the last complete
    /// checkpoint (or from step 1 when there is none yet); without a checkpoint directory the
    /// loss ends the job.
    fn prepare_restart(
        &self,
        lost: JobError,
        train: &mut TrainOptions,
        history: &[StepRecord],
        restart_log: &mut Vec<RestartRecord>,
    ) -> Result<(), JobError> {
        let Some(root) = &train.checkpoint_dir else {
            return Err(lost);
        };
        restart_log.push(RestartRecord {
            lost: lost.to_string(),
            failed_after_step: history.last().map_or(0, |s| s.step),
            ..RestartRecord::default()
        });
        train.resume = checkpoint::latest_complete(root).0.is_some();
        let line = format!(
            "{lost}; restart {}/{MAX_RESTARTS} from {}",
            restart_log.len(),
            if train.resume {
                "the last complete checkpoint"
            } else {
                "step 1 (no checkpoint yet)"
            }
        );
        tracing::warn!("{line}");
        if let Some(d) = &self.config.dashboard {
            d.restart(restart_log.last().map_or(0, |r| r.failed_after_step), &line);
        }
        self.tell(job_event::Kind::Info(line));
        Ok(())
    }
}

/// A progress callback that sends each step's progress to the client.
fn progress_events(events: UnboundedSender<Result<JobEvent, Status>>) -> ProgressFn {
    Arc::new(move |p: &StepProgress| {
        let event = ProgressEvent {
            step: p.step,
            steps: p.steps,
            loss: p.loss,
            time_s: p.time_s,
            lr: p.lr,
            grad_norm: p.grad_norm,
            loss_scale: p.loss_scale,
            skipped: p.skipped,
        };
        let _ = events.send(Ok(JobEvent {
            kind: Some(job_event::Kind::Progress(event)),
        }));
    })
}

/// Places the mesh on the hosts' devices (hosts sorted by island) stage by stage: the replicas of
/// one pipeline stage take consecutive devices, so the inner dp axis stays inside an island while
/// pp stages and the outer dp axis go across islands; a dp group spanning islands then
/// all-reduces hierarchically (the compiler sees each device's island). Under tensor parallelism
/// each tp group takes `tp` devices of one host (Megatron-LM keeps it inside a node: its
/// all-reduces run every layer), and those groups are placed as single devices are. When
/// `shrink` (a restart on fewer hosts), a smaller dp that fits the devices left and divides the
/// batch is taken; otherwise too few devices is an error saying what to change.
fn place(program: &Program, hosts: &[HostInfo], shrink: bool) -> Result<(Plan, Vec<HostInfo>), JobError> {
    let tp = program.plan.tp.max(1);
    let groups = tp_groups(hosts, tp)?;
    let mut program = program.clone();
    let per_replica = program.plan.pp;
    let wanted = program.plan.dp;
    let mut last_error = None;
    for dp in (1..=wanted).rev() {
        if dp * per_replica > groups.len() {
            continue;
        }
        if dp < wanted && !shrink {
            break;
        }
        program.plan.dp = dp;
        if dp < 2 && dp < wanted {
            // A restart shrunk to one replica has no data-parallel collective left to compress
            // (the compression pass refuses the flags at dp=1).
            program.compression = Default::default();
            (program.quantize_grads, program.quantize_weights) = (false, false);
        }
        // Actor (r·pp + s)·tp + t (dp outer, tp inner) takes rank t of group s·dp + r.
        let used: Vec<(&HostInfo, archipelago_dataflow::DeviceSpec)> = (0..dp * per_replica * tp)
            .map(|a| {
                let (replica_stage, t) = (a / tp, a % tp);
                groups[(replica_stage % per_replica) * dp + replica_stage / per_replica][t]
            })
            .collect();
        program.devices = used.iter().map(|(_, d)| *d).collect();
        program.islands = used.iter().map(|(h, _)| h.island.clone()).collect();
        let memories: Vec<u64> = used.iter().map(|(h, _)| h.device_memory).collect();
        if program.plan.device_memory.is_none() && memories.iter().all(|&m| m > 0) {
            program.plan.device_memory = memories.iter().copied().min();
        }
        match compile(&program) {
            Ok(plan) => return Ok((plan, used.iter().map(|(h, _)| (*h).clone()).collect())),
            Err(e) => last_error = Some(e),
        }
    }
    match last_error {
        Some(e) => Err(JobError::Plan(e)),
        None => Err(JobError::Runtime(format!(
            "the job needs {} devices (dp {} × pp {}{}) and the registered hosts offer {} ({}); \
             start more `archipelago host`s or lower --dp",
            wanted * per_replica * tp,
            wanted,
            per_replica,
            if tp > 1 {
                format!(" × tp {tp}, each tp group on one host")
            } else {
                String::new()
            },
            groups.len() * tp,
            describe(hosts)
        ))),
    }
}

/// The hosts' devices in groups of `tp` from one host each (a host's devices past its last whole
/// group stay unused); an error naming the largest host when none holds `tp` devices.
fn tp_groups(hosts: &[HostInfo], tp: usize) -> Result<Vec<Vec<(&HostInfo, DeviceSpec)>>, JobError> {
    let groups: Vec<Vec<(&HostInfo, DeviceSpec)>> = hosts
        .iter()
        .flat_map(|h| {
            h.devices
                .chunks_exact(tp)
                .map(move |c| c.iter().map(|&d| (h, d)).collect())
        })
        .collect();
    let largest = hosts.iter().map(|h| h.devices.len()).max().unwrap_or(0);
    if groups.is_empty() && largest > 0 {
        return Err(JobError::Plan(archipelago_dataflow::PlanError::Conflict(
            format!(
                "--tp {tp}: a tensor-parallel group runs on one host's devices, and the registered hosts \
             have at most {largest} ({}): lower --tp to {largest} or less, or start hosts with more devices",
                describe(hosts)
            ),
        )));
    }
    Ok(groups)
}

fn describe(hosts: &[HostInfo]) -> String {
    let mut seen: Vec<(u32, String)> = Vec::new();
    for h in hosts {
        if !seen.iter().any(|(id, _)| *id == h.id) {
            let devices: Vec<String> = h.devices.iter().map(|d| d.to_string()).collect();
            seen.push((
                h.id,
                format!("{} [island {}: {}]", h.name, h.island, devices.join(",")),
            ));
        }
    }
    if seen.is_empty() {
        "no hosts".into()
    } else {
        seen.into_iter().map(|(_, s)| s).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
#[path = "placement_tests.rs"]
mod placement_tests;
