//! The parameter server's figures (Li et al., OSDI 2014; `archipelago_actors::ps`): sparse
//! logistic regression on a million features with 1, 2 and 4 servers and the same workers —
//! pushes and pulls per second, payload bytes per second and examples per second — in one run,
//! on this process (one CPU device per server and per worker); and the slowed-worker figure:
//! one worker slowed 5× for 3 of its clocks, the others' steps per second over that window at
//! `K = 0`, `K = 2` and `K = 12` ([`slowed_worker`]).

use serde_json::json;

use archipelago_actors::ps::{BuiltinUpdate, Consistency, CtrSpec, Initializer, SlowWindow, WorkerRun};
use archipelago_actors::runtime::Runtime;
use archipelago_dataflow::{DeviceSpec, OptimizerSpec};

use crate::ps_job::{PsJob, PsModel, run, run_slowed};

/// One job per server count in `servers`, `workers` workers, `clocks` clocks of `local_batch`
/// examples per worker.
pub fn sparse_scaling(
    servers: &[usize],
    workers: usize,
    local_batch: usize,
    clocks: u64,
) -> anyhow::Result<serde_json::Value> {
    let mut rows = Vec::new();
    for &s in servers {
        let job = sparse_job(s, workers, local_batch, clocks, Consistency::BoundedDelay(1))?;
        let outcome = run(&local(job.devices()), &job)?;
        let wall = outcome.wall_s.max(1e-9);
        let figures: Vec<_> = outcome.servers.iter().map(|r| &r.figures).collect();
        let pushes: u64 = figures.iter().map(|f| f.pushes).sum();
        let pulls: u64 = figures.iter().map(|f| f.pulls).sum();
        let bytes: u64 = figures.iter().map(|f| f.bytes_in + f.bytes_out).sum();
        rows.push(json!({
            "servers": s,
            "workers": workers,
            "clocks": clocks,
            "wall_s": wall,
            "pushes_per_s": pushes as f64 / wall,
            "pulls_per_s": pulls as f64 / wall,
            "refused_pulls": figures.iter().map(|f| f.refused).sum::<u64>(),
            "payload_bytes_per_s": bytes as f64 / wall,
            "examples_per_s": (clocks as usize * workers * local_batch) as f64 / wall,
            "keys": figures.iter().map(|f| f.keys).sum::<u64>(),
            "final_loss": outcome.losses.last().copied(),
        }));
    }
    Ok(json!({
        "workload": "sparse-lr, 1e6 features, 20 draws per example, proximal L1, bounded delay 1",
        "local_batch": local_batch,
        "scaling": rows,
        "slowed_worker": slowed_worker(3, 2, local_batch, clocks.max(12))?,
        "convergence_at_millions": convergence(MILLIONS, 2, workers, local_batch, clocks.max(20) * 2)?,
    }))
}

/// Features of the convergence run: millions, most never touched (created on first touch).
pub const MILLIONS: u64 = 4_000_000;

/// Sparse logistic regression on `features` features to convergence's first stretch: the
/// held-out objective at the start, the end and for the true weights, and how much of the true
/// support the non-zero weights found.
pub fn convergence(
    features: u64,
    servers: usize,
    workers: usize,
    local_batch: usize,
    clocks: u64,
) -> anyhow::Result<serde_json::Value> {
    let spec = CtrSpec {
        features,
        ..ctr_spec()
    };
    let job = PsJob {
        model: PsModel::SparseLr(spec),
        ..sparse_job(
            servers,
            workers,
            local_batch,
            clocks,
            Consistency::BoundedDelay(1),
        )?
    };
    let outcome = run(&local(job.devices()), &job)?;
    let crate::ps_job::FinalModel::Sparse(weights) = &outcome.model else {
        anyhow::bail!("sparse-lr ended without a sparse model")
    };
    let summary = crate::ps_job::report::SparseSummary::of(&spec, weights, L1, 2000);
    Ok(json!({
        "features": features,
        "servers": servers,
        "workers": workers,
        "clocks": clocks,
        "examples_per_s": (clocks as usize * workers * local_batch) as f64 / outcome.wall_s.max(1e-9),
        "keys_held": outcome.servers.iter().map(|r| r.figures.keys).sum::<u64>(),
        "summary": summary,
    }))
}

/// The L1 weight of the bench's jobs.
const L1: f32 = 1e-3;

/// A runtime on `devices` CPU devices of this process, with the job's types registered (as
/// `archipelago ps` runs it: strict mode, when on, checks them).
fn local(devices: usize) -> Runtime {
    crate::ps_job::cli::registry().install();
    Runtime::local(DeviceSpec::cpus(devices))
}

fn ctr_spec() -> CtrSpec {
    CtrSpec {
        seed: 1,
        features: 1_000_000,
        draws: 20,
        support: 100,
    }
}

fn sparse_job(
    servers: usize,
    workers: usize,
    local_batch: usize,
    clocks: u64,
    consistency: Consistency,
) -> anyhow::Result<PsJob<BuiltinUpdate>> {
    Ok(PsJob {
        model: PsModel::SparseLr(ctr_spec()),
        update: BuiltinUpdate::from_spec(OptimizerSpec::sgd(2.0), L1, Initializer::Zeros)
            .map_err(anyhow::Error::msg)?,
        servers,
        workers,
        replicas: 1,
        vnodes: 64,
        consistency,
        local_batch,
        clocks,
        delay_ms: Vec::new(),
        checkpoint_dir: None,
        resume: None,
        log_clocks: false,
        key_caching: true,
        filter: None,
        fault: Default::default(),
        fail_at: None,
    })
}

