//! Offload actors (ZeRO-Offload, Ren et al., USENIX ATC 2021; ZeRO-Infinity, Rajbhandari et
//! al., SC 2021): each device actor that offloads owns one, a thread holding its master
//! parameter shard and optimizer state in a tier (host memory or an NVMe file) and running the
//! optimizer there. The device hands it each gradient bucket as soon as the bucket is reduced;
//! the update runs while the device goes on with its backward, and the step's optimizer
//! instruction only collects the updated parameters.
//!
//! When the step clips its gradients by the global norm, no bucket can be updated before every
//! bucket has been reduced and the norm summed: the device then *stages* each bucket with the
//! offload actor as it is reduced (the copy to the host still overlaps the backward) and, once the
//! norm is known, the step's optimizer instruction has the staged updates applied with the
//! clipping factor (the deferred update; what it loses against the early update is the overlap of
//! the host's optimizer with the backward).
//!
//! The actor learns the order in which segments arrive (the same every step) and reads the next
//! one's state ahead while it updates the current one; after the last segment of a step it reads
//! the first one of the next.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use archipelago_dataflow::{Offload, OptimizerSpec};

use crate::optim::{ParamLayout, StepContext, update_range};

pub mod nvme;
pub mod store;

pub use store::{HostStore, SegmentState, StateStore, TierStats};

/// What an offload actor holds and did, for the step report.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadStats {
    /// The tier's figures.
    pub tier: TierStats,
    /// Seconds spent in optimizer updates.
    pub optimizer_s: f64,
}

enum Request {
    Update {
        step: StepContext,
        segment: usize,
        grads: Vec<f32>,
        return_params: bool,
    },
    /// Keeps a segment's gradients for the deferred update.
    Stage { segment: usize, grads: Vec<f32> },
    /// Applies every staged update, in the order staged, with this step's context.
    ApplyStaged { step: StepContext, return_params: bool },
    /// Drops every staged update unapplied (a skipped step), answering each as an update would.
    DiscardStaged { return_params: bool },
    ReadParams {
        segment: usize,
        full: Vec<f32>,
        at: Range<usize>,
        reply: Sender<Result<Vec<f32>, String>>,
    },
    /// A copy of a segment's whole region `[params | m | v]` (for a checkpoint).
    ReadState {
        segment: usize,
        reply: Sender<Result<Vec<f32>, String>>,
    },
    /// Overwrites a segment's whole region (a restored checkpoint).
    WriteState {
        segment: usize,
        data: Vec<f32>,
        reply: Sender<Result<(), String>>,
    },
}

/// A device actor's handle on its offload actor.
pub struct OffloadActor {
    requests: Option<Sender<Request>>,
    updated: Receiver<Result<(usize, Vec<f32>), String>>,
    stats: Arc<Mutex<OffloadStats>>,
    thread: Option<JoinHandle<()>>,
}

