//! The step simulator: a cost model per block, and a replay of each pipeline device's pass order
//! that predicts the step time and the bubble fraction before anything runs.
//!
//! Costs follow the usual accounting (Kaplan et al., 2020; Narayanan et al., SC 2021): a forward
//! costs `2 · params` flops per token, a backward a fixed multiple of that (2 in flops, 3 as
//! measured here); the optimizer step is memory-bound and costs a fixed time per parameter. A pass starts when its device is free and its inputs
//! exist (the previous chunk's forward of the same micro-batch, the next chunk's backward); the
//! device's bubble is the share of the step it spends idle. The default rates were measured on
//! this project's 2-core CPU machine with burn's flex backend; only their ratio matters for the
//! bubble fraction.
//!
//! Communication ([`crate::simulate_comm`]) enters in two places, with no overlap with compute
//! assumed (an upper bound on the step; on this machine the in-process collectives run on the
//! actors' own cores anyway): each pipeline hand-off (an activation, or its gradient) reaches the
//! next pass one hop later, on the critical path; the data-parallel traffic (gradient reduction,
//! parameter gathers, norms) runs after a device's last pass, before its optimizer step. Neither
//! counts as busy: like the measured bubble (`1 − compute / span`), the predicted one includes
//! the time spent waiting on the fabric.

use serde::{Deserialize, Serialize};

use crate::model_spec::ModelDesc;
use crate::passes::partition::Chunk;
use crate::passes::schedule::{Pass, PassCosts, PipelineShape, Schedule, Slot};
use crate::simulate_comm::{LinkKind, LinkRate, StageComm};

/// Rates of the cost model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Sustained matmul rate of one device, flop/s.
    pub flops_per_s: f64,
    /// A backward's cost over its forward's (2 in flops; more where the weight-gradient matmul
    /// and the gradient copy out of burn run slower than the forward).
    pub backward_over_forward: f64,
    /// Optimizer parameters updated per second on one device.
    pub optimizer_params_per_s: f64,
    /// Between actors of one island (in-process shared buffers or shared memory between the
    /// processes of one machine): [`LinkRate::IN_PROCESS`].
    #[serde(default = "LinkRate::in_process")]
    pub in_process: LinkRate,
    /// Between islands (hosts): [`LinkRate::NETWORK`].
    #[serde(default = "LinkRate::network")]
    pub network: LinkRate,
    /// The compute units the plan's actors share: CPU cores for a CPU plan, GPUs for a GPU plan
    /// (`None`: one each). Where the actors outnumber them, the step is at least their total busy
    /// time over the units (they take turns; one's idle time in the pipeline is another's turn):
    /// [`Prediction::share_cores`].
    #[serde(default, alias = "cpu_cores")]
    pub compute_units: Option<usize>,
}

impl Default for CostModel {
    /// Rates measured on the 2-core CPU machine with burn-flex (mlp-8x1024, 8–64 rows per
    /// micro-batch): forward 8–17 GFLOP/s, backward 2.5–3.9× its forward, Adam 1.9e8 params/s.
    fn default() -> Self {
        CostModel {
            flops_per_s: 10e9,
            backward_over_forward: 3.0,
            optimizer_params_per_s: 2e8,
            in_process: LinkRate::IN_PROCESS,
            network: LinkRate::NETWORK,
            compute_units: None,
        }
    }
}

impl CostModel {
    /// Per-chunk forward and backward seconds for a micro-batch of `rows` samples.
    pub fn pass_costs(&self, model: &ModelDesc, chunks: &[Chunk], rows: usize) -> PassCosts {
        let tokens = (rows * model.input.tokens_per_sample()) as f64;
        let forward: Vec<f64> = chunks
            .iter()
            .map(|&(s, e)| {
                let params: u64 = model.blocks[s..e].iter().map(|b| b.params).sum();
                2.0 * params as f64 * tokens / self.flops_per_s
            })
            .collect();
        let backward = forward.iter().map(|f| self.backward_over_forward * f).collect();
        PassCosts {
            forward,
            backward,
            weight: None,
        }
    }

