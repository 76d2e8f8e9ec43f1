//! Cross-process benchmarks: this process and a peer process (`archipelago bench-peer`, started
//! here) each serve a gRPC fabric on 127.0.0.1 and run the same script as actors 0 and 1 — the
//! three ring collectives of 64 MiB, then actor round trips of one-value tensors, synchronous
//! (one in flight) and pipelined (1000 in flight); then one caller (actor 0, here) and 8 actors
//! (1..=8, threads of the peer) with 1000 calls in flight spread over the 8. The same script over
//! the in-process fabric (threads) gives the in-process figures beside them.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{Value, json};

use archipelago_actors::TypedTensor;
use archipelago_actors::collectives::{
    ChunkPool, DEFAULT_CHUNK_ELEMS, ring_all_gather, ring_all_reduce, ring_reduce_scatter,
};
use archipelago_actors::fabric::Tag;
use archipelago_actors::fabric::{
    DataPath, Fabric, GrpcFabric, InProcessFabric, Inbox, TcpFabric, serve_fabric, serve_tcp_fabric,
};
use archipelago_actors::trust::{Credentials, Tls, TlsFiles};
use archipelago_dataflow::ActorId;

use super::collectives::Ring;
use crate::process_stats::load_avg;
use crate::report::median;

const TOKEN: &str = "bench";
/// How long a receive may wait (callees wait through the whole 2-actor script first).
const PATIENCE: Duration = Duration::from_secs(600);
const IN_FLIGHT: usize = 1000;
/// Rounds of the in-flight phase (each `batches` × [`IN_FLIGHT`] round trips); the median
/// round is the figure. The actor-API bench measures its in-flight calls the same way.
pub(super) const IN_FLIGHT_ROUNDS: usize = 5;
/// Actors one caller spreads its calls over (WORKLOADS.md: one caller → 8 actors pipelined).
const FAN_OUT: usize = 8;
/// Actors on the fabric: the caller and the 8 callees (actors 0 and 1 also run the 2-actor script).
const ACTORS: usize = 1 + FAN_OUT;

/// Flags of the hidden `bench-peer` subcommand (the other end of the cross-process benchmark).
#[derive(Debug, Clone, Args)]
pub struct PeerArgs {
    /// Repetitions of each collective.
    #[arg(long)]
    pub reps: usize,
    /// Bytes per collective.
    #[arg(long)]
    pub bytes: usize,
    /// Synchronous round trips.
    #[arg(long)]
    pub round_trips: usize,
    /// Batches of 1000 round trips in flight.
    #[arg(long)]
    pub batches: usize,
    /// `grpc` or `tcp`.
    #[arg(long, default_value = "grpc")]
    pub data_path: DataPath,
    /// Mutual TLS with the certificates in this directory (`ca.pem`; `a.*` for this process,
    /// `b.*` for the peer), as `archipelago certs --name a --name b` makes them.
    #[arg(long)]
    pub tls_dir: Option<std::path::PathBuf>,
}

impl PeerArgs {
    /// The credentials of side `name` (`a` or `b`): the bench token, with TLS when asked.
    fn credentials(&self, name: &str) -> Credentials {
        let credentials = Credentials::new(TOKEN);
        match &self.tls_dir {
            None => credentials,
            Some(dir) => {
                let files = TlsFiles {
                    cert: dir.join(format!("{name}.pem")),
                    key: dir.join(format!("{name}.key")),
                    ca: dir.join("ca.pem"),
                };
                credentials.with_tls(Arc::new(Tls::load(&files).expect("the bench's TLS files")))
            }
        }
    }

    /// The transport's name in the figures (`tcp`, `tcp_tls`, …).
    fn transport(&self) -> String {
        match self.tls_dir {
            None => self.data_path.to_string(),
            Some(_) => format!("{}_tls", self.data_path),
        }
    }
}

