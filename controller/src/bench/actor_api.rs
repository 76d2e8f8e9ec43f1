//! The runtime API's own cost: Ray's and Monarch's actor microbenchmarks (WORKLOADS.md) run
//! through typed actor calls — one caller → one actor synchronous and with 1000 calls in
//! flight, one caller → 8 actors, a 64 MiB tensor argument — in one process and between two
//! processes (the other one a host serving its actor port), each beside the raw fabric's round
//! trips measured in the same run, so the API's overhead is a ratio; and the driver → A → B →
//! driver chain, classic against compiled (`chain.rs`), in one process, on one host process and
//! with A and B on two host processes.

use std::io::Write;
use std::time::Instant;

use clap::Args;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use archipelago_actors::runtime::remote::{ActorPort, Liveness, serve_actor_port};
use archipelago_actors::runtime::{
    Actor, ActorRef, Context, Handler, Message, Registry, Runtime, Slot, SpawnOptions, TensorRef,
};
use archipelago_actors::typed_tensor::{DType, TypedTensor};
use archipelago_dataflow::DeviceSpec;

use super::cross_process::{IN_FLIGHT_ROUNDS, peer_peak_rss, start_peer};
use chain::{CHAIN_ITERATIONS, compiled_chain};

mod chain;
mod threads;
use crate::process_stats::load_avg;
use crate::report::median;

const IN_FLIGHT: usize = 1000;
const FAN_OUT: usize = 8;
const TENSOR_BYTES: usize = 64 << 20;
const TOKEN: &str = "bench-actor-api";

/// Answers pings and takes tensors.
struct Echo;

impl Actor for Echo {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Echo)
    }
}

#[derive(Serialize, Deserialize)]
struct Ping(u64);
impl Message for Ping {
    type Reply = u64;
}
impl Handler<Ping> for Echo {
    async fn handle(&mut self, Ping(n): Ping, _ctx: &Context<Self>) -> u64 {
        n
    }
}

/// A tensor argument: fetched from its owner by the callee (in one process: the shared buffer).
#[derive(Serialize, Deserialize)]
struct Take(TensorRef);
impl Message for Take {
    type Reply = Result<usize, String>;
}
impl Handler<Take> for Echo {
    async fn handle(&mut self, Take(t): Take, ctx: &Context<Self>) -> Result<usize, String> {
        Ok(ctx.fetch(&t).await.map_err(|e| e.to_string())?.byte_len())
    }
}

fn registry() -> Registry {
    Registry::new()
        .actor::<Echo>()
        .handles::<Echo, Ping>()
        .handles::<Echo, Take>()
        .compiled::<Echo, Ping, u64>(Ping)
}

/// Flags of the hidden `bench-actor-host` subcommand (the other process of the benchmark).
#[derive(Debug, Clone, Args)]
pub struct ActorHostArgs {
    /// Devices (one per callee, plus one).
    #[arg(long, default_value_t = 1 + FAN_OUT)]
    pub devices: usize,
    /// The host's name (in the actors' identities and errors).
    #[arg(long, default_value = "bench-host")]
    pub name: String,
}

/// Serves the bench's actors on an actor port until standard input closes.
pub fn host_main(args: &ActorHostArgs) -> anyhow::Result<()> {
    registry().install();
    let runtime = Runtime::new("bench", &args.name, DeviceSpec::cpus(args.devices));
    let handle = runtime.handle().clone();
    let port = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        serve_actor_port(listener, handle, TOKEN)
    })?;
    println!("actor port {}", port.addr);
    std::io::stdout().flush()?;
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest)?;
    println!("peer peak_rss_bytes {}", crate::process_stats::peak_rss_bytes());
    Ok(())
}

struct Figures {
    sync_s: f64,
    pipelined_s: f64,
    fan_out_s: f64,
    /// The same 1000 in flight to one actor, awaited as one list (`Runtime::wait`, Ray's
    /// `ray.get(list)`) instead of one `get` after another.
    pipelined_wait_all_s: f64,
    tensor_s: f64,
}

