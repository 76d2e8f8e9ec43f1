//! The parameter server's figures (Li et al., OSDI 2014; `archipelago_actors::ps`): sparse
//! logistic regression on a million features with 1, 2 and 4 servers and the same workers —
//! pushes and pulls per second, payload bytes per second and examples per second — in one run,
//! on this process (one CPU device per server and per worker).

use serde_json::json;

use archipelago_actors::ps::{BuiltinUpdate, Consistency, CtrSpec, Initializer};
use archipelago_actors::runtime::Runtime;
use archipelago_dataflow::{DeviceSpec, OptimizerSpec};

use crate::ps_job::{PsJob, PsModel, run};

/// One job per server count in `servers`, `workers` workers, `clocks` clocks of `local_batch`
/// examples per worker.
pub fn sparse_scaling(
    servers: &[usize],
    workers: usize,
    local_batch: usize,
    clocks: u64,
) -> anyhow::Result<serde_json::Value> {
    let spec = CtrSpec {
        seed: 1,
        features: 1_000_000,
        draws: 20,
        support: 100,
    };
    let mut rows = Vec::new();
    for &s in servers {
        let job = PsJob {
            model: PsModel::SparseLr(spec),
            update: BuiltinUpdate::from_spec(OptimizerSpec::sgd(2.0), 1e-3, Initializer::Zeros)
                .map_err(anyhow::Error::msg)?,
            servers: s,
            workers,
            replicas: 1,
            vnodes: 64,
            consistency: Consistency::BoundedDelay(1),
            local_batch,
            clocks,
            delay_ms: Vec::new(),
            checkpoint_dir: None,
            resume: None,
            log_clocks: false,
            fault: Default::default(),
            fail_at: None,
        };
        let outcome = run(&Runtime::local(DeviceSpec::cpus(job.devices())), &job)?;
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
    }))
}
