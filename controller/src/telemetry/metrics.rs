//! The actors' figures as OpenTelemetry metrics, beside the spans: when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) is set, every runtime
//! handed to [`export_actor_metrics`] — the one [`crate::runtime::init`] returns, and a host's —
//! is read by observable instruments at each export of a periodic reader
//! (`OTEL_METRIC_EXPORT_INTERVAL` ms, default 60 000) and sent over OTLP/gRPC:
//!
//! | metric | kind | attributes |
//! |---|---|---|
//! | [`MESSAGES`] `archipelago.actor.messages` | counter: messages handled (its rate is calls/s) | actor |
//! | [`QUEUE_DEPTH`] `archipelago.actor.queue_depth` | gauge: messages waiting | actor |
//! | [`FAILURES`] `archipelago.actor.failures` | counter: handler panics | actor |
//! | [`RESTARTS`] `archipelago.actor.restarts` | counter: restarts after panics | actor |
//! | [`LINK_BYTES`] `archipelago.link.bytes` | counter: tensor bytes per link | link |
//!
//! An actor's attributes are `actor.name`, `actor.id`, `actor.type`, `host`, `device` and `job`;
//! a link's are `from` and `to` (actor names; `driver` for the program itself, `other-process`
//! for a consumer in another process), `from.id` and `to.id` (for actors), `host` and `job`.
//! Each process exports its own actors (on a cluster the hosts export theirs; the driver its
//! fetches). Ended actors keep their last figures (the runtime remembers the last 256).
//!
//! With no endpoint nothing is built: no thread, no exporter, no callback. When a runtime shuts
//! down its figures are exported once more (waiting at most [`FLUSH_WAIT`]); with no collector
//! listening the export gives up on its own thread and never blocks the program.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider};

use archipelago_actors::fabric::{DRIVER, OTHER_PROCESS};
use archipelago_actors::runtime::{ActorStats, RuntimeHandle};
use archipelago_dataflow::ActorId;

/// Messages an actor handled (a counter; the backend's rate of it is the actor's calls/s).
pub const MESSAGES: &str = "archipelago.actor.messages";
/// Messages waiting in an actor's queue (a gauge).
pub const QUEUE_DEPTH: &str = "archipelago.actor.queue_depth";
/// Handler panics of an actor (a counter).
pub const FAILURES: &str = "archipelago.actor.failures";
/// Restarts of an actor after panics (a counter).
pub const RESTARTS: &str = "archipelago.actor.restarts";
/// Tensor bytes moved from one actor to another (a counter per link).
pub const LINK_BYTES: &str = "archipelago.link.bytes";

/// How long a runtime's shutdown (or [`flush_actor_metrics`]) waits for its last export.
pub const FLUSH_WAIT: Duration = Duration::from_secs(3);

/// The runtimes whose actors are exported.
static EXPORTED: Mutex<Vec<RuntimeHandle>> = Mutex::new(Vec::new());
/// The `service.name` of the export, when a binary's role names it (see [`set_service`]).
static SERVICE: OnceLock<String> = OnceLock::new();
/// The process's metrics pipeline, built by the first runtime exported (`None`: it failed).
static PIPELINE: OnceLock<Option<Pipeline>> = OnceLock::new();

/// The meter provider with its periodic reader, and the runtime its gRPC channel runs on.
struct Pipeline {
    provider: SdkMeterProvider,
    _runtime: tokio::runtime::Runtime,
}

/// Whether an OTLP endpoint for metrics is set.
fn metrics_endpoint_set() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    ]
    .iter()
    .any(|var| std::env::var(var).is_ok_and(|v| !v.trim().is_empty()))
}

/// Exports the figures of `runtime`'s actors (on this process) and its links as OpenTelemetry
/// metrics until the runtime shuts down, when they are exported one last time. Returns whether
/// they are exported: `false` when no OTLP endpoint is set (then it costs nothing) or the
/// exporter could not be built (said once on stderr). Calling it twice for a runtime is harmless.
///
/// [`crate::runtime::init`] calls it for the program's runtime; call it for a runtime made with
/// `Runtime::local` or `Runtime::new`:
///
/// ```no_run
/// use archipelago_controller::prelude::*;
/// let runtime = Runtime::local(DeviceSpec::cpus(2));
/// archipelago_controller::telemetry::export_actor_metrics(&runtime);
/// ```
pub fn export_actor_metrics(runtime: &RuntimeHandle) -> bool {
    if !metrics_endpoint_set() {
        return false;
    }
    let Some(pipeline) = pipeline(runtime.job()) else {
        return false;
    };
    let mut exported = EXPORTED.lock().unwrap_or_else(|e| e.into_inner());
    if exported.iter().any(|r| r.same_runtime(runtime)) {
        return true;
    }
    exported.push(runtime.clone());
    drop(exported);
    let provider = pipeline.provider.clone();
    let handle = runtime.clone();
    runtime.on_shutdown(move || {
        flush(provider);
        EXPORTED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|r| !r.same_runtime(&handle));
    });
    true
}

/// Exports the figures of every exported runtime now (waiting at most [`FLUSH_WAIT`]); a no-op
/// when nothing is exported.
pub fn flush_actor_metrics() {
    if let Some(Some(pipeline)) = PIPELINE.get() {
        flush(pipeline.provider.clone());
    }
}

