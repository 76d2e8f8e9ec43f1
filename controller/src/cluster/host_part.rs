//! A host's part of a training job as an actor of the runtime API ([`crate::runtime`]'s actor
//! ports): the controller spawns one [`HostPart`] on every host of the job, over the host's
//! actor port, and drives it with calls — [`StartPart`] builds the host's device actors (the one
//! way every gang starts from a plan, as a local job's does, over a fabric to the other hosts),
//! [`RunPart`] runs a step on them, [`PartBlockSquares`], [`PartHeldParams`] and [`SavePart`]
//! answer for norms, parameters and checkpoints. One engine: a step reaches a device actor as a
//! runtime call from the controller to the host part, then a runtime call from the host part to
//! each device actor.
//!
//! What the host process offers its parts (its fabric ports, the cluster's credentials, the
//! heartbeat's view of the actors, the running job) is [`HostResources`], set once by
//! `archipelago host`. A `Stop` on the host's session ends the job even while a step hangs: it
//! aborts the fabric, which ends the step, without waiting behind the part's mailbox.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use archipelago_actors::checkpoint::{CheckpointReader, ShardFile};
use archipelago_actors::executor::{HeldParams, StepReport};
use archipelago_actors::fabric::grpc::{GrpcFabric, Inbox};
use archipelago_actors::fabric::{DataPath, Fabric, InProcessFabric, TcpFabric};
use archipelago_actors::progress::ActorProgress;
use archipelago_actors::runtime::{Actor, Context, Handler, Message, Registry};
use archipelago_actors::trust::Credentials;
use archipelago_actors::{ActorFailure, Builders};
use archipelago_dataflow::{ActorId, ModelSpec, Plan};

use crate::JobError;
use crate::actor_gang::ActorGang;
use crate::gang::Gang;
use crate::train::launch::{GangLaunch, start_gang};

/// What a host part is built from: the host's share of the plan and how to reach the others.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartParams {
    /// The job's name (in every error an actor reports).
    pub job: String,
    /// This launch's key on the hosts (a job restarted after a loss is launched again under a
    /// new key): the host's `Stop` names it.
    pub launch: String,
    /// The plan as this host needs it ([`Plan::for_actors`]: its actors' streams, everyone's
    /// placement).
    pub plan: Plan,
    /// The actors this host runs.
    pub actors: Vec<ActorId>,
    /// Every actor's host address on the data path (fabric or raw-TCP port), by actor id.
    pub peers: Vec<String>,
    /// How long a receive may wait.
    pub patience: Duration,
    /// A checkpoint directory to load the actors' state from.
    pub restore: Option<String>,
    /// How tensors travel between the hosts.
    pub data_path: DataPath,
}

/// Why a host part's call failed: the message, and the actor's failure when one failed (the
/// controller picks the root cause by [`ActorFailure::secondary`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartError {
    /// The error as text.
    pub message: String,
    /// The actor's own report, when an actor failed.
    pub failure: Option<Box<ActorFailure>>,
}

impl PartParams {
    /// Parameters from the network are hostile: every actor named must be one of the plan's,
    /// each with its own stream, and every actor of the plan must have a peer address.
    fn check(&self) -> Result<(), JobError> {
        let n = self.plan.actors.len();
        if let Err(why) = self.plan.streams.check_shape(n) {
            return Err(JobError::Runtime(format!(
                "job {}: the host part's streams: {why}",
                self.job
            )));
        }
        if self.peers.len() != n {
            return Err(JobError::Runtime(format!(
                "job {}: the host part names {} peer addresses for a plan of {n} actors",
                self.job,
                self.peers.len()
            )));
        }
        match self
            .actors
            .iter()
            .find(|&&a| a >= n || self.plan.actors[a].actor != a)
        {
            Some(a) => Err(JobError::Runtime(format!(
                "job {}: the host part names actor {a}, which the plan of {n} actors does not hold at that index",
                self.job
            ))),
            None => Ok(()),
        }
    }
}

