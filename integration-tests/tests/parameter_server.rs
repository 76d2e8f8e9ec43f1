//! The parameter-server library (Li et al., OSDI 2014; `archipelago_actors::ps`, driven by
//! `archipelago_controller::ps_job`) on this process: sequential consistency on a dense model is
//! the library's data-parallel SGD element by element (with negative controls), and with every
//! range chain-replicated on two servers the same model value for value on exactly two copies,
//! the bounded delay holds in the servers' clock logs (an eventual run is rejected by the same check), sparse
//! logistic regression with L1 converges toward the known weights, a stopped and resumed job ends
//! where an unstopped one does (a damaged checkpoint does not), and `archipelago ps` refuses bad
//! input with the fix and writes a report of train's shape.

use std::path::Path;

use archipelago_actors::checkpoint::{CheckpointReader, step_dir};
use archipelago_actors::ps::checkpoint::{read_server_file, server_path, write_server_file};
use archipelago_actors::ps::server::ServerFault;
use archipelago_actors::ps::{
    BuiltinUpdate, ClockEvent, Consistency, CtrSpec, Initializer, KeyStore, ServerUpdate,
};
use archipelago_actors::runtime::Runtime;
use archipelago_controller::ps_job::report::SparseSummary;
use archipelago_controller::ps_job::{FinalModel, PsJob, PsModel, PsOutcome, run};
use archipelago_controller::{Controller, TrainOptions};
use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec, ParallelPlan, Program};
use archipelago_integration_tests::{MARGIN, assert_caught};

const GPT: &str = "gpt:vocab=64,ctx=16,d=16,layers=1,heads=2";
/// The dense comparisons' tolerance (element-wise, absolute; exact ones' controls use it too).
const TOLERANCE: f32 = 1e-5;
fn dense_job(
    model: &str,
    optimizer: OptimizerSpec,
    workers: usize,
    local_batch: usize,
    clocks: u64,
) -> PsJob<BuiltinUpdate> {
    let spec = ModelSpec::parse(model).unwrap();
    let program = Program::new(spec.clone()).with_seed(7);
    PsJob {
        model: PsModel::Dense {
            model: spec,
            data: program.data.clone(),
            seed: 7,
            width: 256,
        },
        update: BuiltinUpdate::from_spec(optimizer, 0.0, Initializer::Zeros).unwrap(),
        servers: 2,
        workers,
        replicas: 1,
        vnodes: 16,
        consistency: Consistency::Sequential,
        local_batch,
        clocks,
        delay_ms: Vec::new(),
        checkpoint_dir: None,
        resume: None,
        log_clocks: true,
        key_caching: true,
        filter: None,
        fault: ServerFault::None,
        fail_at: None,
    }
}

fn run_local(job: &PsJob<BuiltinUpdate>) -> PsOutcome {
    // The job's types, as a cluster needs them (strict registration mode checks them here).
    archipelago_controller::ps_job::cli::registry().install();
    run(&Runtime::local(DeviceSpec::cpus(job.devices())), job).unwrap()
}

