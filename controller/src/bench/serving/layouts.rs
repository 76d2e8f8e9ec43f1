//! The serving bench's layouts (issue 42): one model served on one device, cut over two
//! tensor-parallel ranks (`--tp 2`), into two pipeline stages (`--pp 2`, a step's sequences as
//! two micro-batches), and as two replicas behind the router (`--replicas 2`), the four servers
//! up side by side under the same loads (16 clients in a closed loop and Poisson arrivals at 8
//! requests/s, 64 tokens each), with the ratios to one device. Every rank, stage and replica runs
//! on a thread of its own; on this machine's 2 cores they share two cores (CPU devices), so the
//! figures show what the cut costs and what overlap two cores give, not what separate devices
//! would.

use std::path::Path;
use std::sync::Arc;

use serde_json::{Value, json};

use super::load::{Arrivals, Load};
use super::{BATCH, MAX_TOKENS, Server, start};

/// The three layouts under each load; their runs and ratios to one device.
pub fn layouts(weights: &Path, prompts: Arc<Vec<Vec<u32>>>, quick: bool) -> anyhow::Result<Value> {
    let (max_requests, max_s) = if quick { (40, 15.0) } else { (200, 60.0) };
    let loads = [
        Arrivals::Closed { clients: BATCH },
        Arrivals::Poisson { rate: 8.0 },
    ];
    let runtime = tokio::runtime::Runtime::new()?;
    let servers: [Server; 4] = [
        start(&runtime, weights, "one device", &[])?,
        start(&runtime, weights, "tp=2", &["--tp", "2"])?,
        start(&runtime, weights, "pp=2", &["--pp", "2"])?,
        start(&runtime, weights, "2 replicas", &["--replicas", "2"])?,
    ];
    let mut runs = Vec::new();
    for (i, &arrivals) in loads.iter().enumerate() {
        let load = Load {
            arrivals,
            max_requests,
            max_s,
            max_tokens: (MAX_TOKENS, MAX_TOKENS),
            seed: 100 + i as u64,
        };
        for server in &servers {
            let mut figures = runtime.block_on(server.run(prompts.clone(), load));
            figures["layout"] = json!(server.batching);
            eprintln!("serving layouts: {} {arrivals:?} done", server.batching);
            runs.push(figures);
        }
    }
    runtime.shutdown_background();
    let ratio = |layout: &str, closed: bool, key: &str| {
        let find = |name: &str| {
            runs.iter()
                .find(|r| r["layout"] == name && r["arrivals"]["closed_clients"].is_number() == closed)
        };
        Some(find(layout)?[key].as_f64()? / find("one device")?[key].as_f64()?)
    };
    let mut ratios = serde_json::Map::new();
    for (layout, key) in [("tp=2", "tp2"), ("pp=2", "pp2"), ("2 replicas", "2_replicas")] {
        for (name, closed, figure) in [
            ("closed_16_tokens_per_s", true, "generated_tokens_per_s"),
            ("closed_16_itl_p50", true, "itl_ms_p50"),
            ("closed_16_itl_p99", true, "itl_ms_p99"),
            ("poisson_8_ttft_p50", false, "ttft_ms_p50"),
        ] {
            ratios.insert(
                format!("{name}_{key}_over_one"),
                json!(ratio(layout, closed, figure)),
            );
        }
    }
    Ok(json!({
        "layouts": [
            "one device",
            "tp=2 (a thread per rank, all-reduce through shared buffers)",
            "pp=2 (a thread per stage, 2 micro-batches a step)",
            "2 replicas (a thread each)"
        ],
        "runs": runs,
        "ratios": ratios,
    }))
}
