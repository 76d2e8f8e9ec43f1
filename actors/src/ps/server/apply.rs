//! How a server applies the clocks of the aggregating models (`K` finite; Li et al., OSDI 2014,
//! §3.3 and §4.1): the pushes of a clock are kept until every worker's push of it has reached a
//! key range — the range's version vector says so — and then applied to that range's keys at
//! once, as their sum in worker order. Ranges normally complete together, position by position
//! (every worker pushes every part to every server every clock), and a part whose chain position
//! has completed is applied whole, without looking its keys up; after a failover a range handed
//! to a new member comes with the pushes its sender kept and completes when the workers' retried
//! pushes reach it, so no clock is ever applied in two pieces and no push twice.

use std::collections::{HashMap, HashSet};

use super::{ClockEvent, PsServer, Push, ServerFault};
use crate::ps::failover::PendingPush;
use crate::ps::update::ServerUpdate;

/// The ring version of parts handed over by a failover (never the current one).
const HANDED_OVER: u64 = u64::MAX;

impl<U: ServerUpdate> PsServer<U> {
    /// Drops the keys of `push` whose range it has reached already (none, but for a push
    /// retried after a failover; answered from the arcs alone in that common case).
    pub(super) fn drop_reached(&self, push: &mut Push) {
        let (worker, clock, width) = (push.worker, push.clock, self.params.width);
        if self.versions.none_has(push.part, worker, clock) {
            return;
        }
        let (mut keys, mut grads) = (Vec::new(), Vec::new());
        for (key, grad) in push.keys.iter().zip(push.grads.chunks_exact(width)) {
            if !self.versions.has(*key, worker, clock) {
                keys.push(*key);
                grads.extend_from_slice(grad);
            }
        }
        (push.keys, push.grads) = (keys, grads);
    }

    /// Keeps `push` (its keys not yet applied) with the pending pushes of its clock.
    pub(super) fn keep_pending(&mut self, push: Push) {
        let (clock, worker) = (push.clock, push.worker);
        self.pending_of(clock, worker).push(push);
    }

    /// Takes part of a push another server kept for a range handed over by a failover.
    pub(crate) fn keep_handed_over(&mut self, part: PendingPush) {
        let push = Push {
            worker: part.worker,
            clock: part.clock,
            keys: part.keys,
            list: Default::default(),
            grads: part.grads,
            part: 0,
            epoch: HANDED_OVER,
        };
        self.pending_of(part.clock, part.worker).push(push);
    }

    fn pending_of(&mut self, clock: u64, worker: usize) -> &mut Vec<Push> {
        let workers = self.params.workers;
        &mut self
            .pending
            .entry(clock)
            .or_insert_with(|| vec![Vec::new(); workers])[worker]
    }

    /// Applies every clock every worker's push has reached, range by range, in clock order.
    pub(super) fn apply_ready(&mut self) {
        loop {
            let ready = self.versions.ready();
            if ready.is_empty() {
                break;
            }
            for (clock, ends) in ready {
                self.apply_to(clock, &ends);
                self.versions.mark_applied(&ends, clock);
            }
        }
        let applied = self.versions.min_applied().unwrap_or(self.applied);
        while let Some((&clock, _)) = self.pending.first_key_value()
            && clock < applied
        {
            self.pending.remove(&clock);
        }
        while self.applied < applied {
            if self.params.log_clocks {
                let pushed = self.clocks.clocks().to_vec();
                self.log.push(ClockEvent::Applied {
                    clock: self.applied,
                    pushed,
                });
            }
            self.applied += 1;
        }
    }

    /// Applies `clock` to the keys of the arcs `ends`: the sum of the kept pushes of those keys,
    /// taken out of the pending pushes.
    fn apply_to(&mut self, clock: u64, ends: &[u64]) {
        let Some(pushes) = self.pending.get_mut(&clock) else {
            return;
        };
        let ends: HashSet<u64> = ends.iter().copied().collect();
        let whole_positions: Vec<bool> = (0..self.params.replicas)
            .map(|part| self.versions.all_at_position_in(part, clock, &ends))
            .collect();
        let width = self.params.width;
        let mut sums: HashMap<u64, Vec<f32>> = HashMap::new();
        for (worker, parts) in pushes.iter_mut().enumerate() {
            let dropped = self.params.fault == ServerFault::DropPushOf(worker);
            let mut add = |key: u64, grad: &[f32]| {
                if dropped {
                    return;
                }
                match sums.get_mut(&key) {
                    Some(sum) => sum.iter_mut().zip(grad).for_each(|(s, g)| *s += g),
                    None => {
                        sums.insert(key, grad.to_vec());
                    }
                }
            };
            for push in parts.iter_mut() {
                let whole = push.epoch == self.epoch && whole_positions.get(push.part) == Some(&true);
                if whole {
                    for (key, grad) in push.keys.iter().zip(push.grads.chunks_exact(width)) {
                        add(*key, grad);
                    }
                    (push.keys, push.grads) = (Vec::new(), Vec::new());
                    continue;
                }
                let (mut keys, mut grads) = (Vec::new(), Vec::new());
                for (key, grad) in push.keys.iter().zip(push.grads.chunks_exact(width)) {
                    if self.versions.arc_end_of(*key).is_some_and(|e| ends.contains(&e)) {
                        add(*key, grad);
                    } else {
                        keys.push(*key);
                        grads.extend_from_slice(grad);
                    }
                }
                (push.keys, push.grads) = (keys, grads);
            }
            parts.retain(|p| !p.keys.is_empty());
        }
        if self.params.fault == ServerFault::AveragePushes {
            let w = self.params.workers as f32;
            sums.values_mut().flatten().for_each(|s| *s /= w);
        }
        for (key, grad) in &sums {
            self.store.update(*key, grad, &self.params.update);
        }
    }
}
