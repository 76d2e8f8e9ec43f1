//! OpenTelemetry metrics: a program on the runtime API, started with `OTEL_EXPORTER_OTLP_ENDPOINT`
//! set, exports its actors' figures over OTLP/gRPC without a line of its own. A small metrics
//! receiver (a tonic server of the OTLP metrics service) on 127.0.0.1 receives them from a real
//! program — the test run again as [`metrics_program`] in a child process — and checks
//! the messages each actor handled, a queue held up behind a busy handler, a panic among the
//! failures and restarts, the tensor bytes per link, and an idle actor's zeros.

mod otlp_text;

use std::collections::HashMap;
use std::io::Write as _;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::metrics::v1::metric::Data;
use opentelemetry_proto::tonic::metrics::v1::number_data_point;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use otlp_text::{service_name, text};

use archipelago_actors::prerequisite;
use archipelago_controller::prelude::*;
use archipelago_controller::telemetry::{FAILURES, LINK_BYTES, MESSAGES, QUEUE_DEPTH, RESTARTS};

/// Calls the program makes to its `busy` actor.
const CALLS: u64 = 25;
/// Messages the program leaves queued behind the `held` actor's busy handler.
const QUEUED: u64 = 5;
/// Elements of the tensor that moves (f32: 4 bytes each).
const ELEMENTS: usize = 1024;
/// How long the checks wait for figures to arrive (the child's start and first export).
const DEADLINE: Duration = Duration::from_secs(60);

// ---- the program ----

/// The program's one actor type; `gate` holds up a `Hold` until the program opens it.
struct Worker {
    gate: Arc<Semaphore>,
}

impl Actor for Worker {
    type Params = Arc<Semaphore>;
    async fn new(gate: Arc<Semaphore>, _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Worker { gate })
    }
}

struct Work(u64);
impl Message for Work {
    type Reply = u64;
}
impl Handler<Work> for Worker {
    async fn handle(&mut self, Work(n): Work, _ctx: &Context<Self>) -> u64 {
        n + 1
    }
}

struct Boom;
impl Message for Boom {
    type Reply = ();
}
impl Handler<Boom> for Worker {
    async fn handle(&mut self, _: Boom, _ctx: &Context<Self>) {
        panic!("boom (a panic the metrics test asked for)");
    }
}

struct Hold;
impl Message for Hold {
    type Reply = ();
}
impl Handler<Hold> for Worker {
    async fn handle(&mut self, _: Hold, _ctx: &Context<Self>) {
        let _ = self.gate.acquire().await;
    }
}

struct Make(usize);
impl Message for Make {
    type Reply = TensorRef;
}
impl Handler<Make> for Worker {
    async fn handle(&mut self, Make(n): Make, ctx: &Context<Self>) -> TensorRef {
        let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
        ctx.put(TypedTensor::from_values(vec![n], &values))
    }
}

struct Take(TensorRef);
impl Message for Take {
    type Reply = usize;
}
impl Handler<Take> for Worker {
    async fn handle(&mut self, Take(tensor): Take, ctx: &Context<Self>) -> usize {
        ctx.fetch(&tensor).await.map(|t| t.elements()).unwrap_or(0)
    }
}

/// The program, in the child process a test started with [`start_program`] (the test asks
/// [`played_the_program`] first). Its runtime comes from `runtime::init`, which exports its
/// actors' figures. `stay`: after its calls it waits for standard input to close, then opens the
/// gate and ends; `exit`: it ends right after its calls.
fn metrics_program(mode: &str) {
    let runtime = archipelago_controller::runtime::init(Registry::new(), DeviceSpec::cpus(2)).unwrap();
    // Local-only by design: the workers share an `Arc<Semaphore>` gate, which no process can send
    // to another, so nothing here is registered and strict registration mode does not apply.
    runtime.set_strict_registry(false);
    let gate = Arc::new(Semaphore::new(0));
    let spawn = |device: u32, options: SpawnOptions| {
        runtime
            .spawn_with::<Worker>(DeviceSpec::Cpu(device), gate.clone(), options)
            .get()
            .unwrap()
    };
    let busy = spawn(0, SpawnOptions::named("busy"));
    let _idle = spawn(1, SpawnOptions::named("idle"));
    let fragile = spawn(1, SpawnOptions::named("fragile").restarts(1));
    let producer = spawn(0, SpawnOptions::named("producer"));
    let consumer = spawn(1, SpawnOptions::named("consumer"));
    let held = spawn(0, SpawnOptions::named("held"));
    for i in 0..CALLS {
        assert_eq!(busy.call(Work(i)).get().unwrap(), i + 1);
    }
    assert!(fragile.call(Boom).get().is_err(), "the panic fails its call");
    let tensor = producer.call(Make(ELEMENTS)).get().unwrap();
    assert_eq!(consumer.call(Take(tensor.clone())).get().unwrap(), ELEMENTS);
    assert_eq!(runtime.fetch(&tensor).get().unwrap().elements(), ELEMENTS);
    if mode == "stay" {
        held.cast(Hold).unwrap();
        for i in 0..QUEUED {
            held.cast(Work(i)).unwrap();
        }
        println!("program ready");
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
        gate.add_permits(1);
        held.call(Work(0)).get().unwrap();
    }
    drop(runtime);
}

