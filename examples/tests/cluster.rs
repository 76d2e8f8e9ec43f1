//! The examples' programs on a cluster: a controller in this test process and two host
//! processes of each example's own binary (`support/cluster.rs`), with a driver here running
//! the same program code as on this process, and the results compared with that local run.
//! The host binaries are the examples cargo builds beside the tests (`cargo test -p
//! archipelago-examples`, or `cargo build -p archipelago-examples --examples`).

mod support {
    pub mod cluster;
    pub mod parameter_server;
    pub mod trial_search;
}

/// The sharded store run by a driver against a controller and two host processes of the
/// example's own binary, beside the same program on this process.
mod actors_cluster {
    use std::time::{Duration, Instant};

    use archipelago_controller::prelude::*;
    use archipelago_controller::runtime::connect;
    use archipelago_examples::programs::sharded_store::{Busy, Get, PutVia, registry, run};
    use archipelago_examples::programs::tensor_exchange::{
        self, AskByName, HeldBytes, Holder, MakeEvery, MakeRamp, SumOf, SumOfCall, every_dtype,
    };

    use crate::support::cluster::{TOKEN, TestCluster};

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

    /// A call still pending here, passed to an actor of the other host process, resolves there
    /// (the tensor's bytes go owner → consumer, none through here, and are freed after); a
    /// detached named holder outlives this process's handles and is found by name from the
    /// other host process (which asks the controller for its peers); a released one is not.
    fn futures_and_names_between_processes(cluster: &Runtime) {
        let named = SpawnOptions::named("directory").detached();
        let owner = cluster.spawn_at::<Holder>(0, (), named).get().unwrap();
        let other = cluster
            .spawn_at::<Holder>(2, (), SpawnOptions::default())
            .get()
            .unwrap();
        assert_ne!(owner.info().host, other.info().host);
        let through_here = || cluster.link_bytes().touching(archipelago_actors::fabric::DRIVER);
        let before = through_here();
        let n = 1 << 16;
        let pending = owner.call(MakeRamp(n));
        let sum = other.call(SumOfCall(pending)).get().unwrap().unwrap();
        assert_eq!(sum, (n as f64) * (n as f64 - 1.0) / 2.0);
        assert_eq!(through_here(), before, "a tensor byte came through the driver");
        assert_eq!(eventually(0, || owner.call(HeldBytes).get().unwrap()), 0);

        let owner_host = owner.info().host.clone();
        drop(owner);
        std::thread::sleep(Duration::from_millis(300));
        let asked = other.call(AskByName("directory".into())).get().unwrap();
        assert_eq!(
            asked,
            Ok((owner_host, 0)),
            "the detached holder, found from the other host"
        );
        let temporary = SpawnOptions::named("temporary");
        drop(cluster.spawn_at::<Holder>(1, (), temporary).get().unwrap());
        let gone = eventually(1, || {
            let asked = other.call(AskByName("temporary".into())).get().unwrap();
            u64::from(asked.is_err_and(|e| e.contains("no live actor")))
        });
        assert_eq!(gone, 1, "a holder whose last handle was dropped is still found");
        let found = cluster.find::<Holder>("directory").get().unwrap();
        found.stop("done");
        found.ended().get();
    }

    #[test]
    fn the_same_program_runs_on_two_host_processes_and_a_killed_host_is_named() {
        let mut hosts = TestCluster::start("actors_cluster", &["h1", "h2"], "cpu:0,cpu:1");
        registry().merge(tensor_exchange::registry()).install();
        let local = Runtime::local(DeviceSpec::cpus(4));
        let (expected, _) = run(&local, 500).unwrap();
        let cluster = hosts.connect(4);
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
        futures_and_names_between_processes(&cluster);

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
            let addr = hosts.addr.clone();
            move || connect(&addr, TOKEN, 5).err().map(|e| e.to_string())
        });

        // SIGKILL the host of shard 3 while a call to it is pending.
        let pending = store.members()[3].call(Busy(60_000));
        std::thread::sleep(Duration::from_millis(200));
        hosts.kill(&victim);
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

/// The parameter server on two host processes of `parameter_server` (3 devices each: servers on
/// slots 0 and 1, workers on 2, 3 and 4, so workers pull and push across hosts, each worker's
/// loop calling the servers itself): at bounded delay 0 it ends on the parameters of the same
/// run on this process, and hence of the library's data-parallel SGD; at bounded delay 2 the
/// bound holds; a failing loop ends the run.
mod parameter_server {
    use archipelago_examples::programs::parameter_server::{Fault, registry, run};

    use crate::support::cluster::TestCluster;
    use crate::support::parameter_server::{
        bounded, check_bounded_delay, config, data_parallel, max_diff, run_local,
    };

