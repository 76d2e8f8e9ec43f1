//! `archipelago bench`: figures as JSON (to `--json FILE`), each with its unit, configuration
//! and the load average, and the physical limit measured in the same run where there is one
//! (memcpy for collectives, sequential file I/O for the NVMe offload tier); a summary table of
//! the headline figures on stdout ([`summary`]) and a line per section done on stderr.

pub mod actor_api;
mod collectives;
mod compression;
pub mod cross_process;
pub mod device;
mod hang;
mod kernels;
mod lora;
mod offload;
pub mod parameter_server;
mod peers;
mod precision;
mod precision_convergence;
mod scale;
mod serving;
pub mod slow_link;
mod slow_link_bench;
mod soak;
pub mod summary;
mod training;

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde_json::{Value, json};

use archipelago_actors::fabric::DataPath;

use crate::process_stats::load_avg;

/// Flags of `bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Fewer repetitions (under two minutes).
    #[arg(long)]
    pub quick: bool,
    /// Write every figure, with its configuration, as JSON here (stdout gets a summary of the
    /// headline figures).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Run only the training throughput on this device (`cuda:0` with a `cuda` build, or
    /// `cpu:0`): gpt-tiny and, on a GPU, a 151M-parameter gpt, tokens/s and model FLOP
    /// utilisation against the device's measured matmul rate and datasheet peak.
    #[arg(long)]
    pub device: Option<archipelago_dataflow::DeviceSpec>,
    /// Directory for the NVMe offload files and the sequential I/O baseline (a local disk;
    /// default: the system's temporary directory).
    #[arg(long)]
    pub nvme_dir: Option<PathBuf>,
    /// Run only the runtime API's actor-call figures (beside the in-process fabric's round
    /// trips) and stop.
    #[arg(long)]
    pub actor_api_only: bool,
    /// Run only the parameter server's figures (sparse logistic regression at 1, 2 and 4
    /// servers: pushes, pulls and bytes per second, examples per second) and stop.
    #[arg(long)]
    pub ps_only: bool,
    /// Run only the collectives (ring in one process, shared buffers in one process, ring over
    /// gRPC) beside a memcpy of the same bytes, and stop.
    #[arg(long)]
    pub collectives_only: bool,
    /// Run only the soak (10,000 short steps; 2,000 with --quick): memory at step 1,000 and at
    /// the end, with the dashboard attached, and stop.
    #[arg(long)]
    pub soak_only: bool,
    /// Run only the controller-at-scale figures (compiling a 4096-device plan; one step
    /// dispatched to 1024 no-op actors; starting 4096 of them) and stop.
    #[arg(long)]
    pub scale_only: bool,
    /// Run only the raw-TCP data path between two processes in clear and under mutual TLS
    /// (64 MiB ring collectives, round trips), with the all-reduce bandwidth ratio, and stop.
    #[arg(long)]
    pub tls_only: bool,
    /// Run only the data paths between two processes of this machine, one after the other in
    /// one window: shared memory, raw TCP and gRPC (64 MiB collectives, a 64 MiB tensor moved
    /// beside a memcpy, round trips), and stop.
    #[arg(long)]
    pub data_paths_only: bool,
    /// Run only the CPU kernels' section and stop: gpt-tiny and mlp-8x1024 at dp=1 and dp=2 with
    /// each CPU matmul this machine has (Flex, OpenBLAS as detected, OpenBLAS with each core
    /// type the CPU allows), each in a child process right beside a run of auto; with --peers, PyTorch's
    /// steps of the same workloads right after.
    #[arg(long)]
    pub kernels_only: bool,
    /// Run only mixed precision's section and stop: mlp-8x1024 and gpt-tiny at dp=2 in f32, bf16
    /// and f16, alternated (steps/s, the 16-bit step over f32's, fabric bytes, model state), then
    /// gpt-tiny for 300 steps in bf16 and f16 on one device, dp=2 ZeRO-3 and pp=2 × dp=2 against
    /// f32 on one device (the mean loss of the last 20 steps).
    #[arg(long)]
    pub precision_only: bool,
    /// Run only communication compression's section and stop: gpt-tiny at dp=2 for 300 steps
    /// uncompressed, with --compress int8, qsgd:8, qsgd:4, terngrad and topk:0.01, with
    /// --optimizer onebit-adam, and under ZeRO-3 with --quantize-grads int8,
    /// --quantize-weights int8 and both (the mean loss of the last 20 steps against the
    /// uncompressed run, fabric bytes per step measured and predicted, step time).
    #[arg(long)]
    pub compression_only: bool,
    /// With --compression-only: only the compressed runs whose name contains this text (e.g.
    /// `topk`), each beside the uncompressed run of its layout and optimizer.
    #[arg(long)]
    pub runs: Option<String>,
    /// Run only the slow link and stop (root; iproute2): mlp-8x1024 at dp=2 on two host
    /// processes in a network namespace of their own, over its loopback shaped to 100 Mbit/s
    /// with `tc tbf` and `--data-path tcp`, uncompressed, with top-k 1% and with 1-bit Adam
    /// (steps/s and its ratio to the uncompressed run's, gradient and link bytes per step).
    #[arg(long)]
    pub slow_link_only: bool,
    /// Run only gpt-tiny's layouts and stop: dp=1, dp=2, pp=2 (GPipe and 1F1B, m=8), ZeRO-3 at
    /// dp=2 and tp=2, one after the other in one window (tokens/s, fabric bytes per step).
    #[arg(long)]
    pub layouts_only: bool,
    /// Run only LoRA against full fine-tuning and stop: a GPT-2 of gpt-tiny's size at dp=2, full
    /// against adapters of rank 8 (on c_attn, and on every projection), alternated (steps/s,
    /// backward seconds, model-state, optimizer and gradient fabric bytes).
    #[arg(long)]
    pub lora_only: bool,
    /// Run only the serving load and stop: a GPT-2 of gpt-tiny's size behind `archipelago serve`
    /// on 127.0.0.1 with continuous and with static batching (16 requests or 50 ms), Poisson
    /// arrivals at 2, 8 and 32 requests/s and 16 clients in a closed loop (generated tokens/s,
    /// time to first token and inter-token latency p50/p99, cache-pool use), and batch-1
    /// decoding; with --peers, `transformers`' generate on the same weights.
    #[arg(long)]
    pub serving_only: bool,
    /// Run only the serving layouts and stop: the serving load's closed loop of 16 clients and
    /// Poisson arrivals at 8/s against one device, `--tp 2` and `--replicas 2` side by side.
    #[arg(long)]
    pub serving_layouts_only: bool,
    /// The Python of the peers' environment (`scripts/peers_venv.sh` makes it): PyTorch's gloo
    /// collectives and DDP steps are measured right after ours, in the same window, and their
    /// figures and our ratios to them land in the JSON (`peers`). Never in CI.
    #[arg(long, value_name = "PYTHON")]
    pub peers: Option<PathBuf>,
}

