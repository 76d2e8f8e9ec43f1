//! The parameter server's test configuration and comparisons, shared by the local tests
//! (`programs.rs`) and the cluster tests (`cluster.rs`): a tiny mlp, the library's
//! data-parallel training of the same model as the reference, and the bounded-delay checks.

use archipelago_actors::checkpoint::{CheckpointReader, step_dir};
use archipelago_controller::prelude::*;
use archipelago_controller::ps_job::PsOutcome;
use archipelago_controller::{Controller, TrainOptions};
use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program};
use archipelago_examples::programs::parameter_server::{
    ClockEvent, Fault, PsConfig, clock_log, registry, run, worker_steps,
};

/// 2 servers and `workers` workers train a tiny mlp for 12 clocks at bounded delay `staleness`.
pub fn config(workers: usize, staleness: u64, fault: Fault) -> PsConfig {
    PsConfig {
        model: ModelSpec::parse("mlp:in=16,hidden=32,layers=2,out=4").unwrap(),
        seed: 7,
        optimizer: OptimizerSpec::sgd(0.5),
        servers: 2,
        workers,
        local_batch: 8,
        clocks: 12,
        staleness,
        delay_ms: Vec::new(),
        fault,
    }
}

/// `config` at bounded delay 2 with worker 2 sleeping 15 ms per clock.
pub fn bounded(workers: usize) -> PsConfig {
    PsConfig {
        delay_ms: vec![0, 0, 15],
        ..config(workers, 2, Fault::None)
    }
}

/// The run on this process (one device per actor).
pub fn run_local(config: &PsConfig) -> PsOutcome {
    // The program's types, as a cluster needs them (strict registration mode checks them here).
    registry().install();
    let runtime = Runtime::local(DeviceSpec::cpus(config.devices()));
    run(&runtime, config).unwrap()
}

/// `Controller::train` of the same model, seed, data, SGD and global batch at data
/// parallelism `dp`: each step's loss, and the final flat parameters (block after block).
pub fn data_parallel(config: &PsConfig, dp: usize) -> (Vec<f32>, Vec<f32>) {
    let plan = ParallelPlan {
        dp,
        batch: config.global_batch(),
        ..ParallelPlan::default()
    };
    let program = Program::new(config.model.clone())
        .with_seed(config.seed)
        .with_optimizer(config.optimizer)
        .with_plan(plan);
    let dir = tempfile::tempdir().unwrap();
    let options = TrainOptions {
        steps: config.clocks,
        job: format!("ps-reference-dp{dp}"),
        checkpoint_dir: Some(dir.path().to_path_buf()),
        ..TrainOptions::default()
    };
    let report = Controller::local(DeviceSpec::cpus(dp))
        .train(&program, &options)
        .unwrap();
    let reader = CheckpointReader::open(&step_dir(dir.path(), config.clocks)).unwrap();
    let params = (config.model.desc().blocks.iter().enumerate())
        .flat_map(|(i, b)| reader.read(i, 0..b.params as usize, false).unwrap()[0].clone())
        .collect();
    (report.steps.iter().map(|s| s.loss).collect(), params)
}

/// The largest absolute difference between two vectors of the same length.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A run at bounded delay `k` with a slow worker 2: no pull was granted more than `k` clocks
/// ahead of the slowest worker, every clock was applied as soon as the slowest pushed it, the
/// fast workers got ahead as far as the bound allows and were held back there, and it trains.
pub fn check_bounded_delay(ps: &PsOutcome, k: u64) {
    for event in clock_log(ps) {
        match event {
            ClockEvent::Granted { clock, pushed, .. } => {
                assert!(*clock <= pushed.iter().min().unwrap() + k, "{event:?}");
            }
            // A clock is applied as soon as the slowest worker has pushed it.
            ClockEvent::Applied { clock, pushed } => {
                assert_eq!(*clock + 1, *pushed.iter().min().unwrap(), "{event:?}");
            }
        }
    }
    // The fast workers did get ahead (so the bound was tested), as far as it allows.
    assert_eq!(ps.max_lead(), k);
    let steps = worker_steps(ps);
    for step in steps.iter().copied().flatten() {
        assert!(step.clock - step.applied <= k, "{step:?}");
    }
    assert!(steps[0].iter().any(|s| s.clock - s.applied == k));
    // ... and were held back there: the servers enforced the bound.
    assert!(steps[0].iter().any(|s| s.refused > 0));
    let last = ps.losses.len() - 1;
    assert!(
        ps.losses[last] < 0.8 * ps.losses[0],
        "it still trains: {:?}",
        ps.losses
    );
}
