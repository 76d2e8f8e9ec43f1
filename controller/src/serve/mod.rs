//! `archipelago serve`: a model answering OpenAI's HTTP API (`/v1/completions`,
//! `/v1/chat/completions`, streamed or not), with `/v1/models`, `/health` and Prometheus
//! `/metrics` — the official OpenAI client libraries work against it unchanged. `--replicas R`
//! model replicas (one CPU device and one thread each, [`archipelago_actors::serving::Replica`])
//! sit behind one router that sends each request to the least loaded; each replica batches
//! continuously over its cache pool ([`archipelago_actors::batching`]). The pool is sized from
//! the memory free after the weights are loaded (`--cache-fraction` of it, shared by the
//! replicas) unless `--cache-tokens` says. It listens on 127.0.0.1 unless told otherwise, and
//! anywhere else only with the cluster token (`--token-file`), which every request then carries
//! as `Authorization: Bearer` (the OpenAI clients' `api_key`).

pub mod chat;
pub mod http;
pub mod metrics;
pub mod openai;
pub mod remote;
pub mod router;
pub mod summary;
pub mod tls_listener;

use summary::mib;
pub use summary::{ActorMemory, Summary};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use clap::Args;

use archipelago_actors::batching::CachePool;
use archipelago_actors::inference::WholeModel;
use archipelago_actors::inference_sharded::{Layout, ShardedModel};
use archipelago_actors::serving::{Replica, Router, Scheduling};
use archipelago_actors::text_tokens::codec;
use archipelago_dataflow::ModelSpec;

use crate::cluster::security::TlsArgs;
use crate::weight_args::{QuantizeArgs, WeightArgs};
use chat::ChatTemplate;
use http::Service;

/// Flags of `serve`.
#[derive(Debug, Clone, Args, serde::Serialize, serde::Deserialize)]
pub struct ServeArgs {
    /// The model and its weights.
    #[command(flatten)]
    pub weights: WeightArgs,
    /// int8 weights.
    #[command(flatten)]
    pub quantize: QuantizeArgs,
    /// A Hugging Face `tokenizer.json` (without it, the text's bytes are the tokens).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The chat template: `plain` (`role: content` lines, then `assistant:`) or a Jinja file;
    /// default: the `chat_template` of the `tokenizer_config.json` beside --tokenizer, else plain.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Where to listen (HOST:PORT; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: String,
    /// Model replicas behind the router (each its own copy of the weights and its own thread;
    /// with --controller, one on each of R distinct hosts behind a router in this process).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Tensor parallelism: each stage of a replica cut over this many ranks as training cuts it
    /// (heads and MLP columns; Megatron-LM's layers), each rank on a thread of its own with its
    /// heads' cache; their outputs all-reduced after each sub-layer and the head's vocabulary
    /// columns all-gathered with training's collectives.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline parallelism: each replica's blocks cut into this many stages balanced by
    /// parameters, each stage (its ranks) on threads of its own with its blocks' cache; a step's
    /// sequences go through the stages as --micro-batches micro-batches, so the stages work at
    /// once.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// With --pp: micro-batches a step's sequences are cut into (default: --pp).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// Sequences one replica runs in a step at most (the batch).
    #[arg(long, default_value_t = 16)]
    pub max_sequences: usize,
    /// How batches form: `continuous` (requests join and leave at every step) or `static` (the
    /// baseline: wait for --max-sequences requests or --batch-wait-ms, run that batch until its
    /// longest request ends).
    #[arg(long, default_value = "continuous", value_parser = ["continuous", "static"])]
    pub batching: String,
    /// With --batching static: the longest a request waits for the batch to fill.
    #[arg(long, default_value_t = 50)]
    pub batch_wait_ms: u64,
    /// Chunked prefill: the most positions one step computes (each running sequence's next
    /// token first, then prompts, a long one over several steps); default: whole prompts.
    #[arg(long)]
    pub max_step_tokens: Option<usize>,
    /// Positions per cache block.
    #[arg(long, default_value_t = 16)]
    pub block_tokens: usize,
    /// Cache positions per replica (rounded down to whole blocks); default: from free memory.
    #[arg(long)]
    pub cache_tokens: Option<usize>,
    /// The share of the memory free after loading the weights that the replicas' caches take.
    #[arg(long, default_value_t = 0.5)]
    pub cache_fraction: f64,
    /// Requests answered at once; more get 503.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// The largest request body read; larger gets 413.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// The model's name in answers and `/v1/models` (default: the model, e.g. `gpt2:vocab=…`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Print the plan (weight and cache memory, how many positions of cache fit) and exit
    /// without serving.
    #[arg(long)]
    pub plan: bool,
    /// A file holding the cluster token, which every request must then carry (needed off
    /// loopback).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Mutual TLS, as the cluster's processes take it: clients connect over HTTPS and show a
    /// certificate the cluster CA signed (with --controller: how this client reaches the
    /// controller).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Place the service on a host of this controller's cluster instead of serving here
    /// (`host:port`; the token from --token-file): the controller picks a host, starts the
    /// service there, lists it on its dashboard and keeps it while this process runs. Paths
    /// (weights, tokenizer, template) must be readable on the hosts at the same place.
    #[arg(long)]
    pub controller: Option<String>,
    /// The serving job's name on the cluster (default: the controller names it `serve-N`).
    #[arg(long, requires = "controller")]
    pub job: Option<String>,
}