/// Runs the suite (or the sub-suite a flag picks), writes its JSON to `--json FILE` (only
/// there) and prints its summary on stdout; stderr gets a line as each section is done.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let out = match sub_suite(args)? {
        Some(out) => out,
        None => full_suite(args)?,
    };
    write_out(&out, args)
}

/// Repetitions of the 64 MiB collectives.
fn reps(args: &BenchArgs) -> usize {
    if args.quick { 5 } else { 15 }
}

/// Clocks of the parameter server's runs.
fn ps_clocks(args: &BenchArgs) -> u64 {
    if args.quick { 8 } else { 30 }
}

/// Steps of the soak.
fn soak_steps(args: &BenchArgs) -> u64 {
    if args.quick { 2_000 } else { 10_000 }
}

/// The JSON of the sub-suite `--device` or a `--*-only` flag picks (`None`: the full suite).
fn sub_suite(args: &BenchArgs) -> anyhow::Result<Option<Value>> {
    let started = Instant::now();
    let wall = || started.elapsed().as_secs_f64();
    let out = if let Some(device) = args.device {
        let training = device::gpt_on_device(device, args.quick)?;
        json!({ "suite": "device", "quick": args.quick, "device_training": training, "peak_rss_bytes_bench_process": crate::process_stats::peak_rss_bytes(), "wall_s": wall() })
    } else if args.ps_only {
        let ps = parameter_server::sparse_scaling(&[1, 2, 4], 2, 1024, ps_clocks(args))?;
        json!({ "suite": "parameter_server", "quick": args.quick, "parameter_server": ps, "load_avg_end": load_avg(), "wall_s": wall() })
    } else if args.soak_only {
        let soak = soak::soak(soak_steps(args))?;
        json!({ "suite": "soak", "soak": soak, "wall_s": wall() })
    } else if args.layouts_only {
        let (warmup, timed) = if args.quick { (2, 3) } else { (5, 30) };
        json!({ "suite": "layouts", "quick": args.quick, "gpt_tiny": training::gpt_tiny(warmup, timed)?, "load_avg_end": load_avg(), "wall_s": wall() })
    } else if args.lora_only {
        let (warmup, timed, rounds) = if args.quick { (2, 3, 1) } else { (3, 15, 2) };
        json!({ "suite": "lora", "quick": args.quick, "lora": lora::lora_vs_full(warmup, timed, rounds)?, "load_avg_end": load_avg(), "wall_s": wall() })
    } else if args.serving_layouts_only {
        let layouts = serving::serving_layouts(args.quick)?;
        json!({ "suite": "serving_layouts", "quick": args.quick, "serving_layouts": layouts, "load_avg_end": load_avg(), "wall_s": wall() })
    } else if args.serving_only {
        let serving = serving::serving(args.quick, args.peers.as_deref())?;
        json!({ "suite": "serving", "quick": args.quick, "serving": serving, "load_avg_end": load_avg(), "wall_s": wall() })
    } else if args.scale_only {
        json!({ "suite": "scale", "scale": scale_only(args)?, "wall_s": wall() })
    } else if args.tls_only {
        let tcp = cross_process::plain_vs_tls(&peer_args(args, reps(args), DataPath::Tcp))?;
        json!({ "suite": "tls", "tcp_2_processes": tcp, "wall_s": wall() })
    } else if args.data_paths_only {
        data_paths_only(args, started)?
    } else if args.kernels_only {
        kernels_only(args)
    } else if args.precision_only {
        let (warmup, timed) = if args.quick { (2, 3) } else { (5, 30) };
        let precision = precision::mixed_precision(warmup, timed)?;
        let convergence = precision_convergence::convergence(if args.quick { 30 } else { 300 })?;
        json!({ "suite": "precision", "quick": args.quick, "precision": precision, "convergence": convergence, "wall_s": wall() })
    } else if args.compression_only {
        let steps = if args.quick { 30 } else { 300 };
        let convergence = compression::convergence(steps, args.runs.as_deref())?;
        json!({ "suite": "compression", "quick": args.quick, "compression": convergence, "load_avg_end": load_avg(), "wall_s": wall() })
    } else if args.slow_link_only {
        let link = slow_link_bench::slow_link(if args.quick { 6 } else { 20 })?;
        json!({ "suite": "slow_link", "quick": args.quick, "slow_link": link, "load_avg_end": load_avg(), "wall_s": wall() })
    } else if args.actor_api_only {
        actor_api_only(args, started)?
    } else if args.collectives_only {
        json!({ "suite": "collectives", "collectives": ring(reps(args)), "wall_s": wall() })
    } else {
        return Ok(None);
    };
    Ok(Some(out))
}

