//! Test helper of the collectives' unit tests: one closure per member of an in-process fabric,
//! each on a thread of its own, as the actors' collective workers run them.

use std::time::Duration;

use archipelago_dataflow::ActorId;

use crate::fabric::InProcessFabric;

/// Runs `member(me, fabric, group)` for every member `me` of a group of `n` on one in-process
/// fabric, each on its own thread; their results in member order.
pub(crate) fn on_members<R: Send>(
    n: usize,
    member: impl Fn(ActorId, &InProcessFabric, &[ActorId]) -> R + Sync,
) -> Vec<R> {
    let fabric = InProcessFabric::new(n, Duration::from_secs(10));
    let group: Vec<ActorId> = (0..n).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|me| {
                let (fabric, group, member) = (&fabric, &group[..], &member);
                s.spawn(move || member(me, fabric, group))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("member")).collect()
    })
}