    /// Seconds of the optimizer step over `params` parameters.
    pub fn optimizer(&self, params: u64) -> f64 {
        params as f64 / self.optimizer_params_per_s
    }

    /// The rates of a link of `kind`.
    pub fn link(&self, kind: LinkKind) -> LinkRate {
        match kind {
            LinkKind::InProcess => self.in_process,
            LinkKind::Network => self.network,
        }
    }
}

/// What the simulator predicts for one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Predicted step time in seconds.
    pub step_s: f64,
    /// Per pipeline device: seconds busy (passes and optimizer).
    pub busy_s: Vec<f64>,
    /// Per pipeline device: idle share of the step, `1 − busy / step`.
    pub bubble: Vec<f64>,
    /// Per pipeline device: the most micro-batches whose activations it holds at once.
    pub peak_in_flight: Vec<usize>,
    /// Per pipeline device: seconds of communication per step (its slowest replica's pipeline
    /// hand-offs and data-parallel traffic); empty in predictions made before it was modelled.
    #[serde(default)]
    pub comm_s: Vec<f64>,
}

impl Prediction {
    /// The step when `replicas` copies of the pipeline's devices share `cores` compute units (CPU
    /// cores, or GPUs where several actors sit on one): at least their total busy time over the
    /// units (a work-conserving bound; the replay's own step when that is longer). Each stage's bubble is then the share of the longer step it is idle.
    pub fn share_cores(&mut self, replicas: usize, cores: Option<usize>) {
        let Some(cores) = cores.filter(|c| *c > 0) else {
            return;
        };
        let devices = replicas * self.busy_s.len();
        if devices <= cores {
            return;
        }
        let busy: f64 = replicas as f64 * self.busy_s.iter().sum::<f64>();
        let shared = busy / cores as f64;
        if shared > self.step_s {
            self.step_s = shared;
            self.bubble = (self.busy_s.iter())
                .map(|b| (1.0 - b / shared).max(0.0))
                .collect();
        }
    }
}

/// Replays `orders` (one per pipeline device) under `costs`; `optimizer_s[s]` is device `s`'s
/// optimizer step, run after its last pass. No communication: [`simulate_with_comm`] adds it.
pub fn simulate(
    schedule: Schedule,
    shape: PipelineShape,
    orders: &[Vec<Slot>],
    costs: &PassCosts,
    optimizer_s: &[f64],
) -> Prediction {
    let comm = StageComm::none(shape.pp);
    simulate_with_comm(schedule, shape, orders, costs, optimizer_s, &comm)
}

/// [`simulate`] with communication: a pass that takes its input from another pipeline device
/// starts `comm.hop_s` of its own device after that input was made, and each device's
/// `comm.after_s` runs between its last pass and its optimizer step.
pub fn simulate_with_comm(
    schedule: Schedule,
    shape: PipelineShape,
    orders: &[Vec<Slot>],
    costs: &PassCosts,
    optimizer_s: &[f64],
    comm: &StageComm,
) -> Prediction {
    let (with_tp, tp_share) = with_in_pass(shape, costs, comm);
    let (free, mut busy) = replay(schedule, shape, orders, &with_tp, &comm.hop_s);
    // Waiting on the tp all-reduces is not compute (as the measured bubble counts it).
    for (s, b) in busy.iter_mut().enumerate() {
        *b = (*b - tp_share[s]).max(0.0);
    }
    let ends: Vec<f64> = (0..shape.pp)
        .map(|s| free[s] + comm.after_s[s] + optimizer_s[s])
        .collect();
    let step_s = ends.iter().copied().fold(0.0, f64::max);
    let busy_s: Vec<f64> = (0..shape.pp).map(|s| busy[s] + optimizer_s[s]).collect();
    Prediction {
        step_s,
        bubble: busy_s
            .iter()
            .map(|b| if step_s > 0.0 { 1.0 - b / step_s } else { 0.0 })
            .collect(),
        busy_s,
        peak_in_flight: orders
            .iter()
            .map(|o| crate::passes::schedule::peak_in_flight(o))
            .collect(),
        comm_s: comm.total_s.clone(),
    }
}