/// What one side of the script measured.
struct Figures {
    collectives: Vec<(&'static str, f64, Vec<f64>)>,
    sync_s: f64,
    pipelined_s: f64,
    /// One caller → 8 actors, 1000 in flight (`args.batches` batches); the caller's side only.
    fan_out_s: f64,
    /// One tensor of `args.bytes` moved from actor 0 to actor 1 (until 0 has 1's one-value
    /// acknowledgement), per repetition; actor 0's side only.
    move_s: Vec<f64>,
}

/// Actor 0 sends a tensor of `bytes` to actor 1, which acknowledges it with one value, `reps`
/// times (the tensor is built once: the send shares its buffer, as a trainer's does).
fn move_tensor(fabric: &dyn Fabric, me: ActorId, bytes: usize, reps: usize) -> Vec<f64> {
    let tensor = TypedTensor::flat(vec![1.5f32; bytes / 4]);
    let mut times = Vec::with_capacity(reps);
    for rep in 0..reps as u64 {
        let edge = (13 << 40) | (rep << 8);
        barrier(fabric, me, edge | 1);
        let tag = Tag { edge, seq: 0 };
        let t = Instant::now();
        if me == 0 {
            fabric.send(0, 1, tag, tensor.clone()).expect("tensor");
            fabric.recv(0, 1, tag).expect("acknowledgement");
            times.push(t.elapsed().as_secs_f64());
        } else {
            let got = fabric.recv(1, 0, tag).expect("tensor");
            assert_eq!(got.elements(), bytes / 4, "the moved tensor's length");
            fabric
                .send(1, 0, tag, TypedTensor::scalar(got.f32s()[got.elements() - 1]))
                .expect("acknowledgement");
        }
    }
    times
}

/// One caller → [`FAN_OUT`] actors pipelined: actor 0 sends `IN_FLIGHT` one-value calls spread
/// round-robin over actors 1..=8, then takes all replies; each callee echoes its share. Returns
/// the caller's time (0 for callees).
fn fan_out(fabric: &dyn Fabric, me: ActorId, batches: usize) -> f64 {
    let edge = 12 << 40;
    let t = Instant::now();
    for batch in 0..batches as u64 {
        let tag = |i: usize| Tag {
            edge: edge | (batch << 8),
            seq: i as u64,
        };
        let callee = |i: usize| 1 + i % FAN_OUT;
        if me == 0 {
            for i in 0..IN_FLIGHT {
                fabric
                    .send(0, callee(i), tag(i), TypedTensor::flat(vec![1.0]))
                    .expect("call");
            }
            for i in 0..IN_FLIGHT {
                fabric.recv(0, callee(i), tag(i)).expect("reply");
            }
        } else {
            for i in (0..IN_FLIGHT).filter(|&i| callee(i) == me) {
                let v = fabric.recv(me, 0, tag(i)).expect("call");
                fabric.send(me, 0, tag(i), v).expect("reply");
            }
        }
    }
    if me == 0 { t.elapsed().as_secs_f64() } else { 0.0 }
}

/// Runs the callees 2..=8 of [`fan_out`] on threads (actor 1 is the caller of the script's
/// other half and joins the fan-out after it).
fn spawn_callees(fabric: &Arc<dyn Fabric>, batches: usize) -> Vec<std::thread::JoinHandle<f64>> {
    (2..ACTORS)
        .map(|me| {
            let fabric = fabric.clone();
            std::thread::spawn(move || fan_out(fabric.as_ref(), me, batches))
        })
        .collect()
}

fn barrier(fabric: &dyn Fabric, me: ActorId, edge: u64) {
    let peer = 1 - me;
    let tag = Tag { edge, seq: 0 };
    fabric
        .send(me, peer, tag, TypedTensor::flat(vec![0.0]))
        .expect("barrier send");
    fabric.recv(me, peer, tag).expect("barrier recv");
}

/// The script both sides run, as actor `me` of 2.
fn script(fabric: &dyn Fabric, me: ActorId, args: &PeerArgs) -> Figures {
    let rings: [(&'static str, Ring, f64); 3] = [
        ("all_reduce", ring_all_reduce, 2.0),
        ("reduce_scatter", ring_reduce_scatter, 1.0),
        ("all_gather", ring_all_gather, 1.0),
    ];
    let group = [0, 1];
    let mut data = vec![me as f32; args.bytes / 4];
    let mut pool = ChunkPool::default();
    let mut collectives = Vec::new();
    for (k, (name, run, traffic)) in rings.into_iter().enumerate() {
        let mut times = Vec::new();
        for rep in 0..args.reps as u64 {
            let edge = ((k as u64 + 1) << 40) | (rep << 8);
            barrier(fabric, me, edge | 1);
            let t = Instant::now();
            run(
                fabric,
                me,
                &group,
                edge,
                &mut data,
                DEFAULT_CHUNK_ELEMS,
                &mut pool,
            )
            .expect("collective");
            times.push(t.elapsed().as_secs_f64());
        }
        collectives.push((name, traffic, times));
    }
    let peer = 1 - me;
    let one = || TypedTensor::flat(vec![1.0]);
    let sync_edge = 10 << 40;
    barrier(fabric, me, sync_edge | 1);
    let t = Instant::now();
    for i in 0..args.round_trips as u64 {
        let tag = Tag {
            edge: sync_edge,
            seq: i,
        };
        if me == 0 {
            fabric.send(0, 1, tag, one()).expect("ping");
            fabric.recv(0, 1, tag).expect("pong");
        } else {
            let v = fabric.recv(1, 0, tag).expect("ping");
            fabric.send(1, 0, tag, v).expect("pong");
        }
    }
    let sync_s = t.elapsed().as_secs_f64();
    // The in-flight phase is short (tens of ms): it runs IN_FLIGHT_ROUNDS times and the median
    // round counts, so that one preemption by another process does not make the figure.
    let mut rounds = Vec::with_capacity(IN_FLIGHT_ROUNDS);
    for round in 0..IN_FLIGHT_ROUNDS as u64 {
        let pipe_edge = (11 << 40) | (round << 32);
        barrier(fabric, me, pipe_edge | 1);
        let t = Instant::now();
        for batch in 0..args.batches as u64 {
            let tag = |i: usize| Tag {
                edge: pipe_edge | (batch << 8),
                seq: i as u64,
            };
            if me == 0 {
                for i in 0..IN_FLIGHT {
                    fabric.send(0, 1, tag(i), one()).expect("ping");
                }
                for i in 0..IN_FLIGHT {
                    fabric.recv(0, 1, tag(i)).expect("pong");
                }
            } else {
                for i in 0..IN_FLIGHT {
                    let v = fabric.recv(1, 0, tag(i)).expect("ping");
                    fabric.send(1, peer, tag(i), v).expect("pong");
                }
            }
        }
        rounds.push(t.elapsed().as_secs_f64());
    }
    let pipelined_s = median(&mut rounds);
    let fan_out_s = fan_out(fabric, me, args.batches);
    let move_s = move_tensor(fabric, me, args.bytes, args.reps);
    Figures {
        collectives,
        sync_s,
        pipelined_s,
        fan_out_s,
        move_s,
    }
}

/// A fabric endpoint on `path`; returns the runtime serving it (gRPC), the inbox and its
/// address (the fabric is connected once the peer's address is known).
fn endpoint(
    path: DataPath,
    credentials: &Credentials,
) -> (tokio::runtime::Runtime, Arc<InProcessFabric>, String) {
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let inbox = Inbox::default();
    // The mailboxes are in place before the address is given out: nothing arrives before them.
    let local = Arc::new(InProcessFabric::new(ACTORS, PATIENCE));
    inbox.install(Some(local.clone()));
    let addr = match path {
        DataPath::Grpc => runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            serve_fabric(listener, inbox.clone(), credentials).expect("fabric server")
        }),
        DataPath::Tcp | DataPath::Shm | DataPath::Auto => {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            serve_tcp_fabric(listener, inbox.clone(), credentials).expect("tcp fabric server")
        }
    };
    (runtime, local, addr.to_string())
}

