//! The driver → A → B → driver chain of tiny calls (Ray's compiled-graph microbenchmark): as
//! two classic calls from the program (the program gets A's reply and calls B with it) and
//! recorded once as a compiled program (A's value goes to B without the program), measured in
//! alternating rounds so that both see the same load; the speedup is their ratio. Run with A
//! and B in one process, on one host process, and on two host processes (A on one, B on the
//! other: 4 network hops eager against 3 compiled).

use std::time::Instant;

use serde_json::{Value, json};

use archipelago_actors::runtime::compiled::Recorder;
use archipelago_actors::runtime::remote::Liveness;
use archipelago_actors::runtime::{ActorRef, Runtime, SpawnOptions};
use archipelago_dataflow::DeviceSpec;

use super::super::cross_process::start_peer;
use super::threads::Snapshot;
use super::{Echo, Ping, TOKEN, registry};
use crate::process_stats::load_avg;
use crate::report::median;

/// Iterations of the chain, each way (Ray's compiled-graph microbenchmark runs 10,000).
pub(super) const CHAIN_ITERATIONS: usize = 10_000;
/// Rounds the iterations are split into, classic and compiled alternating (a burst of other
/// load then hits both ways alike).
const ROUNDS: usize = 20;

/// One way of running the chain, per iteration of each round: µs of wall time, and (over all
/// the chain's processes) µs of CPU, threads scheduled in and threads moved to another CPU.
#[derive(Default)]
struct Rounds {
    wall_us: Vec<f64>,
    cpu_us: Vec<f64>,
    switches: Vec<f64>,
    migrations: Vec<f64>,
    /// Per round, each thread's times scheduled in and CPU µs per iteration.
    by_thread: Vec<std::collections::BTreeMap<String, [f64; 2]>>,
}

impl Rounds {
    /// Times `iterations` of `body` (given the iteration's number) as one round.
    fn time(
        &mut self,
        pids: &[u32],
        iterations: std::ops::Range<u64>,
        mut body: impl FnMut(u64) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let n = (iterations.end - iterations.start) as f64;
        let (t, snapshot) = (Instant::now(), Snapshot::of(pids));
        for i in iterations {
            body(i)?;
        }
        self.wall_us.push(t.elapsed().as_secs_f64() / n * 1e6);
        let later = Snapshot::of(pids);
        self.by_thread.push(later.since(&snapshot, n));
        let (before, after) = (snapshot.total(), later.total());
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / n;
        self.cpu_us.push(per(after.ns, before.ns) / 1e3);
        self.switches.push(per(after.runs, before.runs));
        self.migrations.push(per(after.migrations, before.migrations));
        Ok(())
    }

    /// Each thread's times scheduled in and CPU µs per iteration (the median round's, thread by
    /// thread).
    fn by_thread(&self) -> Value {
        let mut keys: Vec<&String> = self.by_thread.iter().flat_map(|r| r.keys()).collect();
        keys.sort();
        keys.dedup();
        let rounded = |x: f64| (x * 1000.0).round() / 1000.0;
        let thread = |key: &String| {
            let of = |i: usize| {
                let mut each: Vec<f64> = (self.by_thread.iter())
                    .map(|r| r.get(key).map_or(0.0, |f| f[i]))
                    .collect();
                rounded(median(&mut each))
            };
            let [runs, cpu_us] = [of(0), of(1)];
            (key.clone(), json!({ "scheduled_in": runs, "cpu_us": cpu_us }))
        };
        let busy = |(_, v): &(String, Value)| v["scheduled_in"] != json!(0.0);
        Value::Object(keys.into_iter().map(thread).filter(busy).collect())
    }

    /// The median round's figures: wall µs, CPU µs, switches, migrations.
    fn medians(mut self) -> [f64; 4] {
        [
            median(&mut self.wall_us),
            median(&mut self.cpu_us),
            median(&mut self.switches),
            median(&mut self.migrations),
        ]
    }
}

/// Classic calls, then the compiled program, `ROUNDS` times; `pids` are the processes of the
/// chain (this one and its hosts).
fn alternate(
    runtime: &Runtime,
    (a, b): (&ActorRef<Echo>, &ActorRef<Echo>),
    iterations: usize,
    pids: &[u32],
) -> anyhow::Result<(Rounds, Rounds)> {
    let mut recorder = Recorder::<u64>::new();
    let input = recorder.input();
    let x = recorder.call(a, &input, Ping);
    let y = recorder.call(b, &x, Ping);
    let program = recorder.compile(runtime, &y)?;
    // Warm both ways (connections made, buffers grown) before anything counts.
    for i in 0..100 {
        anyhow::ensure!(program.run(i).get()? == i, "the compiled chain lost its value");
        anyhow::ensure!(
            b.call(Ping(a.call(Ping(i)).get()?)).get()? == i,
            "the chain lost its value"
        );
    }
    let per_round = (iterations / ROUNDS).max(1) as u64;
    let (mut classic, mut compiled) = (Rounds::default(), Rounds::default());
    for round in 0..ROUNDS as u64 {
        let these = round * per_round..(round + 1) * per_round;
        classic.time(pids, these.clone(), |i| {
            let x = a.call(Ping(i)).get()?;
            anyhow::ensure!(b.call(Ping(x)).get()? == i, "the chain lost its value");
            Ok(())
        })?;
        compiled.time(pids, these, |i| {
            anyhow::ensure!(program.run(i).get()? == i, "the compiled chain lost its value");
            Ok(())
        })?;
    }
    Ok((classic, compiled))
}