impl PartError {
    /// Whether it only followed a failure elsewhere (a peer stopped, a host vanished).
    pub fn secondary(&self) -> bool {
        self.failure.as_ref().is_none_or(|f| f.secondary)
    }
}

impl From<JobError> for PartError {
    fn from(error: JobError) -> PartError {
        PartError {
            message: error.to_string(),
            failure: match error {
                JobError::Actor(failure) => Some(failure),
                _ => None,
            },
        }
    }
}

impl From<PartError> for JobError {
    fn from(error: PartError) -> JobError {
        match error.failure {
            Some(failure) => JobError::Actor(failure),
            None => JobError::Runtime(error.message),
        }
    }
}

/// Builds the host's device actors (stopping any earlier job's first).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartPart;
impl Message for StartPart {
    type Reply = Result<(), PartError>;
}

/// Runs step `n` on the host's actors: one report per actor, in actor order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunPart(pub u64);
impl Message for RunPart {
    type Reply = Result<Vec<StepReport>, PartError>;
}

/// The host's actors' sums of squares of parameters by block.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartBlockSquares;
impl Message for PartBlockSquares {
    type Reply = Result<Vec<(usize, f64)>, PartError>;
}

/// A copy of every parameter the host's actors hold, by actor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartHeldParams;
impl Message for PartHeldParams {
    type Reply = Result<Vec<(ActorId, Vec<HeldParams>)>, PartError>;
}

/// The host's actors write their checkpoint shards after step `step` into `dir`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavePart {
    /// The checkpoint directory (the same path on every host).
    pub dir: String,
    /// The step whose state is written.
    pub step: u64,
}
impl Message for SavePart {
    type Reply = Result<Vec<ShardFile>, PartError>;
}

/// The actor and message types of training on hosts; installed by the controller and by every
/// `archipelago host`.
pub fn registry() -> Registry {
    Registry::new()
        .actor::<HostPart>()
        .handles::<HostPart, StartPart>()
        .handles::<HostPart, RunPart>()
        .handles::<HostPart, PartBlockSquares>()
        .handles::<HostPart, PartHeldParams>()
        .handles::<HostPart, SavePart>()
}

/// The host's part of the running job. Steps run holding the gang; a `Stop` aborts the
/// fabric first (without the gang), which ends a hanging step, then stops the gang.
struct LocalJob {
    launch: String,
    gang: Arc<tokio::sync::Mutex<ActorGang>>,
    fabric: Arc<dyn Fabric>,
}

impl LocalJob {
    async fn stop(self, reason: &str) {
        self.fabric.abort(reason);
        self.gang.lock().await.stop().await;
    }
}

/// The host's running actors with what each is running, as its heartbeats report them.
pub(crate) type Progress = Arc<Mutex<Vec<(ActorId, Arc<ActorProgress>)>>>;

/// What a host process offers the parts it runs.
pub struct HostResources {
    /// Where the host's fabric ports deliver tensors (to the running job's local fabric).
    pub inbox: Inbox,
    /// The gRPC fabric's published address.
    pub fabric_addr: String,
    /// The raw-TCP tensor port's published address.
    pub tcp_addr: String,
    /// The cluster's credentials.
    pub credentials: Credentials,
    /// The running actors, as heartbeats report them.
    pub progress: Progress,
    /// The host's name.
    pub name: String,
    /// The host agent's tokio runtime: every part's work runs there.
    pub agent: tokio::runtime::Handle,
    job: Mutex<Option<LocalJob>>,
    /// Held while a job starts or stops: a `Stop` of the last job that is still tearing it down
    /// when the next job starts must not then uninstall the new job's inbox.
    lifecycle: tokio::sync::Mutex<()>,
    /// The launches stopped lately (the session's `Stop` and the actor port's `StartPart` travel
    /// on two connections: a launch stopped before its start arrived must not start).
    stopped: Mutex<std::collections::VecDeque<String>>,
}