impl ServeArgs {
    /// How each replica is cut.
    pub fn layout(&self) -> Layout {
        Layout {
            tp: self.tp,
            pp: self.pp,
        }
    }

    /// How the replicas form their batches.
    pub fn scheduling(&self) -> Scheduling {
        match self.batching.as_str() {
            "static" => Scheduling::Static {
                wait: std::time::Duration::from_millis(self.batch_wait_ms),
            },
            _ => Scheduling::Continuous {
                step_tokens: self.max_step_tokens,
            },
        }
    }
}

/// Refuses flags that cannot go together or are out of range, before any file is read.
pub fn check_flags(args: &ServeArgs) -> Result<(), String> {
    let counts = [
        args.replicas,
        args.max_sequences,
        args.block_tokens,
        args.tp,
        args.pp,
    ];
    if counts.contains(&0) || args.micro_batches == Some(0) {
        return Err(
            "--replicas, --tp, --pp, --micro-batches, --max-sequences and --block-tokens must be 1 or more"
                .into(),
        );
    }
    if args.layout() != (Layout { tp: 1, pp: 1 }) && args.quantize.quantize.is_some() {
        return Err("--quantize int8 runs on one device per replica: drop --tp/--pp or --quantize".into());
    }
    args.quantize.check()?;
    match (args.batching.as_str(), args.max_step_tokens) {
        (_, Some(0)) => return Err("--max-step-tokens must be 1 or more".into()),
        ("static", Some(_)) => {
            return Err(
                "--max-step-tokens chunks prefill under continuous batching: drop it or --batching static"
                    .into(),
            );
        }
        _ => {}
    }
    Ok(())
}

/// The model, its weights and the plan, without starting anything.
pub fn plan(args: &ServeArgs) -> Result<(Summary, Vec<Vec<f32>>), String> {
    check_flags(args)?;
    let (spec, values, source) = args.weights.load()?;
    let Some(ctx) = spec.get("ctx").filter(|_| spec.get("vocab").is_some()) else {
        return Err(format!(
            "{spec} does not generate tokens: serve a gpt or gpt2 model"
        ));
    };
    if let Some(heads) = spec.get("heads").filter(|h| h % args.tp != 0) {
        return Err(format!(
            "--tp {}: {spec} has {heads} heads, which do not divide over {} ranks; give a --tp that divides {heads}",
            args.tp, args.tp
        ));
    }
    let value_bytes = if args.quantize.bf16() { 2 } else { 4 };
    let block_bytes = CachePool::block_bytes(&spec, args.block_tokens, 4);
    // Each actor holds its slices (padded where a split does not divide) and its own copy of
    // what is replicated (LayerNorms, positions, row-parallel biases).
    let mut actors = summary::actor_memory(&spec, args.layout(), value_bytes, block_bytes, 0)?;
    if args.quantize.quantize.is_some() {
        // Every projection (the model's own list): its weights from 4 bytes to 1, plus a 4-byte
        // scale per output column.
        for (_, [d_in, d_out]) in spec.projections() {
            let (d_in, d_out) = (d_in as u64, d_out as u64);
            actors[0].weight_bytes = actors[0].weight_bytes - 3 * d_in * d_out + 4 * d_out;
        }
    }
    let weight_bytes = actors.iter().map(|a| a.weight_bytes).sum();
    let (pool, sized_by) = pool_for(args, &spec, ctx, weight_bytes);
    if pool.blocks_for(2) > pool.total {
        return Err(format!(
            "the cache pool holds {} positions, fewer than one request needs: give --cache-tokens {} or more",
            pool.tokens(),
            args.block_tokens
        ));
    }
    let with_cache = summary::actor_memory(&spec, args.layout(), value_bytes, block_bytes, pool.total)?;
    for (actor, cached) in actors.iter_mut().zip(with_cache) {
        actor.cache_bytes = cached.cache_bytes;
    }
    if args.cache_tokens.is_some() {
        let needed = (weight_bytes + block_bytes * pool.total as u64) * args.replicas as u64;
        let free = crate::process_stats::mem_available_bytes();
        if needed > free {
            return Err(format!(
                "the weights and cache pools of {} replica(s) take {:.1} MiB, more than the {:.1} MiB free here: lower --cache-tokens or --replicas",
                args.replicas,
                mib(needed),
                mib(free)
            ));
        }
    }
    let summary = Summary {
        block_bytes,
        spec,
        source,
        weight_bytes,
        pool,
        replicas: args.replicas,
        sized_by,
        layout: args.layout(),
        actors,
    };
    Ok((summary, values))
}