impl OffloadActor {
    /// Starts the offload actor of `actor` on `tier` with each segment's initial parameter shard
    /// (keyed by the segment's first block) and the parameters of each shard (weight-decay
    /// groups; a segment without one is one group with decay); the optimizer state starts at zero.
    pub fn spawn(
        tier: &Offload,
        actor: usize,
        spec: OptimizerSpec,
        shards: HashMap<usize, Vec<f32>>,
        layouts: HashMap<usize, ParamLayout>,
    ) -> Result<OffloadActor, String> {
        if spec.needs_param_norms() {
            return Err(format!(
                "{} needs per-parameter norms over every shard before its update; the offload actor updates each \
                 segment alone",
                spec.name()
            ));
        }
        for (segment, layout) in &layouts {
            let len = shards.get(segment).map(Vec::len);
            if len != Some(layout.len()) {
                return Err(format!(
                    "segment {segment}: parameter groups of {} elements for a shard of {len:?}",
                    layout.len()
                ));
            }
        }
        let floats = 1 + spec.state_floats_per_param() as usize;
        let store: Box<dyn StateStore> = match tier {
            Offload::Cpu => {
                let regions = shards
                    .into_iter()
                    .map(|(k, params)| {
                        let len = params.len();
                        let mut data = params;
                        data.resize(floats * len, 0.0);
                        (k, SegmentState { data, len })
                    })
                    .collect();
                Box::new(HostStore::new(regions))
            }
            Offload::Nvme { dir } => {
                Box::new(nvme::NvmeStore::create(Path::new(dir), actor, shards, floats)?)
            }
            Offload::None => return Err("no offload tier was asked for".into()),
        };
        let (requests, inbox) = channel();
        let (results, updated) = channel();
        let stats = Arc::new(Mutex::new(OffloadStats::default()));
        let shared = stats.clone();
        let thread = std::thread::Builder::new()
            .name(format!("offload-{actor}"))
            .spawn(move || {
                // A panic inside the tier is reported to the device actor, not swallowed.
                let report = results.clone();
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(store, spec, &layouts, inbox, results, shared)
                }));
                if let Err(panic) = outcome {
                    let what = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "unknown panic".into());
                    let _ = report.send(Err(format!(
                        "the offload actor of actor {actor} panicked: {what}"
                    )));
                }
            })
            .map_err(|e| format!("cannot start the offload actor of actor {actor}: {e}"))?;
        Ok(OffloadActor {
            requests: Some(requests),
            updated,
            stats,
            thread: Some(thread),
        })
    }

    fn send(&self, request: Request) -> Result<(), String> {
        self.requests
            .as_ref()
            .and_then(|r| r.send(request).ok())
            .ok_or_else(|| "the offload actor has stopped".to_string())
    }

    /// Hands `segment`'s gradients to the offload actor for the update of `step` (its number
    /// from 1, learning rate and clipping factor); [`OffloadActor::next_updated`] returns the
    /// result (the parameters when `return_params`).
    pub fn update(
        &self,
        step: StepContext,
        segment: usize,
        grads: Vec<f32>,
        return_params: bool,
    ) -> Result<(), String> {
        self.send(Request::Update {
            step,
            segment,
            grads,
            return_params,
        })
    }

    /// Keeps `segment`'s gradients for the deferred update of this step (clipping: the factor is
    /// not known yet); [`OffloadActor::apply_staged`] applies them.
    pub fn stage(&self, segment: usize, grads: Vec<f32>) -> Result<(), String> {
        self.send(Request::Stage { segment, grads })
    }

    /// Applies every staged update with `step` (its clipping factor included), in the order
    /// staged; [`OffloadActor::next_updated`] returns each result, as for
    /// [`OffloadActor::update`].
    pub fn apply_staged(&self, step: StepContext, return_params: bool) -> Result<(), String> {
        self.send(Request::ApplyStaged { step, return_params })
    }

    /// Drops every staged update (loss scaling skipped the step): the state stays as it was;
    /// [`OffloadActor::next_updated`] returns each segment's unchanged parameters (empty unless
    /// `return_params`), in the order staged, as [`OffloadActor::apply_staged`] would.
    pub fn discard_staged(&self, return_params: bool) -> Result<(), String> {
        self.send(Request::DiscardStaged { return_params })
    }

    /// The next finished update: the segment and its updated parameters (empty unless asked).
    pub fn next_updated(&self) -> Result<(usize, Vec<f32>), String> {
        self.updated
            .recv()
            .map_err(|_| "the offload actor has stopped".to_string())?
    }

    /// Fills `full[at]` with `segment`'s parameter shard (after every update handed over
    /// before) and gives the buffer back.
    pub fn read_params(&self, segment: usize, full: Vec<f32>, at: Range<usize>) -> Result<Vec<f32>, String> {
        let (reply, result) = channel();
        self.send(Request::ReadParams {
            segment,
            full,
            at,
            reply,
        })?;
        result
            .recv()
            .map_err(|_| "the offload actor has stopped".to_string())?
    }

    /// A copy of `segment`'s region `[params | m | v]` (after every update handed over before).
    pub fn read_state(&self, segment: usize) -> Result<Vec<f32>, String> {
        let (reply, result) = channel();
        self.send(Request::ReadState { segment, reply })?;
        result
            .recv()
            .map_err(|_| "the offload actor has stopped".to_string())?
    }

    /// Overwrites `segment`'s region `[params | m | v]` with `data` (same length).
    pub fn write_state(&self, segment: usize, data: Vec<f32>) -> Result<(), String> {
        let (reply, result) = channel();
        self.send(Request::WriteState { segment, data, reply })?;
        result
            .recv()
            .map_err(|_| "the offload actor has stopped".to_string())?
    }

    /// What it holds and did so far.
    pub fn stats(&self) -> OffloadStats {
        *self.stats.lock().expect("offload stats")
    }
}

