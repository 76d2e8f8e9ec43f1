//! A serving job on the cluster (`archipelago serve --controller`), the controller's side: it
//! places the job's `--replicas R` replicas on R distinct registered `archipelago host`s (those
//! with the fewest serving jobs; refused, naming the count, when fewer than R register within
//! the controller's `--wait-for-hosts-s`), runs each as a [`ServingReplica`] (its part spawned
//! over the host's actor port, its address sent to the client, its figures on the dashboard),
//! and keeps them for as long as the client's call is open. The job ends when the client goes
//! away (the parts are stopped with their connections). A replica whose host is lost or whose
//! part stops answering is reported to the client as a [`ReplicaLost`] event naming the host
//! while other replicas serve on; the job fails (the client hears why, naming the hosts) when
//! every replica is lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::mpsc::UnboundedSender;
use tonic::Status;

use archipelago_actors::proto::{JobEvent, ReplicaLost, job_event};
use archipelago_actors::trust::Credentials;

use super::registry::{ClusterConfig, HostInfo, Registry};
use super::serving_replica::{Ended, ReplicaJob, ServingReplica};
use crate::serve::ServeArgs;

/// The longest name a serving job may have.
const MAX_NAME: usize = 64;

/// The serving jobs the controller runs: their names and how many each host holds.
#[derive(Default)]
pub struct ServingJobs {
    started: AtomicU64,
    by_host: Mutex<BTreeMap<u32, usize>>,
    running: Mutex<BTreeSet<String>>,
}

