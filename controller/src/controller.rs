//! The [`Controller`]: the one door through which a training job starts. A controller made with
//! [`Controller::local`] compiles the program and runs its actors in this process
//! (`train::local_job`); one made with [`Controller::connect`] submits the program to a
//! controller service, whose hosts run it ([`crate::cluster::client`]). Either way the caller
//! gets the same [`TrainReport`] and progress callbacks.

use std::sync::Arc;

use archipelago_actors::trust::Credentials;
use archipelago_actors::zoo::ModelBuilder;
use archipelago_actors::{Builders, CpuBackend};
use archipelago_dataflow::{DeviceSpec, ModelSpec, Plan, PlanError, Program, compile};

use crate::JobError;
use crate::cluster::client::{RemoteTarget, submit};
use crate::report::TrainReport;
use crate::train::TrainOptions;
use crate::train::local_job::run_local;

/// A controller with its own async runtime. Its methods block until the job ends.
pub struct Controller {
    devices: Vec<DeviceSpec>,
    runtime: tokio::runtime::Runtime,
    /// A controller service to submit jobs to instead of running them here.
    remote: Option<RemoteTarget>,
}

impl Controller {
    /// A controller that runs actors in this process on `devices`.
    ///
    /// # Panics
    /// When the async runtime cannot be created (no threads available).
    pub fn local(devices: Vec<DeviceSpec>) -> Controller {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("controller")
            .enable_all()
            .build()
            .expect("tokio runtime");
        Controller {
            devices,
            runtime,
            remote: None,
        }
    }

    /// A handle on the controller service at `addr` (`archipelago controller`), whose hosts run
    /// the jobs; `credentials` are the cluster's token (a `&str` will do) or [`Credentials`]
    /// with mutual TLS. Jobs are compiled and placed by that controller.
    pub fn connect(addr: &str, credentials: impl Into<Credentials>) -> Controller {
        let mut controller = Controller::local(Vec::new());
        controller.remote = Some(RemoteTarget {
            addr: addr.to_string(),
            credentials: credentials.into(),
        });
        controller
    }

    /// The devices this controller places actors on.
    pub fn devices(&self) -> &[DeviceSpec] {
        &self.devices
    }

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
            return self.runtime.block_on(submit(remote, program, options));
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
        self.run_here(plan, builders, options)
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
        self.run_here(plan, Builders::zoo(spec), options)
    }

    /// Runs `plan` in this process; tells the dashboard how the job ended.
    fn run_here(
        &self,
        plan: Plan,
        builders: Builders,
        options: &TrainOptions,
    ) -> Result<TrainReport, JobError> {
        let result = self.runtime.block_on(run_local(plan, builders, options));
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
