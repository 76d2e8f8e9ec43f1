//! The README's `Counter` example ("The runtime API"), made to run unchanged on this process or
//! on a cluster. Two things differ from the snippet as the README had it, each because it could
//! not run on a cluster: `Add` derives serde's traits (a message crosses processes as bincode),
//! and the program registers the actor and its message and starts with
//! `archipelago_controller::runtime::init` (which reads the role from the environment) instead
//! of `Runtime::local`. On a cluster `spawn_with(DeviceSpec::Cpu(1), …)` places the counter on
//! a CPU device of some host (spread across hosts); on this process, on `cpu:1` itself.
//!
//! Prints `13` in every role that returns.

use archipelago_controller::prelude::*;

struct Counter {
    total: i64,
}
impl Actor for Counter {
    type Params = i64; // cloned for every restart
    async fn new(start: i64, _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Counter { total: start })
    }
}
#[derive(serde::Serialize, serde::Deserialize)]
struct Add(i64);
impl Message for Add {
    type Reply = i64;
}
impl Handler<Add> for Counter {
    async fn handle(&mut self, Add(n): Add, _ctx: &Context<Self>) -> i64 {
        self.total += n;
        self.total
    }
}

fn main() -> anyhow::Result<()> {
    let registry = Registry::new().actor::<Counter>().handles::<Counter, Add>();
    let runtime = archipelago_controller::runtime::init(registry, DeviceSpec::cpus(2))?;
    let options = SpawnOptions::named("counter").restarts(3);
    let counter = runtime
        .spawn_with::<Counter>(DeviceSpec::Cpu(1), 10, options)
        .get()?;
    counter.cast(Add(1))?; // no reply
    let reply = counter.call(Add(2)).timeout(std::time::Duration::from_secs(1)); // a future
    println!("{}", reply.get()?); // 13 (or .await it)
    Ok(())
}
