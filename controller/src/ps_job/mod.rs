//! The driver of a parameter-server job (Li et al., OSDI 2014) on the runtime API: it spawns the
//! servers of `archipelago_actors::ps` on the runtime's first `S` slots and the workers on the
//! next `W` (this process's devices, or the hosts of a cluster: the same code), seeds a dense
//! model's initial values through worker 0, starts every worker's loop, and collects the servers'
//! figures and final values, checkpointing them when asked. Values and gradients move worker ↔
//! server only; the driver reads the final model once, at the end, for the report.
//!
//! With `replicas > 1` every key range is chain-replicated; [`failover`] watches the servers and,
//! when one's host is lost, moves its ranges to the next replicas and back onto `R` servers (or
//! names the range lost with all its replicas and stops the job).
//!
//! `archipelago ps` ([`cli`]) builds a [`PsJob`] (described and checked in `job`) from train's
//! flags; [`report`] is its JSON.

pub mod cli;
pub mod failover;
mod job;
pub mod report;

use std::collections::HashMap;
use std::time::Instant;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use archipelago_actors::ps::checkpoint::{Manifest, read_manifest, write_manifest};
use archipelago_actors::ps::versions::RangeVersions;
use archipelago_actors::ps::{
    DenseWorker, DenseWorkerParams, Dump, LoopSettings, PsServer, Ring, SaveCheckpoint, SeedModel,
    ServerParams, ServerReport, ServerUpdate, SlowWindow, SparseLrParams, SparseLrWorker, Stats, Train,
    WorkerRun,
};
use archipelago_actors::runtime::{Actor, ActorRef, Handler, Pending, Runtime, SpawnError, SpawnOptions};

pub use failover::FailoverEvent;
use failover::Watch;
pub use job::{PsJob, PsModel};

/// The final model as the servers hold it.
#[derive(Debug, Clone, PartialEq)]
pub enum FinalModel {
    /// A dense model's flat parameters, in order (padding dropped).
    Dense(Vec<f32>),
    /// Every weight a server holds.
    Sparse(HashMap<u64, f32>),
}

/// What a job produced.
#[derive(Debug, Clone)]
pub struct PsOutcome {
    /// The clock the job started at.
    pub first_clock: u64,
    /// The global loss of each clock it ran (the sum of the workers' shares).
    pub losses: Vec<f32>,
    /// Each worker's run, by rank.
    pub workers: Vec<WorkerRun>,
    /// Each server's figures and clock log.
    pub servers: Vec<ServerReport>,
    /// The final model.
    pub model: FinalModel,
    /// The ring.
    pub ring: Ring,
    /// Seconds the workers' loops took.
    pub wall_s: f64,
    /// Where each server, then each worker, ran: `(host, device)`.
    pub placement: Vec<(String, String)>,
    /// Copies of every key range.
    pub replicas: usize,
    /// Every failover (a server lost, its ranges back on `R` servers).
    pub failovers: Vec<FailoverEvent>,
    /// How many live servers hold each key at the end (with `replicas > 1`).
    pub replication: Option<Replication>,
}

/// The copies of every key over the live servers at the end of a replicated job.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Replication {
    /// Keys held.
    pub keys: u64,
    /// The fewest servers holding one key.
    pub min_copies: usize,
    /// The most servers holding one key.
    pub max_copies: usize,
    /// The largest difference between two copies of one value.
    pub max_diff: f32,
    /// Keys whose copies' range version vectors differ (or a copy has none): what recovery
    /// knows each replica holds, compared.
    #[serde(default)]
    pub version_mismatches: u64,
}

impl PsOutcome {
    /// The most clocks a granted pull was ahead of the slowest worker, over every server.
    pub fn max_lead(&self) -> u64 {
        self.servers.iter().map(|s| s.figures.max_lead).max().unwrap_or(0)
    }

    /// The dense model's flat parameters (empty for a sparse one).
    pub fn dense_params(&self) -> &[f32] {
        match &self.model {
            FinalModel::Dense(p) => p,
            FinalModel::Sparse(_) => &[],
        }
    }
}

/// Runs `job` on `runtime`: servers on its first `servers` slots, workers on the next `workers`.
pub fn run<U>(runtime: &Runtime, job: &PsJob<U>) -> anyhow::Result<PsOutcome>
where
    U: ServerUpdate + Serialize + DeserializeOwned,
{
    run_slowed(runtime, job, None)
}