impl Drop for OffloadActor {
    fn drop(&mut self) {
        self.requests = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The offload actor's loop: updates in arrival order, reading the next segment ahead.
fn run(
    mut store: Box<dyn StateStore>,
    spec: OptimizerSpec,
    layouts: &HashMap<usize, ParamLayout>,
    inbox: Receiver<Request>,
    results: Sender<Result<(usize, Vec<f32>), String>>,
    stats: Arc<Mutex<OffloadStats>>,
) {
    let mut updater = Updater {
        spec,
        layouts,
        last_order: Vec::new(),
        order: Vec::new(),
        step: 0,
        optimizer_s: 0.0,
        failed: None,
    };
    let mut staged: Vec<(usize, Vec<f32>)> = Vec::new();
    for request in inbox {
        match request {
            Request::Update {
                step: ctx,
                segment,
                grads,
                return_params,
            } => {
                let result = updater.run(&mut *store, ctx, segment, &grads, return_params);
                let _ = results.send(result.map(|p| (segment, p)));
            }
            Request::Stage { segment, grads } => staged.push((segment, grads)),
            Request::ApplyStaged {
                step: ctx,
                return_params,
            } => {
                for (segment, grads) in std::mem::take(&mut staged) {
                    let result = updater.run(&mut *store, ctx, segment, &grads, return_params);
                    let _ = results.send(result.map(|p| (segment, p)));
                }
            }
            Request::DiscardStaged { return_params } => {
                for (segment, _) in std::mem::take(&mut staged) {
                    let params = match return_params {
                        true => current_params(&mut *store, segment),
                        false => Ok(Vec::new()),
                    };
                    let _ = results.send(params.map(|p| (segment, p)));
                }
            }
            Request::ReadParams {
                segment,
                mut full,
                at,
                reply,
            } => {
                let r = match full.get_mut(at.clone()) {
                    Some(out) => match store.shard_len(segment) {
                        Ok(len) if len == out.len() => store.read_params(segment, out).map(|()| full),
                        Ok(len) => Err(format!(
                            "segment {segment}: asked for {} parameters, the shard has {len}",
                            out.len()
                        )),
                        Err(e) => Err(e),
                    },
                    None => Err(format!(
                        "parameter range {at:?} outside a buffer of {}",
                        full.len()
                    )),
                };
                let _ = reply.send(r);
            }
            Request::ReadState { segment, reply } => {
                let r = store.load(segment).and_then(|state| {
                    let copy = state.data.clone();
                    store.save(segment, state).map(|()| copy)
                });
                let _ = reply.send(r);
            }
            Request::WriteState { segment, data, reply } => {
                let r = store.load(segment).and_then(|mut state| {
                    if state.data.len() != data.len() {
                        return Err(format!(
                            "segment {segment}: a region of {} values cannot take {}",
                            state.data.len(),
                            data.len()
                        ));
                    }
                    state.data.copy_from_slice(&data);
                    store.save(segment, state)
                });
                let _ = reply.send(r);
            }
        }
        *stats.lock().expect("offload stats") = OffloadStats {
            tier: store.stats(),
            optimizer_s: updater.optimizer_s,
        };
    }
}

/// `segment`'s parameter shard as the tier holds it.
fn current_params(store: &mut dyn StateStore, segment: usize) -> Result<Vec<f32>, String> {
    let mut params = vec![0.0f32; store.shard_len(segment)?];
    store.read_params(segment, &mut params)?;
    Ok(params)
}

/// The offload actor's update state: the order segments arrived in this step and the last (for
/// reading ahead), time spent, and the first failure (every later update reports it).
struct Updater<'a> {
    spec: OptimizerSpec,
    layouts: &'a HashMap<usize, ParamLayout>,
    last_order: Vec<usize>,
    order: Vec<usize>,
    step: i32,
    optimizer_s: f64,
    failed: Option<String>,
}

impl Updater<'_> {
    /// Updates `segment` with `grads` under `ctx`.
    fn run(
        &mut self,
        store: &mut dyn StateStore,
        ctx: StepContext,
        segment: usize,
        grads: &[f32],
        return_params: bool,
    ) -> Result<Vec<f32>, String> {
        if ctx.t != self.step {
            if !self.order.is_empty() {
                self.last_order = std::mem::take(&mut self.order);
            }
            self.step = ctx.t;
        }
        self.order.push(segment);
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let began = Instant::now();
        let task = Task {
            spec: self.spec,
            step: ctx,
            layout: self.layouts.get(&segment),
            segment,
            grads,
            return_params,
        };
        let result = update(store, task, &self.last_order);
        self.optimizer_s += began.elapsed().as_secs_f64();
        if let Err(e) = &result {
            self.failed = Some(e.clone());
        }
        result
    }
}