/// How many stopped launches a host remembers.
const STOPPED_KEPT: usize = 256;

static HOST: OnceLock<Arc<HostResources>> = OnceLock::new();

impl HostResources {
    /// The resources of this process, now a host (once per process).
    pub fn install(
        name: String,
        inbox: Inbox,
        fabric_addr: String,
        tcp_addr: String,
        credentials: Credentials,
        progress: Progress,
    ) -> anyhow::Result<Arc<HostResources>> {
        let resources = Arc::new(HostResources {
            name,
            inbox,
            fabric_addr,
            tcp_addr,
            credentials,
            progress,
            agent: tokio::runtime::Handle::current(),
            job: Mutex::new(None),
            lifecycle: tokio::sync::Mutex::new(()),
            stopped: Mutex::default(),
        });
        HOST.set(resources.clone())
            .map_err(|_| anyhow::anyhow!("this process already serves as a host"))?;
        Ok(resources)
    }

    /// This process's resources, when it is an `archipelago host`.
    pub fn current() -> Option<Arc<HostResources>> {
        HOST.get().cloned()
    }

    /// Ends the job launched as `launch` (`None`: whichever runs).
    pub async fn stop_job(&self, launch: Option<&str>, reason: &str) {
        let _one_at_a_time = self.lifecycle.lock().await;
        self.stop_locked(launch, reason).await;
    }

    async fn stop_locked(&self, launch: Option<&str>, reason: &str) {
        if let Some(launch) = launch {
            let mut stopped = self.stopped.lock().expect("stopped launches");
            stopped.push_back(launch.to_string());
            while stopped.len() > STOPPED_KEPT {
                stopped.pop_front();
            }
        }
        let job = (self.job.lock().expect("host job")).take_if(|j| launch.is_none_or(|l| l == j.launch));
        if let Some(job) = job {
            job.stop(reason).await;
            self.inbox.install(None);
            self.progress.lock().expect("progress").clear();
        }
    }

    async fn start(&self, params: PartParams) -> Result<(), PartError> {
        let _one_at_a_time = self.lifecycle.lock().await;
        if (self.stopped.lock().expect("stopped launches")).contains(&params.launch) {
            return Err(JobError::Runtime(format!(
                "job {}: the controller stopped launch `{}` before it started here",
                params.job, params.launch
            ))
            .into());
        }
        self.stop_locked(None, "a new job was launched").await;
        let here = if params.data_path.uses_tcp_port() {
            &self.tcp_addr
        } else {
            &self.fabric_addr
        };
        let (gang, fabric) = start_host_gang(&params, &self.inbox, here, &self.credentials).await?;
        *self.progress.lock().expect("progress") =
            gang.progress().iter().map(|(a, _, p)| (*a, p.clone())).collect();
        *self.job.lock().expect("host job") = Some(LocalJob {
            launch: params.launch,
            gang: Arc::new(tokio::sync::Mutex::new(gang)),
            fabric,
        });
        Ok(())
    }

    fn gang(&self, launch: &str) -> Result<Arc<tokio::sync::Mutex<ActorGang>>, PartError> {
        let job = self.job.lock().expect("host job");
        match job.as_ref().filter(|j| j.launch == launch) {
            Some(j) => Ok(j.gang.clone()),
            None => Err(JobError::Runtime(format!(
                "job launch `{launch}` does not run on host `{}` (stopped, or never started)",
                self.name
            ))
            .into()),
        }
    }
}

/// The host's part of one job.
pub struct HostPart {
    params: PartParams,
    host: Arc<HostResources>,
}

impl HostPart {
    /// Runs `work` on the host agent's runtime (where the fabric and the gang live).
    async fn on_agent<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T, PartError>> + Send + 'static,
    ) -> Result<T, PartError> {
        match self.host.agent.spawn(work).await {
            Ok(result) => result,
            Err(e) => Err(JobError::Runtime(format!(
                "job {}: the work of host `{}` for the job ended: {e}",
                self.params.job, self.host.name
            ))
            .into()),
        }
    }
}

