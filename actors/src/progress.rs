//! What an actor is running right now, readable from any thread: heartbeats carry it to the
//! controller, so a dead host is reported with the instruction each of its actors was running.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Step and instruction index of one actor (index `None` between steps).
#[derive(Debug, Default)]
pub struct ActorProgress {
    step: AtomicU64,
    /// Instruction index + 1; 0 between steps.
    index: AtomicUsize,
}

impl ActorProgress {
    /// Records that the actor runs instruction `index` of step `step` (`None`: between steps).
    pub fn set(&self, step: u64, index: Option<usize>) {
        self.step.store(step, Ordering::Relaxed);
        self.index.store(index.map_or(0, |i| i + 1), Ordering::Relaxed);
    }

    /// The last step and instruction index recorded.
    pub fn get(&self) -> (u64, Option<usize>) {
        let index = self.index.load(Ordering::Relaxed);
        (self.step.load(Ordering::Relaxed), index.checked_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_step_and_instruction() {
        let p = ActorProgress::default();
        assert_eq!(p.get(), (0, None));
        p.set(3, Some(0));
        assert_eq!(p.get(), (3, Some(0)));
        p.set(3, None);
        assert_eq!(p.get(), (3, None));
    }
}
