//! Pipeline schedules as data: for each pipeline device, the order of its passes.
//!
//! - GPipe (Huang et al., 2019): every micro-batch's forward, then every backward.
//! - 1F1B (PipeDream-Flush; Narayanan et al., 2021): `pp − s − 1` warm-up forwards on stage `s`,
//!   then one forward / one backward alternately, then the remaining backwards; at most `pp − s`
//!   micro-batches hold activations on stage `s`.
//! - Interleaved 1F1B (Megatron-LM; Narayanan et al., SC 2021): each device holds `V` model chunks
//!   (device `d` holds chunks `d, d + pp, …`); micro-batches advance in groups of `pp` per chunk.
//!   The order below is Megatron's `forward_backward_pipelining_with_interleaving`.
//! - ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward splits into
//!   `B` (input gradient, on the critical path) and `W` (weight gradient, deferrable). A stage runs
//!   a ready `B` first, else a forward while fewer than `pp` micro-batches are in flight (1F1B's
//!   peak, reached on its first stage: a micro-batch is in flight until its `W`), else a pending
//!   `W` to fill what would be a bubble. The order is found by list scheduling on the cost model, as the paper's
//!   heuristic does, so it stays plain data like the others.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward (PipeDream-Flush).
    OneFOneB,
    /// Interleaved 1F1B over `virtual_stages` chunks per device.
    Interleaved,
    /// Zero-bubble ZB-H1: backward split into input- and weight-gradient passes.
    ZbH1,
}

impl FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Schedule, String> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            "interleaved" | "interleaved-1f1b" => Ok(Schedule::Interleaved),
            "zb-h1" | "zbh1" | "zero-bubble" => Ok(Schedule::ZbH1),
            _ => Err(format!(
                "unknown schedule `{s}`: use gpipe, 1f1b, interleaved or zb-h1"
            )),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
            Schedule::ZbH1 => "zb-h1",
        })
    }
}

/// Which part of a micro-batch's work on a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Pass {
    /// Forward.
    F,
    /// Backward (input and weight gradients; only the input gradient under ZB-H1).
    B,
    /// Weight gradient (ZB-H1 only).
    W,
}

/// One entry of a device's pipeline order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Slot {
    /// The pass.
    pub pass: Pass,
    /// Micro-batch.
    pub mb: usize,
    /// Global chunk index (chunk `c` lives on pipeline device `c % pp`).
    pub chunk: usize,
}

impl Slot {
    /// `F3` or, when devices hold several chunks, `F3.c5` (micro-batch 3 on chunk 5).
    pub fn label(&self, virtual_stages: usize) -> String {
        if virtual_stages > 1 {
            format!("{self}.c{}", self.chunk)
        } else {
            self.to_string()
        }
    }
}

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}{}", self.pass, self.mb)
    }
}

/// The shape of a pipeline: `pp` devices, `v` chunks each, `m` micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineShape {
    /// Pipeline devices.
    pub pp: usize,
    /// Chunks per device.
    pub v: usize,
    /// Micro-batches.
    pub m: usize,
}

impl PipelineShape {
    /// Total chunks, `pp × v`.
    pub fn chunks(&self) -> usize {
        self.pp * self.v
    }
}

/// Per-chunk cost of each pass in seconds (index = global chunk).
#[derive(Debug, Clone, PartialEq)]
pub struct PassCosts {
    /// Forward of one micro-batch.
    pub forward: Vec<f64>,
    /// Backward of one micro-batch (input and weight gradients together).
    pub backward: Vec<f64>,
    /// Of that, the weight-gradient part (ZB-H1's `W`); `None` assumes half, as the paper's
    /// `T_B = T_W` does.
    pub weight: Option<Vec<f64>>,
}

impl PassCosts {
    /// Cost of `slot` under `schedule` (ZB-H1 splits the backward into `B` and `W`).
    pub fn of(&self, slot: &Slot, schedule: Schedule) -> f64 {
        let c = slot.chunk;
        let weight = self.weight.as_ref().map_or(self.backward[c] / 2.0, |w| w[c]);
        match (slot.pass, schedule) {
            (Pass::F, _) => self.forward[c],
            (Pass::B, Schedule::ZbH1) => self.backward[c] - weight,
            (Pass::W, _) => weight,
            (Pass::B, _) => self.backward[c],
        }
    }
}

