//! What an actor is running right now, readable from any thread: heartbeats carry it to the
//! controller, so a dead host is reported with the instruction each of its actors was running,
//! and the hang detector (`controller/src/hang.rs`) reads who waits for whom from it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use archipelago_dataflow::ActorId;

/// What an actor blocks on, if anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Waiting {
    /// Not blocked (computing, or between steps).
    #[default]
    Nothing,
    /// A receive of `tag` from actor `from`.
    Recv {
        /// The sender it waits for.
        from: ActorId,
        /// The message's tag.
        tag: u64,
    },
    /// The end of collective `tag` over `group`.
    Collective {
        /// The collective's tag.
        tag: u64,
        /// Its members.
        group: Vec<ActorId>,
    },
}

/// A copy of an actor's progress at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressSnapshot {
    /// The step.
    pub step: u64,
    /// The instruction running (`None`: between steps).
    pub index: Option<usize>,
    /// Instructions started and finished so far: unchanged means no progress.
    pub beats: u64,
    /// What it blocks on.
    pub waiting: Waiting,
}

/// Step and instruction index of one actor (index `None` between steps), what it waits for,
/// and a counter that moves whenever it makes progress.
#[derive(Debug, Default)]
pub struct ActorProgress {
    step: AtomicU64,
    /// Instruction index + 1; 0 between steps.
    index: AtomicUsize,
    beats: AtomicU64,
    waiting: Mutex<Waiting>,
}

impl ActorProgress {
    /// Records that the actor runs instruction `index` of step `step` (`None`: between steps).
    pub fn set(&self, step: u64, index: Option<usize>) {
        self.step.store(step, Ordering::Relaxed);
        self.index.store(index.map_or(0, |i| i + 1), Ordering::Relaxed);
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// The last step and instruction index recorded.
    pub fn get(&self) -> (u64, Option<usize>) {
        let index = self.index.load(Ordering::Relaxed);
        (self.step.load(Ordering::Relaxed), index.checked_sub(1))
    }

    /// Records what the actor is about to block on ([`Waiting::Nothing`] once it stops).
    pub fn wait_on(&self, waiting: Waiting) {
        *self.waiting.lock().expect("actor progress") = waiting;
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    /// Everything at once.
    pub fn snapshot(&self) -> ProgressSnapshot {
        let (step, index) = self.get();
        ProgressSnapshot {
            step,
            index,
            beats: self.beats.load(Ordering::Relaxed),
            waiting: self.waiting.lock().expect("actor progress").clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_step_instruction_and_what_it_waits_for() {
        let p = ActorProgress::default();
        assert_eq!(p.get(), (0, None));
        p.set(3, Some(0));
        assert_eq!(p.get(), (3, Some(0)));
        let before = p.snapshot().beats;
        p.wait_on(Waiting::Recv { from: 2, tag: 9 });
        let now = p.snapshot();
        assert_eq!(now.waiting, Waiting::Recv { from: 2, tag: 9 });
        assert!(now.beats > before);
        p.wait_on(Waiting::Nothing);
        p.set(3, None);
        assert_eq!(p.get(), (3, None));
        assert_eq!(p.snapshot().waiting, Waiting::Nothing);
    }
}