/// `train --dp dp --optimizer sgd` of the same model, seed, data and global batch: each step's
/// loss and the final flat parameters, read back from its end-of-run checkpoint.
fn data_parallel(model: &str, lr: f32, dp: usize, batch: usize, steps: u64) -> (Vec<f32>, Vec<f32>) {
    let spec = ModelSpec::parse(model).unwrap();
    let program = Program::new(spec.clone())
        .with_seed(7)
        .with_optimizer(OptimizerSpec::sgd(lr))
        .with_plan(ParallelPlan {
            dp,
            batch,
            ..ParallelPlan::default()
        });
    let dir = tempfile::tempdir().unwrap();
    let options = TrainOptions {
        keep_params: true,
        steps,
        job: format!("ps-reference-dp{dp}"),
        checkpoint_dir: Some(dir.path().to_path_buf()),
        ..TrainOptions::default()
    };
    let report = Controller::local(DeviceSpec::cpus(dp))
        .train(&program, &options)
        .unwrap();
    let reader = CheckpointReader::open(&step_dir(dir.path(), steps)).unwrap();
    let params = (spec.desc().blocks.iter().enumerate())
        .flat_map(|(i, b)| reader.read(i, 0..b.params as usize, false).unwrap()[0].clone())
        .collect();
    (report.steps.iter().map(|s| s.loss).collect(), params)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn sequential_consistency_on_a_gpt_is_data_parallel_sgd_element_by_element_and_faults_are_caught() {
    let (lr, workers, local, clocks) = (0.5, 2, 4, 5);
    let (losses, params) = data_parallel(GPT, lr, workers, workers * local, clocks);
    let job = dense_job(GPT, OptimizerSpec::sgd(lr), workers, local, clocks);
    let ps = run_local(&job);
    let (d_params, d_losses) = (
        max_diff(ps.dense_params(), &params),
        max_diff(&ps.losses, &losses),
    );
    println!("K=0 gpt vs train --dp {workers} --optimizer sgd: params {d_params:.2e}, losses {d_losses:.2e}");
    println!("losses: {:?}", ps.losses);
    assert!(d_params.max(d_losses) <= TOLERANCE, "{d_params} {d_losses}");
    assert!(
        ps.losses[clocks as usize - 1] < ps.losses[0],
        "it trains: {:?}",
        ps.losses
    );
    assert_eq!(ps.max_lead(), 0);
    // Negative controls: one worker's pushes dropped, pushes averaged instead of summed.
    for fault in [ServerFault::DropPushOf(1), ServerFault::AveragePushes] {
        let faulty = run_local(&PsJob { fault, ..job.clone() });
        let d = max_diff(faulty.dense_params(), &params);
        assert_caught(&format!("{fault:?}"), d.into(), TOLERANCE.into(), 100.0);
    }
}

#[test]
fn chain_replication_keeps_two_identical_copies_and_changes_no_value_and_faults_are_caught() {
    // Sequential consistency on three servers: with every range on two of them, each push
    // walks its chain; the model is the one-copy model value for value, on exactly two servers.
    let one = PsJob {
        servers: 3,
        ..dense_job(GPT, OptimizerSpec::sgd(0.5), 2, 4, 4)
    };
    let two = PsJob {
        replicas: 2,
        ..one.clone()
    };
    let (a, b) = (run_local(&one), run_local(&two));
    let d = max_diff(a.dense_params(), b.dense_params()).max(max_diff(&a.losses, &b.losses));
    let copies = b.replication.expect("counted with two replicas");
    println!("R=2 vs R=1 at K=0: max |diff| {d:.2e}; {copies:?}");
    assert_eq!(d, 0.0);
    assert_eq!(
        (copies.min_copies, copies.max_copies, copies.max_diff),
        (2, 2, 0.0)
    );
    assert!(b.servers.iter().all(|s| s.figures.chained > 0));
    assert_eq!(
        a.servers.iter().map(|s| s.figures.pushes).sum::<u64>(),
        b.servers.iter().map(|s| s.figures.pushes).sum::<u64>(),
        "pushes count once, at the chain's head"
    );
    // Negative control: a replicated run that drops worker 1's pushes does not compare equal.
    let faulty = run_local(&PsJob {
        fault: ServerFault::DropPushOf(1),
        ..two
    });
    let d = max_diff(faulty.dense_params(), a.dense_params());
    assert_caught("a dropped worker, replicated", d.into(), TOLERANCE.into(), MARGIN);
}

fn sparse_spec(features: u64) -> CtrSpec {
    CtrSpec {
        seed: 11,
        features,
        draws: 20,
        support: 50,
    }
}

fn sparse_job(
    consistency: Consistency,
    spec: CtrSpec,
    optimizer: OptimizerSpec,
    l1: f32,
    clocks: u64,
) -> PsJob<BuiltinUpdate> {
    PsJob {
        model: PsModel::SparseLr(spec),
        update: BuiltinUpdate::from_spec(optimizer, l1, Initializer::Zeros).unwrap(),
        servers: 2,
        workers: 3,
        replicas: 1,
        vnodes: 32,
        consistency,
        local_batch: 64,
        clocks,
        delay_ms: Vec::new(),
        checkpoint_dir: None,
        resume: None,
        log_clocks: true,
        key_caching: true,
        filter: None,
        fault: ServerFault::None,
        fail_at: None,
    }
}

/// The most clocks any granted pull was ahead of the slowest worker, from the servers' logs.
fn lead_from_logs(ps: &PsOutcome) -> u64 {
    ps.servers
        .iter()
        .flat_map(|s| &s.log)
        .filter_map(|e| match e {
            ClockEvent::Granted { clock, pushed, .. } => Some(clock - pushed.iter().min().unwrap()),
            ClockEvent::Applied { .. } => None,
        })
        .max()
        .unwrap_or(0)
}

/// Whether no worker was ever more than `k` clocks ahead of the slowest, in the logs.
fn check_bound(ps: &PsOutcome, k: u64) -> Result<(), String> {
    let lead = lead_from_logs(ps);
    if lead <= k {
        Ok(())
    } else {
        Err(format!(
            "a worker started {lead} clocks ahead of the slowest (bound {k})"
        ))
    }
}

#[test]
fn no_worker_runs_more_than_k_ahead_of_the_slowest_and_an_eventual_run_fails_the_same_check() {
    let spec = sparse_spec(10_000);
    let slow = vec![0, 0, 15];
    for k in [0u64, 2] {
        let job = PsJob {
            delay_ms: slow.clone(),
            ..sparse_job(
                Consistency::with_staleness(Some(k)),
                spec,
                OptimizerSpec::sgd(1.0),
                0.0,
                12,
            )
        };
        let ps = run_local(&job);
        let lead = lead_from_logs(&ps);
        let refused: u64 = ps.servers.iter().map(|s| s.figures.refused).sum();
        println!(
            "K = {k}: largest lead {lead}, pulls refused {refused}, applied clocks {:?}",
            ps.servers.iter().map(|s| s.figures.applied).collect::<Vec<_>>()
        );
        check_bound(&ps, k).unwrap();
        // The fast workers got as far ahead as the bound allows (so the bound was tested) and
        // were held there.
        assert_eq!(lead, k);
        assert!(refused > 0);
        assert_eq!(ps.max_lead(), k);
        // Every clock was applied once the slowest worker pushed it.
        for event in ps.servers.iter().flat_map(|s| &s.log) {
            if let ClockEvent::Applied { clock, pushed } = event {
                assert_eq!(clock + 1, *pushed.iter().min().unwrap(), "{event:?}");
            }
        }
    }
    // Negative control: without a bound the fast workers run away, and the check says so.
    let eventual = PsJob {
        delay_ms: vec![0, 0, 25],
        ..sparse_job(Consistency::Eventual, spec, OptimizerSpec::sgd(1.0), 0.0, 12)
    };
    let ps = run_local(&eventual);
    let error = check_bound(&ps, 2).unwrap_err();
    println!("eventual: {error}");
    assert!(lead_from_logs(&ps) > 2);
}

#[test]
fn sparse_logistic_regression_with_l1_converges_toward_the_known_weights() {
    let spec = sparse_spec(100_000);
    let l1 = 2e-3;
    let job = PsJob {
        local_batch: 256,
        log_clocks: false,
        key_caching: true,
        filter: None,
        ..sparse_job(
            Consistency::BoundedDelay(1),
            spec,
            OptimizerSpec::sgd(2.0),
            l1,
            60,
        )
    };
    let ps = run_local(&job);
    let FinalModel::Sparse(weights) = &ps.model else {
        panic!("a sparse model")
    };
    let summary = SparseSummary::of(&spec, weights, l1, 4000);
    let r = summary.recovery;
    println!(
        "sparse LR, {} features: objective {:.4} → {:.4} (true weights {:.4}); batch loss {:.4} → {:.4}",
        spec.features,
        summary.objective_start,
        summary.objective_end,
        summary.objective_true,
        ps.losses[0],
        ps.losses.last().unwrap()
    );
    println!(
        "support: {} keys touched, {} non-zero, {} of {} true features found, {} with the true sign",
        weights.len(),
        r.nonzero,
        r.true_found,
        r.support,
        r.sign_agree
    );
    for s in &ps.servers {
        println!("server {}: {:?}", s.figures.index, s.figures);
    }
    assert!(
        weights.len() > 10_000,
        "first touch created the keys the data reached"
    );
    assert!(
        summary.objective_end < summary.objective_start - 0.05,
        "{summary:?}"
    );
    assert!(r.true_found * 10 >= r.support * 6, "{r:?}");
    assert!(r.sign_agree * 10 >= r.true_found * 9, "{r:?}");
    assert!(r.nonzero <= 4 * r.support, "L1 keeps the model sparse: {r:?}");
}

/// Key caching (Li et al. §3.5) changes the bytes, never the model: a sparse job with it, without
/// it, and with servers that keep no list (every hashed list answered "unknown", sent again
/// whole) end on the same weights and losses, bit for bit; with it the workers send markedly
/// fewer bytes (the push goes by the hash of the list its pull sent).
#[test]
fn key_caching_cuts_the_bytes_and_changes_no_value() {
    let spec = sparse_spec(10_000);
    let job = |key_caching: bool, fault: ServerFault| PsJob {
        key_caching,
        fault,
        log_clocks: false,
        ..sparse_job(Consistency::Sequential, spec, OptimizerSpec::sgd(1.0), 0.0, 8)
    };
    let runs: Vec<(&str, PsOutcome)> = [
        ("without caching", job(false, ServerFault::None)),
        ("with caching", job(true, ServerFault::None)),
        ("servers forget", job(true, ServerFault::ForgetKeyLists)),
    ]
    .into_iter()
    .map(|(what, job)| (what, run_local(&job)))
    .collect();
    let sparse = |ps: &PsOutcome| -> Vec<(u64, u32)> {
        let FinalModel::Sparse(weights) = &ps.model else {
            panic!("a sparse model")
        };
        let mut w: Vec<(u64, u32)> = weights.iter().map(|(k, v)| (*k, v.to_bits())).collect();
        w.sort_unstable();
        w
    };
    let bytes_out = |ps: &PsOutcome| ps.workers.iter().map(|w| w.figures.bytes_out).sum::<u64>();
    for (what, ps) in &runs {
        println!(
            "{what}: workers sent {} bytes, received {}",
            bytes_out(ps),
            ps.workers.iter().map(|w| w.figures.bytes_in).sum::<u64>()
        );
        assert_eq!(sparse(ps), sparse(&runs[0].1), "{what}: weights");
        assert_eq!(ps.losses, runs[0].1.losses, "{what}: losses");
    }
    let (without, with, forgotten) = (
        bytes_out(&runs[0].1),
        bytes_out(&runs[1].1),
        bytes_out(&runs[2].1),
    );
    assert!(
        with * 10 < without * 8,
        "caching saved too little: {with} vs {without} bytes"
    );
    assert!(
        forgotten > with,
        "servers that keep nothing cost the resends: {forgotten} vs {with}"
    );
}

/// The significantly-modified filter holds small gradients back (added up, not lost): on sparse
/// logistic regression it cuts the bytes the workers push at no real loss in the held-out
/// objective; a threshold so high that nothing is ever pushed (the control) leaves the model
/// where it started, which the objective check catches.
#[test]
fn the_significance_filter_cuts_pushed_bytes_and_keeps_the_objective() {
    let spec = sparse_spec(20_000);
    let job = |filter: Option<f32>| PsJob {
        filter,
        log_clocks: false,
        local_batch: 128,
        ..sparse_job(Consistency::Sequential, spec, OptimizerSpec::sgd(2.0), 0.0, 30)
    };
    let objective = |ps: &PsOutcome| {
        let FinalModel::Sparse(weights) = &ps.model else {
            panic!("a sparse model")
        };
        SparseSummary::of(&spec, weights, 0.0, 4000)
    };
    let bytes_out = |ps: &PsOutcome| ps.workers.iter().map(|w| w.figures.bytes_out).sum::<u64>();
    let plain = run_local(&job(None));
    let (plain_objective, plain_bytes) = (objective(&plain), bytes_out(&plain));
    for threshold in [1e-3f32, 3e-3] {
        let filtered = run_local(&job(Some(threshold)));
        let (o, b) = (objective(&filtered), bytes_out(&filtered));
        println!(
            "filter {threshold}: objective {:.4} (unfiltered {:.4}, start {:.4}); workers sent {b} bytes (unfiltered {plain_bytes})",
            o.objective_end, plain_objective.objective_end, plain_objective.objective_start
        );
    }
    // A filtered push goes as its pull's key-list hash and a bit mask of the keys it keeps.
    for threshold in [1e-3f32, 3e-3] {
        let filtered = run_local(&job(Some(threshold)));
        let o = objective(&filtered);
        assert!(
            bytes_out(&filtered) * 10 < plain_bytes * 9,
            "θ {threshold}: the filter saved too little"
        );
        assert!(
            (o.objective_end - plain_objective.objective_end).abs() < 0.01,
            "θ {threshold}: filtered {o:?} vs {plain_objective:?}"
        );
    }
    let silent = objective(&run_local(&job(Some(1e9))));
    let d = (silent.objective_end - plain_objective.objective_end).abs();
    assert_caught("a filter that never pushes (objective)", d, 0.01, MARGIN);
}

/// Replaces every key's update state in server `index`'s checkpoint file with zeros.
fn zero_state(dir: &Path, index: usize, update: &BuiltinUpdate) {
    let width = 256;
    let file = read_server_file(dir, index, update.state_len(width)).unwrap();
    let mut store = KeyStore::new(width, update.state_len(width));
    let zeros = vec![0.0; update.state_len(width)];
    for (key, values, _) in file.entries() {
        store.assign(key, values, Some(&zeros), update);
    }
    std::fs::remove_file(server_path(dir, index)).unwrap();
    write_server_file(dir, index, file.applied, &store).unwrap();
}

#[test]
fn a_stopped_and_resumed_job_ends_where_an_unstopped_one_does_even_on_more_servers() {
    let mlp = "mlp:in=16,hidden=32,layers=2,out=4";
    let job = dense_job(mlp, OptimizerSpec::adam(1e-2), 2, 8, 8);
    let straight = run_local(&job);
    let dir = tempfile::tempdir().unwrap();
    let first = run_local(&PsJob {
        clocks: 4,
        checkpoint_dir: Some(dir.path().to_path_buf()),
        ..job.clone()
    });
    assert_eq!(first.losses[..], straight.losses[..4]);
    for servers in [2, 3] {
        let resumed = run_local(&PsJob {
            servers,
            clocks: 4,
            resume: Some(dir.path().to_path_buf()),
            ..job.clone()
        });
        assert_eq!(resumed.first_clock, 4);
        let d = max_diff(resumed.dense_params(), straight.dense_params());
        println!(
            "resumed on {servers} servers: params differ by {d:.2e}, losses {:?}",
            resumed.losses
        );
        assert_eq!(resumed.losses[..], straight.losses[4..], "{servers} servers");
        assert_eq!(
            resumed.dense_params(),
            straight.dense_params(),
            "{servers} servers"
        );
    }
    // Negative control: the same checkpoint with Adam's moments lost must not end there.
    for s in 0..2 {
        zero_state(dir.path(), s, &job.update);
    }
    let damaged = run_local(&PsJob {
        clocks: 4,
        resume: Some(dir.path().to_path_buf()),
        ..job.clone()
    });
    let d = max_diff(damaged.dense_params(), straight.dense_params());
    assert_caught("resumed without Adam's state", d.into(), TOLERANCE.into(), MARGIN);
}

/// Runs `archipelago ps ARGS` in this process.
fn ps_cli(args: &[&str]) -> anyhow::Result<()> {
    archipelago_controller::ps_job::cli::run_command_line(args).map(|_| ())
}

#[test]
fn the_cli_refuses_bad_input_with_the_fix_and_writes_a_report_of_trains_shape() {
    for (args, wanted) in [
        (&["--staleness", "-1"][..], "at least 0"),
        (
            &["--replicas", "3", "--servers", "2"],
            "cannot have more replicas than there are servers",
        ),
        (&["--replicas", "0"], "--replicas 0"),
        (&["--replicas", "2", "--servers", "1"], "use --replicas 1"),
        (&["--servers", "0"], "--servers 0"),
        (&["--workers", "0"], "--workers 0"),
        (&["--filter=-0.5"], "give a number ≥ 0"),
        (&["--dp", "2"], "--dp (use --workers)"),
        (
            &["--model", "sparse-lr", "--optimizer", "sgd", "--momentum", "0.9"],
            "--momentum",
        ),
        (
            &["--model", "sparse-lr", "--l1", "0.1"],
            "--optimizer sgd or adam",
        ),
        (
            &["--model", "mlp-8x1024", "--batch", "63", "--workers", "2"],
            "multiple of the workers",
        ),
    ] {
        let error = format!("{:#}", ps_cli(args).unwrap_err());
        assert!(error.contains(wanted), "{args:?}: {error}");
    }
    let dir = tempfile::tempdir().unwrap();
    let report_path = dir.path().join("sparse.json");
    let report = report_path.to_str().unwrap();
    ps_cli(&[
        "--model",
        "sparse-lr",
        "--features",
        "20000",
        "--optimizer",
        "sgd",
        "--lr",
        "2",
        "--l1",
        "0.001",
        "--steps",
        "6",
        "--servers",
        "3",
        "--workers",
        "2",
        "--staleness",
        "1",
        "--print-ring",
        "--report",
        report,
    ])
    .unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(json["steps"].as_array().unwrap().len(), 6);
    assert_eq!(json["servers"].as_array().unwrap().len(), 3);
    assert!(json["servers"][0]["pushes"].as_u64().unwrap() == 12);
    assert!(
        json["sparse"]["objective_end"].as_f64().unwrap()
            < json["sparse"]["objective_start"].as_f64().unwrap()
    );
    assert!(json["param_l2"].as_f64().unwrap() > 0.0);

    let dense_path = dir.path().join("dense.json");
    let dense = dense_path.to_str().unwrap();
    ps_cli(&[
        "--model",
        "mlp:in=16,hidden=32,layers=2,out=4",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--batch",
        "16",
        "--steps",
        "3",
        "--key-width",
        "64",
        "--report",
        dense,
    ])
    .unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&dense_path).unwrap()).unwrap();
    assert_eq!(json["block_l2"].as_array().unwrap().len(), 3);
    assert_eq!(json["steps"][2]["step"], 3);
    assert!(json["servers"][1]["bytes_in"].as_u64().unwrap() > 0);
}