/// [`run`], with worker `slow.0` sleeping longer over the clocks of `slow.1` (the slowed-worker
/// figure of `archipelago bench --ps-only`).
pub fn run_slowed<U>(
    runtime: &Runtime,
    job: &PsJob<U>,
    slow: Option<(usize, SlowWindow)>,
) -> anyhow::Result<PsOutcome>
where
    U: ServerUpdate + Serialize + DeserializeOwned,
{
    if let Some((rank, _)) = slow {
        anyhow::ensure!(
            rank < job.workers,
            "the slowed worker {rank} is not one of the {} workers",
            job.workers
        );
    }
    job.check().map_err(anyhow::Error::msg)?;
    let slots = runtime.slots().len();
    anyhow::ensure!(
        job.devices() <= slots,
        "{} servers and {} workers need {} devices; the runtime has {slots}",
        job.servers,
        job.workers,
        job.devices()
    );
    let width = job.model.width();
    let first_clock = match &job.resume {
        Some(dir) => {
            let manifest = read_manifest(dir).map_err(anyhow::Error::msg)?;
            anyhow::ensure!(
                manifest.workers == job.workers && manifest.width == width,
                "the checkpoint in {} was written by {} workers with keys of width {}; resume with --workers {}",
                dir.display(),
                manifest.workers,
                manifest.width,
                manifest.workers
            );
            manifest.clock
        }
        None => 0,
    };
    let ring = Ring::new(0..job.servers, job.vnodes)?;
    let spawn_servers: Vec<_> = (0..job.servers)
        .map(|index| {
            let params = ServerParams {
                index,
                workers: job.workers,
                width,
                consistency: job.consistency,
                update: job.update.clone(),
                ring: ring.clone(),
                replicas: job.replicas,
                first_clock,
                resume: job.resume.clone(),
                log_clocks: job.log_clocks,
                fault: job.fault,
            };
            runtime.spawn_at::<PsServer<U>>(index, params, SpawnOptions::named(format!("ps-server-{index}")))
        })
        .collect();
    let servers = all_or_none(spawn_servers)?;
    let watch = Watch::start(&servers, ring.clone(), job.replicas);
    let result = with_servers(runtime, job, &servers, (ring, slow), first_clock, &watch);
    watch.finish();
    servers.iter().for_each(|s| s.stop("the job is over"));
    match (result, watch.lost()) {
        // The workers' loops ended because the servers were stopped: the lost range is the cause.
        (_, Some(lost)) => Err(anyhow::anyhow!("{lost}")),
        (result, None) => result,
    }
}