    #[test]
    fn on_two_host_processes_k0_ends_where_this_process_and_data_parallel_end_and_k2_keeps_its_bound() {
        let hosts = TestCluster::start("parameter_server", &["h1", "h2"], "cpu:0,cpu:1,cpu:2");
        registry().install();
        let synchronous = config(3, 0, Fault::None);
        let local = run_local(&synchronous);
        let (losses_dp, params_dp) = data_parallel(&synchronous, 3);
        let cluster = hosts.connect(synchronous.devices());
        let ps = run(&cluster, &synchronous).unwrap();
        let on: Vec<&str> = ps.placement.iter().map(|(h, _)| h.as_str()).collect();
        println!("placement (servers, then workers): {on:?}");
        assert!(on.contains(&"h1") && on.contains(&"h2"), "{on:?}");
        assert!(
            (ps.placement[2..]).iter().any(|(h, _)| *h != ps.placement[0].0),
            "a worker on the other host than server 0: {on:?}"
        );
        let d_local =
            max_diff(ps.dense_params(), local.dense_params()).max(max_diff(&ps.losses, &local.losses));
        let d_dp = max_diff(ps.dense_params(), &params_dp).max(max_diff(&ps.losses, &losses_dp));
        println!("K=0 on two hosts vs this process: {d_local:.2e}; vs dp=3: {d_dp:.2e}");
        assert!(d_local <= 1e-5, "{d_local}");
        assert!(d_dp <= 1e-5, "{d_dp}");
        assert_eq!(ps.max_lead(), 0);
        assert!(
            ps.workers
                .iter()
                .flat_map(|w| &w.steps)
                .all(|s| s.applied == s.clock)
        );

        check_bounded_delay(&run(&cluster, &bounded(3)).unwrap(), 2);

        // A loop failing on a host ends the run with its error; the other workers, which would
        // wait for its clocks forever, end with the servers.
        let failing = config(3, 0, Fault::FailAt(1, 4));
        let error = format!("{:#}", run(&cluster, &failing).unwrap_err());
        assert!(
            error.contains("worker 1's loop") && error.contains("a planted failure at clock 4"),
            "{error}"
        );

        cli_on_the_hosts(&hosts);
    }

    /// `archipelago ps --controller ADDR` (its command line run in this process, as the driver)
    /// places a sparse logistic regression on the same hosts — processes of the example's binary,
    /// which registers the library's types as `archipelago ps` does — and ends exactly where the
    /// same command without `--controller` ends.
    fn cli_on_the_hosts(hosts: &TestCluster) {
        use archipelago_controller::ps_job::cli::run_command_line;
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, crate::support::cluster::TOKEN).unwrap();
        let common = [
            "--model",
            "sparse-lr",
            "--features",
            "5000",
            "--optimizer",
            "sgd",
            "--lr",
            "1",
            "--l1",
            "0.001",
            "--steps",
            "5",
            "--servers",
            "2",
            "--workers",
            "2",
            "--batch",
            "64",
            "--staleness",
            "0",
        ];
        let report = |name: &str| dir.path().join(name).display().to_string();
        let (local, remote) = (report("local.json"), report("cluster.json"));
        let mut args: Vec<&str> = common.to_vec();
        args.extend(["--report", &local]);
        let here = run_command_line(&args).unwrap();
        let token = token.display().to_string();
        let mut args: Vec<&str> = common.to_vec();
        args.extend([
            "--controller",
            &hosts.addr,
            "--token-file",
            &token,
            "--report",
            &remote,
        ]);
        let there = run_command_line(&args).unwrap();
        println!(
            "archipelago ps: param_l2 {} here, {} on the hosts",
            here.param_l2, there.param_l2
        );
        assert!(std::path::Path::new(&local).exists() && std::path::Path::new(&remote).exists());
        assert_eq!(there.steps.len(), 5);
        let losses = |r: &archipelago_controller::ps_job::report::PsReport| {
            r.steps.iter().map(|s| s.loss).collect::<Vec<_>>()
        };
        assert_eq!(losses(&here), losses(&there));
        // Norms and objectives sum over a hash map's order: equal up to f64 rounding.
        assert!((here.param_l2 - there.param_l2).abs() <= 1e-9 * here.param_l2);
        let (a, b) = (here.sparse.unwrap(), there.sparse.unwrap());
        assert_eq!(a.recovery, b.recovery);
        assert!((a.objective_end - b.objective_end).abs() <= 1e-9);
        assert_eq!(there.servers[0].pushes, 10);
    }
}

/// Trial search on two host processes of `trial_search` (2 devices each: one trial per device)
/// picks the same winner, stops the same trials and sees the same per-rung losses as on this
/// process with the same seeds.
mod trial_search {
    use archipelago_controller::prelude::*;
    use archipelago_examples::programs::trial_search::{registry, successive_halving};

    use crate::support::cluster::TestCluster;
    use crate::support::trial_search::{check_halving, learning_rates};

    #[test]
    fn on_two_host_processes_successive_halving_picks_the_same_winner_with_the_same_losses() {
        let hosts = TestCluster::start("trial_search", &["h1", "h2"], "cpu:0,cpu:1");
        registry().install();
        let dir = tempfile::tempdir().unwrap();
        let runtime = Runtime::local(DeviceSpec::cpus(2));
        let local = successive_halving(&runtime, learning_rates(&dir.path().join("local")), 2).unwrap();
        let cluster = hosts.connect(4);
        let halving = successive_halving(&cluster, learning_rates(&dir.path().join("cluster")), 2).unwrap();
        let on: Vec<&str> = halving.placement.iter().map(|(h, _)| h.as_str()).collect();
        assert!(on.contains(&"h1") && on.contains(&"h2"), "{on:?}");
        check_halving(&halving);
        assert_eq!(halving.best.name, local.best.name);
        assert_eq!(halving.stopped, local.stopped);
        for (k, (remote, here)) in halving.rungs.iter().zip(&local.rungs).enumerate() {
            assert_eq!(remote.len(), here.len(), "rung {k}");
            for (a, b) in remote.iter().zip(here) {
                assert_eq!(
                    (&a.name, a.steps, a.params),
                    (&b.name, b.steps, b.params),
                    "rung {k}"
                );
                assert!(
                    (a.loss - b.loss).abs() <= 1e-6,
                    "rung {k}, {}: {} vs {}",
                    a.name,
                    a.loss,
                    b.loss
                );
            }
        }
    }
}
