//! One program, one host or many: the process roles of a program written on the runtime API.
//!
//! A program calls [`init`] once in its `main` with its [`Registry`] and the devices it wants;
//! the environment decides what the process becomes:
//!
//! - nothing set: the **embedded default**, a runtime on this process's own devices
//!   (`ARCHIPELAGO_STRICT_REGISTRY=1` checks every spawn and message against the registry as a
//!   cluster would, so a missing registration fails here first);
//! - `ARCHIPELAGO_CONTROLLER` (and `ARCHIPELAGO_TOKEN_FILE`; with `ARCHIPELAGO_TLS_CERT`,
//!   `ARCHIPELAGO_TLS_KEY` and `ARCHIPELAGO_TLS_CA`, mutual TLS on every connection): the
//!   **driver** of a cluster — the
//!   controller places the program's actors on the hosts running its binary (waiting for as
//!   many devices as the program asked for, then refusing with both sizes);
//! - `ARCHIPELAGO_ROLE=host` as well: a **host** — the process registers its devices
//!   (`ARCHIPELAGO_DEVICES`, default `cpu:0`) with the controller, serves its actor port and
//!   runs the actors the driver spawns on it, until the controller goes away; then it exits.
//!
//! The same binary is every role, as Monarch's hosts run the program's own binary: actor and
//! message types are found by name in the registry every role installs.
//!
//! With `OTEL_EXPORTER_OTLP_ENDPOINT` set, every role exports its actors' figures as OpenTelemetry
//! metrics (see [`crate::telemetry::export_actor_metrics`]).
//!
//! ```no_run
//! use archipelago_controller::prelude::*;
//! # struct Counter;
//! # impl Actor for Counter {
//! #     type Params = ();
//! #     async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> { Ok(Counter) }
//! # }
//! fn main() -> anyhow::Result<()> {
//!     let registry = Registry::new().actor::<Counter>();
//!     let runtime = archipelago_controller::runtime::init(registry, DeviceSpec::cpus(4))?;
//!     let counter = runtime.spawn_at::<Counter>(0, (), SpawnOptions::default()).get()?;
//!     Ok(())
//! }
//! ```

mod dashboard;
mod driver;
mod host;

pub use dashboard::serve_dashboard;
pub use driver::connect;
pub use host::{HostSettings, serve_as_host};

use archipelago_actors::runtime::{Registry, Runtime};
use archipelago_actors::trust::Credentials;
use archipelago_dataflow::DeviceSpec;

/// `host` turns a process of the program into a host.
pub const ROLE_ENV: &str = "ARCHIPELAGO_ROLE";
/// The controller's address (`host:port`).
pub const CONTROLLER_ENV: &str = "ARCHIPELAGO_CONTROLLER";
/// A file holding the cluster's token.
pub const TOKEN_FILE_ENV: &str = "ARCHIPELAGO_TOKEN_FILE";
/// A host's devices, e.g. `cpu:0,cpu:1`.
pub const DEVICES_ENV: &str = "ARCHIPELAGO_DEVICES";
/// A host's name.
pub const HOST_NAME_ENV: &str = "ARCHIPELAGO_HOST_NAME";
/// A host's island.
pub const ISLAND_ENV: &str = "ARCHIPELAGO_ISLAND";
/// Where a host's actor port listens (default `127.0.0.1:0`).
pub const LISTEN_ENV: &str = "ARCHIPELAGO_LISTEN";
/// The job's name in every error (default: the program binary's name).
pub const JOB_ENV: &str = "ARCHIPELAGO_JOB";

/// The job's name: `ARCHIPELAGO_JOB`, else the program's binary name.
pub fn job_name() -> String {
    std::env::var(JOB_ENV).ok().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "program".into())
    })
}

/// Installs `registry` and returns the program's runtime: on `devices` of this process, or on
/// the cluster of `ARCHIPELAGO_CONTROLLER` (as many devices as `devices` has). In a process
/// started with `ARCHIPELAGO_ROLE=host` it serves as a host instead and never returns. With
/// `OTEL_EXPORTER_OTLP_ENDPOINT` set, the runtime's actors are exported as OpenTelemetry metrics
/// ([`crate::telemetry::export_actor_metrics`]).
pub fn init(registry: Registry, devices: Vec<DeviceSpec>) -> anyhow::Result<Runtime> {
    registry.install();
    let role = std::env::var(ROLE_ENV).unwrap_or_default();
    if role == "host" {
        let settings = HostSettings::from_env()?;
        let outcome = serve_as_host(&settings);
        if let Err(e) = &outcome {
            eprintln!("error: {e:#}");
        }
        std::process::exit(i32::from(outcome.is_err()));
    }
    if !role.is_empty() {
        anyhow::bail!(
            "{ROLE_ENV} is `{role}`; the only role to set is `host` (leave it unset for the driver)"
        );
    }
    let runtime = match std::env::var(CONTROLLER_ENV) {
        // `auto`: the address the Slurm job implies, as hosts resolve it.
        Ok(addr) => connect(
            &crate::cluster::commands::controller_addr(&addr)?,
            read_credentials()?,
            devices.len(),
        )?,
        Err(_) => Runtime::new(&job_name(), "local", devices),
    };
    crate::telemetry::export_actor_metrics(&runtime);
    Ok(runtime)
}

/// The cluster token from the file `ARCHIPELAGO_TOKEN_FILE` names, with mutual TLS when
/// `ARCHIPELAGO_TLS_CERT`, `ARCHIPELAGO_TLS_KEY` and `ARCHIPELAGO_TLS_CA` are set.
fn read_credentials() -> anyhow::Result<Credentials> {
    let path = std::env::var_os(TOKEN_FILE_ENV).ok_or_else(|| {
        anyhow::anyhow!(
            "{CONTROLLER_ENV} is set but {TOKEN_FILE_ENV} is not: point it at the cluster's token file"
        )
    })?;
    let file = |name: &str| std::env::var_os(name).map(std::path::PathBuf::from);
    let tls = crate::cluster::security::TlsArgs {
        tls_cert: file("ARCHIPELAGO_TLS_CERT"),
        tls_key: file("ARCHIPELAGO_TLS_KEY"),
        tls_ca: file("ARCHIPELAGO_TLS_CA"),
    };
    tls.credentials(std::path::Path::new(&path))
        .map_err(|e| anyhow::anyhow!("{e:#} ({TOKEN_FILE_ENV}, ARCHIPELAGO_TLS_*)"))
}
