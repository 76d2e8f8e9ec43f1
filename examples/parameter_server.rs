//! The parameter server of `programs/parameter_server.rs` (Li et al., OSDI 2014), a user of the
//! library `archipelago_actors::ps`: 2 servers and 4 workers train an mlp, first with bounded
//! delay K = 0 (synchronous data parallelism), then with K = 2 and worker 3 sleeping 10 ms per
//! clock. Prints the ring, the losses and how far ahead of the slowest worker the others ran.
//! `cargo run --example parameter_server [-- K]` runs only that K.
//!
//! With no `ARCHIPELAGO_*` variable set it runs on 6 CPU devices of this process. Like
//! `actors_cluster`, the same binary also runs on a cluster: start `archipelago controller`,
//! hosts of this binary offering 6 devices in all (`ARCHIPELAGO_ROLE=host
//! ARCHIPELAGO_CONTROLLER=… ARCHIPELAGO_TOKEN_FILE=… ARCHIPELAGO_DEVICES=cpu:0,cpu:1,cpu:2`, twice),
//! then this binary with `ARCHIPELAGO_CONTROLLER` and `ARCHIPELAGO_TOKEN_FILE` set: the servers and
//! workers run on the hosts (workers call the servers host to host) and the results are the
//! same (`bash examples/multi_host.sh parameter_server` does all of it).

use archipelago_dataflow::{DeviceSpec, ModelSpec, OptimizerSpec};
use archipelago_examples::programs::parameter_server::{Fault, PsConfig, registry, run};

fn main() -> anyhow::Result<()> {
    let only: Option<u64> = std::env::args().nth(1).map(|k| k.parse()).transpose()?;
    let base = PsConfig {
        model: ModelSpec::parse("mlp:in=32,hidden=64,layers=2,out=4")?,
        seed: 7,
        optimizer: OptimizerSpec::sgd(0.5),
        servers: 2,
        workers: 4,
        local_batch: 16,
        clocks: 30,
        staleness: 0,
        delay_ms: Vec::new(),
        fault: Fault::None,
    };
    let runtime = archipelago_controller::runtime::init(registry(), DeviceSpec::cpus(base.devices()))?;
    for staleness in [0, 2].into_iter().filter(|k| only.is_none_or(|o| o == *k)) {
        let delay_ms = if staleness > 0 {
            vec![0, 0, 0, 10]
        } else {
            Vec::new()
        };
        let config = PsConfig {
            staleness,
            delay_ms,
            ..base.clone()
        };
        let outcome = run(&runtime, &config)?;
        println!(
            "K = {staleness}: {} servers, {} workers, global batch {}, {} clocks in {:.3} s",
            config.servers,
            config.workers,
            config.global_batch(),
            config.clocks,
            outcome.wall_s
        );
        print!("{}", outcome.ring.describe());
        let on: Vec<String> = (outcome.placement.iter())
            .map(|(host, device)| format!("{host} {device}"))
            .collect();
        println!("  servers, then workers, on: {}", on.join(", "));
        for (clock, loss) in outcome.losses.iter().enumerate() {
            println!("  clock {clock:>2}  loss {loss:.5}");
        }
        let refused: u32 = outcome
            .workers
            .iter()
            .flat_map(|w| &w.steps)
            .map(|s| s.refused)
            .sum();
        println!(
            "  most clocks a worker started ahead of the slowest: {} (bound {staleness}); pulls refused: {refused}",
            outcome.max_lead()
        );
        for server in &outcome.servers {
            let f = &server.figures;
            println!(
                "  server {}: {} keys, {} pushes, {} pulls, {} bytes in, {} bytes out",
                f.index, f.keys, f.pushes, f.pulls, f.bytes_in, f.bytes_out
            );
        }
    }
    Ok(())
}
