//! The sharded store of `programs/sharded_store.rs` on this process (4 CPU devices), or on a
//! cluster: start `archipelago controller`, two hosts of this same binary
//! (`ARCHIPELAGO_ROLE=host ARCHIPELAGO_CONTROLLER=… ARCHIPELAGO_TOKEN_FILE=…
//! ARCHIPELAGO_DEVICES=cpu:0,cpu:1`), then this binary with `ARCHIPELAGO_CONTROLLER` and
//! `ARCHIPELAGO_TOKEN_FILE`: the same results, the shards on the hosts.

use archipelago_dataflow::DeviceSpec;
use archipelago_examples::programs::sharded_store::{registry, run};

fn main() -> anyhow::Result<()> {
    let registry = registry().merge(archipelago_examples::programs::tensor_exchange::registry());
    let runtime = archipelago_controller::runtime::init(registry, DeviceSpec::cpus(4))?;
    let (outcome, _store) = run(&runtime, 1000)?;
    for (rank, ((sum, keys), (host, device))) in outcome.shards.iter().zip(&outcome.placement).enumerate() {
        println!("shard {rank} on {host} {device}: {keys} keys, sum {sum}");
    }
    let total: f64 = outcome.read_back.iter().sum();
    println!("read back {} keys, total {total}", outcome.read_back.len());
    Ok(())
}