/// The job once its servers run: spawns and drives the workers, reads the servers' figures and
/// final values, checkpoints them when asked. The caller stops the servers.
fn with_servers<U>(
    runtime: &Runtime,
    job: &PsJob<U>,
    servers: &[ActorRef<PsServer<U>>],
    (ring, slow): (Ring, Option<(usize, SlowWindow)>),
    first_clock: u64,
    watch: &Watch,
) -> anyhow::Result<PsOutcome>
where
    U: ServerUpdate + Serialize + DeserializeOwned,
{
    let width = job.model.width();
    let settings = |rank: usize| LoopSettings {
        rank,
        workers: job.workers,
        local_batch: job.local_batch,
        delay_ms: job.delay_ms.get(rank).copied().unwrap_or(0),
        log_acked: job.log_clocks,
        key_caching: job.key_caching,
        filter: job.filter,
        slow: slow.filter(|(r, _)| *r == rank).map(|(_, w)| w),
        fail_at: job.fail_at.filter(|(r, _)| *r == rank).map(|(_, c)| c),
    };
    let train = Train {
        servers: servers.to_vec(),
        ring: ring.clone(),
        first_clock,
        clocks: job.clocks,
        replicas: job.replicas,
    };
    let (placement_workers, runs, wall_s) = match &job.model {
        PsModel::Dense {
            model,
            data,
            seed,
            width,
        } => {
            let params = |rank| DenseWorkerParams {
                model: model.clone(),
                data: data.clone(),
                seed: *seed,
                width: *width,
                settings: settings(rank),
            };
            let workers = spawn_workers::<DenseWorker<U>>(runtime, job, params)?;
            if job.resume.is_none() {
                let seed = SeedModel {
                    servers: servers.to_vec(),
                    ring: ring.clone(),
                    replicas: job.replicas,
                };
                let seeded = workers[0].call(seed).get();
                if let Err(e) = seeded
                    .map_err(anyhow::Error::from)
                    .and_then(|r| r.map_err(anyhow::Error::msg))
                {
                    workers.iter().for_each(|w| w.stop("seeding failed"));
                    return Err(e.context("worker 0 seeding the model's initial values"));
                }
            }
            drive(runtime, servers, workers, train)?
        }
        PsModel::SparseLr(spec) => {
            let params = |rank| SparseLrParams {
                data: *spec,
                settings: settings(rank),
            };
            let workers = spawn_workers::<SparseLrWorker<U>>(runtime, job, params)?;
            drive(runtime, servers, workers, train)?
        }
    };
    let live: Vec<ActorRef<PsServer<U>>> = watch.live().into_iter().map(|s| servers[s].clone()).collect();
    let reports: Vec<ServerReport> = live
        .iter()
        .map(|s| s.call(Stats).get())
        .collect::<Result<_, _>>()?;
    for report in &reports {
        let s = report.figures.index;
        anyhow::ensure!(
            report.figures.applied == first_clock + job.clocks,
            "server {s} applied {} of {} clocks after every worker finished",
            report.figures.applied,
            first_clock + job.clocks
        );
    }
    let model = final_model(&live, &job.model)?;
    let replication = if job.replicas > 1 {
        Some(replication(&live, width)?)
    } else {
        None
    };
    let failovers = watch.events();
    if let Some(dir) = &job.checkpoint_dir {
        // The directory stops being a checkpoint until the new manifest is in.
        match std::fs::remove_file(dir.join("manifest.json")) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                anyhow::bail!("cannot replace the checkpoint in {}: {e}", dir.display())
            }
            _ => {}
        }
        // After a failover the live servers' ranges hold every key: only they write.
        let mut files = Vec::new();
        for server in &live {
            let s = server.info().name.clone();
            let saved = server.call(SaveCheckpoint { dir: dir.clone() }).get()?;
            saved.map_err(|e| anyhow::anyhow!("{s}'s checkpoint: {e}"))?;
        }
        if !failovers.is_empty() {
            files = watch.live();
            // A file of a lost server left from an earlier checkpoint is no longer part of it.
            for lost in (0..servers.len()).filter(|s| !files.contains(s)) {
                let _ = std::fs::remove_file(archipelago_actors::ps::checkpoint::server_path(dir, lost));
            }
        }
        let manifest = Manifest {
            clock: first_clock + job.clocks,
            servers: job.servers,
            files,
            workers: job.workers,
            width,
            update: job.update.describe(),
        };
        write_manifest(dir, &manifest).map_err(anyhow::Error::msg)?;
    }
    let losses = (0..job.clocks as usize)
        .map(|c| runs.iter().map(|r| r.steps[c].loss).sum())
        .collect();
    let placement = servers
        .iter()
        .map(|s| (s.info().host.clone(), s.info().device.to_string()))
        .chain(placement_workers)
        .collect();
    Ok(PsOutcome {
        first_clock,
        losses,
        workers: runs,
        servers: reports,
        model,
        ring: watch.ring(),
        wall_s,
        placement,
        replicas: job.replicas,
        failovers,
        replication,
    })
}

/// Counts the live servers holding each key and compares the copies.
fn replication<U: ServerUpdate>(live: &[ActorRef<PsServer<U>>], width: usize) -> anyhow::Result<Replication> {
    let mut copies: HashMap<u64, (usize, Vec<f32>)> = HashMap::new();
    let mut versions: HashMap<u64, Option<Vec<u64>>> = HashMap::new();
    let (mut max_diff, mut version_mismatches) = (0.0f32, 0u64);
    for server in live {
        let dump = server.call(Dump { replicas: true }).get()?;
        for (key, values) in dump.keys.iter().zip(dump.values.chunks_exact(width)) {
            let version = RangeVersions::find(&dump.versions, *key).map(|arc| arc.next.clone());
            match versions.get(key) {
                Some(first) if *first != version || version.is_none() => version_mismatches += 1,
                Some(_) => {}
                None => {
                    versions.insert(*key, version);
                }
            }
            match copies.get_mut(key) {
                Some((n, first)) => {
                    *n += 1;
                    let d = first
                        .iter()
                        .zip(values)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    max_diff = max_diff.max(d);
                }
                None => {
                    copies.insert(*key, (1, values.to_vec()));
                }
            }
        }
    }
    Ok(Replication {
        keys: copies.len() as u64,
        min_copies: copies.values().map(|c| c.0).min().unwrap_or(0),
        max_copies: copies.values().map(|c| c.0).max().unwrap_or(0),
        max_diff,
        version_mismatches,
    })
}

