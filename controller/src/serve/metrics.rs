//! `GET /metrics` of `archipelago serve`, through Prometheus' own Rust client
//! (`prometheus-client`): the replicas' queue, batch and cache-pool figures read at each scrape,
//! generated tokens, requests by outcome, and time-to-first-token and inter-token latency
//! histograms. Served as OpenMetrics text (`application/openmetrics-text; version=1.0.0`), which
//! Prometheus asks for; the same text with the 0.0.4 content type to a client that asks only
//! for `text/plain`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use archipelago_actors::serving::ReplicaStats;

/// OpenMetrics' content type.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Prometheus' classic text format's content type.
pub const TEXT_004: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The service's metrics.
pub struct Metrics {
    registry: Registry,
    /// Seconds from a request's arrival to its first token.
    pub time_to_first_token: Histogram,
    /// Seconds between a request's consecutive tokens.
    pub inter_token_latency: Histogram,
    /// Requests answered, by outcome (`ok`, `refused`, `failed`, `disconnected`).
    pub requests: Family<Vec<(String, String)>, Counter>,
}

impl Metrics {
    /// The metrics of a service over `replicas`.
    pub fn new(replicas: Vec<Arc<ReplicaStats>>) -> Metrics {
        let mut registry = Registry::with_prefix("archipelago_serve");
        let time_to_first_token = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let inter_token_latency = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let requests = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token",
            time_to_first_token.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request",
            inter_token_latency.clone(),
        );
        registry.register("requests", "Requests answered, by outcome", requests.clone());
        registry.register_collector(Box::new(Replicas(replicas)));
        Metrics {
            registry,
            time_to_first_token,
            inter_token_latency,
            requests,
        }
    }

    /// Counts a request's outcome.
    pub fn outcome(&self, outcome: &str) {
        (self.requests)
            .get_or_create(&vec![("outcome".to_string(), outcome.to_string())])
            .inc();
    }

    /// The text and its content type: OpenMetrics unless `accept` asks only for plain text.
    pub fn render(&self, accept: &str) -> (String, &'static str) {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        let plain = accept.contains("text/plain") && !accept.contains("openmetrics");
        (text, if plain { TEXT_004 } else { OPENMETRICS })
    }
}

/// The replicas' figures, summed at each scrape.
#[derive(Debug)]
struct Replicas(Vec<Arc<ReplicaStats>>);

impl Replicas {
    fn sum(&self, read: impl Fn(&ReplicaStats) -> u64) -> u64 {
        self.0.iter().map(|s| read(s)).sum()
    }
}

impl Collector for Replicas {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let relaxed = Ordering::Relaxed;
        let gauges: [(&str, &str, u64); 5] = [
            (
                "queue_length",
                "Requests waiting for a place in a batch",
                self.sum(|s| s.waiting.load(relaxed) as u64),
            ),
            (
                "running_sequences",
                "Sequences in the replicas' batches",
                self.sum(|s| s.running.load(relaxed) as u64),
            ),
            (
                "cache_blocks_used",
                "KV-cache blocks held by running sequences",
                self.sum(|s| s.blocks_used.load(relaxed) as u64),
            ),
            (
                "cache_blocks_free",
                "KV-cache blocks free in the pools",
                self.sum(|s| {
                    (s.blocks_total.load(relaxed)
                        - s.blocks_used.load(relaxed).min(s.blocks_total.load(relaxed)))
                        as u64
                }),
            ),
            (
                "replicas",
                "Model replicas behind the router",
                self.0.len() as u64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value as i64);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let counters: [(&str, &str, u64); 3] = [
            (
                "generated_tokens",
                "Tokens generated",
                self.sum(|s| s.generated.load(relaxed)),
            ),
            (
                "cancelled_requests",
                "Requests cancelled because their client went away",
                self.sum(|s| s.cancelled.load(relaxed)),
            ),
            (
                "preemptions",
                "Sequences preempted for cache blocks (recomputed later)",
                self.sum(|s| s.preemptions.load(relaxed)),
            ),
        ];
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        Ok(())
    }
}
