//! The `controller` and `host` subcommands of the `archipelago` binary. Addresses and the token
//! file can come from the environment (`ARCHIPELAGO_CONTROLLER`, `ARCHIPELAGO_TOKEN_FILE`), so a
//! Slurm or Kubernetes launcher sets them once for every node.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use archipelago_dataflow::DeviceSpec;

use super::host_agent::{HostOptions, run_host};
use super::security::TlsArgs;
use super::service::{ClusterConfig, serve_controller};
use super::slurm;
use crate::dashboard::Dashboard;

/// Flags of `archipelago controller`.
#[derive(Debug, Args)]
pub struct ControllerArgs {
    /// Address to listen on (hosts and clients connect here); `auto` in a Slurm job: this
    /// node's address at the job's port, where `--controller auto` looks.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: String,
    /// File holding the cluster token every host and client must present.
    #[arg(long, env = "ARCHIPELAGO_TOKEN_FILE")]
    pub token_file: PathBuf,
    /// Seconds of silence after which a host is declared lost.
    #[arg(long, default_value_t = 5.0)]
    pub host_timeout_s: f64,
    /// Seconds a job waits for enough devices to register.
    #[arg(long, default_value_t = 60.0)]
    pub wait_for_hosts_s: f64,
    /// Serve the live dashboard (cluster, running job, timeline, failures) on this address (a
    /// bare port means 127.0.0.1:PORT); on any address but loopback every request must carry
    /// the cluster token.
    #[arg(long)]
    pub dashboard: Option<String>,
    /// Serve `/healthz` and `/readyz` over HTTP on this address (a bare port means
    /// 127.0.0.1:PORT; on any other address requests must carry the token), for supervisors and
    /// Kubernetes probes (`archipelago health http://127.0.0.1:PORT/readyz`).
    #[arg(long)]
    pub health: Option<String>,
    /// Mutual TLS for hosts and clients.
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// Flags of `archipelago host`.
#[derive(Debug, Args)]
pub struct HostArgs {
    /// The controller's address; `auto` in a Slurm job: the job's first node at the job's port.
    #[arg(long, env = "ARCHIPELAGO_CONTROLLER")]
    pub controller: String,
    /// File holding the cluster token.
    #[arg(long, env = "ARCHIPELAGO_TOKEN_FILE")]
    pub token_file: PathBuf,
    /// Devices this host offers, e.g. `cpu:0,cpu:1`; `auto` in a Slurm job: the GPUs Slurm bound
    /// to the task (a `cuda` build), else one CPU device per CPU of the task.
    #[arg(long, default_value = "cpu:0")]
    pub devices: String,
    /// The island this host belongs to (devices with a fast interconnect among them; default:
    /// the node's name in a Slurm job, else `default`).
    #[arg(long)]
    pub island: Option<String>,
    /// Memory per device in bytes (plans that do not fit are refused before launch).
    #[arg(long)]
    pub memory: Option<u64>,
    /// This host's name (default: `NODE-LOCALID` in a Slurm job, else `host-<pid>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Where this host's fabric listens for tensors from other hosts; `auto`: this node's
    /// address (its name resolved), any port.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub fabric_listen: String,
    /// The name other hosts reach this host's fabric at (its ports stay those bound), when it
    /// is not the --fabric-listen address: a DNS name its TLS certificate names (in Kubernetes
    /// `$(POD_NAME).SERVICE.NAMESPACE`), an address behind NAT.
    #[arg(long)]
    pub advertise: Option<String>,
    /// Milliseconds between heartbeats.
    #[arg(long, default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// Mutual TLS with the controller and the other hosts.
    #[command(flatten)]
    pub tls: TlsArgs,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Runs `archipelago controller` until it is killed.
pub fn controller(args: &ControllerArgs) -> anyhow::Result<()> {
    let credentials = args.tls.credentials(&args.token_file)?;
    let token = credentials.token().to_string();
    let dashboard = args.dashboard.as_ref().map(|_| Dashboard::new());
    if let Some(d) = &dashboard {
        // Bound to anything but loopback, the dashboard needs the cluster token (see dashboard::access).
        d.require_token(&token);
    }
    let config = ClusterConfig {
        host_timeout: Duration::from_secs_f64(args.host_timeout_s),
        wait_for_hosts: Duration::from_secs_f64(args.wait_for_hosts_s),
        dashboard: dashboard.clone(),
    };
    runtime()?.block_on(async {
        // Slurm's warning before the time limit: checkpoint after the step running, then stop.
        crate::preemption::on_sigusr1()?;
        if let (Some(addr), Some(dashboard)) = (&args.dashboard, dashboard) {
            let addr = crate::dashboard::access::bind_address(addr);
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|e| anyhow::anyhow!("cannot serve the dashboard on {addr}: {e}"))?;
            println!(
                "dashboard at http://{}/",
                crate::dashboard::serve(listener, dashboard)?
            );
        }
        let listen = match args.listen.as_str() {
            slurm::AUTO => slurm::controller_listen(&slurm::ProcessEnv)?,
            addr => addr.to_string(),
        };
        let listener = tokio::net::TcpListener::bind(&listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
        let (addr, registry) = serve_controller(listener, &credentials, config)?;
        if let Some(health) = &args.health {
            let bind = crate::dashboard::access::bind_address(health);
            let listener = tokio::net::TcpListener::bind(&bind)
                .await
                .map_err(|e| anyhow::anyhow!("cannot serve the health endpoint on {bind}: {e}"))?;
            let at = super::health::serve(listener, registry, credentials.token())?;
            println!("health at http://{at}/healthz and /readyz");
        }
        println!("controller listening on {addr}");
        std::future::pending::<()>().await;
        Ok(())
    })
}

/// The controller's address as given, or for `auto` the one the Slurm job implies.
pub fn controller_addr(given: &str) -> anyhow::Result<String> {
    match given {
        slurm::AUTO => slurm::controller_addr(&slurm::ProcessEnv),
        addr => Ok(addr.to_string()),
    }
}

/// Runs `archipelago host` until the controller ends its session.
pub fn host(args: &HostArgs) -> anyhow::Result<()> {
    let place = slurm::HostPlace::resolve(
        &slurm::ProcessEnv,
        &args.devices,
        &args.fabric_listen,
        args.name.clone(),
        args.island.clone(),
    )?;
    let devices = place
        .devices
        .split(',')
        .map(|d| d.trim().parse::<DeviceSpec>())
        .collect::<Result<Vec<_>, _>>()?;
    // A host offers only what it can run: `cuda:N` needs a `cuda` build, the driver and the GPU.
    archipelago_actors::check_devices(&devices).map_err(anyhow::Error::msg)?;
    // GPUs offer their own memory unless told otherwise.
    let memory = args
        .memory
        .or_else(|| archipelago_actors::gpus::smallest_memory(&devices));
    let options = HostOptions {
        controller: controller_addr(&args.controller)?,
        credentials: args.tls.credentials(&args.token_file)?,
        name: place.name,
        island: place.island,
        devices,
        memory,
        fabric_listen: place.listen,
        advertise: args.advertise.clone(),
        heartbeat: Duration::from_millis(args.heartbeat_ms),
        connect_timeout: Duration::from_secs(30),
    };
    runtime()?.block_on(run_host(options))
}