fn connect(
    path: DataPath,
    runtime: &tokio::runtime::Runtime,
    local: Arc<InProcessFabric>,
    addrs: &[String],
    here: &str,
    credentials: &Credentials,
) -> Arc<dyn Fabric> {
    match path {
        DataPath::Grpc => Arc::new(
            runtime
                .block_on(GrpcFabric::connect(addrs, here, local, credentials))
                .expect("connect the fabric"),
        ),
        path @ (DataPath::Tcp | DataPath::Shm | DataPath::Auto) => {
            Arc::new(TcpFabric::connect(addrs, here, local, credentials, path).expect("connect the fabric"))
        }
    }
}

/// `archipelago bench-peer`: prints its fabric address, reads the other side's from stdin, runs
/// the script as actor 1.
pub fn peer_main(args: &PeerArgs) -> anyhow::Result<()> {
    let credentials = args.credentials("b");
    let (runtime, local, here) = endpoint(args.data_path, &credentials);
    println!("peer fabric {here}");
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let mut addrs = vec![line.trim().to_string()];
    addrs.extend(std::iter::repeat_n(here.clone(), FAN_OUT));
    let fabric = connect(args.data_path, &runtime, local, &addrs, &here, &credentials);
    let callees = spawn_callees(&fabric, args.batches);
    script(fabric.as_ref(), 1, args);
    for c in callees {
        c.join()
            .map_err(|_| anyhow::anyhow!("a callee thread panicked"))?;
    }
    // The peer's peak RSS, for the suite's memory figures.
    println!("peer peak_rss_bytes {}", crate::process_stats::peak_rss_bytes());
    std::io::stdout().flush()?;
    // Stay up until the other side has every reply and has closed its streams to this one (it
    // closes stdin then); then close this side's and go.
    std::io::stdin().read_line(&mut String::new())?;
    drop(fabric);
    std::thread::sleep(Duration::from_millis(200));
    Ok(())
}