/// Runs the four measurements against `echo` and `callees` from this thread.
fn measure(
    runtime: &Runtime,
    echo: &ActorRef<Echo>,
    callees: &[ActorRef<Echo>],
    round_trips: usize,
    batches: usize,
) -> anyhow::Result<Figures> {
    for i in 0..100 {
        echo.call(Ping(i)).get()?;
    }
    let t = Instant::now();
    for i in 0..round_trips as u64 {
        echo.call(Ping(i)).get()?;
    }
    let sync_s = t.elapsed().as_secs_f64();
    let in_flight = |targets: &[ActorRef<Echo>]| -> anyhow::Result<f64> {
        let t = Instant::now();
        for _ in 0..batches {
            let calls: Vec<_> = (0..IN_FLIGHT)
                .map(|i| targets[i % targets.len()].call(Ping(i as u64)))
                .collect();
            for call in calls {
                call.get()?;
            }
        }
        Ok(t.elapsed().as_secs_f64())
    };
    // Short phases: the median of IN_FLIGHT_ROUNDS rounds, as the fabric's figure beside it.
    let mut rounds = (0..IN_FLIGHT_ROUNDS)
        .map(|_| in_flight(std::slice::from_ref(echo)))
        .collect::<anyhow::Result<Vec<f64>>>()?;
    let pipelined_s = median(&mut rounds);
    let fan_out_s = in_flight(callees)?;
    let mut rounds = Vec::with_capacity(IN_FLIGHT_ROUNDS);
    for _ in 0..IN_FLIGHT_ROUNDS {
        let t = Instant::now();
        for _ in 0..batches {
            let calls: Vec<_> = (0..IN_FLIGHT).map(|i| echo.call(Ping(i as u64))).collect();
            let waited = runtime.wait(calls, IN_FLIGHT, None);
            anyhow::ensure!(waited.pending.is_empty(), "calls left pending");
            for (_, result) in waited.ready {
                result?;
            }
        }
        rounds.push(t.elapsed().as_secs_f64());
    }
    let pipelined_wait_all_s = median(&mut rounds);
    let tensor = runtime.put(TypedTensor::zeros(DType::F32, vec![TENSOR_BYTES / 4])?);
    echo.call(Take(tensor.clone()))
        .get()?
        .map_err(anyhow::Error::msg)?;
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        let bytes = echo
            .call(Take(tensor.clone()))
            .get()?
            .map_err(anyhow::Error::msg)?;
        anyhow::ensure!(bytes == TENSOR_BYTES, "the callee got {bytes} bytes");
    }
    let tensor_s = t.elapsed().as_secs_f64() / reps as f64;
    Ok(Figures {
        sync_s,
        pipelined_s,
        fan_out_s,
        pipelined_wait_all_s,
        tensor_s,
    })
}

fn figures_json(
    f: &Figures,
    round_trips: usize,
    batches: usize,
    fabric_round_trips: &Value,
    transport: &str,
) -> Value {
    let pipelined = (batches * IN_FLIGHT) as f64;
    let sync_per_s = round_trips as f64 / f.sync_s;
    let ratio = |api: f64, key: &str| {
        fabric_round_trips
            .get(key)
            .and_then(Value::as_f64)
            .map(|f| api / f)
    };
    json!({
        "config": { "transport": transport, "payload": "one u64", "sync_calls": round_trips, "in_flight": IN_FLIGHT, "pipelined_calls": pipelined, "pipelined_rounds": IN_FLIGHT_ROUNDS, "pipelined_statistic": "median round (one caller and wait-all)", "fan_out_callees": FAN_OUT, "tensor_bytes": TENSOR_BYTES, "caller": "the program's thread (Call::get)", "callees": "one actor per device thread", "tensor": "the program puts it, the callee fetches it from the program's store" },
        "sync_calls_per_s": sync_per_s,
        "sync_latency_us": f.sync_s / round_trips as f64 * 1e6,
        "in_flight_1000_calls_per_s": pipelined / f.pipelined_s,
        "in_flight_1000_wait_all_calls_per_s": pipelined / f.pipelined_wait_all_s,
        "one_caller_8_actors_in_flight_1000_calls_per_s": pipelined / f.fan_out_s,
        "tensor_64mib_argument_gb_per_s": TENSOR_BYTES as f64 / f.tensor_s / 1e9,
        "ratio_to_fabric": {
            "sync": ratio(sync_per_s, "sync_per_s"),
            "in_flight_1000": ratio(pipelined / f.pipelined_s, "in_flight_1000_per_s"),
            "in_flight_1000_wait_all": ratio(pipelined / f.pipelined_wait_all_s, "in_flight_1000_per_s"),
            "one_caller_8": ratio(pipelined / f.fan_out_s, "one_caller_8_actors_in_flight_1000_per_s"),
        },
        "load_avg": load_avg(),
    })
}