/// `--scale-only`: the plan, and one step dispatched to 1024 no-op and working actors and to
/// 4096 no-op ones.
fn scale_only(args: &BenchArgs) -> anyhow::Result<Value> {
    let steps = if args.quick { 20 } else { 100 };
    Ok(json!({
        "plan": scale::plan_4096_devices(if args.quick { 1 } else { 3 })?,
        "dispatch": scale::noop_step(1024, steps)?,
        "dispatch_working": scale::working_step(1024, steps)?,
        "dispatch_4096": scale::noop_step(4096, steps / 4)?,
    }))
}

/// `--data-paths-only`: shared memory, raw TCP and gRPC between two processes, and (with
/// `--peers`) gloo's collectives right after, with shared memory's all-reduce over gloo's.
fn data_paths_only(args: &BenchArgs, started: Instant) -> anyhow::Result<Value> {
    let reps = reps(args);
    let peer = peer_args(args, reps, DataPath::Shm);
    let paths = cross_process::data_paths(&peer)?;
    let peers = args.peers.as_deref().map(|python| {
        let gloo = peers::gloo(python, peer.bytes, reps);
        let ours = (paths["shm_2_processes"]["collectives"].as_array())
            .and_then(|c| c.iter().find(|r| r["name"] == "all_reduce_shm_2_processes"))
            .and_then(|r| r["algbw_gb_per_s"].as_f64());
        let ratio = ours
            .zip(peers::gloo_gb_per_s(&gloo, "all_reduce"))
            .map(|(o, g)| o / g);
        json!({ "gloo": gloo, "all_reduce_shm_over_gloo": ratio, "aim": 3.0 })
    });
    Ok(
        json!({ "suite": "data_paths", "data_paths": paths, "peers": peers, "load_avg_end": load_avg(), "wall_s": started.elapsed().as_secs_f64() }),
    )
}

