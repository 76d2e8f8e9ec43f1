//! Typed collectives through the collective worker (what the executor runs), on every way a
//! group meets: in-process shared buffers, in-process rings, and rings across two hosts over
//! raw TCP. bf16 and f16 all-reduce, reduce-scatter and all-gather over 2 and 3 members equal
//! the f64 sum of the same inputs rounded once, bit for bit (the direct reduce-scatter sums in
//! f32); i8 and u8 payloads are gathered exactly and refused for a sum. Negative control: the
//! reduce-scatter between processes (the direct one of 16-bit buffers, on an in-process ring
//! fabric) accumulating in 16 bits misses that reference over three members.
//!
//! The f32 all-reduce of the maximum over 2 and 3 members gives every member the maximum over
//! all members, bit for bit (negative values, infinities and a NaN included), and reads the
//! bytes `collective_read_elems` predicts; 16-bit and byte maxima are refused. Negative
//! control: each member's own values (a maximum that never looked at its peers) miss that
//! reference.

use std::sync::Arc;
use std::time::Duration;

use archipelago_dataflow::fabric_bytes::collective_read_elems;
use archipelago_dataflow::{ActorId, CollectiveKind};
use half::{bf16, f16};

use super::element::Accumulation;
use super::ring_all_reduce::reduce_scatter_with;
use super::shared::shared_16bit_tests::{Half, input, reference};
use super::{ChunkPool, CollectiveWorker, Collectives, shard_range};
use crate::fabric::{DataPath, Fabric, InProcessFabric};
use crate::typed_tensor::{Element, TypedTensor};

/// Elements per collective: several messages of `CHUNK` (and an odd tail).
const LEN: usize = 3 * CHUNK + 37;
const CHUNK: usize = 1000;

/// Runs `kind` over `group` (actor `a` on `fabrics[place(a)]`), member `m` bringing `start(m)`;
/// every member's result, in group order.
fn on_members(
    fabrics: &[Arc<dyn Fabric>],
    place: fn(ActorId) -> usize,
    group: &[ActorId],
    kind: CollectiveKind,
    start: impl Fn(usize) -> TypedTensor,
) -> Vec<Result<TypedTensor, String>> {
    let counted = on_members_counting_reads(fabrics, place, group, kind, start);
    counted.into_iter().map(|(result, _)| result).collect()
}

