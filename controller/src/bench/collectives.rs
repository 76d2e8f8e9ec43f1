//! Collective benchmarks: the in-process ring all-reduce, reduce-scatter and all-gather beside a
//! memcpy of the same bytes.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use serde_json::{Value, json};

use archipelago_actors::collectives::{
    ChunkPool, DEFAULT_CHUNK_ELEMS, ring_all_gather, ring_all_reduce, ring_reduce_scatter,
};
use archipelago_actors::fabric::InProcessFabric;
use archipelago_actors::fabric::{Fabric, FabricError};
use archipelago_dataflow::{ActorId, CollectiveKind};

use crate::process_stats::load_avg;
use crate::report::median;

fn chunk_elems() -> usize {
    std::env::var("ARCHIPELAGO_CHUNK_ELEMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CHUNK_ELEMS)
}

type Ring =
    fn(&dyn Fabric, ActorId, &[ActorId], u64, &mut [f32], usize, &mut ChunkPool) -> Result<(), FabricError>;

/// Median time of a ring collective of `bytes` (the full buffer, all shards) across `members`
/// threads, and of a memcpy of `bytes` into a reused buffer, with bandwidths and their ratio.
pub fn ring_vs_memcpy(kind: CollectiveKind, bytes: usize, members: usize, reps: usize) -> Value {
    let (run, name, traffic): (Ring, &str, f64) = match kind {
        CollectiveKind::AllReduceSum => (ring_all_reduce, "all_reduce_in_process", 2.0),
        CollectiveKind::ReduceScatterSum => (ring_reduce_scatter, "reduce_scatter_in_process", 1.0),
        CollectiveKind::AllGather => (ring_all_gather, "all_gather_in_process", 1.0),
    };
    let elems = bytes / 4;
    let src = vec![1.0f32; elems];
    let mut dst = vec![0.0f32; elems];
    let mut memcpy_s = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        memcpy_s.push(t.elapsed().as_secs_f64());
    }
    drop((src, dst));
    let fabric = Arc::new(InProcessFabric::new(members, std::time::Duration::from_secs(60)));
    let barrier = Arc::new(Barrier::new(members));
    let group: Vec<usize> = (0..members).collect();
    let handles: Vec<_> = (0..members)
        .map(|me| {
            let (fabric, barrier, group) = (fabric.clone(), barrier.clone(), group.clone());
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
        "config": { "bytes": bytes, "members": members, "algorithm": "ring, chunked, pipelined", "chunk_bytes": chunk_elems() * 4, "reps": reps },
        "median_s": all_reduce,
        "algbw_gb_per_s": gbs(all_reduce),
        "busbw_gb_per_s": gbs(all_reduce) * traffic * (n - 1.0) / n,
        "memcpy_median_s": memcpy,
        "memcpy_gb_per_s": gbs(memcpy),
        "algbw_fraction_of_memcpy": memcpy / all_reduce,
        "load_avg": load_avg(),
    })
}
