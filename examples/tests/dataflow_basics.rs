//! Checks the results of the dataflow example's graphs.

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
