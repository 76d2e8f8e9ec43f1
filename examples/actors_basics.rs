//! Typed actors, futures passed into calls, an error and a restart: see
//! `programs/actors_basics.rs`. Run with `cargo run --example actors_basics`.

fn main() -> anyhow::Result<()> {
    let outcome = archipelago_examples::programs::actors_basics::run(64, 256, 128)?;
    let worst = outcome
        .sum
        .iter()
        .zip(&outcome.expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "sum of two projections computed by the reducer: {} values, max |diff| vs a plain loop {worst:.2e}",
        outcome.sum.len()
    );
    println!(
        "tensor bytes projector 0 → reducer {}, projector 1 → reducer {}, through this program {}",
        outcome.bytes_to_reducer[0], outcome.bytes_to_reducer[1], outcome.bytes_through_program
    );
    println!("the call that panicked failed with: {}", outcome.error);
    println!(
        "after the restart: call {} of the new life, {} restart(s)",
        outcome.after_restart.0, outcome.after_restart.1
    );
    Ok(())
}