/// The order of passes on every pipeline device.
pub fn orders(schedule: Schedule, shape: PipelineShape, costs: &PassCosts) -> Vec<Vec<Slot>> {
    match schedule {
        Schedule::GPipe => (0..shape.pp).map(|s| gpipe(shape, s)).collect(),
        Schedule::OneFOneB => (0..shape.pp).map(|s| one_f_one_b(shape, s)).collect(),
        Schedule::Interleaved => (0..shape.pp).map(|s| interleaved(shape, s)).collect(),
        Schedule::ZbH1 => zb_h1(shape, costs),
    }
}

fn slot(pass: Pass, mb: usize, chunk: usize) -> Slot {
    Slot { pass, mb, chunk }
}

fn gpipe(shape: PipelineShape, s: usize) -> Vec<Slot> {
    let f = (0..shape.m).map(|mb| slot(Pass::F, mb, s));
    let b = (0..shape.m).map(|mb| slot(Pass::B, mb, s));
    f.chain(b).collect()
}

fn one_f_one_b(shape: PipelineShape, s: usize) -> Vec<Slot> {
    let m = shape.m;
    let warmup = (shape.pp - s - 1).min(m);
    let mut out: Vec<Slot> = (0..warmup).map(|mb| slot(Pass::F, mb, s)).collect();
    for i in 0..m - warmup {
        out.push(slot(Pass::F, warmup + i, s));
        out.push(slot(Pass::B, i, s));
    }
    out.extend((m - warmup..m).map(|mb| slot(Pass::B, mb, s)));
    out
}

/// Megatron-LM's interleaved order; `m` must be a multiple of `pp` (checked by the compiler).
fn interleaved(shape: PipelineShape, s: usize) -> Vec<Slot> {
    let PipelineShape { pp, v, m } = shape;
    let total = m * v;
    let group = pp * v;
    let local_chunk = |k: usize, forward: bool| {
        let c = (k % group) / pp;
        if forward { c } else { v - 1 - c }
    };
    let mb_of = |k: usize| (k / group) * pp + k % pp;
    let at = |pass: Pass, k: usize| slot(pass, mb_of(k), local_chunk(k, pass == Pass::F) * pp + s);
    let warmup = if m == pp {
        total
    } else {
        ((pp - s - 1) * 2 + (v - 1) * pp).min(total)
    };
    let mut out: Vec<Slot> = (0..warmup).map(|k| at(Pass::F, k)).collect();
    for i in 0..total - warmup {
        out.push(at(Pass::F, warmup + i));
        out.push(at(Pass::B, i));
    }
    out.extend((total - warmup..total).map(|k| at(Pass::B, k)));
    out
}

/// ZB-H1 by list scheduling: B first, then F within 1F1B's peak memory, then W.
fn zb_h1(shape: PipelineShape, costs: &PassCosts) -> Vec<Vec<Slot>> {
    let PipelineShape { pp, m, .. } = shape;
    let mut out = vec![Vec::new(); pp];
    let mut free = vec![0.0f64; pp];
    // Finish times of F and B per (stage, mb).
    let mut f_done = vec![vec![None::<f64>; m]; pp];
    let mut b_done = vec![vec![None::<f64>; m]; pp];
    let (mut next_f, mut next_b) = (vec![0usize; pp], vec![0usize; pp]);
    let mut pending_w: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); pp];
    let mut in_flight = vec![0usize; pp];
    let total = 3 * pp * m;
    let mut placed = 0;
    while placed < total {
        // For every stage: the earliest time it can start something, and what.
        let mut best: Option<(f64, usize, Slot)> = None;
        for s in 0..pp {
            let mut candidates: Vec<(f64, u8, Slot)> = Vec::new();
            if next_b[s] < m {
                let mb = next_b[s];
                let dep = if s + 1 == pp {
                    f_done[s][mb]
                } else {
                    b_done[s + 1][mb]
                };
                if let Some(t) = dep {
                    candidates.push((free[s].max(t), 0, slot(Pass::B, mb, s)));
                }
            }
            if next_f[s] < m && in_flight[s] < pp {
                let mb = next_f[s];
                let dep = if s == 0 { Some(0.0) } else { f_done[s - 1][mb] };
                if let Some(t) = dep {
                    candidates.push((free[s].max(t), 1, slot(Pass::F, mb, s)));
                }
            }
            if let Some(&mb) = pending_w[s].front() {
                candidates.push((free[s], 2, slot(Pass::W, mb, s)));
            }
            // Among what can start earliest, the highest priority (B, then F, then W).
            let Some(start) = candidates.iter().map(|c| c.0).reduce(f64::min) else {
                continue;
            };
            let chosen = candidates
                .iter()
                .filter(|c| c.0 <= start)
                .min_by_key(|c| c.1)
                .expect("one candidate starts at the minimum");
            if best.as_ref().is_none_or(|b| start < b.0) {
                best = Some((start, s, chosen.2));
            }
        }
        let (start, s, chosen) =
            best.expect("ZB-H1 list scheduling cannot stall: a B or W is always reachable");
        let end = start + costs.of(&chosen, Schedule::ZbH1);
        free[s] = end;
        match chosen.pass {
            Pass::F => {
                f_done[s][chosen.mb] = Some(end);
                next_f[s] += 1;
                in_flight[s] += 1;
            }
            Pass::B => {
                b_done[s][chosen.mb] = Some(end);
                next_b[s] += 1;
                pending_w[s].push_back(chosen.mb);
            }
            Pass::W => {
                pending_w[s].pop_front();
                in_flight[s] -= 1;
            }
        }
        out[s].push(chosen);
        placed += 1;
    }
    out
}

