//! Not a training loop: a sharded map-reduce over 4 actors (eager calls) and a producer →
//! consumer loop recorded once as a compiled program, the consumer's total kept across runs; see
//! `programs/dataflow_basics.rs`.
//!
//! Run: `cargo run --example dataflow_basics`

use archipelago_examples::programs::dataflow_basics::{SHARDS, producer_consumer, sharded_sum_of_squares};

fn main() -> anyhow::Result<()> {
    let n = 1000;
    let total = sharded_sum_of_squares(n)?;
    let expected: f64 = (0..n).map(|i| (i * i) as f64).sum();
    println!("Σ i² for i < {n} over {SHARDS} shard actors = {total} (exact: {expected})");
    anyhow::ensure!(
        ((total as f64 - expected) / expected).abs() < 1e-5,
        "map-reduce result is wrong"
    );

    let totals = producer_consumer(5)?;
    for (run, total) in totals.iter().enumerate() {
        println!("run {}: consumer total {:?}", run + 1, total);
    }
    anyhow::ensure!(
        totals.last() == Some(&vec![15.0, 30.0, 45.0]),
        "producer → consumer loop is wrong"
    );
    Ok(())
}