// ---- the receiver ----

/// A received data point: its metric, the exporting service and the point's attributes.
#[derive(Debug, Clone)]
struct Point {
    metric: String,
    service: String,
    monotonic_sum: bool,
    attributes: HashMap<String, String>,
    value: f64,
}

#[derive(Clone, Default)]
struct Receiver {
    points: Arc<Mutex<Vec<Point>>>,
}

#[tonic::async_trait]
impl MetricsService for Receiver {
    async fn export(
        &self,
        request: Request<ExportMetricsServiceRequest>,
    ) -> Result<Response<ExportMetricsServiceResponse>, Status> {
        let mut points = self.points.lock().unwrap();
        for resource in request.into_inner().resource_metrics {
            let service = service_name(resource.resource.iter().flat_map(|r| &r.attributes));
            for metric in resource.scope_metrics.into_iter().flat_map(|s| s.metrics) {
                let (monotonic_sum, data_points) = match metric.data {
                    Some(Data::Sum(sum)) => (sum.is_monotonic, sum.data_points),
                    Some(Data::Gauge(gauge)) => (false, gauge.data_points),
                    _ => continue,
                };
                for point in data_points {
                    let value = match point.value {
                        Some(number_data_point::Value::AsInt(i)) => i as f64,
                        Some(number_data_point::Value::AsDouble(d)) => d,
                        None => continue,
                    };
                    points.push(Point {
                        metric: metric.name.clone(),
                        service: service.clone(),
                        monotonic_sum,
                        attributes: point
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                            .collect(),
                        value,
                    });
                }
            }
        }
        Ok(Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// The last point of `metric` whose attributes include `with`.
    fn last(&self, metric: &str, with: &[(&str, &str)]) -> Option<Point> {
        let points = self.points.lock().unwrap();
        points
            .iter()
            .rev()
            .find(|p| {
                p.metric == metric
                    && with
                        .iter()
                        .all(|(k, v)| p.attributes.get(*k).map(String::as_str) == Some(*v))
            })
            .cloned()
    }

    /// The last value of `metric` for the actor named `actor`.
    fn actor(&self, metric: &str, actor: &str) -> Option<f64> {
        self.last(metric, &[("actor.name", actor)]).map(|p| p.value)
    }

    /// The last value of the link `from` → `to`.
    fn link(&self, from: &str, to: &str) -> Option<f64> {
        self.last(LINK_BYTES, &[("from", from), ("to", to)])
            .map(|p| p.value)
    }

    /// Waits (up to [`DEADLINE`]) until `done` holds; returns whether it did.
    fn wait_for(&self, done: impl Fn(&Receiver) -> bool) -> bool {
        let deadline = Instant::now() + DEADLINE;
        while !done(self) {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        true
    }
}

/// A metrics receiver on 127.0.0.1 (on `runtime`); returns it and its endpoint.
fn start_receiver(runtime: &tokio::runtime::Runtime) -> (Receiver, String) {
    let receiver = Receiver::default();
    let addr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = MetricsServiceServer::new(receiver.clone());
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
                .unwrap();
        });
        addr
    });
    (receiver, format!("http://{addr}"))
}

/// In the child process [`start_program`] started, runs [`metrics_program`] and says so; in the
/// test itself, `false`.
fn played_the_program() -> bool {
    let Some(mode) = prerequisite::child_role() else {
        return false;
    };
    metrics_program(&mode);
    true
}