fn spawn_workers<W: Actor>(
    runtime: &Runtime,
    job: &PsJob<impl Sized>,
    params: impl Fn(usize) -> W::Params,
) -> anyhow::Result<Vec<ActorRef<W>>> {
    let pending: Vec<_> = (0..job.workers)
        .map(|rank| {
            let options = SpawnOptions::named(format!("ps-worker-{rank}"));
            runtime.spawn_at::<W>(job.servers + rank, params(rank), options)
        })
        .collect();
    all_or_none(pending)
}

/// Every spawned actor, or the first error with the others stopped.
fn all_or_none<A: Actor>(
    pending: Vec<Pending<Result<ActorRef<A>, SpawnError>>>,
) -> anyhow::Result<Vec<ActorRef<A>>> {
    let results: Vec<_> = pending.into_iter().map(|p| p.get()).collect();
    if let Some(index) = results.iter().position(Result::is_err) {
        results
            .iter()
            .flatten()
            .for_each(|a| a.stop("another actor of the job could not start"));
        let error = results
            .into_iter()
            .nth(index)
            .expect("the failed spawn")
            .unwrap_err();
        return Err(error.into());
    }
    Ok(results.into_iter().flatten().collect())
}

type Placed = Vec<(String, String)>;

/// Starts every worker's loop and waits for all; if one fails, stops the servers (the other
/// loops would wait for that worker's clocks forever) and returns its error.
fn drive<U, W>(
    runtime: &Runtime,
    servers: &[ActorRef<PsServer<U>>],
    workers: Vec<ActorRef<W>>,
    train: Train<U>,
) -> anyhow::Result<(Placed, Vec<WorkerRun>, f64)>
where
    U: ServerUpdate,
    W: Actor + Handler<Train<U>>,
{
    let placed = workers
        .iter()
        .map(|w| (w.info().host.clone(), w.info().device.to_string()))
        .collect();
    let began = Instant::now();
    let mut pending: Vec<(usize, _)> = workers
        .iter()
        .map(|w| w.call(train.clone()))
        .enumerate()
        .collect();
    let mut runs: Vec<Option<WorkerRun>> = vec![None; workers.len()];
    let mut failure = None;
    while !pending.is_empty() {
        let (ranks, calls): (Vec<usize>, Vec<_>) = pending.into_iter().unzip();
        let waited = runtime.wait(calls, 1, None);
        for (i, result) in waited.ready {
            match result
                .map_err(anyhow::Error::from)
                .and_then(|r| r.map_err(anyhow::Error::msg))
            {
                Ok(run) => runs[ranks[i]] = Some(run),
                Err(e) if failure.is_none() => {
                    servers.iter().for_each(|s| s.stop("a worker's loop failed"));
                    failure = Some(e.context(format!("worker {}'s loop", ranks[i])));
                }
                Err(_) => {}
            }
        }
        pending = waited
            .pending
            .into_iter()
            .map(|(i, call)| (ranks[i], call))
            .collect();
    }
    let wall_s = began.elapsed().as_secs_f64();
    workers.iter().for_each(|w| w.stop("the job is over"));
    if let Some(error) = failure {
        return Err(error);
    }
    Ok((
        placed,
        runs.into_iter()
            .map(|r| r.expect("every loop answered"))
            .collect(),
        wall_s,
    ))
}

/// Reads every server's keys and values.
fn final_model<U: ServerUpdate>(
    servers: &[ActorRef<PsServer<U>>],
    model: &PsModel,
) -> anyhow::Result<FinalModel> {
    let dumps: Vec<_> = servers.iter().map(|s| s.call(Dump::default())).collect();
    let mut entries: Vec<(u64, Vec<f32>)> = Vec::new();
    let width = model.width();
    for dump in dumps {
        let dump = dump.get()?;
        for (key, values) in dump.keys.iter().zip(dump.values.chunks_exact(width)) {
            entries.push((*key, values.to_vec()));
        }
    }
    Ok(match model {
        PsModel::Dense { model, .. } => {
            let params = model.desc().params() as usize;
            let mut flat = vec![0.0f32; params.div_ceil(width) * width];
            for (key, values) in entries {
                let at = key as usize * width;
                anyhow::ensure!(
                    at + width <= flat.len(),
                    "a server holds key {key}, outside the model"
                );
                flat[at..at + width].copy_from_slice(&values);
            }
            flat.truncate(params);
            FinalModel::Dense(flat)
        }
        PsModel::SparseLr(_) => FinalModel::Sparse(entries.into_iter().map(|(k, v)| (k, v[0])).collect()),
    })
}
