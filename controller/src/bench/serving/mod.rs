//! The serving bench (issue 41; WORKLOADS.md's serving load): a GPT-2 of gpt-tiny's size served
//! by `archipelago serve` on 127.0.0.1 with continuous batching (Orca, Yu et al. OSDI 2022) and
//! with static batching (wait for 16 requests or 50 ms, run the batch until its longest request
//! ends), and continuous with chunked prefill (Sarathi-Serve: at most 64 positions a pass), the
//! three servers up side by side and each load run on each in turn: prompts of
//! 32–96 tokens from gpt-tiny's data, 64 tokens each, Poisson arrivals at several rates and 16
//! clients in a closed loop; generated tokens/s, time to first token and inter-token latency
//! p50/p99, cache-pool use. Then one request at a time in this process (batch-1 decoding), and
//! with `--peers` `transformers`' `generate` with its KV cache on the same weights
//! (`scripts/serve_peer.py`), with the ratios the aims are stated in.

mod layouts;
mod load;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{Value, json};

use archipelago_actors::batching::{Batcher, CachePool, Event};
use archipelago_actors::block::initial_params;
use archipelago_actors::generate::Request;
use archipelago_actors::inference::WholeModel;
use archipelago_actors::sampling::Sampling;
use archipelago_actors::serving::ReplicaStats;
use archipelago_actors::weights_file::write_weights;
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::data::TokenStream;
use archipelago_dataflow::rng::SplitMix64;

use crate::process_stats::load_avg;
use crate::serve::{self, ServeArgs};
use load::{Arrivals, Load};

/// GPT-2 at gpt-tiny's size (WORKLOADS.md's gpt2-tiny) with 256 positions instead of 128: a
/// 96-token prompt and 64 generated tokens do not fit in 128.
const MODEL: &str = "gpt2:vocab=256,ctx=256,d=256,layers=4,heads=4";

/// Positions of the model.
const CTX: usize = 256;

/// Tokens each request generates.
const MAX_TOKENS: usize = 64;

/// The varied answer lengths' range.
const VARIED: (usize, usize) = (8, 120);

/// Chunked prefill's positions a pass: 16 decoding sequences' next tokens and 48 of prompts.
const STEP_TOKENS: &str = "64";

/// The chunked-prefill server's name in the JSON.
const CHUNKED: &str = "continuous, chunked prefill";

/// Sequences a step (and the static batch).
const BATCH: usize = 16;