/// `--actor-api-only`: the runtime API's actor calls beside the fabric's round trips, in one
/// process and between two.
fn actor_api_only(args: &BenchArgs, started: Instant) -> anyhow::Result<Value> {
    let peer = cross_process::PeerArgs {
        bytes: 1 << 20,
        ..peer_args(args, 1, DataPath::Grpc)
    };
    let fabric = cross_process::in_process(&peer);
    let tcp = cross_process::between_processes(&cross_process::PeerArgs {
        data_path: DataPath::Tcp,
        ..peer.clone()
    })?;
    let api = json!({
        "in_process": actor_api::in_process(peer.round_trips, peer.batches, &fabric["round_trips"])?,
        "two_processes": actor_api::between_processes(peer.round_trips, peer.batches, &tcp["round_trips"])?,
    });
    Ok(
        json!({ "suite": "actor_api", "fabric_in_process": fabric["round_trips"], "fabric_tcp_2_processes": tcp["round_trips"], "actor_api": api, "wall_s": started.elapsed().as_secs_f64() }),
    )
}

/// The in-process collectives (shared buffers, ring in one process, ring over gRPC on
/// 127.0.0.1), 64 MiB between 2 members `reps` times, each beside a memcpy of the same bytes.
fn ring(reps: usize) -> Vec<Value> {
    let mut ring = Vec::new();
    for transport in [
        collectives::Transport::SharedBuffers,
        collectives::Transport::InProcess,
        collectives::Transport::GrpcLoopback,
    ] {
        for kind in [
            collectives::RingOp::AllReduce,
            collectives::RingOp::ReduceScatter,
            collectives::RingOp::AllGather,
        ] {
            ring.push(collectives::ring_vs_memcpy(kind, transport, 64 << 20, 2, reps));
        }
    }
    ring
}

/// Times the sections of a suite: one line on stderr as each is done.
struct Progress(Instant);

impl Progress {
    fn start() -> Progress {
        Progress(Instant::now())
    }

    /// Says that `section` is done, and in how long; times the next one from now.
    fn done(&mut self, section: &str) {
        eprintln!("bench: {section} done in {:.1} s", self.0.elapsed().as_secs_f64());
        self.0 = Instant::now();
    }
}