fn figures_json(transport: &str, figures: Figures, args: &PeerArgs) -> Value {
    let gbs = |s: f64| args.bytes as f64 / s / 1e9;
    let collectives: Vec<Value> = figures
        .collectives
        .into_iter()
        .map(|(name, traffic, mut times)| {
            let s = median(&mut times);
            json!({
                "name": format!("{name}_{transport}"),
                "config": { "bytes": args.bytes, "members": 2, "transport": transport, "reps": args.reps, "algorithm": "ring, chunked, pipelined" },
                "median_s": s,
                "algbw_gb_per_s": gbs(s),
                "busbw_gb_per_s": gbs(s) * traffic / 2.0,
            })
        })
        .collect();
    let pipelined = (args.batches * IN_FLIGHT) as f64;
    // The bound of a move: one memcpy of the same bytes in this process, measured right after.
    let mut memcpy_s = Vec::new();
    super::collectives::memcpy_times(args.bytes / 4, args.reps.max(3), &mut memcpy_s);
    let (mut move_s, memcpy_s) = (figures.move_s, median(&mut memcpy_s));
    let move_s = median(&mut move_s);
    json!({
        "transport": transport,
        "collectives": collectives,
        "tensor_move": {
            "config": { "bytes": args.bytes, "reps": args.reps, "statistic": "median; until the receiver's one-value acknowledgement is back" },
            "median_s": move_s,
            "gb_per_s": gbs(move_s),
            "memcpy_gb_per_s": gbs(memcpy_s),
            "fraction_of_memcpy": memcpy_s / move_s,
        },
        "round_trips": {
            "config": { "payload": "one f32", "sync_round_trips": args.round_trips, "in_flight": IN_FLIGHT, "pipelined_round_trips": pipelined, "pipelined_rounds": IN_FLIGHT_ROUNDS, "pipelined_statistic": "median round", "fan_out_callees": FAN_OUT },
            "sync_per_s": args.round_trips as f64 / figures.sync_s,
            "sync_latency_us": figures.sync_s / args.round_trips as f64 * 1e6,
            "in_flight_1000_per_s": pipelined / figures.pipelined_s,
            "one_caller_8_actors_in_flight_1000_per_s": pipelined / figures.fan_out_s,
        },
        "load_avg": load_avg(),
    })
}

/// Starts a second process of this binary with `args`; returns it, its standard output, and
/// what its first line says after `prefix` (its address).
pub(super) fn start_peer(
    args: &[&str],
    prefix: &str,
) -> anyhow::Result<(Child, BufReader<ChildStdout>, String)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    let said = line
        .trim()
        .strip_prefix(prefix)
        .ok_or_else(|| anyhow::anyhow!("the bench's other process ({}) said `{line}`", args[0]))?
        .to_string();
    Ok((child, stdout, said))
}

