//! Collective benchmarks: the ring all-reduce, reduce-scatter and all-gather beside a memcpy of
//! the same bytes — between threads of one process (in-process fabric), and between fabric
//! endpoints that talk gRPC over 127.0.0.1 (one "host" per member, each with its own server and
//! streams; the endpoints share this process, so the figure is the gRPC data path, not yet two
//! OS processes).

use std::sync::{Arc, Barrier};
use std::time::Instant;

use serde_json::{Value, json};

use archipelago_actors::collectives::{
    ChunkPool, Collectives, DEFAULT_CHUNK_ELEMS, all_gather, all_reduce, reduce_scatter,
};
use archipelago_actors::fabric::{Fabric, FabricError, GrpcFabric, InProcessFabric, Inbox, serve_fabric};
use archipelago_dataflow::ActorId;

use crate::process_stats::load_avg;
use crate::report::median;

fn chunk_elems() -> usize {
    std::env::var("ARCHIPELAGO_CHUNK_ELEMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CHUNK_ELEMS)
}

pub(super) type Ring =
    fn(&dyn Fabric, ActorId, &[ActorId], u64, &mut [f32], usize, &mut ChunkPool) -> Result<(), FabricError>;

/// The ring collectives measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingOp {
    /// Ring all-reduce (sum).
    AllReduce,
    /// Ring reduce-scatter (sum).
    ReduceScatter,
    /// Ring all-gather.
    AllGather,
}

/// How the members of a collective benchmark reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Threads of one process reducing through each other's buffers (no messages).
    SharedBuffers,
    /// Threads of one process running the ring over shared mailboxes.
    InProcess,
    /// One gRPC fabric endpoint per member on 127.0.0.1.
    GrpcLoopback,
}

/// One fabric per member (and the runtime serving the gRPC ones, kept alive by the caller).
fn fabrics(transport: Transport, members: usize) -> (Vec<Arc<dyn Fabric>>, Option<tokio::runtime::Runtime>) {
    let patience = std::time::Duration::from_secs(60);
    match transport {
        Transport::SharedBuffers | Transport::InProcess => {
            let collectives = match transport {
                Transport::SharedBuffers => Collectives::Shared,
                _ => Collectives::Ring,
            };
            let shared: Arc<dyn Fabric> =
                Arc::new(InProcessFabric::with_collectives(members, patience, collectives));
            (vec![shared; members], None)
        }
        Transport::GrpcLoopback => {
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            let fabrics = runtime.block_on(async {
                let mut hosts = Vec::new();
                for _ in 0..members {
                    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
                    let inbox = Inbox::default();
                    let addr = serve_fabric(listener, inbox.clone(), &"bench".into()).expect("fabric server");
                    hosts.push((addr.to_string(), inbox));
                }
                let addrs: Vec<String> = hosts.iter().map(|h| h.0.clone()).collect();
                let mut fabrics: Vec<Arc<dyn Fabric>> = Vec::new();
                for (addr, inbox) in &hosts {
                    let local = Arc::new(InProcessFabric::new(members, patience));
                    inbox.install(Some(local.clone()));
                    let fabric = GrpcFabric::connect(&addrs, addr, local, &"bench".into())
                        .await
                        .expect("connect");
                    fabrics.push(Arc::new(fabric));
                }
                fabrics
            });
            (fabrics, Some(runtime))
        }
    }
}

/// Appends the times of `reps` copies of `elems` f32 into a reused, already-touched buffer.
pub(super) fn memcpy_times(elems: usize, reps: usize, out: &mut Vec<f64>) {
    let src = vec![1.0f32; elems];
    let mut dst = vec![2.0f32; elems];
    for _ in 0..reps {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        out.push(t.elapsed().as_secs_f64());
    }
}

/// Median time of a ring collective of `bytes` (the full buffer, all shards) across `members`
/// threads, and of a memcpy of `bytes` into a reused buffer, with bandwidths and their ratio.
pub fn ring_vs_memcpy(
    kind: RingOp,
    transport: Transport,
    bytes: usize,
    members: usize,
    reps: usize,
) -> Value {
    let (run, op, traffic): (Ring, &str, f64) = match kind {
        RingOp::AllReduce => (all_reduce, "all_reduce", 2.0),
        RingOp::ReduceScatter => (reduce_scatter, "reduce_scatter", 1.0),
        RingOp::AllGather => (all_gather, "all_gather", 1.0),
    };
    let (name, algorithm) = match transport {
        Transport::SharedBuffers => (
            format!("{op}_shared_buffers"),
            "shared buffers, one shard per member",
        ),
        Transport::InProcess => (format!("{op}_in_process"), "ring, chunked, pipelined"),
        Transport::GrpcLoopback => (format!("{op}_grpc_loopback"), "ring, chunked, pipelined"),
    };
    // Aims of the performance issue, as fractions of memcpy in the same run (in one process).
    let aim = match (transport, kind) {
        (Transport::SharedBuffers, RingOp::AllReduce) => Some(0.6),
        (Transport::SharedBuffers, _) => Some(0.8),
        _ => None,
    };
    let elems = bytes / 4;
    let mut memcpy_s = Vec::new();
    memcpy_times(elems, reps, &mut memcpy_s);
    let (fabrics, runtime) = fabrics(transport, members);
    let barrier = Arc::new(Barrier::new(members));
    let group: Vec<usize> = (0..members).collect();
    let handles: Vec<_> = (0..members)
        .map(|me| {
            let (fabric, barrier, group) = (fabrics[me].clone(), barrier.clone(), group.clone());
            std::thread::spawn(move || {
                let mut data = vec![me as f32; elems];
                let mut times = Vec::new();
                let mut pool = ChunkPool::default();
                for rep in 0..reps as u64 {
                    barrier.wait();
                    let t = Instant::now();
                    run(
                        fabric.as_ref(),
                        me,
                        &group,
                        rep,
                        &mut data,
                        chunk_elems(),
                        &mut pool,
                    )
                    .expect("collective");
                    barrier.wait();
                    times.push(t.elapsed().as_secs_f64());
                }
                times
            })
        })
        .collect();
    let mut times: Vec<Vec<f64>> = handles.into_iter().map(|h| h.join().expect("member")).collect();
    drop((fabrics, runtime));
    // The bound is measured before and after the collective, so a burst of load on the shared
    // machine during one of them moves both figures alike.
    memcpy_times(elems, reps, &mut memcpy_s);
    let mut slowest: Vec<f64> = (0..reps)
        .map(|i| times.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    let all_reduce = median(&mut slowest);
    let memcpy = median(&mut memcpy_s);
    times.clear();
    let n = members as f64;
    let gbs = |s: f64| bytes as f64 / s / 1e9;
    json!({
        "name": name,
        "config": { "bytes": bytes, "members": members, "transport": format!("{transport:?}"), "algorithm": algorithm, "chunk_bytes": chunk_elems() * 4, "reps": reps },
        "median_s": all_reduce,
        "algbw_gb_per_s": gbs(all_reduce),
        "busbw_gb_per_s": gbs(all_reduce) * traffic * (n - 1.0) / n,
        "memcpy_median_s": memcpy,
        "memcpy_gb_per_s": gbs(memcpy),
        "algbw_fraction_of_memcpy": memcpy / all_reduce,
        "aim_fraction_of_memcpy": aim,
        "load_avg": load_avg(),
    })
}
