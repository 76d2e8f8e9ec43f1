//! Logs and traces of the `archipelago` binary. Logs go to stderr (`RUST_LOG`, default by
//! role). When `OTEL_EXPORTER_OTLP_ENDPOINT` is set, the spans of archipelago's own crates (one
//! per instruction an actor runs, one per step the controller drives, …) are also exported over
//! OTLP/gRPC with the process's role as `service.name`. The exporter batches on its own runtime
//! thread; with no collector it drops spans (bounded queue) and never blocks the job. tonic, h2,
//! hyper and OpenTelemetry's own spans are kept out of the export.
//!
//! Beside the spans, the figures of runtime-API actors (messages handled, queue depth, failures,
//! restarts, bytes per link) are exported as OTLP metrics: see [`export_actor_metrics`], which
//! [`crate::runtime::init`] calls for the program's runtime.

mod metrics;

pub use metrics::{
    FAILURES, FLUSH_WAIT, LINK_BYTES, MESSAGES, QUEUE_DEPTH, RESTARTS, export_actor_metrics,
    flush_actor_metrics,
};

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The installed subscriber's exporter (if any), flushed by [`Telemetry::shutdown`].
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// The runtime the gRPC exporter runs on.
    _runtime: Option<tokio::runtime::Runtime>,
}

impl Telemetry {
    /// Installs the global subscriber for a process playing `service` (e.g.
    /// `archipelago-host`), logging at `level` unless `RUST_LOG` says otherwise.
    pub fn init(service: &str, level: &str) -> Telemetry {
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
        // Colour codes only on a terminal: a log file or a pipe gets plain text.
        let logs = tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .with_filter(filter);
        let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap_or_default();
        metrics::set_service(service);
        let (provider, runtime) = if endpoint.is_empty() {
            (None, None)
        } else {
            match exporter(service) {
                Ok((provider, runtime)) => (Some(provider), Some(runtime)),
                Err(e) => {
                    eprintln!("OpenTelemetry export to {endpoint} disabled: {e}");
                    (None, None)
                }
            }
        };
        let spans = provider.as_ref().map(|p| {
            let ours = Targets::new()
                .with_target("archipelago_controller", Level::INFO)
                .with_target("archipelago_actors", Level::INFO)
                .with_target("archipelago", Level::INFO);
            tracing_opentelemetry::layer()
                .with_tracer(p.tracer("archipelago"))
                .with_filter(ours)
        });
        tracing_subscriber::registry().with(logs).with(spans).init();
        Telemetry {
            provider,
            _runtime: runtime,
        }
    }

    /// Flushes the spans still queued and the actors' figures (waiting at most a few seconds
    /// for the collector).
    pub fn shutdown(self) {
        flush_actor_metrics();
        if let Some(provider) = self.provider {
            let _ = provider.shutdown_with_timeout(Duration::from_secs(3));
        }
    }
}

fn exporter(service: &str) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let provider = runtime.block_on(async {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| e.to_string())?;
        let resource = Resource::builder().with_service_name(service.to_string()).build();
        Ok::<_, String>(
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(resource)
                .build(),
        )
    })?;
    Ok((provider, runtime))
}