/// The peak RSS a peer process printed in its last words (`peer peak_rss_bytes N`; 0 if none).
pub(super) fn peer_peak_rss(rest: &str) -> u64 {
    rest.lines()
        .find_map(|l| l.strip_prefix("peer peak_rss_bytes "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The script between this process and a peer process over `args.data_path` on 127.0.0.1.
pub fn between_processes(args: &PeerArgs) -> anyhow::Result<Value> {
    let reps = args.reps.to_string();
    let bytes = args.bytes.to_string();
    let round_trips = args.round_trips.to_string();
    let batches = args.batches.to_string();
    let data_path = args.data_path.to_string();
    let mut peer_args = vec![
        "bench-peer",
        "--reps",
        &reps,
        "--bytes",
        &bytes,
        "--round-trips",
        &round_trips,
        "--batches",
        &batches,
        "--data-path",
        &data_path,
    ];
    let tls_dir = args.tls_dir.as_ref().map(|d| d.to_string_lossy().into_owned());
    if let Some(dir) = &tls_dir {
        peer_args.extend(["--tls-dir", dir]);
    }
    let (mut child, mut stdout, peer) = start_peer(&peer_args, "peer fabric ")?;
    let credentials = args.credentials("a");
    let (runtime, local, here) = endpoint(args.data_path, &credentials);
    let mut stdin = child.stdin.take().expect("piped");
    writeln!(stdin, "{here}")?;
    let mut addrs = vec![here.clone()];
    addrs.extend(std::iter::repeat_n(peer, FAN_OUT));
    let fabric = connect(args.data_path, &runtime, local, &addrs, &here, &credentials);
    let figures = script(fabric.as_ref(), 0, args);
    // Close this side's streams while the peer still listens (no stream breaks mid-flight),
    // then let the peer go.
    drop(fabric);
    std::thread::sleep(Duration::from_millis(200));
    drop(stdin);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest)?;
    let status = child.wait()?;
    if !status.success() {
        anyhow::bail!("the bench peer failed: {status}");
    }
    let peer_rss = peer_peak_rss(&rest);
    let transport = format!("{}_2_processes", args.transport());
    let mut out = figures_json(&transport, figures, args);
    out["peak_rss_bytes"] =
        json!({ "this_process_so_far": crate::process_stats::peak_rss_bytes(), "peer": peer_rss });
    Ok(out)
}

/// [`between_processes`] twice in one window on the same path: in clear, then under mutual TLS
/// (certificates made for the run with `archipelago certs`' code, removed after); with the TLS
/// cost as the ratio of all-reduce bandwidths.
pub fn plain_vs_tls(args: &PeerArgs) -> anyhow::Result<Value> {
    let dir = std::env::temp_dir().join(format!("archipelago-bench-certs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    archipelago_actors::trust::certs::make_certs(&dir, &["a".into(), "b".into()], &[])
        .map_err(anyhow::Error::msg)?;
    let plain = between_processes(&PeerArgs {
        tls_dir: None,
        ..args.clone()
    });
    let tls = between_processes(&PeerArgs {
        tls_dir: Some(dir.clone()),
        ..args.clone()
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (plain, tls) = (plain?, tls?);
    let all_reduce = |v: &Value| v["collectives"][0]["algbw_gb_per_s"].as_f64().unwrap_or(f64::NAN);
    Ok(json!({
        "plain": plain,
        "tls": tls,
        "all_reduce_tls_over_plain": all_reduce(&tls) / all_reduce(&plain),
    }))
}

/// [`between_processes`] over shared memory, raw TCP and gRPC one after the other (one window),
/// with shared memory's all-reduce and tensor-move bandwidths as ratios to raw TCP's.
pub fn data_paths(args: &PeerArgs) -> anyhow::Result<Value> {
    let mut out = serde_json::Map::new();
    for path in [DataPath::Shm, DataPath::Tcp, DataPath::Grpc] {
        let started = std::time::Instant::now();
        let figures = between_processes(&PeerArgs {
            data_path: path,
            ..args.clone()
        })?;
        eprintln!(
            "bench: {path} between 2 processes done in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        out.insert(format!("{path}_2_processes"), figures);
    }
    let all_reduce = |p: &str| {
        out[p]["collectives"][0]["algbw_gb_per_s"]
            .as_f64()
            .unwrap_or(f64::NAN)
    };
    let moved = |p: &str| out[p]["tensor_move"]["gb_per_s"].as_f64().unwrap_or(f64::NAN);
    let ratios = json!({
        "all_reduce_shm_over_tcp": all_reduce("shm_2_processes") / all_reduce("tcp_2_processes"),
        "tensor_move_shm_over_tcp": moved("shm_2_processes") / moved("tcp_2_processes"),
    });
    out.insert("ratios".into(), ratios);
    Ok(Value::Object(out))
}

/// The same script between two threads over the in-process fabric.
pub fn in_process(args: &PeerArgs) -> Value {
    let fabric: Arc<dyn Fabric> = Arc::new(InProcessFabric::new(ACTORS, PATIENCE));
    let callees = spawn_callees(&fabric, args.batches);
    let (peer_fabric, peer_args) = (fabric.clone(), args.clone());
    let peer = std::thread::spawn(move || script(peer_fabric.as_ref(), 1, &peer_args));
    let figures = script(fabric.as_ref(), 0, args);
    peer.join().expect("peer thread");
    callees.into_iter().for_each(|c| {
        c.join().expect("callee thread");
    });
    figures_json("in_process", figures, args)
}