/// The most micro-batches whose activations a device holds at once under `order` (a micro-batch
/// is held on a chunk from its forward until its backward, or its `W` under ZB-H1).
pub fn peak_in_flight(order: &[Slot]) -> usize {
    let splits = order.iter().any(|s| s.pass == Pass::W);
    let mut held = 0usize;
    let mut peak = 0;
    for s in order {
        match s.pass {
            Pass::F => held += 1,
            Pass::B if !splits => held -= 1,
            Pass::W => held -= 1,
            Pass::B => {}
        }
        peak = peak.max(held);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(shape: PipelineShape) -> PassCosts {
        PassCosts {
            forward: vec![1.0; shape.chunks()],
            backward: vec![2.0; shape.chunks()],
            weight: None,
        }
    }

    fn check_complete(order: &[Slot], shape: PipelineShape, s: usize, passes: &[Pass]) {
        for c in (0..shape.v).map(|i| i * shape.pp + s) {
            for mb in 0..shape.m {
                for &p in passes {
                    let n = order
                        .iter()
                        .filter(|x| x.chunk == c && x.mb == mb && x.pass == p)
                        .count();
                    assert_eq!(n, 1, "{p:?}{mb} chunk {c} on stage {s}: {order:?}");
                }
                let f = order.iter().position(|x| *x == slot(Pass::F, mb, c)).unwrap();
                let b = order.iter().position(|x| *x == slot(Pass::B, mb, c)).unwrap();
                assert!(f < b);
            }
        }
    }

    #[test]
    fn every_schedule_runs_every_pass_once_and_forward_before_backward() {
        for (schedule, v) in [
            (Schedule::GPipe, 1),
            (Schedule::OneFOneB, 1),
            (Schedule::Interleaved, 2),
            (Schedule::Interleaved, 3),
            (Schedule::ZbH1, 1),
        ] {
            for pp in [1, 2, 3, 4] {
                for m in [pp, 2 * pp, 4 * pp] {
                    let shape = PipelineShape { pp, v, m };
                    let o = orders(schedule, shape, &unit(shape));
                    let passes: &[Pass] = if schedule == Schedule::ZbH1 {
                        &[Pass::F, Pass::B, Pass::W]
                    } else {
                        &[Pass::F, Pass::B]
                    };
                    for (s, order) in o.iter().enumerate() {
                        check_complete(order, shape, s, passes);
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_at_most_pp_micro_batches_and_gpipe_holds_m() {
        let shape = PipelineShape { pp: 4, v: 1, m: 8 };
        let c = unit(shape);
        let f1b = orders(Schedule::OneFOneB, shape, &c);
        let gp = orders(Schedule::GPipe, shape, &c);
        let zb = orders(Schedule::ZbH1, shape, &c);
        for s in 0..4 {
            assert_eq!(peak_in_flight(&f1b[s]), 4 - s);
            assert_eq!(peak_in_flight(&gp[s]), 8);
            assert!(peak_in_flight(&zb[s]) <= 4);
        }
        assert_eq!(
            f1b[2].iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" "),
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
        );
    }

    #[test]
    fn names_parse_and_print() {
        for s in ["gpipe", "1f1b", "interleaved", "zb-h1"] {
            assert_eq!(s.parse::<Schedule>().unwrap().to_string(), s);
        }
        assert!("pipedream".parse::<Schedule>().unwrap_err().contains("zb-h1"));
    }
}