/// `costs` with each device's tensor-parallel seconds (`comm.in_pass_s`) spread over its passes:
/// half over its forwards, half over its backwards (g after a forward's row-parallel blocks, f
/// after a backward's column-parallel ones); and those seconds per device, to take back out of
/// its busy time.
fn with_in_pass(shape: PipelineShape, costs: &PassCosts, comm: &StageComm) -> (PassCosts, Vec<f64>) {
    let mut out = costs.clone();
    let share: Vec<f64> = (0..shape.pp)
        .map(|s| comm.in_pass_s.get(s).copied().unwrap_or(0.0))
        .collect();
    let passes = (shape.v * shape.m).max(1) as f64;
    for c in 0..shape.chunks().min(out.forward.len()).min(out.backward.len()) {
        let each = share[c % shape.pp] / (2.0 * passes);
        out.forward[c] += each;
        out.backward[c] += each;
        // ZB-H1's B carries the backward's f; its W none.
        if let Some(w) = out.weight.as_mut().and_then(|w| w.get_mut(c)) {
            *w = w.max(0.0);
        }
    }
    (out, share)
}

/// Runs every device's passes as soon as the device is free and the input has arrived (`hop_s`
/// after it was made on another device); returns each device's end and busy seconds.
fn replay(
    schedule: Schedule,
    shape: PipelineShape,
    orders: &[Vec<Slot>],
    costs: &PassCosts,
    hop_s: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let chunks = shape.chunks();
    let key = |pass: Pass, chunk: usize, mb: usize| (pass as usize * chunks + chunk) * shape.m + mb;
    let mut done: Vec<Option<f64>> = vec![None; 3 * chunks * shape.m];
    let mut pc = vec![0usize; shape.pp];
    let mut free = vec![0.0f64; shape.pp];
    let mut busy = vec![0.0f64; shape.pp];
    loop {
        let mut progress = false;
        for s in 0..shape.pp {
            while let Some(slot) = orders[s].get(pc[s]) {
                let (dep, from) = match slot.pass {
                    Pass::F if slot.chunk == 0 => (Some(0.0), slot.chunk),
                    Pass::F => (done[key(Pass::F, slot.chunk - 1, slot.mb)], slot.chunk - 1),
                    Pass::B if slot.chunk + 1 == chunks => {
                        (done[key(Pass::F, slot.chunk, slot.mb)], slot.chunk)
                    }
                    Pass::B => (done[key(Pass::B, slot.chunk + 1, slot.mb)], slot.chunk + 1),
                    Pass::W => (done[key(Pass::B, slot.chunk, slot.mb)], slot.chunk),
                };
                let Some(made) = dep else { break };
                let hop = if from % shape.pp == s { 0.0 } else { hop_s[s] };
                let cost = costs.of(slot, schedule);
                let end = free[s].max(made + hop) + cost;
                free[s] = end;
                busy[s] += cost;
                done[key(slot.pass, slot.chunk, slot.mb)] = Some(end);
                pc[s] += 1;
                progress = true;
            }
        }
        if !progress {
            return (free, busy);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::schedule::orders;

    fn predict(schedule: Schedule, pp: usize, v: usize, m: usize) -> Prediction {
        let shape = PipelineShape { pp, v, m };
        let costs = PassCosts {
            forward: vec![1.0 / v as f64; pp * v],
            backward: vec![2.0 / v as f64; pp * v],
            weight: None,
        };
        let o = orders(schedule, shape, &costs);
        simulate(schedule, shape, &o, &costs, &vec![0.0; pp])
    }

    #[test]
    fn gpipe_and_1f1b_bubbles_match_the_closed_form() {
        // (p − 1) / (m + p − 1) for balanced stages.
        for (pp, m) in [(2, 8), (4, 8), (4, 16), (3, 5)] {
            let expected = (pp - 1) as f64 / (m + pp - 1) as f64;
            for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                let p = predict(schedule, pp, 1, m);
                assert!(
                    (p.bubble[0] - expected).abs() < 1e-9,
                    "{schedule} {pp} {m}: {p:?}"
                );
                assert!((p.step_s - 3.0 * (m + pp - 1) as f64).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn interleaving_and_zero_bubble_shrink_the_bubble() {
        let base = predict(Schedule::OneFOneB, 4, 1, 8).bubble[0];
        let inter = predict(Schedule::Interleaved, 4, 2, 8).bubble[0];
        let zb = predict(Schedule::ZbH1, 4, 1, 8);
        // Interleaving divides the bubble by about V (Megatron-LM's (p − 1) / (V · m)).
        assert!(inter < 0.65 * base, "interleaved {inter} vs 1f1b {base}");
        let zb_mean = zb.bubble.iter().sum::<f64>() / 4.0;
        assert!(zb_mean < 0.7 * base, "zb-h1 {zb:?} vs 1f1b {base}");
        assert!(zb.peak_in_flight.iter().all(|p| *p <= 4), "{zb:?}");
    }

    #[test]
    fn actors_sharing_cores_take_at_least_their_total_work_over_the_cores() {
        // 1F1B, pp=2, m=4: each device busy 12 s of a 15 s step (bubble 0.2).
        let alone = predict(Schedule::OneFOneB, 2, 1, 4);
        let mut shared = alone.clone();
        // dp=2 × pp=2 on 2 cores: 4 devices × 12 s of work over 2 cores = 24 s.
        shared.share_cores(2, Some(2));
        assert!((shared.step_s - 24.0).abs() < 1e-9, "{shared:?}");
        assert!((shared.bubble[0] - 0.5).abs() < 1e-9, "{shared:?}");
        // Enough cores, or none given: the replay's step stands.
        for cores in [Some(4), Some(8), None] {
            let mut p = alone.clone();
            p.share_cores(2, cores);
            assert_eq!(p, alone, "{cores:?}");
        }
        // 4 devices on 3 cores: 48 s of work over 3 = 16 s (a bound that forgot the second
        // replica would say 8 s and leave the replay's 15 s standing).
        let mut three = alone.clone();
        three.share_cores(2, Some(3));
        assert!((three.step_s - 16.0).abs() < 1e-9, "{three:?}");
    }

    /// Tensor parallelism's all-reduces lengthen one device's passes (0.4 s a step over two
    /// micro-batches: 0.1 s more per forward and per backward) and the step by as much, without
    /// counting as busy.
    #[test]
    fn tp_all_reduces_sit_inside_the_passes_and_are_not_busy() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let shape = PipelineShape { pp: 1, v: 1, m: 2 };
        let costs = PassCosts {
            forward: vec![1.0],
            backward: vec![2.0],
            weight: None,
        };
        let o = orders(Schedule::OneFOneB, shape, &costs);
        let mut comm = StageComm::none(1);
        let plain = simulate_with_comm(Schedule::OneFOneB, shape, &o, &costs, &[0.0], &comm);
        comm.in_pass_s = vec![0.4];
        let p = simulate_with_comm(Schedule::OneFOneB, shape, &o, &costs, &[0.0], &comm);
        assert!(
            close(plain.step_s, 6.0) && close(p.step_s, 6.4),
            "{plain:?} {p:?}"
        );
        assert!(close(p.busy_s[0], 6.0), "{p:?}");
        assert!(close(p.bubble[0], 1.0 - 6.0 / 6.4), "{p:?}");
    }
}