/// The chain driver → `a` → `b` → driver, classic and compiled, as JSON; `hosts` are the
/// processes of `a` and `b` other than this one (for the CPU time).
pub(super) fn compiled_chain(
    runtime: &Runtime,
    (a, b): (&ActorRef<Echo>, &ActorRef<Echo>),
    iterations: usize,
    placement: &str,
    hosts: &[u32],
) -> anyhow::Result<Value> {
    let pids: Vec<u32> = std::iter::once(std::process::id())
        .chain(hosts.iter().copied())
        .collect();
    let (classic, compiled) = alternate(runtime, (a, b), iterations, &pids)?;
    let mut ratios: Vec<f64> = (classic.wall_us.iter().zip(&compiled.wall_us))
        .map(|(c, p)| c / p)
        .collect();
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = ratios.iter().copied().fold(0.0, f64::max);
    let by_thread = json!({ "classic_calls": classic.by_thread(), "compiled": compiled.by_thread() });
    let [classic_us, classic_cpu, classic_switches, classic_moves] = classic.medians();
    let [compiled_us, compiled_cpu, compiled_switches, compiled_moves] = compiled.medians();
    Ok(json!({
        "config": { "iterations": iterations, "rounds": ROUNDS, "statistic": "median round of each; classic and compiled rounds alternate (compiled_speedup: their ratio; per round: each round's classic over the compiled round right after it)", "chain": format!("driver -> A -> B -> driver, one u64, {placement}") },
        "classic_calls_us_per_iteration": classic_us,
        "compiled_us_per_iteration": compiled_us,
        "compiled_speedup": classic_us / compiled_us,
        "compiled_speedup_per_round": { "median": median(&mut ratios), "range": [lowest, highest] },
        "cpu_us_per_iteration": { "classic_calls": classic_cpu, "compiled": compiled_cpu, "of": "every thread of the chain's processes (median round)" },
        "threads_scheduled_in_per_iteration": { "classic_calls": classic_switches, "compiled": compiled_switches },
        "per_iteration_by_thread": by_thread,
        "cpu_migrations_per_iteration": { "classic_calls": classic_moves, "compiled": compiled_moves },
        "ray_2_60_same_machine_kind_us": { "compiled": 604.0, "classic": 3666.0, "note": "issue 16, 2026-11-23; another day's machine gave 241 and 1,363" },
        "load_avg": load_avg(),
    }))
}

/// The chain with A on one host process and B on another (both of this binary, each serving
/// its actor port on 127.0.0.1) and the driver here: classic, the driver's calls go to A's
/// host and back, then to B's and back (4 hops); compiled, A's host sends the value straight
/// to B's, which sends it back (3 hops: the bound is about 4/3).
///
/// A host whose connection closes while open is logged as lost, so they end in order: the
/// driver's runtime first (its connections to both), then A's host (its connection to B's),
/// then B's.
pub(super) fn across_hosts(iterations: usize) -> anyhow::Result<Value> {
    registry().install();
    let mut hosts = Vec::new();
    for name in ["bench-host-a", "bench-host-b"] {
        let args = ["bench-actor-host", "--devices", "1", "--name", name];
        hosts.push((name, start_peer(&args, "actor port ")?));
    }
    let slots = hosts
        .iter()
        .map(|(name, (_, _, addr))| archipelago_actors::runtime::Slot {
            host: name.to_string(),
            island: "bench".into(),
            addr: addr.clone(),
            device: DeviceSpec::Cpu(0),
        })
        .collect();
    let pids: Vec<u32> = hosts.iter().map(|(_, (child, _, _))| child.id()).collect();
    let measured = (|| {
        let runtime =
            Runtime::on_cluster("bench", slots, TOKEN, Liveness::default()).map_err(anyhow::Error::msg)?;
        let a = runtime.spawn_at::<Echo>(0, (), SpawnOptions::default()).get()?;
        let b = runtime.spawn_at::<Echo>(1, (), SpawnOptions::default()).get()?;
        let placement = "A on one host process, B on another (raw TCP between each pair)";
        compiled_chain(&runtime, (&a, &b), iterations, placement, &pids)
    })();
    let mut rss = Vec::new();
    for (name, (mut child, mut stdout, _)) in hosts {
        drop(child.stdin.take());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut rest)?;
        child.wait()?;
        rss.push((
            name.to_string(),
            json!(super::super::cross_process::peer_peak_rss(&rest)),
        ));
    }
    let mut out = measured?;
    out["peak_rss_bytes_host_processes"] = Value::Object(rss.into_iter().collect());
    Ok(out)
}
