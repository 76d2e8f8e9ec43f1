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
