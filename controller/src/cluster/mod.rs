//! Several hosts: the controller service, the host agent, and the client that submits jobs.
//!
//! - [`service`]: `archipelago controller` — the registry of hosts and the job runner;
//! - [`host_agent`]: `archipelago host` — one per machine, runs its part of each job;
//! - [`client`]: `Controller::connect` / `archipelago train --controller`;
//! - [`remote_gang`], [`remote_job`]: placement, dispatch, loss detection and restarts;
//! - [`serving_job`], [`serving_replica`], [`serve_part`]: `archipelago serve --controller` — a
//!   serving job's replicas placed on distinct hosts, each one's service started there, followed
//!   on the dashboard (a lost replica reported while the others serve on);
//! - [`security`]: the TLS flags every process takes, and `archipelago certs`;
//! - [`health`]: `/healthz` and `/readyz` for supervisors and probes, and `archipelago health`;
//! - [`slurm`]: addresses, names and devices from a Slurm job's environment (`auto`).

pub mod client;
pub mod commands;
pub mod health;
pub mod host_agent;
pub mod host_part;
pub mod registry;
pub mod remote_gang;
pub mod remote_job;
pub mod security;
pub mod serve_part;
pub mod service;
pub mod serving_job;
pub mod serving_replica;
pub mod slurm;

/// Reads the cluster token from `path` (surrounding whitespace trimmed; must not be empty).
pub fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the token file {}: {e}", path.display()))?;
    let token = text.trim().to_string();
    if token.is_empty() {
        anyhow::bail!("the token file {} is empty", path.display());
    }
    Ok(token)
}