/// The full suite, section after section in one window.
fn full_suite(args: &BenchArgs) -> anyhow::Result<Value> {
    let started = Instant::now();
    let mut progress = Progress::start();
    let reps = reps(args);
    let ring = ring(reps);
    progress.done("collectives");
    let peer = peer_args(args, reps, DataPath::Grpc);
    let processes = data_paths(&peer)?;
    progress.done("cross_process");
    let api = json!({
        "in_process": actor_api::in_process(peer.round_trips, peer.batches, &processes["in_process"]["round_trips"])?,
        "two_processes": actor_api::between_processes(peer.round_trips, peer.batches, &processes["tcp_2_processes"]["round_trips"])?,
    });
    progress.done("actor_api");
    let scale = json!({
        "plan": scale::plan_4096_devices(if args.quick { 1 } else { 3 })?,
        "dispatch": scale::noop_step(1024, if args.quick { 20 } else { 100 })?,
        "hang_report": hang::hang_to_report()?,
    });
    progress.done("controller_at_scale");
    let mut out = training_sections(args, &peer, &mut progress)?;
    // One round of fewer steps here; `--kernels-only` runs two of WORKLOADS.md's length.
    let cpu_kernels = kernels::kernels(kernels::Settings::new(true));
    progress.done("kernels");
    let (warmup, timed) = if args.quick { (2, 8) } else { (5, 30) };
    let dir = args.nvme_dir.clone().unwrap_or_else(std::env::temp_dir);
    let offload = offload::mlp_offload(warmup, timed, &dir)?;
    progress.done("offload");
    let soak = soak::soak(soak_steps(args))?;
    progress.done("soak");
    let ps = parameter_server::sparse_scaling(&[1, 2, 4], 2, 1024, ps_clocks(args))?;
    progress.done("parameter_server");
    let physical = physical_limits(args);
    progress.done("physical_limits");
    let rest = json!({
        "physical_limits": physical,
        "suite": "foundation+pipeline+zero+offload+multi_host",
        "quick": args.quick,
        "collectives": ring,
        "cross_process": processes,
        "actor_api": api,
        "controller_at_scale": scale,
        "kernels": cpu_kernels,
        "offload": offload,
        "soak": soak,
        "parameter_server": ps,
        "load_avg_end": load_avg(),
        // VmHWM of this process over the whole suite (every in-process run shares it); the peer
        // process's is under cross_process.*_2_processes.peak_rss_bytes.
        "peak_rss_bytes_bench_process": crate::process_stats::peak_rss_bytes(),
        "wall_s": started.elapsed().as_secs_f64(),
    });
    merge(&mut out, rest);
    Ok(out)
}

/// The data paths of the full suite: in one process, and between two over gRPC, shared
/// memory, and raw TCP in clear and under TLS.
fn data_paths(peer: &cross_process::PeerArgs) -> anyhow::Result<Value> {
    let tcp = cross_process::PeerArgs {
        data_path: DataPath::Tcp,
        ..peer.clone()
    };
    let tcp_tls = cross_process::plain_vs_tls(&tcp)?;
    let shm = cross_process::PeerArgs {
        data_path: DataPath::Shm,
        ..peer.clone()
    };
    Ok(json!({
        "in_process": cross_process::in_process(peer),
        "grpc_2_processes": cross_process::between_processes(peer)?,
        "shm_2_processes": cross_process::between_processes(&shm)?,
        "tcp_2_processes": tcp_tls["plain"],
        "tcp_tls_2_processes": tcp_tls["tls"],
        "tcp_all_reduce_tls_over_plain": tcp_tls["all_reduce_tls_over_plain"],
    }))
}

