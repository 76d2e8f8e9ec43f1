//! The ring collectives across hosts: a ring all-reduce over four actors, two on each of two
//! hosts, on every data path between processes (gRPC, raw TCP, shared memory), sums exactly.
//! The fabrics' own tests check that their messages arrive; these check the ring on them.

use std::sync::Arc;

use super::{ChunkPool, ring_all_reduce};
use crate::fabric::{DataPath, Fabric};

/// A ring all-reduce of `len` values over 4 actors, 2 on each of two hosts (`fabrics[h]` is host
/// `h`'s fabric, actor `a` on host `a / 2`), the ring crossing hosts both ways, sums correctly.
fn ring_all_reduce_across_two_hosts(fabrics: [Arc<dyn Fabric>; 2], len: usize, chunk: usize) {
    let handles: Vec<_> = (0..4)
        .map(|me| {
            let fabric = fabrics[me / 2].clone();
            std::thread::spawn(move || {
                let mut data: Vec<f32> = (0..len).map(|k| ((me + 1) * (k % 1000)) as f32).collect();
                let mut pool = ChunkPool::default();
                ring_all_reduce(fabric.as_ref(), me, &[0, 2, 1, 3], 5, &mut data, chunk, &mut pool).unwrap();
                data
            })
        })
        .collect();
    for h in handles {
        let data = h.join().unwrap();
        for k in [0, 1, 999, len / 2, len - 1] {
            assert_eq!(data[k], (10 * (k % 1000)) as f32, "value {k}");
        }
    }
}

#[test]
fn a_ring_all_reduce_across_two_hosts_sums_over_grpc() {
    let (_, fabrics, _runtime) = crate::fabric::grpc::tests::two_hosts(&"secret".into());
    let len = 3 * (crate::fabric::grpc::CHUNK_BYTES / 4) + 17; // messages of several gRPC chunks
    ring_all_reduce_across_two_hosts([fabrics[0].clone(), fabrics[1].clone()], len, len / 2);
}

#[test]
fn a_ring_all_reduce_across_two_hosts_sums_over_raw_tcp_and_shared_memory() {
    for path in [DataPath::Tcp, DataPath::Shm] {
        let (_, fabrics) = crate::fabric::tcp::tests::two_hosts(&"secret".into(), path);
        ring_all_reduce_across_two_hosts([fabrics[0].clone(), fabrics[1].clone()], 3_000_017, 1 << 18);
    }
}
