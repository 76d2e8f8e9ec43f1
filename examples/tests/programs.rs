//! Checks what the examples show on this process (one test binary for all of them: each binary
//! links burn again); `cluster.rs` runs the same programs on host processes of the examples'
//! binaries.

mod support {
    pub mod parameter_server;
    pub mod trial_search;
}

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

/// The map-reduce over shard actors and the producer → consumer compiled program of
/// `programs/dataflow_basics.rs`.
mod dataflow_basics {
    use archipelago_examples::programs::dataflow_basics::{producer_consumer, sharded_sum_of_squares};

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

/// The parameter server (Li et al., OSDI 2014) of `programs/parameter_server.rs`: at bounded
/// delay 0 it must train exactly as the library's data-parallel training does (the controller's
/// own compile → actors → all-reduce → flat SGD path, its final parameters read back from the
/// checkpoint it writes after the last step); a planted fault must break that comparison; at
/// bounded delay 2 no worker may start more than 2 clocks ahead of the slowest.
mod parameter_server {
    use archipelago_controller::prelude::*;
    use archipelago_examples::programs::parameter_server::{Fault, registry, run};

    use crate::support::parameter_server::{
        bounded, check_bounded_delay, config, data_parallel, max_diff, run_local,
    };

    #[test]
    fn at_bounded_delay_0_it_trains_exactly_like_data_parallel_sgd_and_faults_are_caught() {
        let synchronous = config(3, 0, Fault::None);
        let (losses, params) = data_parallel(&synchronous, 3);
        let (losses_dp1, params_dp1) = data_parallel(&synchronous, 1);
        let ps = run_local(&synchronous);
        let (d_params, d_losses) = (
            max_diff(ps.dense_params(), &params),
            max_diff(&ps.losses, &losses),
        );
        let d_dp1 = max_diff(ps.dense_params(), &params_dp1).max(max_diff(&ps.losses, &losses_dp1));
        println!("K=0 vs dp=3: params {d_params:.2e}, losses {d_losses:.2e}; vs dp=1: {d_dp1:.2e}");
        assert!(d_params <= 1e-5 && d_losses <= 1e-5, "{d_params} {d_losses}");
        assert!(d_dp1 <= 1e-5, "{d_dp1}");
        assert!(ps.losses[11] < 0.8 * ps.losses[0], "it trains: {:?}", ps.losses);
        // Lockstep: every clock computed on values holding every earlier clock.
        assert_eq!(ps.max_lead(), 0);
        assert!(
            ps.workers
                .iter()
                .flat_map(|w| &w.steps)
                .all(|s| s.applied == s.clock)
        );

        for fault in [Fault::DropPushOf(1), Fault::AveragePushes] {
            let faulty = run_local(&config(3, 0, fault));
            let d = max_diff(faulty.dense_params(), &params);
            println!("{fault:?}: params {d:.2e}");
            assert!(d > 1e-3, "{fault:?} went unnoticed: max |diff| {d}");
        }
    }

    #[test]
    fn a_failing_worker_loop_ends_the_run_with_its_error_instead_of_a_hang() {
        let failing = config(3, 0, Fault::FailAt(1, 4));
        registry().install();
        let runtime = Runtime::local(DeviceSpec::cpus(failing.devices()));
        let error = format!("{:#}", run(&runtime, &failing).unwrap_err());
        assert!(
            error.contains("worker 1's loop") && error.contains("a planted failure at clock 4"),
            "{error}"
        );
    }

    #[test]
    fn at_bounded_delay_2_fast_workers_run_ahead_of_a_slow_one_by_at_most_2_clocks() {
        check_bounded_delay(&run_local(&bounded(3)), 2);
    }
}

/// Trial search: successive halving stops the worse half at every rung and keeps training the
/// rest from their checkpoints; the power-law fit recovers a known law; a ladder trains.
mod trial_search {
    use archipelago_controller::prelude::*;
    use archipelago_examples::programs::trial_search::{
        TrainTo, fit_power_law, registry, scaling_ladder, successive_halving,
    };

    use crate::support::trial_search::{check_halving, config, learning_rates};

    #[test]
    fn successive_halving_stops_the_worse_half_at_every_rung() {
        registry().install();
        let dir = tempfile::tempdir().unwrap();
        let runtime = Runtime::local(DeviceSpec::cpus(2));
        let halving = successive_halving(&runtime, learning_rates(dir.path()), 2).unwrap();
        check_halving(&halving);
    }

    #[test]
    fn the_power_law_fit_recovers_a_known_law_and_a_ladder_scales() {
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
        // 40 steps: enough for the wider model to reach a lower loss (a fit over 3 steps gave
        // either sign).
        let (results, law) = scaling_ladder(&runtime, ladder, 40).unwrap();
        assert!(results[0].params < results[1].params);
        assert!(results[1].tail_loss < results[0].tail_loss, "{results:?}");
        assert!(law.alpha > 0.0, "{law:?}");
        assert!(
            law.describe().starts_with("L(N) = (N_c / N)^alpha: alpha "),
            "{}",
            law.describe()
        );
        // Control: losses that rise with size give no law, only the advice.
        let inverted = fit_power_law(&[(1e3, 1.5), (1e4, 1.6), (1e5, 1.7)]);
        assert!(inverted.alpha < 0.0);
        assert!(
            inverted.describe().starts_with("no scaling seen"),
            "{}",
            inverted.describe()
        );
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