/// The full suite's training runs (mlp data-parallel, pipelined, ZeRO; gpt-tiny) and, with
/// `--peers`, PyTorch's steps and gloo's collectives right after, with the ratios.
fn training_sections(
    args: &BenchArgs,
    peer: &cross_process::PeerArgs,
    progress: &mut Progress,
) -> anyhow::Result<Value> {
    let (warmup, timed) = if args.quick { (2, 8) } else { (5, 30) };
    let training = training::mlp_dp_scaling(warmup, timed)?;
    progress.done("training");
    let pipeline = training::mlp_pipeline(warmup, timed)?;
    progress.done("pipeline");
    let zero = training::mlp_zero(warmup, timed)?;
    progress.done("zero");
    // WORKLOADS.md: warm up 5 steps, time 30 (gpt-tiny takes ~2 s a step here: fewer when quick).
    let gpt = if args.quick {
        training::gpt_tiny(2, 3)?
    } else {
        training::gpt_tiny(warmup, timed)?
    };
    progress.done("gpt_tiny");
    let precision = if args.quick {
        precision::mixed_precision(2, 3)?
    } else {
        precision::mixed_precision(warmup, timed)?
    };
    progress.done("precision");
    let peers = args.peers.as_deref().map(|python| {
        let (warmup, timed) = if args.quick { (2, 5) } else { (warmup, timed) };
        let torch = peers::torch_training(python, "gpt-tiny,mlp-8x1024", warmup, timed);
        let gloo = peers::gloo(python, peer.bytes, peer.reps);
        let mut ratios = peers::throughput_ratios(&training, &torch);
        if let (Some(all), Some(more)) = (
            ratios.as_array_mut(),
            peers::throughput_ratios(&gpt, &torch).as_array(),
        ) {
            all.extend(more.iter().cloned());
        }
        json!({ "torch_training": torch, "gloo": gloo, "training_ours_over_torch": ratios })
    });
    if peers.is_some() {
        progress.done("peers");
    }
    Ok(
        json!({ "training": training, "pipeline": pipeline, "zero": zero, "gpt_tiny": gpt, "precision": precision, "peers": peers }),
    )
}

/// The matmul rate of one core (burn's Flex and the CPU kernel the runs use).
fn physical_limits(args: &BenchArgs) -> Value {
    let reps = if args.quick { 5 } else { 20 };
    json!({
        "matmul_gflops_one_thread": archipelago_actors::peak::matmul_gflops(512, reps),
        "config": { "n": 512, "dtype": "f32", "backend": "burn Flex, one thread (one actor's core)" },
        "cpu_matmul_gflops_one_thread": archipelago_actors::peak::cpu_kernel_matmul_gflops(512, reps),
        "cpu_matmul": archipelago_actors::kernels::describe(),
        "load_avg": load_avg(),
    })
}

/// Adds the fields of the object `more` to the object `out`.
fn merge(out: &mut Value, more: Value) {
    if let (Some(out), Value::Object(more)) = (out.as_object_mut(), more) {
        out.extend(more);
    }
}

/// `--kernels-only`: the kernels' section, then (with `--peers`) PyTorch's steps of the same
/// workloads and auto's throughput over PyTorch's.
fn kernels_only(args: &BenchArgs) -> Value {
    let started = Instant::now();
    let settings = kernels::Settings::new(args.quick);
    let section = kernels::kernels(settings);
    let peers = args.peers.as_deref().map(|python| {
        let (warmup, timed) = settings.mlp_steps;
        let torch = peers::torch_training(python, "gpt-tiny,mlp-8x1024", warmup, timed);
        let ratios = peers::throughput_ratios(&kernels::auto_runs(&section), &torch);
        json!({ "torch_training": torch, "auto_over_torch": ratios, "load_avg_end": load_avg() })
    });
    json!({
        "suite": "kernels",
        "quick": args.quick,
        "cpu_matmul": archipelago_actors::kernels::describe(),
        "kernels": section,
        "peers": peers,
        "load_avg_end": load_avg(),
        "wall_s": started.elapsed().as_secs_f64(),
    })
}

/// The cross-process script's settings for `path`: 64 MiB collectives `reps` times, then the
/// round trips (fewer with `--quick`).
fn peer_args(args: &BenchArgs, reps: usize, path: DataPath) -> cross_process::PeerArgs {
    cross_process::PeerArgs {
        reps,
        bytes: 64 << 20,
        round_trips: if args.quick { 2000 } else { 10_000 },
        batches: if args.quick { 5 } else { 20 },
        data_path: path,
        tls_dir: None,
    }
}

/// Writes the suite's JSON to `--json FILE` (if given) and prints its summary on stdout.
fn write_out(out: &Value, args: &BenchArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(out)?)?;
    }
    for line in summary::summary(out, args.json.as_deref()) {
        println!("{line}");
    }
    Ok(())
}
