//! Checks what the examples show (one test binary for all of them: each binary links burn again).

mod actors_basics {
    #[test]
    fn the_actors_example_sums_projections_moves_bytes_directly_and_restarts() {
        let outcome = archipelago_examples::programs::actors_basics::run(8, 32, 16).unwrap();
        assert_eq!(outcome.sum.len(), 8 * 16);
        for (a, b) in outcome.sum.iter().zip(&outcome.expected) {
            assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} vs {b}");
        }
        assert_eq!(outcome.bytes_to_reducer, [8 * 16 * 4, 8 * 16 * 4]);
        assert_eq!(outcome.bytes_through_program, 0);
        for part in [
            "Flaky",
            "\"flaky\"",
            "cpu:3",
            "Risky",
            "the third call of its first life",
        ] {
            assert!(
                outcome.error.contains(part),
                "`{part}` missing from: {}",
                outcome.error
            );
        }
        assert_eq!(outcome.after_restart, (1, 1));
    }
}

mod dataflow_basics {

    use archipelago_examples::{producer_consumer, sharded_sum_of_squares};

    #[test]
    fn sharded_map_reduce_sums_squares_exactly() {
        let total = sharded_sum_of_squares(400).unwrap();
        let expected: f64 = (0..400).map(|i| (i * i) as f64).sum();
        assert!(
            ((total as f64 - expected) / expected).abs() < 1e-6,
            "{total} vs {expected}"
        );
    }

    #[test]
    fn producer_consumer_loop_accumulates_every_run() {
        let totals = producer_consumer(4).unwrap();
        let expected: Vec<Vec<f32>> = (1..=4)
            .map(|k: i32| {
                let s = (k * (k + 1) / 2) as f32;
                vec![s, 2.0 * s, 3.0 * s]
            })
            .collect();
        assert_eq!(totals, expected);
    }
}

/// The sharded store run by a driver against a controller and two host processes of the
/// example's own binary, beside the same program on this process.
mod actors_cluster {
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use archipelago_controller::cluster::service::{ClusterConfig, serve_controller};
    use archipelago_controller::prelude::*;
    use archipelago_controller::runtime::{
        CONTROLLER_ENV, DEVICES_ENV, HOST_NAME_ENV, ISLAND_ENV, ROLE_ENV, TOKEN_FILE_ENV, connect,
    };
    use archipelago_examples::programs::sharded_store::{Busy, Get, PutVia, registry, run};
    use archipelago_examples::programs::tensor_exchange::{
        self, HeldBytes, Holder, MakeEvery, MakeRamp, SumOf, every_dtype,
    };