/// The calling test run again in a child process as [`metrics_program`] in `mode` (`stay` or
/// `exit`), exporting to `endpoint` every `interval_ms`.
fn start_program(mode: &str, endpoint: &str, interval_ms: u64) -> Child {
    prerequisite::child_of_this_test(mode)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_METRIC_EXPORT_INTERVAL", interval_ms.to_string())
        .env("ARCHIPELAGO_JOB", "metrics-test")
        .env("RUST_BACKTRACE", "0")
        .env_remove("OTEL_SERVICE_NAME")
        .env_remove("ARCHIPELAGO_CONTROLLER")
        .env_remove("ARCHIPELAGO_ROLE")
        .stdin(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for `child` to end (killing it after [`DEADLINE`]) and says whether it succeeded.
fn ended_well(child: &mut Child) -> bool {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_running_program_exports_its_actors_figures() {
    if played_the_program() {
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (receiver, endpoint) = start_receiver(&runtime);
    let mut program = start_program("stay", &endpoint, 200);
    let bytes = (4 * ELEMENTS) as f64;
    let arrived = receiver.wait_for(|r| {
        r.actor(MESSAGES, "busy") == Some(CALLS as f64)
            && r.actor(QUEUE_DEPTH, "held") == Some(QUEUED as f64)
            && r.actor(FAILURES, "fragile") == Some(1.0)
            && r.actor(RESTARTS, "fragile") == Some(1.0)
            && r.link("producer", "consumer") == Some(bytes)
            && r.link("producer", "driver") == Some(bytes)
    });
    let summary = |r: &Receiver| {
        format!(
            "busy messages {:?}, held queue {:?}, fragile failures {:?} restarts {:?}, links {:?} {:?}",
            r.actor(MESSAGES, "busy"),
            r.actor(QUEUE_DEPTH, "held"),
            r.actor(FAILURES, "fragile"),
            r.actor(RESTARTS, "fragile"),
            r.link("producer", "consumer"),
            r.link("producer", "driver"),
        )
    };
    if !arrived {
        let _ = program.kill();
        panic!("the figures did not arrive: {}", summary(&receiver));
    }

    // Every actor has every figure, with its attributes; the idle one has zeros.
    let busy = receiver.last(MESSAGES, &[("actor.name", "busy")]).unwrap();
    assert_eq!(busy.service, "metrics-test");
    assert!(busy.monotonic_sum, "messages are a monotonic counter: {busy:?}");
    assert_eq!(busy.attributes["host"], "local");
    assert_eq!(busy.attributes["device"], "cpu:0");
    assert_eq!(busy.attributes["job"], "metrics-test");
    assert!(busy.attributes["actor.type"].ends_with("Worker"), "{busy:?}");
    assert!(busy.attributes.contains_key("actor.id"), "{busy:?}");
    let held_queue = receiver.last(QUEUE_DEPTH, &[("actor.name", "held")]).unwrap();
    assert!(
        !held_queue.monotonic_sum,
        "queue depth is a gauge: {held_queue:?}"
    );
    assert_eq!(
        receiver.actor(MESSAGES, "held"),
        Some(1.0),
        "only `Hold` is taken off the queue"
    );
    for actor in ["busy", "idle", "fragile", "producer", "consumer", "held"] {
        for metric in [MESSAGES, QUEUE_DEPTH, FAILURES, RESTARTS] {
            assert!(
                receiver.actor(metric, actor).is_some(),
                "no {metric} of `{actor}`"
            );
        }
    }
    assert_eq!(
        receiver.actor(MESSAGES, "idle"),
        Some(0.0),
        "an actor never called handled nothing"
    );
    assert_eq!(receiver.actor(QUEUE_DEPTH, "idle"), Some(0.0));
    assert_eq!(
        receiver.actor(FAILURES, "busy"),
        Some(0.0),
        "no panic, no failure"
    );
    assert_eq!(receiver.actor(RESTARTS, "busy"), Some(0.0));
    let idle_links = receiver
        .points
        .lock()
        .unwrap()
        .iter()
        .filter(|p| p.metric == LINK_BYTES)
        .filter(|p| {
            p.attributes.get("from").map(String::as_str) == Some("idle")
                || p.attributes.get("to").map(String::as_str) == Some("idle")
        })
        .count();
    assert_eq!(idle_links, 0, "no bytes went to or from the idle actor");
    let link = receiver
        .last(LINK_BYTES, &[("from", "producer"), ("to", "consumer")])
        .unwrap();
    assert!(
        link.monotonic_sum
            && link.attributes.contains_key("from.id")
            && link.attributes.contains_key("to.id")
    );

    // Standard input closes: the program opens the gate, its queue drains, and the figures go
    // out once more as its runtime shuts down.
    drop(program.stdin.take());
    assert!(ended_well(&mut program), "the program failed");
    assert!(
        receiver.wait_for(|r| r.actor(MESSAGES, "held") == Some(2.0 + QUEUED as f64)
            && r.actor(QUEUE_DEPTH, "held") == Some(0.0)),
        "the last figures did not arrive: held messages {:?}, queue {:?}",
        receiver.actor(MESSAGES, "held"),
        receiver.actor(QUEUE_DEPTH, "held")
    );
}

/// With an export interval far longer than the program, the figures still arrive: the runtime's
/// shutdown exports them on the way out.
#[test]
fn a_program_that_ends_at_once_exports_on_the_way_out() {
    if played_the_program() {
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (receiver, endpoint) = start_receiver(&runtime);
    let mut program = start_program("exit", &endpoint, 600_000);
    assert!(ended_well(&mut program), "the program failed");
    assert_eq!(receiver.actor(MESSAGES, "busy"), Some(CALLS as f64));
    assert_eq!(receiver.actor(FAILURES, "fragile"), Some(1.0));
    assert_eq!(receiver.link("producer", "consumer"), Some((4 * ELEMENTS) as f64));
    assert_eq!(receiver.actor(MESSAGES, "idle"), Some(0.0));
}

/// With an endpoint where no collector listens, the program runs and ends as without one.
#[test]
fn no_metrics_collector_blocks_nothing() {
    if played_the_program() {
        return;
    }
    let began = Instant::now();
    let mut program = start_program("exit", "http://127.0.0.1:9", 100);
    assert!(ended_well(&mut program), "the program failed");
    // Keep stdout of the child and this line apart.
    let _ = std::io::stdout().flush();
    println!(
        "a program with an unreachable metrics collector took {:.2} s",
        began.elapsed().as_secs_f64()
    );
}