impl Actor for HostPart {
    type Params = PartParams;

    async fn new(params: PartParams, _ctx: &Context<Self>) -> Result<Self, String> {
        let host = HOST.get().cloned().ok_or_else(|| {
            "this process is not an `archipelago host`: a job's host part runs only there".to_string()
        })?;
        Ok(HostPart { params, host })
    }

    /// The controller went away (its connection closed, which stops its parts): the launch ends
    /// here too, even when its `Stop` never comes.
    async fn stopping(&mut self, _ctx: &Context<Self>) {
        let (host, launch) = (self.host.clone(), self.params.launch.clone());
        let stop = async move {
            host.stop_job(
                Some(&launch),
                "the controller's connection to this host part closed",
            )
            .await
        };
        let _ = self.host.agent.spawn(stop).await;
    }
}

impl Handler<StartPart> for HostPart {
    async fn handle(&mut self, _: StartPart, _ctx: &Context<Self>) -> Result<(), PartError> {
        let (host, params) = (self.host.clone(), self.params.clone());
        self.on_agent(async move { host.start(params).await }).await
    }
}

impl Handler<RunPart> for HostPart {
    async fn handle(
        &mut self,
        RunPart(n): RunPart,
        _ctx: &Context<Self>,
    ) -> Result<Vec<StepReport>, PartError> {
        let gang = self.host.gang(&self.params.launch)?;
        self.on_agent(async move {
            let mut reports = gang.lock().await.step(n).await?;
            let rss = crate::process_stats::peak_rss_bytes();
            reports.iter_mut().for_each(|r| r.host_peak_rss_bytes = rss);
            Ok(reports)
        })
        .await
    }
}

impl Handler<PartBlockSquares> for HostPart {
    async fn handle(
        &mut self,
        _: PartBlockSquares,
        _ctx: &Context<Self>,
    ) -> Result<Vec<(usize, f64)>, PartError> {
        let gang = self.host.gang(&self.params.launch)?;
        self.on_agent(async move { Ok(gang.lock().await.block_squares().await?) })
            .await
    }
}

impl Handler<PartHeldParams> for HostPart {
    async fn handle(
        &mut self,
        _: PartHeldParams,
        _ctx: &Context<Self>,
    ) -> Result<Vec<(ActorId, Vec<HeldParams>)>, PartError> {
        let gang = self.host.gang(&self.params.launch)?;
        self.on_agent(async move { Ok(gang.lock().await.held_params().await?) })
            .await
    }
}

impl Handler<SavePart> for HostPart {
    async fn handle(&mut self, save: SavePart, _ctx: &Context<Self>) -> Result<Vec<ShardFile>, PartError> {
        let gang = self.host.gang(&self.params.launch)?;
        self.on_agent(async move {
            Ok(gang
                .lock()
                .await
                .checkpoint(Path::new(&save.dir), save.step)
                .await?)
        })
        .await
    }
}

/// Connects the fabric to the other hosts and starts the host's device actors the one way
/// every gang starts from a plan ([`start_gang`]).
async fn start_host_gang(
    params: &PartParams,
    inbox: &Inbox,
    here: &str,
    credentials: &Credentials,
) -> Result<(ActorGang, Arc<dyn Fabric>), JobError> {
    params.check()?;
    let plan = &params.plan;
    let fabric = connect_fabric(params, inbox, here, credentials).await?;
    let restore = match &params.restore {
        None => None,
        Some(dir) => Some(Arc::new(
            CheckpointReader::open(Path::new(dir)).map_err(JobError::Runtime)?,
        )),
    };
    let spec = ModelSpec::parse(&plan.program.model.name)?;
    let launch = GangLaunch {
        job: &params.job,
        plan,
        actors: &params.actors,
        builders: &Builders::zoo(spec),
        restore,
        patience: params.patience,
    };
    let gang = start_gang(launch, fabric.clone()).await?;
    Ok((gang, fabric))
}