    /// Waits (up to 5 s) until `probe` gives `want`; returns the last value.
    fn eventually(want: u64, probe: impl Fn() -> u64) -> u64 {
        let started = Instant::now();
        loop {
            let got = probe();
            if got == want || started.elapsed() > Duration::from_secs(5) {
                return got;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every dtype round-trips exactly between processes; a reference handed to an actor of the
    /// other host moves owner → consumer (not through this process) and is freed on the owner
    /// once both drop it; a reference whose owner ended says so.
    fn tensors_between_processes(cluster: &Runtime) {
        let owner = cluster
            .spawn_at::<Holder>(0, (), SpawnOptions::default())
            .get()
            .unwrap();
        let other = cluster
            .spawn_at::<Holder>(2, (), SpawnOptions::default())
            .get()
            .unwrap();
        assert_ne!(owner.info().host, other.info().host);
        let refs = owner.call(MakeEvery).get().unwrap();
        let mut fetched = 0;
        for (r, expected) in refs.iter().zip(every_dtype()) {
            let got = cluster.fetch(r).get().unwrap();
            assert_eq!((got.dtype(), got.shape()), (expected.dtype(), expected.shape()));
            assert_eq!(
                got.bytes(),
                expected.bytes(),
                "{} changed on the way",
                expected.dtype()
            );
            fetched += got.byte_len() as u64;
        }
        drop(refs);
        let n = 1 << 16;
        let ramp = owner.call(MakeRamp(n)).get().unwrap();
        let sum = other.call(SumOf(ramp.clone())).get().unwrap().unwrap();
        assert_eq!(sum, (n as f64) * (n as f64 - 1.0) / 2.0);
        let through_here = cluster.link_bytes().touching(archipelago_actors::fabric::DRIVER);
        assert_eq!(
            through_here, fetched,
            "only the explicit fetches reached this process"
        );
        assert_eq!(owner.call(HeldBytes).get().unwrap(), 4 * n as u64);
        // A reference passed back to an actor on its owner's own host, used and dropped there
        // while this process still holds it: the owner must keep the tensor (the two changes
        // travel on different connections and may arrive in either order).
        let neighbour = cluster
            .spawn_at::<Holder>(1, (), SpawnOptions::default())
            .get()
            .unwrap();
        assert_eq!(neighbour.info().host, owner.info().host);
        for _ in 0..50 {
            let small = owner.call(MakeRamp(8)).get().unwrap();
            assert_eq!(neighbour.call(SumOf(small.clone())).get().unwrap().unwrap(), 28.0);
            let again = cluster
                .fetch(&small)
                .get()
                .expect("the owner freed a tensor still referenced");
            assert_eq!(again.elements(), 8);
        }
        drop(ramp);
        assert_eq!(eventually(0, || owner.call(HeldBytes).get().unwrap()), 0);
        let orphan = owner.call(MakeRamp(4)).get().unwrap();
        owner.stop("its work is done");
        owner.ended().get();
        let error = cluster.fetch(&orphan).get().unwrap_err().to_string();
        assert!(error.contains("its work is done"), "{error}");
    }

    /// The example's binary (cargo builds examples beside the tests).
    fn example_binary() -> PathBuf {
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().unwrap().parent().unwrap();
        profile_dir.join("examples").join("actors_cluster")
    }

    struct Hosts(Vec<Child>);

    impl Drop for Hosts {
        fn drop(&mut self) {
            for child in &mut self.0 {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    #[test]
    fn the_same_program_runs_on_two_host_processes_and_a_killed_host_is_named() {
        let binary = example_binary();
        assert!(binary.exists(), "{} is built by `cargo test`", binary.display());
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, "cluster-secret").unwrap();
        let controller = tokio::runtime::Runtime::new().unwrap();
        let config = ClusterConfig {
            host_timeout: Duration::from_secs(2),
            wait_for_hosts: Duration::from_secs(6),
            dashboard: None,
        };
        let (addr, _registry) = controller
            .block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                serve_controller(listener, "cluster-secret", config)
            })
            .unwrap();
        let host = |name: &str| {
            Command::new(&binary)
                .env(ROLE_ENV, "host")
                .env(CONTROLLER_ENV, addr.to_string())
                .env(TOKEN_FILE_ENV, &token_file)
                .env(DEVICES_ENV, "cpu:0,cpu:1")
                .env(HOST_NAME_ENV, name)
                .env(ISLAND_ENV, "island-a")
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        };
        let mut hosts = Hosts(vec![host("h1"), host("h2")]);

        registry().merge(tensor_exchange::registry()).install();
        let local = Runtime::local(DeviceSpec::cpus(4));
        let (expected, _) = run(&local, 500).unwrap();
        let cluster = connect(&addr.to_string(), "cluster-secret", 4).unwrap();
        let (outcome, store) = run(&cluster, 500).unwrap();
        assert_eq!(outcome.shards, expected.shards);
        assert_eq!(outcome.read_back, expected.read_back);
        // Hosts in registration order, each host's devices side by side.
        let hosts_used: Vec<&str> = outcome.placement.iter().map(|(h, _)| h.as_str()).collect();
        assert!(
            hosts_used == ["h1", "h1", "h2", "h2"] || hosts_used == ["h2", "h2", "h1", "h1"],
            "{hosts_used:?}"
        );
        let victim = hosts_used[3].to_string();

        tensors_between_processes(&cluster);

        // An actor reference in a message: shard 0 (one host) puts a key into shard 3 (the
        // other host) by calling it itself.
        let via = store.members()[0]
            .call(PutVia {
                to: store.members()[3].clone(),
                key: 4 * 1000 + 3,
                value: 2.5,
            })
            .get()
            .unwrap()
            .unwrap();
        let (from, to) = (&outcome.placement[0].0, &outcome.placement[3].0);
        assert_eq!(via, format!("{from} → {to}"));
        assert_ne!(from, to);
        assert_eq!(
            store.members()[3].call(Get(4 * 1000 + 3)).get().unwrap(),
            Some(2.5)
        );

        // A mesh larger than the cluster is refused once the wait for hosts has passed.
        let too_big = std::thread::spawn({
            let addr = addr.to_string();
            move || connect(&addr, "cluster-secret", 5).err().map(|e| e.to_string())
        });

        // SIGKILL the host of shard 3 while a call to it is pending.
        let pending = store.members()[3].call(Busy(60_000));
        std::thread::sleep(Duration::from_millis(200));
        hosts.0[if victim == "h1" { 0 } else { 1 }].kill().unwrap();
        let killed = Instant::now();
        let error = pending.get().unwrap_err().to_string();
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "named after {:?}",
            killed.elapsed()
        );
        assert!(
            error.contains(&format!("host {victim}")) && error.contains("was lost"),
            "{error}"
        );
        assert!(error.contains("Shard") && error.contains("cpu:1"), "{error}");
        // The other host's shards still answer.
        assert_eq!(store.members()[0].call(Get(0)).get().unwrap(), Some(0.0));

        let too_big = too_big.join().unwrap().expect("5 devices are refused");
        assert!(
            too_big.contains("needs 5 devices") && too_big.contains("offer"),
            "{too_big}"
        );
    }
}

/// The parameter server (Li et al., OSDI 2014) of `programs/parameter_server.rs`: at bounded
/// delay 0 it must train exactly as the library's data-parallel training does (the controller's
/// own compile → actors → all-reduce → flat SGD path, its final parameters read back from the
/// checkpoint it writes after the last step); a planted fault must break that comparison; at
/// bounded delay 2 no worker may start more than 2 clocks ahead of the slowest.
mod parameter_server {
    use archipelago_actors::checkpoint::{CheckpointReader, step_dir};
    use archipelago_controller::prelude::*;
    use archipelago_controller::{Controller, TrainOptions};
    use archipelago_dataflow::{ModelSpec, OptimizerSpec, ParallelPlan, Program};
    use archipelago_examples::programs::parameter_server::{ClockEvent, Fault, Outcome, PsConfig, run};

    fn config(workers: usize, staleness: u64, fault: Fault) -> PsConfig {
        PsConfig {
            model: ModelSpec::parse("mlp:in=16,hidden=32,layers=2,out=4").unwrap(),
            seed: 7,
            optimizer: OptimizerSpec::Sgd { lr: 0.5 },
            servers: 2,
            workers,
            local_batch: 8,
            clocks: 12,
            staleness,
            delay_ms: Vec::new(),
            fault,
        }
    }

    fn run_local(config: &PsConfig) -> Outcome {
        let runtime = Runtime::local(DeviceSpec::cpus(config.devices()));
        run(&runtime, config).unwrap()
    }

    /// `Controller::train` of the same model, seed, data, SGD and global batch at data
    /// parallelism `dp`: each step's loss, and the final flat parameters (block after block).
    fn data_parallel(config: &PsConfig, dp: usize) -> (Vec<f32>, Vec<f32>) {
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

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn at_bounded_delay_0_it_trains_exactly_like_data_parallel_sgd_and_faults_are_caught() {
        let synchronous = config(3, 0, Fault::None);
        let (losses, params) = data_parallel(&synchronous, 3);
        let (losses_dp1, params_dp1) = data_parallel(&synchronous, 1);
        let ps = run_local(&synchronous);
        let (d_params, d_losses) = (max_diff(&ps.params, &params), max_diff(&ps.losses, &losses));
        let d_dp1 = max_diff(&ps.params, &params_dp1).max(max_diff(&ps.losses, &losses_dp1));
        println!("K=0 vs dp=3: params {d_params:.2e}, losses {d_losses:.2e}; vs dp=1: {d_dp1:.2e}");
        assert!(d_params <= 1e-5 && d_losses <= 1e-5, "{d_params} {d_losses}");
        assert!(d_dp1 <= 1e-5, "{d_dp1}");
        assert!(ps.losses[11] < 0.8 * ps.losses[0], "it trains: {:?}", ps.losses);
        // Lockstep: every clock computed on values holding every earlier clock.
        assert_eq!(ps.max_lead(), 0);
        assert!(ps.workers.iter().flatten().all(|s| s.applied == s.clock));

        for fault in [Fault::DropPushOf(1), Fault::AveragePushes] {
            let faulty = run_local(&config(3, 0, fault));
            let d = max_diff(&faulty.params, &params);
            println!("{fault:?}: params {d:.2e}");
            assert!(d > 1e-3, "{fault:?} went unnoticed: max |diff| {d}");
        }
    }

    #[test]
    fn at_bounded_delay_2_fast_workers_run_ahead_of_a_slow_one_by_at_most_2_clocks() {
        let bounded = PsConfig {
            delay_ms: vec![0, 0, 15],
            ..config(3, 2, Fault::None)
        };
        let ps = run_local(&bounded);
        for event in ps.logs.iter().flatten() {
            match event {
                ClockEvent::Granted { clock, pushed, .. } => {
                    assert!(*clock <= pushed.iter().min().unwrap() + 2, "{event:?}");
                }
                // A clock is applied as soon as the slowest worker has pushed it.
                ClockEvent::Applied { clock, pushed } => {
                    assert_eq!(*clock + 1, *pushed.iter().min().unwrap(), "{event:?}");
                }
            }
        }
        // The fast workers did get ahead (so the bound was tested), as far as it allows.
        assert_eq!(ps.max_lead(), 2);
        for step in ps.workers.iter().flatten() {
            assert!(step.clock - step.applied <= 2, "{step:?}");
        }
        assert!(ps.workers[0].iter().any(|s| s.clock - s.applied == 2));
        // ... and were held back there: the servers enforced the bound.
        assert!(ps.workers[0].iter().any(|s| s.refused > 0));
        assert!(
            ps.losses[11] < 0.8 * ps.losses[0],
            "it still trains: {:?}",
            ps.losses
        );
    }
}

/// Trial search: successive halving stops the worse half at every rung and keeps training the
/// rest from their checkpoints; the power-law fit recovers a known law; a ladder trains.
mod trial_search {
    use archipelago_controller::prelude::*;
    use archipelago_examples::programs::trial_search::{
        TrainTo, TrialConfig, fit_power_law, registry, scaling_ladder, successive_halving,
    };

    fn config(dir: &std::path::Path, name: &str, model: &str, lr: f32) -> TrialConfig {
        TrialConfig {
            name: name.into(),
            model: model.into(),
            lr,
            batch: 4,
            seed: 0,
            dir: dir.join(name),
        }
    }

    #[test]
    fn successive_halving_stops_the_worse_half_at_every_rung() {
        registry().install();
        let dir = tempfile::tempdir().unwrap();
        let runtime = Runtime::local(DeviceSpec::cpus(2));
        let model = "gpt:vocab=64,ctx=16,d=16,layers=1,heads=2";
        let configs = [1e-4f32, 3e-3, 1e-2, 3e-2]
            .iter()
            .map(|lr| config(dir.path(), &format!("lr={lr}"), model, *lr))
            .collect();
        let halving = successive_halving(&runtime, configs, 2).unwrap();
        let sizes: Vec<usize> = halving.rungs.iter().map(Vec::len).collect();
        assert_eq!(sizes, [4, 2, 1]);
        let steps: Vec<u64> = halving.rungs.iter().map(|r| r[0].steps).collect();
        assert_eq!(steps, [2, 4, 8], "survivors continue from their checkpoints");
        for (k, rung) in halving.rungs.iter().enumerate().take(2) {
            let kept: Vec<&str> = halving.rungs[k + 1].iter().map(|r| r.name.as_str()).collect();
            let worst_kept = rung
                .iter()
                .filter(|r| kept.contains(&r.name.as_str()))
                .map(|r| r.loss)
                .fold(f32::MIN, f32::max);
            let best_stopped = rung
                .iter()
                .filter(|r| !kept.contains(&r.name.as_str()))
                .map(|r| r.loss)
                .fold(f32::MAX, f32::min);
            assert!(
                worst_kept <= best_stopped,
                "rung {k}: kept {worst_kept} vs stopped {best_stopped}"
            );
        }
        assert_eq!(halving.stopped.len(), 3);
        assert_eq!(halving.best, halving.rungs[2][0]);
        assert!(halving.best.loss < halving.rungs[0].iter().map(|r| r.loss).fold(f32::MIN, f32::max));
    }

    #[test]
    fn the_power_law_fit_recovers_a_known_law_and_a_ladder_trains() {
        let points: Vec<(f64, f64)> = [1e3, 1e4, 1e5, 1e6]
            .iter()
            .map(|n: &f64| (*n, (2e8 / n).powf(0.076)))
            .collect();
        let law = fit_power_law(&points);
        assert!(
            (law.alpha - 0.076).abs() < 1e-9 && (law.n_c / 2e8 - 1.0).abs() < 1e-6,
            "{law:?}"
        );
        assert!((law.r2 - 1.0).abs() < 1e-12);
        registry().install();
        let dir = tempfile::tempdir().unwrap();
        let runtime = Runtime::local(DeviceSpec::cpus(2));
        let ladder = [8, 32]
            .iter()
            .map(|d| {
                config(
                    dir.path(),
                    &format!("d={d}"),
                    &format!("gpt:vocab=64,ctx=16,d={d},layers=1,heads=2"),
                    3e-3,
                )
            })
            .collect();
        let (results, law) = scaling_ladder(&runtime, ladder, 3).unwrap();
        assert!(results[0].params < results[1].params);
        assert!(law.alpha.is_finite() && law.r2.is_finite(), "{law:?}");
        // A trial that cannot build its model is refused at spawn, with the reason.
        let bad = config(dir.path(), "bad", "transformer-xl", 1e-3);
        let error = runtime
            .spawn::<archipelago_examples::programs::trial_search::Trial>(DeviceSpec::Cpu(0), bad)
            .get()
            .unwrap_err();
        assert!(error.to_string().contains("could not start"), "{error}");
        let _ = TrainTo(0);
    }
}