/// Loads the model, starts the replicas and makes the routes' shared state; every request
/// carries the token of `--token-file`, when given.
pub fn build(args: &ServeArgs) -> Result<(Arc<Service>, Summary), String> {
    let token = match &args.token_file {
        Some(path) => Some(crate::cluster::read_token(path).map_err(|e| e.to_string())?),
        None => None,
    };
    build_with_token(args, token.map(|t| Arc::from(t.as_str())))
}

/// [`build`] with the token every request must carry given (a serving job on a host takes the
/// host's).
pub fn build_with_token(
    args: &ServeArgs,
    token: Option<Arc<str>>,
) -> Result<(Arc<Service>, Summary), String> {
    let (summary, values) = plan(args)?;
    let spec = &summary.spec;
    let (ctx, vocab) = (spec.get("ctx").unwrap_or(0), spec.get("vocab").unwrap_or(0));
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(|p| p.to_string_lossy().into_owned());
    let template = ChatTemplate::choose(args.chat_template.as_deref(), args.tokenizer.as_deref())?;
    let mut replicas = Vec::with_capacity(args.replicas);
    for r in 0..args.replicas {
        let (_, decode) = codec(tokenizer.as_deref(), vocab)?;
        let (name, batch) = (format!("replica-{r}"), (args.max_sequences, summary.pool));
        let started = if args.layout() != (Layout { tp: 1, pp: 1 }) {
            let micro_batches = args.micro_batches.unwrap_or(args.pp);
            let mut model =
                ShardedModel::load(spec, &values, args.layout())?.with_micro_batches(micro_batches);
            if args.quantize.bf16() {
                model.to_bf16();
            }
            Replica::start(&name, model, decode, batch, args.scheduling())
        } else {
            let mut model = WholeModel::load(spec, &values)?;
            args.quantize.apply(&mut model)?;
            Replica::start(&name, model, decode, batch, args.scheduling())
        };
        let replica = started.map_err(|e| format!("cannot start replica {r}'s thread: {e}"))?;
        replicas.push(replica);
    }
    drop(values);
    let stats = replicas.iter().map(Replica::shared_stats).collect();
    let (encode, _) = codec(tokenizer.as_deref(), vocab)?;
    let service = Service {
        replicas: Router::new(replicas)?,
        encode,
        template,
        name: (args.served_model_name.clone()).unwrap_or_else(|| spec.explicit()),
        ctx,
        vocab,
        metrics: metrics::Metrics::new(stats),
        max_body_bytes: args.max_body_bytes,
        connections: Arc::new(tokio::sync::Semaphore::new(args.max_connections.max(1))),
        token,
        answered: AtomicU64::new(0),
        seeds_drawn: AtomicU64::new(0),
        created: http::unix_seconds(),
    };
    Ok((Arc::new(service), summary))
}

/// One replica's pool and how it was sized: `--cache-tokens`, else `--cache-fraction` of the
/// memory free once every replica's weights are loaded, shared by the replicas, at most what
/// `--max-sequences` full contexts need.
fn pool_for(args: &ServeArgs, spec: &ModelSpec, ctx: usize, weight_bytes: u64) -> (CachePool, String) {
    let (tokens, sized_by) = match args.cache_tokens {
        Some(tokens) => (tokens, format!("--cache-tokens {tokens}")),
        None => {
            let other_replicas = weight_bytes * (args.replicas as u64 - 1);
            let available = crate::process_stats::mem_available_bytes().saturating_sub(other_replicas);
            let fraction = args.cache_fraction.clamp(0.0, 1.0);
            let bytes = (available as f64 * fraction / args.replicas as f64) as u64;
            let fitting = CachePool::fitting(spec, bytes, args.block_tokens, 4).tokens();
            let most = args.max_sequences * ctx;
            let why = if fitting > most {
                format!("{} full contexts of --max-sequences", args.max_sequences)
            } else {
                format!(
                    "{:.0}% of {:.1} GiB free",
                    fraction * 100.0,
                    available as f64 / (1u64 << 30) as f64
                )
            };
            (fitting.min(most), why)
        }
    };
    let pool = CachePool {
        block_tokens: args.block_tokens,
        total: tokens / args.block_tokens,
    };
    (pool, sized_by)
}