/// [`on_members`], with the bytes each member's worker read from its peers.
fn on_members_counting_reads(
    fabrics: &[Arc<dyn Fabric>],
    place: fn(ActorId) -> usize,
    group: &[ActorId],
    kind: CollectiveKind,
    start: impl Fn(usize) -> TypedTensor,
) -> Vec<(Result<TypedTensor, String>, u64)> {
    let handles: Vec<_> = (group.iter().enumerate())
        .map(|(m, &me)| {
            let worker = CollectiveWorker::spawn(me, fabrics[place(me)].clone(), CHUNK);
            let (group, tensor) = (group.to_vec(), start(m));
            std::thread::spawn(move || {
                let (result, read) = worker.start(kind, 7, group, tensor).wait();
                (result.map_err(|e| e.to_string()), read.bytes)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("member")).collect()
}

fn inputs<T: Half>(m: usize) -> TypedTensor {
    let values: Vec<T> = (0..LEN).map(|k| T::from_f64(input(m, k))).collect();
    TypedTensor::from_values(vec![LEN], &values)
}

/// Elements of every member's result that differ in any bit from `expected(member, k)`.
fn misses<T: Half>(out: &[Result<TypedTensor, String>], expected: impl Fn(usize, usize) -> T) -> usize {
    (out.iter().enumerate())
        .map(|(i, r)| {
            let got = r.as_ref().expect("collective").values::<T>();
            (got.iter().enumerate())
                .filter(|&(k, v)| v.bits() != expected(i, k).bits())
                .count()
        })
        .sum()
}

/// bf16 or f16 collectives over 2 and 3 members of `fabrics` equal the once-rounded reference.
fn sixteen_bit_collectives_round_once<T: Half>(
    fabrics: &[Arc<dyn Fabric>],
    place: fn(ActorId) -> usize,
    what: &str,
) {
    for group in [&[0, 2][..], &[0, 1, 2][..]] {
        let n = group.len();
        let what = format!("{what} {} over {group:?}", T::DTYPE);
        let reduced = on_members(fabrics, place, group, CollectiveKind::AllReduceSum, inputs::<T>);
        assert_eq!(
            misses(&reduced, |_, k| reference::<T>(n, k)),
            0,
            "{what}: all-reduce"
        );
        let scattered = on_members(
            fabrics,
            place,
            group,
            CollectiveKind::ReduceScatterSum,
            inputs::<T>,
        );
        let shard = |i: usize, k: usize| reference::<T>(n, shard_range(LEN, n, i).start + k);
        assert_eq!(misses(&scattered, shard), 0, "{what}: reduce-scatter");
        let owners = |_: usize, k: usize| {
            let owner = (0..n)
                .find(|&j| shard_range(LEN, n, j).contains(&k))
                .expect("an owner");
            T::from_f64(input(owner, k))
        };
        let gathered = on_members(fabrics, place, group, CollectiveKind::AllGather, inputs::<T>);
        assert_eq!(misses(&gathered, owners), 0, "{what}: all-gather");
    }
}

/// i8 and u8 payloads are gathered exactly over three members; a sum over them is refused
/// with a message that says what sums run on.
fn byte_payloads_are_gathered_and_not_summed<T: Element + TryFrom<u8> + PartialEq + std::fmt::Debug>(
    fabrics: &[Arc<dyn Fabric>],
    place: fn(ActorId) -> usize,
) {
    let group = [0, 1, 2];
    let value = |m: usize, k: usize| {
        T::try_from(((m * 31 + k * 7) % 100) as u8).unwrap_or_else(|_| panic!("a byte under 100"))
    };
    let start =
        |m: usize| TypedTensor::from_values(vec![LEN], &(0..LEN).map(|k| value(m, k)).collect::<Vec<T>>());
    let gathered = on_members(fabrics, place, &group, CollectiveKind::AllGather, start);
    for r in &gathered {
        let got = r.as_ref().expect("all-gather").values::<T>();
        for (k, v) in got.iter().enumerate() {
            let owner = (0..3)
                .find(|&j| shard_range(LEN, 3, j).contains(&k))
                .expect("an owner");
            assert_eq!(*v, value(owner, k), "{} element {k}", T::DTYPE);
        }
    }
    let summed = on_members(fabrics, place, &group, CollectiveKind::AllReduceSum, start);
    for r in summed {
        let error = r.expect_err("a sum over bytes");
        assert!(error.contains("only gathered"), "{error}");
    }
}

fn in_process(collectives: Collectives) -> Vec<Arc<dyn Fabric>> {
    vec![Arc::new(InProcessFabric::with_collectives(
        3,
        Duration::from_secs(20),
        collectives,
    ))]
}

#[test]
fn typed_collectives_on_shared_buffers() {
    let fabrics = in_process(Collectives::Shared);
    sixteen_bit_collectives_round_once::<bf16>(&fabrics, |_| 0, "shared");
    sixteen_bit_collectives_round_once::<f16>(&fabrics, |_| 0, "shared");
    byte_payloads_are_gathered_and_not_summed::<u8>(&fabrics, |_| 0);
    every_member_ends_with_the_maximum(&fabrics, |_| 0, "shared");
    a_maximum_is_refused_but_on_f32(&fabrics, |_| 0);
}

#[test]
fn typed_collectives_on_in_process_rings() {
    let fabrics = in_process(Collectives::Ring);
    sixteen_bit_collectives_round_once::<bf16>(&fabrics, |_| 0, "ring");
    sixteen_bit_collectives_round_once::<f16>(&fabrics, |_| 0, "ring");
    byte_payloads_are_gathered_and_not_summed::<i8>(&fabrics, |_| 0);
    every_member_ends_with_the_maximum(&fabrics, |_| 0, "ring");
    a_maximum_is_refused_but_on_f32(&fabrics, |_| 0);
}

#[test]
fn typed_collectives_across_two_hosts_over_raw_tcp() {
    let (_, hosts) = crate::fabric::tcp::tests::two_hosts(&"secret".into(), DataPath::Tcp);
    let fabrics: Vec<Arc<dyn Fabric>> = hosts.into_iter().map(|f| f as Arc<dyn Fabric>).collect();
    sixteen_bit_collectives_round_once::<bf16>(&fabrics, |a| a / 2, "raw TCP");
    sixteen_bit_collectives_round_once::<f16>(&fabrics, |a| a / 2, "raw TCP");
    byte_payloads_are_gathered_and_not_summed::<u8>(&fabrics, |a| a / 2);
    every_member_ends_with_the_maximum(&fabrics, |a| a / 2, "raw TCP");
    a_maximum_is_refused_but_on_f32(&fabrics, |a| a / 2);
}

#[test]
fn the_maximum_across_two_hosts_over_shared_memory() {
    let (_, hosts) = crate::fabric::tcp::tests::two_hosts(&"secret".into(), DataPath::Shm);
    let fabrics: Vec<Arc<dyn Fabric>> = hosts.into_iter().map(|f| f as Arc<dyn Fabric>).collect();
    every_member_ends_with_the_maximum(&fabrics, |a| a / 2, "shared memory");
}

/// Member `m`'s value `k` of a maximum over `n` members: mostly negative, the largest held by
/// a different member from one position to the next (by none in particular where several tie),
/// every member `-inf` at position 3, and member 1 NaN at position 5.
fn max_input(n: usize, m: usize, k: usize) -> f32 {
    match k {
        3 => f32::NEG_INFINITY,
        5 if m == 1 => f32::NAN,
        _ => {
            let mut h = (n * 1_000_003 + m * 7919 + k) as u64;
            h = (h ^ (h >> 13)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            h ^= h >> 29;
            (h % 4001) as f32 / 16.0 - 200.0
        }
    }
}

fn max_inputs(n: usize, len: usize) -> impl Fn(usize) -> TypedTensor {
    move |m| TypedTensor::new(vec![len], (0..len).map(|k| max_input(n, m, k)).collect())
}

/// Elements of `values` (one member's result) that differ in any bit from the maximum over
/// the `n` members of [`max_input`] (NaN where any member is NaN).
fn max_misses(n: usize, values: &[f32]) -> usize {
    let maximum = |k: usize| {
        (0..n)
            .map(|m| max_input(n, m, k))
            .reduce(|a, b| {
                if a.is_nan() || b.is_nan() {
                    f32::NAN
                } else {
                    a.max(b)
                }
            })
            .expect("members")
    };
    (values.iter().enumerate())
        .filter(|&(k, v)| v.to_bits() != maximum(k).to_bits())
        .count()
}

/// An f32 all-reduce of the maximum over 2 and 3 members of `fabrics`, of several chunks and
/// of one value, leaves every member with the maximum over all members, and each member's
/// worker reads the bytes the plan predicts for it.
fn every_member_ends_with_the_maximum(fabrics: &[Arc<dyn Fabric>], place: fn(ActorId) -> usize, what: &str) {
    let max = CollectiveKind::AllReduceMax;
    for group in [&[0, 2][..], &[0, 1, 2][..]] {
        let n = group.len();
        for len in [LEN, 1] {
            let what = format!("{what}: maximum of {len} over {group:?}");
            let out = on_members_counting_reads(fabrics, place, group, max, max_inputs(n, len));
            for ((result, read), &me) in out.iter().zip(group) {
                let got = result.as_ref().expect("all-reduce of the maximum");
                assert_eq!(got.shape(), &[len][..], "{what}");
                assert_eq!(max_misses(n, got.values::<f32>()), 0, "{what}: member {me}");
                let predicted = 4 * collective_read_elems(max, group, me, len);
                assert_eq!(*read, predicted, "{what}: bytes member {me} read");
            }
        }
    }
}

/// bf16, f16 and i8 maxima are refused, by every member alike (none waits for the others), and
/// the refusal says that the maximum runs on f32.
fn a_maximum_is_refused_but_on_f32(fabrics: &[Arc<dyn Fabric>], place: fn(ActorId) -> usize) {
    let group = [0, 1, 2];
    let start = |m: usize| TypedTensor::from_values(vec![4], &[bf16::from_f32(m as f32); 4]);
    let bf16s = on_members(fabrics, place, &group, CollectiveKind::AllReduceMax, start);
    let start = |m: usize| TypedTensor::from_values(vec![4], &[f16::from_f32(m as f32); 4]);
    let f16s = on_members(fabrics, place, &group, CollectiveKind::AllReduceMax, start);
    let start = |m: usize| TypedTensor::from_values(vec![4], &[m as i8; 4]);
    let i8s = on_members(fabrics, place, &group, CollectiveKind::AllReduceMax, start);
    for result in bf16s.into_iter().chain(f16s).chain(i8s) {
        let error = result.expect_err("a maximum of other than f32");
        assert!(error.contains("maximum runs on f32 only"), "{error}");
    }
}

/// The control: a maximum that never looked at the peers (each member keeping its own values)
/// misses the reference on more than a third of the elements for every member, over 2 and 3
/// members; and every member holds the maximum somewhere (its own values meet the reference).
#[test]
fn a_maximum_over_the_own_values_only_is_caught() {
    for n in [2, 3] {
        for m in 0..n {
            let own: Vec<f32> = (0..LEN).map(|k| max_input(n, m, k)).collect();
            let missed = max_misses(n, &own);
            eprintln!("control: member {m} of {n} keeping its own values misses {missed} of {LEN}");
            assert!(
                missed > LEN / 3 && missed < LEN - LEN / 5,
                "member {m} of {n}: its own values miss {missed} of {LEN}"
            );
        }
    }
}

/// The control: the direct reduce-scatter that 16-bit buffers take between processes,
/// accumulating in 16 bits (rounding after every addition), misses the once-rounded reference on at least a tenth of the elements over three
/// members.
#[test]
fn sixteen_bit_accumulation_on_the_ring_is_caught() {
    fn share_missed<T: Half>(fabric: Arc<dyn Fabric>) -> f64 {
        let group = [0, 1, 2];
        let handles: Vec<_> = (0..3)
            .map(|m| {
                let fabric = fabric.clone();
                std::thread::spawn(move || {
                    let mut data: Vec<T> = (0..LEN).map(|k| T::from_f64(input(m, k))).collect();
                    let mut pool = ChunkPool::default();
                    let sixteen = Accumulation::InElementType;
                    reduce_scatter_with(
                        fabric.as_ref(),
                        m,
                        &group,
                        9,
                        &mut data,
                        CHUNK,
                        &mut pool,
                        sixteen,
                    )
                    .expect("reduce-scatter");
                    data
                })
            })
            .collect();
        let out: Vec<Vec<T>> = handles.into_iter().map(|h| h.join().expect("member")).collect();
        let missed: usize = (out.iter().enumerate())
            .map(|(i, data)| {
                (shard_range(LEN, 3, i))
                    .filter(|&k| data[k].bits() != reference::<T>(3, k).bits())
                    .count()
            })
            .sum();
        missed as f64 / LEN as f64
    }
    let ring = || in_process(Collectives::Ring).remove(0);
    let (b, h) = (share_missed::<bf16>(ring()), share_missed::<f16>(ring()));
    eprintln!("control ring: 16-bit accumulation misses bf16 {b:.3}, f16 {h:.3} of the elements");
    assert!(
        b > 0.1 && h > 0.1,
        "16-bit accumulation barely shows (bf16 {b}, f16 {h})"
    );
}
