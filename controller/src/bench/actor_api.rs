//! The runtime API's own cost: Ray's and Monarch's actor microbenchmarks (WORKLOADS.md) run
//! through typed actor calls — one caller → one actor synchronous and with 1000 calls in
//! flight, one caller → 8 actors, a 64 MiB tensor argument — beside the raw fabric's round
//! trips between two threads measured in the same run, so the API's overhead is a ratio.

use std::time::Instant;

use serde_json::{Value, json};

use archipelago_actors::runtime::{Actor, Context, Handler, Message, Runtime};
use archipelago_actors::typed_tensor::TypedTensor;
use archipelago_dataflow::DeviceSpec;

use crate::process_stats::load_avg;

const IN_FLIGHT: usize = 1000;
const FAN_OUT: usize = 8;

/// Answers pings and takes tensors.
struct Echo;

impl Actor for Echo {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Echo)
    }
}

struct Ping(u64);
impl Message for Ping {
    type Reply = u64;
}
impl Handler<Ping> for Echo {
    async fn handle(&mut self, Ping(n): Ping, _ctx: &Context<Self>) -> u64 {
        n
    }
}

/// A tensor argument by value (in-process: the shared buffer moves, no copy).
struct Take(TypedTensor);
impl Message for Take {
    type Reply = usize;
}
impl Handler<Take> for Echo {
    async fn handle(&mut self, Take(t): Take, _ctx: &Context<Self>) -> usize {
        t.byte_len()
    }
}

/// Actor-call figures in one process; `fabric_round_trips` is the in-process fabric's
/// `round_trips` object from the same run (for the ratios).
pub fn in_process(round_trips: usize, batches: usize, fabric_round_trips: &Value) -> anyhow::Result<Value> {
    let runtime = Runtime::local(DeviceSpec::cpus(1 + FAN_OUT));
    let echo = runtime.spawn::<Echo>(DeviceSpec::Cpu(0), ()).get()?;
    for i in 0..100 {
        echo.call(Ping(i)).get()?;
    }
    let t = Instant::now();
    for i in 0..round_trips as u64 {
        echo.call(Ping(i)).get()?;
    }
    let sync_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..batches {
        let calls: Vec<_> = (0..IN_FLIGHT as u64).map(|i| echo.call(Ping(i))).collect();
        for call in calls {
            call.get()?;
        }
    }
    let pipelined_s = t.elapsed().as_secs_f64();
    let callees = (1..=FAN_OUT as u32)
        .map(|d| runtime.spawn::<Echo>(DeviceSpec::Cpu(d), ()).get())
        .collect::<Result<Vec<_>, _>>()?;
    let t = Instant::now();
    for _ in 0..batches {
        let calls: Vec<_> = (0..IN_FLIGHT)
            .map(|i| callees[i % FAN_OUT].call(Ping(i as u64)))
            .collect();
        for call in calls {
            call.get()?;
        }
    }
    let fan_out_s = t.elapsed().as_secs_f64();
    let tensor = TypedTensor::zeros(archipelago_actors::typed_tensor::DType::F32, vec![16 << 20])?;
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        echo.call(Take(tensor.clone())).get()?;
    }
    let tensor_s = t.elapsed().as_secs_f64() / reps as f64;
    let pipelined = (batches * IN_FLIGHT) as f64;
    let sync_per_s = round_trips as f64 / sync_s;
    let ratio = |api: f64, key: &str| {
        fabric_round_trips
            .get(key)
            .and_then(Value::as_f64)
            .map(|f| api / f)
    };
    Ok(json!({
        "config": { "payload": "one u64", "sync_calls": round_trips, "in_flight": IN_FLIGHT, "pipelined_calls": pipelined, "fan_out_callees": FAN_OUT, "tensor_bytes": tensor.byte_len(), "caller": "the program's thread (Call::get)", "callees": "one actor per device thread" },
        "sync_calls_per_s": sync_per_s,
        "sync_latency_us": sync_s / round_trips as f64 * 1e6,
        "in_flight_1000_calls_per_s": pipelined / pipelined_s,
        "one_caller_8_actors_in_flight_1000_calls_per_s": pipelined / fan_out_s,
        "tensor_64mib_argument_gb_per_s": tensor.byte_len() as f64 / tensor_s / 1e9,
        "tensor_note": "in one process a tensor argument moves as its shared buffer (no copy)",
        "ratio_to_fabric": {
            "sync": ratio(sync_per_s, "sync_per_s"),
            "in_flight_1000": ratio(pipelined / pipelined_s, "in_flight_1000_per_s"),
            "one_caller_8": ratio(pipelined / fan_out_s, "one_caller_8_actors_in_flight_1000_per_s"),
        },
        "load_avg": load_avg(),
    }))
}