/// Names the export's `service.name` (a binary's role, e.g. `archipelago-host`) unless
/// `OTEL_SERVICE_NAME` does; by default it is the first exported runtime's job.
pub(crate) fn set_service(service: &str) {
    let _ = SERVICE.set(service.to_string());
}

/// A collection and export on the reader's thread, awaited at most [`FLUSH_WAIT`].
fn flush(provider: SdkMeterProvider) {
    let (done, flushed) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("otlp-metrics-flush".into())
        .spawn(move || {
            let _ = provider.force_flush();
            let _ = done.send(());
        });
    if spawned.is_ok() {
        let _ = flushed.recv_timeout(FLUSH_WAIT);
    }
}

/// The process's pipeline, built on first use for the service named by `OTEL_SERVICE_NAME`,
/// [`set_service`] or `job`.
fn pipeline(job: &str) -> Option<&'static Pipeline> {
    PIPELINE
        .get_or_init(|| match build(job) {
            Ok(pipeline) => Some(pipeline),
            Err(e) => {
                eprintln!("OpenTelemetry metrics export disabled: {e}");
                None
            }
        })
        .as_ref()
}

fn build(job: &str) -> Result<Pipeline, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-metrics")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    // The gRPC channel's worker is spawned on this runtime; the reader's thread only awaits.
    let exporter = {
        let _entered = runtime.enter();
        opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| e.to_string())?
    };
    let mut resource = Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(SERVICE.get().cloned().unwrap_or_else(|| job.to_string()));
    }
    let provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(exporter).build())
        .with_resource(resource.build())
        .build();
    instruments(&provider.meter("archipelago"));
    Ok(Pipeline {
        provider,
        _runtime: runtime,
    })
}

/// The observable instruments; their callbacks read the exported runtimes at each collection.
fn instruments(meter: &Meter) {
    meter
        .u64_observable_counter(MESSAGES)
        .with_description("Messages an actor handled (its rate is the actor's calls/s)")
        .with_unit("{message}")
        .with_callback(|o| each_actor(|s, attrs| o.observe(s.handled, attrs)))
        .build();
    meter
        .u64_observable_gauge(QUEUE_DEPTH)
        .with_description("Messages waiting in an actor's queue")
        .with_unit("{message}")
        .with_callback(|o| each_actor(|s, attrs| o.observe(s.queue_depth, attrs)))
        .build();
    meter
        .u64_observable_counter(FAILURES)
        .with_description("Handler panics of an actor")
        .with_unit("{failure}")
        .with_callback(|o| each_actor(|s, attrs| o.observe(s.failures, attrs)))
        .build();
    meter
        .u64_observable_counter(RESTARTS)
        .with_description("Restarts of an actor after panics")
        .with_unit("{restart}")
        .with_callback(|o| each_actor(|s, attrs| o.observe(u64::from(s.restarts), attrs)))
        .build();
    meter
        .u64_observable_counter(LINK_BYTES)
        .with_description("Tensor bytes moved from one actor to another")
        .with_unit("By")
        .with_callback(|o| each_link(|bytes, attrs| o.observe(bytes, attrs)))
        .build();
}

/// The exported runtimes (cloned, so that no lock is held while they are read).
fn exported() -> Vec<RuntimeHandle> {
    EXPORTED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Calls `observe` with every exported actor's figures and attributes. A panic in there would
/// end the reader's thread (the SDK does not catch it): it is caught and the round skipped.
fn each_actor(observe: impl Fn(&ActorStats, &[KeyValue])) {
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
        for runtime in exported() {
            let job = runtime.job().to_string();
            for stats in runtime.local_actor_stats() {
                observe(&stats, &actor_attributes(&stats, &job));
            }
        }
    }));
}

/// Calls `observe` with every exported runtime's links (bytes, attributes).
fn each_link(observe: impl Fn(u64, &[KeyValue])) {
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
        for runtime in exported() {
            let links = runtime.link_bytes().snapshot();
            if links.is_empty() {
                continue;
            }
            let stats = runtime.local_actor_stats();
            let name = |id: ActorId| match id {
                DRIVER => "driver".to_string(),
                OTHER_PROCESS => "other-process".to_string(),
                id => stats
                    .iter()
                    .find(|s| s.info.id == id)
                    .map_or_else(|| format!("actor-{id}"), |s| s.info.name.clone()),
            };
            for ((from, to), bytes) in links {
                let mut attrs = vec![
                    KeyValue::new("from", name(from)),
                    KeyValue::new("to", name(to)),
                    KeyValue::new("host", runtime.host().to_string()),
                    KeyValue::new("job", runtime.job().to_string()),
                ];
                for (key, id) in [("from.id", from), ("to.id", to)] {
                    if id != DRIVER && id != OTHER_PROCESS {
                        attrs.push(KeyValue::new(key, id as i64));
                    }
                }
                observe(bytes, &attrs);
            }
        }
    }));
}

/// An actor's attributes: `actor.name`, `actor.id`, `actor.type`, `host`, `device`, `job`.
fn actor_attributes(stats: &ActorStats, job: &str) -> [KeyValue; 6] {
    let info = &stats.info;
    [
        KeyValue::new("actor.name", info.name.clone()),
        KeyValue::new("actor.id", info.id as i64),
        KeyValue::new("actor.type", info.type_name.clone()),
        KeyValue::new("host", info.host.clone()),
        KeyValue::new("device", info.device.to_string()),
        KeyValue::new("job", job.to_string()),
    ]
}