/// The bench's model with seeded weights, written as a safetensors file (and its `config.json`)
/// in a fresh directory: the model, its values, the directory and the file.
fn bench_model(part: &str) -> anyhow::Result<(ModelSpec, Vec<Vec<f32>>, PathBuf, PathBuf)> {
    let spec = ModelSpec::parse(MODEL).map_err(anyhow::Error::msg)?;
    let dir = std::env::temp_dir().join(format!("archipelago-serving-{part}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let values: Vec<Vec<f32>> = (spec.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, 7))
        .collect();
    let weights = dir.join("model.safetensors");
    write_weights(&weights, &spec, &values).map_err(anyhow::Error::msg)?;
    std::fs::write(dir.join("config.json"), spec.config().to_string())?;
    Ok((spec, values, dir, weights))
}

/// The layouts part alone (`bench --serving-layouts-only`): one device, tp=2 and 2 replicas.
pub fn serving_layouts(quick: bool) -> anyhow::Result<Value> {
    let (_, _, dir, weights) = bench_model("layouts")?;
    let result = layouts::layouts(&weights, Arc::new(prompts(200)), quick);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({ "model": MODEL, "max_tokens": MAX_TOKENS, "layouts": result?, "load_avg": load_avg() }))
}

/// The bench: the three servers under each load, batch-1 decoding, the peer.
pub fn serving(quick: bool, peers: Option<&Path>) -> anyhow::Result<Value> {
    let (spec, values, dir, weights) = bench_model("bench")?;
    let prompts = Arc::new(prompts(200));
    let (max_requests, max_s) = if quick { (40, 15.0) } else { (200, 60.0) };
    let rates: &[f64] = if quick { &[8.0] } else { &[2.0, 8.0, 32.0] };
    let fixed = (MAX_TOKENS, MAX_TOKENS);
    let mut loads: Vec<(Arrivals, (usize, usize))> = (rates.iter())
        .map(|&rate| (Arrivals::Poisson { rate }, fixed))
        .collect();
    loads.push((Arrivals::Closed { clients: BATCH }, fixed));
    // Beyond WORKLOADS.md: answers of different lengths (8–120 tokens, mean 64), where a static
    // batch holds its finished requests' places until its longest ends.
    loads.push((Arrivals::Closed { clients: BATCH }, VARIED));

    let runtime = tokio::runtime::Runtime::new()?;
    let servers = [
        start(&runtime, &weights, "continuous", &[])?,
        start(&runtime, &weights, CHUNKED, &["--max-step-tokens", STEP_TOKENS])?,
        start(&runtime, &weights, "static", &["--batching", "static"])?,
    ];
    let mut runs = Vec::new();
    for (i, &(arrivals, max_tokens)) in loads.iter().enumerate() {
        let load = Load {
            arrivals,
            max_requests,
            max_s,
            max_tokens,
            seed: i as u64,
        };
        for server in &servers {
            let figures = runtime.block_on(server.run(prompts.clone(), load));
            eprintln!("serving: {} {arrivals:?} done", server.batching);
            runs.push(figures);
        }
    }
    runtime.shutdown_background();
    let count = if quick { 4 } else { 16 };
    let mut alone = batch_one(&spec, &values, &prompts[..count])?;
    let ours = alone["greedy_tokens"].take();
    let peer = peers.map(|python| {
        let file = dir.join("prompts.json");
        std::fs::write(&file, json!(prompts[..count]).to_string())
            .map(|_| super::peers::transformers_generate(python, &dir, &file, MAX_TOKENS))
            .map(|mut peer| {
                let theirs = peer["greedy_tokens"].take();
                peer["same_greedy_answers"] = json!(same_answers(&ours, &theirs));
                peer
            })
            .unwrap_or_else(|e| json!({ "error": e.to_string() }))
    });
    let _ = std::fs::remove_dir_all(&dir);
    let ratios = ratios(&runs, &alone, peer.as_ref());
    Ok(json!({
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "batch": BATCH,
        "static_wait_ms": 50,
        "prompts": "32–96 tokens of gpt-tiny's synthetic stream (seeded)",
        "runs": runs,
        "batch_1_in_process": alone,
        "peer": peer,
        "ratios": ratios,
        "load_avg": load_avg(),
    }))
}

/// How many prompts got the same greedy answer from both (the peer ran the same weights), of
/// how many.
fn same_answers(ours: &Value, theirs: &Value) -> Value {
    let (Some(ours), Some(theirs)) = (ours.as_array(), theirs.as_array()) else {
        return Value::Null;
    };
    let same = ours.iter().zip(theirs).filter(|(a, b)| a == b).count();
    json!({ "same": same, "of": ours.len().min(theirs.len()) })
}

/// `count` prompts of 32–96 tokens cut from gpt-tiny's data at seeded places.
fn prompts(count: usize) -> Vec<Vec<u32>> {
    let stream = TokenStream::synthetic(0, 256);
    let ids = stream.ids();
    let mut rng = SplitMix64::keyed(&[41, 0x9B]);
    (0..count)
        .map(|_| {
            let len = 32 + rng.below(65) as usize;
            let at = rng.below((ids.len() - len) as u64) as usize;
            ids[at..at + len].to_vec()
        })
        .collect()
}

/// A server in this process, listening on 127.0.0.1.
struct Server {
    batching: &'static str,
    addr: std::net::SocketAddr,
    /// Each replica's figures.
    stats: Vec<Arc<ReplicaStats>>,
}

/// Starts `archipelago serve` with `flags` on a free port of 127.0.0.1.
fn start(
    runtime: &tokio::runtime::Runtime,
    weights: &Path,
    batching: &'static str,
    flags: &[&str],
) -> anyhow::Result<Server> {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let init = weights.to_string_lossy();
    let cache = (BATCH * CTX).to_string();
    let batch = BATCH.to_string();
    let common = [
        "serve",
        "--init",
        &init,
        "--cache-tokens",
        &cache,
        "--max-sequences",
        &batch,
    ];
    let args = Cli::parse_from(common.iter().chain(flags)).serve;
    let (service, _) = serve::build(&args).map_err(anyhow::Error::msg)?;
    let stats = service
        .replicas
        .replicas()
        .iter()
        .map(|r| r.shared_stats())
        .collect();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    runtime.spawn(serve::serve_on(listener, service));
    Ok(Server {
        batching,
        addr,
        stats,
    })
}

impl Server {
    /// Runs `load` against this server, sampling its cache pool as it goes.
    async fn run(&self, prompts: Arc<Vec<Vec<u32>>>, load: Load) -> Value {
        let (stats, done) = (
            self.stats.clone(),
            Arc::new(std::sync::atomic::AtomicBool::new(false)),
        );
        let sampling = done.clone();
        // The server runs every load: its preemptions counted from this one's start.
        let sum = move |field: fn(&ReplicaStats) -> usize| stats.iter().map(|s| field(s)).sum::<usize>();
        let preemptions = |s: &ReplicaStats| s.preemptions.load(Ordering::Relaxed) as usize;
        let preempted_before = sum(preemptions);
        let sampler = tokio::spawn(async move {
            let (mut samples, mut peak, mut total_used, mut waiting_peak) = (0usize, 0usize, 0usize, 0usize);
            while !sampling.load(Ordering::Relaxed) {
                let used = sum(|s| s.blocks_used.load(Ordering::Relaxed));
                (samples, total_used, peak) = (samples + 1, total_used + used, peak.max(used));
                waiting_peak = waiting_peak.max(sum(|s| s.waiting.load(Ordering::Relaxed)));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let total = sum(|s| s.blocks_total.load(Ordering::Relaxed)).max(1) as f64;
            json!({
                "blocks_total": total,
                "blocks_used_peak": peak,
                "pool_use_mean": total_used as f64 / samples.max(1) as f64 / total,
                "pool_use_peak": peak as f64 / total,
                "waiting_peak": waiting_peak,
                "preemptions": sum(preemptions) - preempted_before,
            })
        });
        let mut figures = load::run(self.addr, prompts, load).await;
        done.store(true, Ordering::Relaxed);
        figures["pool"] = sampler.await.unwrap_or(Value::Null);
        figures["batching"] = json!(self.batching);
        figures["load_avg"] = json!(load_avg());
        figures
    }
}

/// Each prompt alone through a batcher in this process: the first step's seconds (prefill and
/// the first token) and each later step's (one token).
fn batch_one(spec: &ModelSpec, values: &[Vec<f32>], prompts: &[Vec<u32>]) -> anyhow::Result<Value> {
    let model = WholeModel::load(spec, values).map_err(anyhow::Error::msg)?;
    let pool = CachePool {
        block_tokens: CTX,
        total: 1,
    };
    let (mut first, mut steps, mut tokens) = (Vec::new(), Vec::new(), 0usize);
    let mut answers = Vec::new();
    let started = Instant::now();
    for (i, prompt) in prompts.iter().enumerate() {
        let mut batcher = Batcher::new(&model, 1, pool);
        let request = Request {
            prompt: prompt.clone(),
            max_tokens: MAX_TOKENS,
            sampling: Sampling::greedy(),
            stop: Vec::new(),
        };
        batcher.submit(request).map_err(anyhow::Error::msg)?;
        let mut answer = Vec::with_capacity(MAX_TOKENS);
        for step in 0..MAX_TOKENS {
            let at = Instant::now();
            let events = batcher.step().map_err(anyhow::Error::msg)?;
            let s = at.elapsed().as_secs_f64();
            answer.extend(events.iter().filter_map(|e| match e {
                Event::Token { token, .. } => Some(*token),
                Event::Done { .. } => None,
            }));
            // The first prompt warms up and is not counted.
            if i > 0 {
                if step == 0 {
                    first.push(s)
                } else {
                    steps.push(s)
                }
                tokens += 1;
            }
        }
        answers.push(answer);
    }
    let wall = started.elapsed().as_secs_f64();
    let decode_s: f64 = steps.iter().sum();
    let mut sorted = steps.clone();
    Ok(json!({
        "prompts_timed": prompts.len().saturating_sub(1),
        "generated_tokens": tokens,
        "decode_tokens_per_s": steps.len() as f64 / decode_s.max(1e-12),
        "ttft_ms_median": crate::report::median(&mut first) * 1e3,
        "itl_ms_median": crate::report::median(&mut sorted) * 1e3,
        "wall_s": wall,
        "greedy_tokens": answers,
    }))
}

/// Continuous over static batching at 16 clients (answers of 64 tokens, and of varied lengths),
/// and batch-1 decoding over the peer's.
fn ratios(runs: &[Value], alone: &Value, peer: Option<&Value>) -> Value {
    let closed = |batching: &str, varied: bool| {
        runs.iter().find(|r| {
            r["batching"] == batching
                && r["arrivals"]["closed_clients"].is_number()
                && (r["max_tokens"][0] != r["max_tokens"][1]) == varied
        })
    };
    let ratio = |a: &str, key: &str, varied: bool| {
        let (c, s) = (closed(a, varied)?, closed("static", varied)?);
        Some(c[key].as_f64()? / s[key].as_f64()?)
    };
    let over = |key: &str, varied: bool| ratio("continuous", key, varied);
    let chunked = |key: &str, varied: bool| ratio(CHUNKED, key, varied);
    let peer_decode = peer.and_then(|p| p["batch_1"]["decode_tokens_per_s"].as_f64());
    json!({
        "closed_16_tokens_per_s_continuous_over_static": over("generated_tokens_per_s", false),
        "closed_16_itl_p99_continuous_over_static": over("itl_ms_p99", false),
        "closed_16_varied_tokens_per_s_continuous_over_static": over("generated_tokens_per_s", true),
        "closed_16_varied_itl_p99_continuous_over_static": over("itl_ms_p99", true),
        "closed_16_tokens_per_s_chunked_over_static": chunked("generated_tokens_per_s", false),
        "closed_16_itl_p99_chunked_over_static": chunked("itl_ms_p99", false),
        "closed_16_varied_tokens_per_s_chunked_over_static": chunked("generated_tokens_per_s", true),
        "closed_16_varied_itl_p99_chunked_over_static": chunked("itl_ms_p99", true),
        "batch_1_decode_ours_over_peer": peer_decode
            .and_then(|p| Some(alone["decode_tokens_per_s"].as_f64()? / p)),
    })
}