impl ServingJobs {
    /// A new job's name, now taken: the client's (at most 64 of `A-Z a-z 0-9 . _ -`,
    /// not one running), or `serve-N`.
    pub fn name(&self, asked: &str) -> Result<String, String> {
        let mut running = self.running.lock().expect("serving jobs");
        let name = match asked {
            "" => loop {
                let n = self.started.fetch_add(1, Ordering::Relaxed) + 1;
                let name = format!("serve-{n}");
                if !running.contains(&name) {
                    break name;
                }
            },
            name if name.len() > MAX_NAME
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) =>
            {
                return Err(format!(
                    "serving job name `{}`: use at most {MAX_NAME} of A-Z a-z 0-9 . _ -",
                    name.chars().take(MAX_NAME).collect::<String>().escape_debug()
                ));
            }
            name if running.contains(name) => {
                return Err(format!(
                    "a serving job named `{name}` already runs: give another --job"
                ));
            }
            name => name.to_string(),
        };
        running.insert(name.clone());
        Ok(name)
    }

    /// The job named `name` ended: the name is free again.
    fn ended(&self, name: &str) {
        self.running.lock().expect("serving jobs").remove(name);
    }

    /// `count` distinct hosts among `hosts`, those holding the fewest serving jobs first (in
    /// registration order among equals), each counted as holding one more; `None` when there
    /// are fewer than `count`.
    fn place(&self, hosts: &[HostInfo], count: usize) -> Option<Vec<HostInfo>> {
        if hosts.len() < count {
            return None;
        }
        let mut by_host = self.by_host.lock().expect("serving jobs by host");
        let mut ranked: Vec<&HostInfo> = hosts.iter().collect();
        ranked.sort_by_key(|h| by_host.get(&h.id).copied().unwrap_or(0));
        let placed: Vec<HostInfo> = ranked.into_iter().take(count).cloned().collect();
        for host in &placed {
            *by_host.entry(host.id).or_default() += 1;
        }
        Some(placed)
    }

    fn release(&self, host: u32) {
        let mut by_host = self.by_host.lock().expect("serving jobs by host");
        if let Some(n) = by_host.get_mut(&host) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Everything a serving job uses on the controller.
pub struct ServingJob {
    /// The cluster's hosts.
    pub registry: Arc<Registry>,
    /// The cluster's settings (and dashboard).
    pub config: ClusterConfig,
    /// The cluster's credentials (shown at the host's actor port).
    pub credentials: Credentials,
    /// The controller's serving jobs.
    pub jobs: Arc<ServingJobs>,
    /// The job's name.
    pub name: String,
    /// `serve`'s flags.
    pub args: ServeArgs,
    /// The client's events.
    pub events: UnboundedSender<Result<JobEvent, Status>>,
}

impl ServingJob {
    /// Places and runs the job's replicas until its client goes away or every replica failed.
    pub async fn run(self) {
        let replicas = self.args.replicas.max(1);
        let hosts = match self.place(replicas).await {
            Ok(hosts) => hosts,
            Err(why) => {
                self.jobs.ended(&self.name);
                self.send(job_event::Kind::Error(why));
                return;
            }
        };
        // The part's types, known here as on every host.
        super::serve_part::registry().install();
        let job = ReplicaJob {
            name: &self.name,
            args: &self.args,
            registry: &self.registry,
            config: &self.config,
            credentials: &self.credentials,
            events: &self.events,
        };
        let mut running = FuturesUnordered::new();
        for (index, host) in hosts.into_iter().enumerate() {
            if let Some(d) = &self.config.dashboard {
                d.serving_placed(&self.name, index, replicas, &host.name);
            }
            let replica = ServingReplica {
                job: &job,
                index,
                replicas,
                host,
            };
            self.send(job_event::Kind::Info(format!(
                "{} placed on host `{}` ({})",
                replica.who(),
                replica.host.name,
                replica.host.devices[0]
            )));
            running.push(replica.run());
        }
        let mut failures = Vec::new();
        while let Some((replica, ended)) = running.next().await {
            self.replica_ended(&replica, ended, &mut failures);
        }
        self.jobs.ended(&self.name);
        if failures.len() == replicas {
            let why = match replicas {
                1 => failures.remove(0),
                _ => format!(
                    "serving job {}: every replica was lost: {}",
                    self.name,
                    failures.join("; ")
                ),
            };
            self.send(job_event::Kind::Error(why));
        }
    }

    /// Replica `replica` ended: its host counted out, the dashboard told; a failure is added
    /// to `failures` and, while other replicas serve, reported to the client as lost.
    fn replica_ended(&self, replica: &ServingReplica<'_>, ended: Ended, failures: &mut Vec<String>) {
        let (index, host) = (replica.index, &replica.host.name);
        self.jobs.release(replica.host.id);
        let failure = match &ended {
            Ended::Stopped => None,
            Ended::Failed(why) => Some(why.as_str()),
        };
        if let Some(d) = &self.config.dashboard {
            d.serving_ended(&self.name, index, failure);
        }
        let Ended::Failed(why) = ended else {
            tracing::info!(job = %self.name, replica = index, host = %host, "serving replica stopped: its client went away");
            return;
        };
        tracing::error!(job = %self.name, replica = index, host = %host, "{why}");
        failures.push(why.clone());
        if failures.len() < replica.replicas {
            self.send(job_event::Kind::ReplicaLost(ReplicaLost {
                job: self.name.clone(),
                replica: index as u32,
                host: host.clone(),
                why,
            }));
        }
    }

    /// `replicas` distinct hosts for the job, waiting up to the cluster's `--wait-for-hosts-s`
    /// for enough to register; refused, naming the count, when fewer do.
    async fn place(&self, replicas: usize) -> Result<Vec<HostInfo>, String> {
        let wait = self.config.wait_for_hosts;
        let deadline = Instant::now() + wait;
        loop {
            let mut hosts = self.registry.wait_for_devices(replicas, wait, false).await;
            hosts.retain(|h| !h.devices.is_empty());
            if let Some(placed) = self.jobs.place(&hosts, replicas) {
                return Ok(placed);
            }
            if Instant::now() >= deadline {
                return Err(match (replicas, hosts.len()) {
                    (1, _) => format!(
                        "serving job {}: no `archipelago host` registered with the controller after waiting {wait:?}; start one (`archipelago host --controller …`)",
                        self.name
                    ),
                    (_, registered) => format!(
                        "serving job {}: --replicas {replicas} needs {replicas} distinct hosts, but {registered} `archipelago host`(s) registered with the controller after waiting {wait:?}; start more hosts or lower --replicas",
                        self.name
                    ),
                });
            }
            // Enough devices but too few hosts: look again as hosts register.
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Sends `kind` to the client (gone already: nothing to do).
    pub fn send(&self, kind: job_event::Kind) {
        let _ = self.events.send(Ok(JobEvent { kind: Some(kind) }));
    }
}