/// Serves on `listener` (TCP, or [`tls_listener::TlsListener`]) until the process ends.
pub async fn serve_on<L>(listener: L, service: Arc<Service>) -> std::io::Result<()>
where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    axum::serve(listener, http::app(service).into_make_service()).await
}

/// Runs `archipelago serve`.
pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    if let Some(controller) = &args.controller
        && !args.plan
    {
        return remote::serve_on_cluster(args, controller);
    }
    if args.plan {
        println!("{}", plan(args).map_err(anyhow::Error::msg)?.0.plan());
        return Ok(());
    }
    crate::dashboard::access::check_bind(&args.listen, args.token_file.is_some())?;
    let tls = match args.tls.files()? {
        Some(files) => Some(Arc::new(archipelago_actors::trust::Tls::load(&files)?)),
        None => None,
    };
    let (service, summary) = build(args).map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on --listen {}: {e}", args.listen))?;
        let addr = listener.local_addr()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        println!("serving {}", summary.line());
        println!("listening on {scheme}://{addr} (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics)");
        match tls {
            Some(tls) => serve_on(tls_listener::TlsListener::new(listener, tls)?, service).await?,
            None => serve_on(listener, service).await?,
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn args(extra: &[&str]) -> ServeArgs {
        let init = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../integration-tests/fixtures/gpt2/model.safetensors"
        );
        let base = ["serve", "--init", init, "--cache-tokens", "256"];
        Cli::parse_from(base.iter().chain(extra)).serve
    }

    #[test]
    fn the_plans_int8_weights_are_what_quantizing_the_model_leaves() {
        let (f32_plan, values) = plan(&args(&[])).unwrap();
        let (int8_plan, _) = plan(&args(&["--quantize", "int8"])).unwrap();
        let mut model = WholeModel::load(&f32_plan.spec, &values).unwrap();
        let bytes = model.quantize_int8(6.0).unwrap();
        assert!(bytes.layers > 0);
        let saved = bytes.f32_bytes - bytes.int8_bytes - bytes.scale_bytes;
        assert_eq!(f32_plan.weight_bytes - int8_plan.weight_bytes, saved as u64);
        let (bf16_plan, _) = plan(&args(&["--precision", "bf16"])).unwrap();
        assert_eq!(2 * bf16_plan.weight_bytes, f32_plan.weight_bytes);
        let both = plan(&args(&["--precision", "bf16", "--quantize", "int8"])).unwrap_err();
        assert!(both.contains("do not go together"), "{both}");
        let chunked_static = plan(&args(&["--batching", "static", "--max-step-tokens", "8"])).unwrap_err();
        assert!(chunked_static.contains("--max-step-tokens"), "{chunked_static}");
        let zero = plan(&args(&["--max-step-tokens", "0"])).unwrap_err();
        assert!(zero.contains("1 or more"), "{zero}");
        // At tp=2 the ranks hold their slices and each a copy of what is replicated.
        let (tp_plan, _) = plan(&args(&["--tp", "2"])).unwrap();
        let tp = ShardedModel::load(&f32_plan.spec, &values, Layout { tp: 2, pp: 1 }).unwrap();
        assert_eq!(tp_plan.weight_bytes, 4 * tp.params() as u64);
        assert!(tp_plan.weight_bytes > f32_plan.weight_bytes);
        // At tp=2 × pp=2 every actor holds what its rank of its stage loads, and a share of the
        // cache: the shares add up to the pool.
        let (plan_2x2, _) = plan(&args(&["--tp", "2", "--pp", "2"])).unwrap();
        let model = ShardedModel::load(&f32_plan.spec, &values, Layout { tp: 2, pp: 2 }).unwrap();
        let held: Vec<u64> = (model.rank_params().iter().flatten())
            .map(|&p| 4 * p as u64)
            .collect();
        let planned: Vec<u64> = plan_2x2.actors.iter().map(|a| a.weight_bytes).collect();
        assert_eq!(planned, held);
        let stages: Vec<_> = plan_2x2
            .actors
            .iter()
            .step_by(2)
            .map(|a| a.blocks.clone())
            .collect();
        assert_eq!(stages, model.stages());
        let cache: u64 = plan_2x2.actors.iter().map(|a| a.cache_bytes).sum();
        assert_eq!(cache, plan_2x2.cache_bytes());
        let too_many = plan(&args(&["--pp", "9"])).unwrap_err();
        assert!(too_many.contains("do not cut into 9 stages"), "{too_many}");
        let mut huge = args(&[]);
        huge.cache_tokens = Some(100_000_000_000);
        let huge = plan(&huge).unwrap_err();
        assert!(huge.contains("lower --cache-tokens"), "{huge}");
    }
}