/// Clocks of worker 0 that are slowed.
pub const SLOWED_CLOCKS: u64 = 3;

/// The slowed-worker figure: per `K` in `{0, 2, 12}`, the job once unslowed, then with worker 0
/// sleeping 4× its own median clock time extra (5× slower) over 3 clocks ([`SLOWED_CLOCKS`]) from
/// `clocks / 3`; for the other workers, their steps per second over that window (worker 0's
/// wall-clock span of the slowed clocks) over their steps per second unslowed.
///
/// 3 clocks 5× slower cost 12 clock-times: `K = 2` lets the others run 2 clocks ahead and then
/// wait (at best (3 + 2) / 15 = 0.33 of their unslowed rate over the window), `K = 12` lets them
/// run through it.
///
/// Timelines are each worker's cumulative clock times from the start of its loop (the workers
/// start together), so the window is placed to within a clock's jitter.
pub fn slowed_worker(
    workers: usize,
    servers: usize,
    local_batch: usize,
    clocks: u64,
) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        workers >= 2,
        "the slowed-worker figure needs at least 2 workers, not {workers}"
    );
    let first = clocks / 3;
    anyhow::ensure!(
        first >= 1 && first + SLOWED_CLOCKS < clocks,
        "{clocks} clocks leave no room for {SLOWED_CLOCKS} slowed clocks; use at least 6"
    );
    let runtime = local(servers + workers);
    let mut rows = Vec::new();
    for k in [0u64, 2, 12] {
        let job = sparse_job(
            servers,
            workers,
            local_batch,
            clocks,
            Consistency::with_staleness(Some(k)),
        )?;
        let plain = run(&runtime, &job)?;
        let mut own: Vec<f64> = plain.workers[0].steps.iter().map(|s| s.time_s).collect();
        own.sort_by(f64::total_cmp);
        let median_s = own[own.len() / 2];
        let window = SlowWindow {
            first_clock: first,
            clocks: SLOWED_CLOCKS,
            extra_ms: (4.0 * median_s * 1e3).round().max(1.0) as u64,
        };
        let slowed = run_slowed(&runtime, &job, Some((0, window)))?;
        let ends0 = ends(&slowed.workers[0]);
        let (t0, t1) = (
            ends0[first as usize - 1],
            ends0[(first + SLOWED_CLOCKS) as usize - 1],
        );
        let others = 1..workers;
        // Unslowed: the others' steps per second from the end of their first clock (warm-up) on.
        let unslowed: f64 = others
            .clone()
            .map(|w| {
                let e = ends(&plain.workers[w]);
                (e.len() - 1) as f64 / (e[e.len() - 1] - e[0]).max(1e-9)
            })
            .sum::<f64>()
            / (workers - 1) as f64;
        let in_window: f64 = others
            .clone()
            .map(|w| steps_within(&ends(&slowed.workers[w]), t0, t1) / (t1 - t0).max(1e-9))
            .sum::<f64>()
            / (workers - 1) as f64;
        let whole_run = |o: &crate::ps_job::PsOutcome| {
            others
                .clone()
                .map(|w| ends(&o.workers[w]).last().copied().unwrap_or(0.0))
                .sum::<f64>()
                / (workers - 1) as f64
        };
        rows.push(json!({
            "k": k,
            "worker0_median_clock_s": median_s,
            "extra_ms_per_slowed_clock": window.extra_ms,
            "window_s": t1 - t0,
            "others_steps_per_s_unslowed": unslowed,
            "others_steps_per_s_in_window": in_window,
            "slowed_window_throughput_ratio": in_window / unslowed,
            "others_run_s_unslowed": whole_run(&plain),
            "others_run_s_slowed": whole_run(&slowed),
        }));
    }
    Ok(json!({
        "workload": "sparse-lr, 1e6 features, 20 draws per example, proximal L1",
        "servers": servers,
        "workers": workers,
        "local_batch": local_batch,
        "clocks": clocks,
        "slowed": { "worker": 0, "first_clock": first, "clocks": SLOWED_CLOCKS, "factor": 5 },
        "per_k": rows,
    }))
}

/// When each clock of a worker's loop ended, in seconds from the loop's start.
fn ends(run: &WorkerRun) -> Vec<f64> {
    run.steps
        .iter()
        .scan(0.0, |t, s| {
            *t += s.time_s;
            Some(*t)
        })
        .collect()
}

/// Clocks (fractional at the edges) of a worker whose clocks end at `ends` that fall in
/// `[t0, t1]`.
fn steps_within(ends: &[f64], t0: f64, t1: f64) -> f64 {
    let mut start = 0.0_f64;
    let mut n = 0.0;
    for &end in ends {
        let overlap = (end.min(t1) - start.max(t0)).max(0.0);
        if end > start {
            n += overlap / (end - start);
        }
        start = end;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::steps_within;

    #[test]
    fn steps_within_counts_fractions_at_the_edges() {
        let ends = [1.0, 2.0, 3.0, 4.0];
        assert!((steps_within(&ends, 1.0, 3.0) - 2.0).abs() < 1e-12);
        assert!((steps_within(&ends, 0.5, 2.5) - 2.0).abs() < 1e-12);
        // Negative control: a window past the last clock holds none.
        assert_eq!(steps_within(&ends, 5.0, 6.0), 0.0);
    }
}