/// One segment's update as handed over.
struct Task<'a> {
    spec: OptimizerSpec,
    step: StepContext,
    /// The shard's parameter groups (`None`: one group with decay).
    layout: Option<&'a ParamLayout>,
    segment: usize,
    grads: &'a [f32],
    return_params: bool,
}

/// One segment's update: read the next segment ahead, load, step, save (written behind).
fn update(store: &mut dyn StateStore, task: Task<'_>, last_order: &[usize]) -> Result<Vec<f32>, String> {
    let Task {
        spec,
        step,
        layout,
        segment,
        grads,
        return_params,
    } = task;
    let position = last_order.iter().position(|&s| s == segment);
    let last = position.is_some_and(|i| i + 1 == last_order.len());
    if let Some(&next) = position.and_then(|i| last_order.get(i + 1)) {
        store.prefetch(next)?;
    }
    let mut state = store.load(segment)?;
    if grads.len() != state.len {
        return Err(format!(
            "segment {segment}: {} gradients for a shard of {} parameters",
            grads.len(),
            state.len
        ));
    }
    let len = state.len;
    let (params, m, v) = state.split();
    let whole;
    let layout = match layout {
        Some(l) => l,
        None => {
            whole = ParamLayout::whole(len);
            &whole
        }
    };
    update_range(spec, &step, layout, 0..len, params, m, v, grads);
    let out = if return_params {
        params.to_vec()
    } else {
        Vec::new()
    };
    store.save(segment, state)?;
    // After the step's last segment, read the next step's first one ahead.
    if last && last_order[0] != segment {
        store.prefetch(last_order[0])?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::FlatOptimizer;

    /// The offload actor's Adam, over steps with segments arriving out of order, equals one
    /// flat optimizer over the whole vector — on both tiers.
    #[test]
    fn offloaded_adam_equals_the_flat_optimizer_on_every_tier() {
        let dir = tempfile::tempdir().unwrap();
        let spec = OptimizerSpec::adam(0.01);
        let init: Vec<f32> = (0..10).map(|i| i as f32 * 0.1).collect();
        for tier in [
            Offload::Cpu,
            Offload::Nvme {
                dir: dir.path().display().to_string(),
            },
        ] {
            let shards = HashMap::from([(0, init[..6].to_vec()), (6, init[6..].to_vec())]);
            let actor = OffloadActor::spawn(&tier, 0, spec, shards, HashMap::new()).unwrap();
            let mut flat = FlatOptimizer::new(spec, 10);
            let mut expected = init.clone();
            for t in 1..=4 {
                let grads: Vec<f32> = (0..10).map(|i| ((i * t) % 7) as f32 - 3.0).collect();
                let step = StepContext {
                    t,
                    lr: spec.lr(),
                    grad_scale: 1.0,
                    exchanged_momentum_after: None,
                };
                actor.update(step, 6, grads[6..].to_vec(), true).unwrap();
                actor.update(step, 0, grads[..6].to_vec(), true).unwrap();
                flat.begin_step();
                flat.update(0, &mut expected, &grads);
                let mut got = vec![0.0; 10];
                for _ in 0..2 {
                    let (segment, params) = actor.next_updated().unwrap();
                    got[segment..segment + params.len()].copy_from_slice(&params);
                }
                assert_eq!(got, expected, "{tier} step {t}");
            }
            let read = actor.read_params(6, vec![0.0; 6], 2..6).unwrap();
            assert_eq!(&read[2..], &expected[6..], "{tier}");
            let wrong = actor.read_params(6, vec![0.0; 6], 0..3).unwrap_err();
            assert!(wrong.contains("the shard has 4"), "{tier}: {wrong}");
            let step = StepContext {
                t: 5,
                lr: spec.lr(),
                grad_scale: 1.0,
                exchanged_momentum_after: None,
            };
            let bad = actor.update(step, 0, vec![1.0; 3], true);
            assert!(bad.is_ok());
            assert!(
                actor.next_updated().unwrap_err().contains("3 gradients"),
                "{tier}"
            );
        }
    }

    /// SGD with momentum keeps one state value per parameter (`[params | buffer]`), and the
    /// shard's parameter groups and the step's rate reach the offloaded update: equal to a flat
    /// optimizer with the same groups and schedule.
    #[test]
    fn offloaded_momentum_with_groups_equals_the_flat_optimizer() {
        use archipelago_dataflow::LrSchedule;

        use crate::optim::{ParamLayout, ParamPart};
        let spec = OptimizerSpec::sgd(0.1)
            .with_weight_decay(0.2)
            .with_momentum(0.9, true)
            .unwrap();
        let schedule = LrSchedule::cosine(1, 4);
        let init: Vec<f32> = (0..6).map(|i| 1.0 - i as f32 * 0.3).collect();
        let part = |range, param, decay| ParamPart { range, param, decay };
        let layout = ParamLayout::new(vec![part(0..4, 0, true), part(4..6, 1, false)], 2).unwrap();
        let layouts = HashMap::from([(0, layout.clone())]);
        let shards = HashMap::from([(0, init.clone())]);
        let actor = OffloadActor::spawn(&Offload::Cpu, 0, spec, shards, layouts).unwrap();
        let mut flat = FlatOptimizer::new(spec, 6)
            .with_schedule(schedule)
            .with_layout(layout);
        let mut expected = init.clone();
        for t in 1..=4 {
            let grads: Vec<f32> = (0..6).map(|i| ((i + t) % 3) as f32 - 1.0).collect();
            flat.begin_step();
            flat.update(0, &mut expected, &grads);
            actor.update(flat.context(), 0, grads, true).unwrap();
            assert_eq!(actor.next_updated().unwrap().1, expected, "step {t}");
        }
        assert_eq!(
            actor.read_state(0).unwrap().len(),
            12,
            "parameters and one buffer"
        );
        let lamb = OffloadActor::spawn(
            &Offload::Cpu,
            1,
            OptimizerSpec::lamb(0.1),
            HashMap::new(),
            HashMap::new(),
        );
        assert!(lamb.err().unwrap().contains("per-parameter norms"));
    }
}