/// Actor-call figures in one process; `fabric_round_trips` is the in-process fabric's
/// `round_trips` object from the same run (for the ratios).
pub fn in_process(round_trips: usize, batches: usize, fabric_round_trips: &Value) -> anyhow::Result<Value> {
    registry().install();
    let runtime = Runtime::local(DeviceSpec::cpus(1 + FAN_OUT));
    let echo = runtime.spawn::<Echo>(DeviceSpec::Cpu(0), ()).get()?;
    let callees = (1..=FAN_OUT as u32)
        .map(|d| runtime.spawn::<Echo>(DeviceSpec::Cpu(d), ()).get())
        .collect::<Result<Vec<_>, _>>()?;
    let figures = measure(&runtime, &echo, &callees, round_trips, batches)?;
    let mut out = figures_json(&figures, round_trips, batches, fabric_round_trips, "in_process");
    let placement = "A and B on two device threads of this process";
    out["compiled_chain"] = compiled_chain(&runtime, (&echo, &callees[0]), CHAIN_ITERATIONS, placement, &[])?;
    Ok(out)
}

/// The same between this process (the driver) and a host process of this binary over its
/// actor port on 127.0.0.1; `fabric_round_trips` is the raw-TCP fabric's between 2 processes.
///
/// Each process holds a connection to the other's actor port (the host fetches the program's
/// tensor from this process's), and a connection whose far end goes away while it is open is a
/// lost host, logged as an error. So the two end in order: this process's runtime (and its
/// connection to the host) first, then the host process (and its connection to this process's
/// port, which runs on an executor of its own), then that port.
pub fn between_processes(
    round_trips: usize,
    batches: usize,
    fabric_round_trips: &Value,
) -> anyhow::Result<Value> {
    registry().install();
    let (mut child, mut stdout, addr) = start_peer(&["bench-actor-host"], "actor port ")?;
    let port_executor = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("bench-actor-port")
        .enable_all()
        .build()?;
    let measured = drive_host(&addr, child.id(), port_executor.handle(), round_trips, batches);
    drop(child.stdin.take());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest)?;
    child.wait()?;
    let (figures, chain, port) = measured?;
    drop(port);
    drop(port_executor);
    let mut out = figures_json(
        &figures,
        round_trips,
        batches,
        fabric_round_trips,
        "actor_port_tcp_2_processes",
    );
    out["peak_rss_bytes_host_process"] = json!(peer_peak_rss(&rest));
    out["compiled_chain"] = chain;
    out["compiled_chain_across_hosts"] = chain::across_hosts(CHAIN_ITERATIONS)?;
    Ok(out)
}

/// Measures against the host at `addr` from a runtime on its devices, with the program's own
/// tensors served from an actor port of this process on `port_executor` (returned open). The
/// runtime, with its connection to the host, is shut down on return.
fn drive_host(
    addr: &str,
    host_pid: u32,
    port_executor: &tokio::runtime::Handle,
    round_trips: usize,
    batches: usize,
) -> anyhow::Result<(Figures, Value, ActorPort)> {
    let slots = DeviceSpec::cpus(1 + FAN_OUT)
        .into_iter()
        .map(|device| Slot {
            host: "bench-host".into(),
            island: "bench".into(),
            addr: addr.to_string(),
            device,
        })
        .collect();
    let runtime =
        Runtime::on_cluster("bench", slots, TOKEN, Liveness::default()).map_err(anyhow::Error::msg)?;
    let handle = runtime.handle().clone();
    let port = port_executor.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        serve_actor_port(listener, handle, TOKEN)
    })?;
    let echo = runtime.spawn_at::<Echo>(0, (), SpawnOptions::default()).get()?;
    let callees = (1..=FAN_OUT)
        .map(|slot| runtime.spawn_at::<Echo>(slot, (), SpawnOptions::default()).get())
        .collect::<Result<Vec<_>, _>>()?;
    let figures = measure(&runtime, &echo, &callees, round_trips, batches)?;
    let placement = "A and B on two device threads of the other process (raw TCP to it and back)";
    let chain = compiled_chain(
        &runtime,
        (&echo, &callees[0]),
        CHAIN_ITERATIONS,
        placement,
        &[host_pid],
    )?;
    drop((echo, callees));
    drop(runtime);
    Ok((figures, chain, port))
}