/// The job's fabric on this host: an in-process one for the host's own actors (installed in the
/// host's inbox, where its fabric ports deliver) and links to the other hosts on the data path
/// the job asks for.
async fn connect_fabric(
    params: &PartParams,
    inbox: &Inbox,
    here: &str,
    credentials: &Credentials,
) -> Result<Arc<dyn Fabric>, JobError> {
    let local = Arc::new(InProcessFabric::new(params.plan.actors.len(), params.patience));
    inbox.install(Some(local.clone()));
    Ok(match params.data_path {
        DataPath::Grpc => Arc::new(
            GrpcFabric::connect(&params.peers, here, local, credentials)
                .await
                .map_err(JobError::Runtime)?,
        ),
        path @ (DataPath::Tcp | DataPath::Shm | DataPath::Auto) => {
            let addrs = params.peers.clone();
            let (here, credentials) = (here.to_string(), credentials.clone());
            let connect = move || TcpFabric::connect(&addrs, &here, local, &credentials, path);
            let fabric = tokio::task::spawn_blocking(connect)
                .await
                .map_err(|e| JobError::Runtime(e.to_string()))?
                .map_err(JobError::Runtime)?;
            Arc::new(fabric)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resources() -> HostResources {
        HostResources {
            name: "h1".into(),
            inbox: Inbox::default(),
            fabric_addr: "127.0.0.1:1".into(),
            tcp_addr: "127.0.0.1:2".into(),
            credentials: Credentials::new("token"),
            progress: Progress::default(),
            agent: tokio::runtime::Handle::current(),
            job: Mutex::new(None),
            lifecycle: tokio::sync::Mutex::new(()),
            stopped: Mutex::default(),
        }
    }

    fn params(launch: &str) -> PartParams {
        let program = archipelago_dataflow::Program::new(
            ModelSpec::parse("mlp:in=8,hidden=16,layers=2,out=3").unwrap(),
        )
        .with_plan(archipelago_dataflow::ParallelPlan {
            batch: 4,
            ..Default::default()
        });
        PartParams {
            job: "job".into(),
            launch: launch.into(),
            plan: archipelago_dataflow::compile(&program).unwrap(),
            actors: vec![0],
            peers: vec!["127.0.0.1:9".into()],
            patience: Duration::from_secs(1),
            restore: None,
            data_path: DataPath::Grpc,
        }
    }

    /// A launch whose `Stop` came before its `StartPart` (two connections, no order between
    /// them) is refused, naming the launch; the control: another launch gets past that check
    /// (it then fails further on, connecting a fabric to a peer that is not there).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_launch_stopped_before_it_started_does_not_start() {
        let host = resources();
        host.stop_job(Some("job@7"), "the job ended").await;
        let refused = host.start(params("job@7")).await.unwrap_err();
        assert!(
            refused
                .message
                .contains("stopped launch `job@7` before it started"),
            "{}",
            refused.message
        );
        let other = host.start(params("job@8")).await.unwrap_err();
        assert!(!other.message.contains("before it started"), "{}", other.message);
        assert!(host.job.lock().unwrap().is_none());
    }

    /// Parameters naming an actor the plan does not hold, or too few peers, are refused with
    /// what is wrong (they come from the network), not a panic; well-formed ones pass.
    #[test]
    fn hostile_part_parameters_are_refused_before_anything_starts() {
        assert!(params("job@1").check().is_ok());
        let mut stranger = params("job@1");
        stranger.actors = vec![5];
        let error = stranger.check().unwrap_err().to_string();
        assert!(error.contains("names actor 5"), "{error}");
        let mut few = params("job@1");
        few.peers.clear();
        let error = few.check().unwrap_err().to_string();
        assert!(
            error.contains("0 peer addresses for a plan of 1 actors"),
            "{error}"
        );
    }
}
