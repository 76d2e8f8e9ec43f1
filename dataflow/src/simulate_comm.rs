//! The step simulator's communication term: the seconds each actor spends on the bytes
//! [`crate::fabric_bytes::predict`] says it reads from its peers, on the link its peers sit on.
//!
//! A link has a bandwidth and a latency per message (the α–β model of Hockney, 1994, as Thakur,
//! Rabenseifner & Gropp, 2005, cost MPI's collectives): an actor's seconds per step are
//! `Σ bytes / bandwidth + messages × latency` over the links it uses.
//!
//! - **Link**: two actors of one island ([`crate::Program::islands`]; none named: one island)
//!   talk in-process (shared buffers, or shared memory between the processes of one machine:
//!   the plan cannot tell which, and both are memory copies); actors of two islands over the
//!   network. The plan does not say which actors share a GPU interconnect, so there is no
//!   device-to-device kind.
//! - **Messages**: a receive is one; a ring collective over `n` members runs its steps one after
//!   the other: `2(n − 1)` for an all-reduce, `n − 1` for a reduce-scatter or an all-gather; a
//!   hierarchical all-reduce `2(k − 1)` inside its island of `k` and `2(I − 1)` across its `I`
//!   islands.
//! - **Bytes**: a receive's go over its link. A flat collective whose group spans islands moves
//!   at the pace of its slowest link: all its bytes count as network. A hierarchical all-reduce
//!   reads `(I − 1)/(n − 1)` of its bytes across islands (with even shards it reads
//!   `2(k − 1)/k · len` inside the island and `2(I − 1)/I · len/k` across). The fabric bytes are
//!   per actor and kind, so each kind's bytes are split by the mean network share of that
//!   kind's instructions: exact where they share one group, as an actor's gradient and parameter
//!   collectives all do (its dp group).
//!
//! The simulator ([`crate::simulate::simulate_with_comm`]) puts the pipeline hand-offs on the
//! critical path, one average hop per receive, and the data-parallel traffic (gradients,
//! parameters, norms) after each device's last pass; a stage counts its slowest replica.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::ActorId;
use crate::fabric_bytes::{FabricBytes, FabricKind};
use crate::instruction::{CollectiveKind, Instruction};
use crate::plan::Plan;
use crate::simulate::{CostModel, Prediction};

/// Where two actors' bytes travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LinkKind {
    /// Within an island: in-process shared buffers or shared memory on one machine.
    InProcess,
    /// Between islands: the network between hosts.
    Network,
}

/// The rates of one kind of link.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkRate {
    /// Sustained bandwidth, bytes per second.
    pub bytes_per_s: f64,
    /// Seconds per message (one receive, one step of a ring).
    pub latency_s: f64,
}

impl LinkRate {
    /// 10 GB/s and 5 µs per message: order-of-magnitude defaults for this project's 2-core CPU
    /// machine, not a benchmark. DESIGN.md records memcpy into a reused buffer at ≈ 10 GB/s; a
    /// tiny program here measured 15–18 GB/s for a 64 MiB memcpy and 2–12 µs for a one-way
    /// hand-off between two threads over a std channel. A collective also sums, hence 10.
    pub const IN_PROCESS: LinkRate = LinkRate {
        bytes_per_s: 10e9,
        latency_s: 5e-6,
    };

    /// 1 GB/s and 50 µs per message: order-of-magnitude defaults, not a benchmark. DESIGN.md
    /// records loopback tonic streaming at ≈ 1 GB/s (raw TCP 2–3 GB/s; the same tiny program
    /// measured 3.6–4.5 GB/s in bulk and 2.5 µs one way on loopback, which has no wire); 1 GB/s
    /// is also a 10 Gb/s link's order. 50 µs is an assumed data-centre hop plus the RPC stack,
    /// not measured.
    pub const NETWORK: LinkRate = LinkRate {
        bytes_per_s: 1e9,
        latency_s: 50e-6,
    };

    /// [`LinkRate::IN_PROCESS`] (a serde default).
    pub fn in_process() -> LinkRate {
        LinkRate::IN_PROCESS
    }

    /// [`LinkRate::NETWORK`] (a serde default).
    pub fn network() -> LinkRate {
        LinkRate::NETWORK
    }
}

/// One actor's communication in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ActorComm {
    /// Seconds receiving pipeline hand-offs (activations and their gradients).
    pub pipeline_s: f64,
    /// How many hand-offs it receives.
    pub hand_offs: u64,
    /// Seconds of data-parallel traffic: gradient reduction, parameter gathers, norms.
    pub data_parallel_s: f64,
    /// Seconds of tensor-parallel all-reduces (Megatron's f and g, the loss's statistics, the
    /// replicated gradients): inside the passes they delay (see [`StageComm::in_pass_s`]).
    pub tensor_parallel_s: f64,
}

impl ActorComm {
    /// Every term together.
    pub fn total_s(&self) -> f64 {
        self.pipeline_s + self.data_parallel_s + self.tensor_parallel_s
    }
}

/// The communication the simulator adds, per pipeline device (its slowest replica's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageComm {
    /// Seconds one hand-off takes to reach this device (the mean over its receives).
    pub hop_s: Vec<f64>,
    /// Seconds of data-parallel traffic, between its last pass and its optimizer step.
    pub after_s: Vec<f64>,
    /// Seconds of communication per step.
    pub total_s: Vec<f64>,
    /// Seconds per step of tensor-parallel all-reduces, which sit between a device's blocks on
    /// its critical path: the simulator spreads them over the device's passes (half over the
    /// forwards, half over the backwards), waiting on the fabric, not busy.
    pub in_pass_s: Vec<f64>,
}

impl StageComm {
    /// No communication on `pp` devices.
    pub fn none(pp: usize) -> StageComm {
        StageComm {
            hop_s: vec![0.0; pp],
            after_s: vec![0.0; pp],
            total_s: vec![0.0; pp],
            in_pass_s: vec![0.0; pp],
        }
    }

    /// Per pipeline device, the slowest of its actors `comm` (indexed by actor).
    pub fn of(plan: &Plan, comm: &[ActorComm]) -> StageComm {
        let mut out = StageComm::none(plan.program.plan.pp);
        for (a, c) in plan.actors.iter().zip(comm) {
            let s = a.stage;
            let hop = if c.hand_offs > 0 {
                c.pipeline_s / c.hand_offs as f64
            } else {
                0.0
            };
            out.hop_s[s] = out.hop_s[s].max(hop);
            out.after_s[s] = out.after_s[s].max(c.data_parallel_s);
            out.total_s[s] = out.total_s[s].max(c.total_s());
            out.in_pass_s[s] = out.in_pass_s[s].max(c.tensor_parallel_s);
        }
        out
    }

    /// The plan's communication under `model`, from its fabric bytes.
    pub fn of_plan(plan: &Plan, model: &CostModel) -> StageComm {
        StageComm::of(plan, &actor_comm(plan, &plan.fabric, model))
    }
}

/// Each actor's communication per step under `model`, from its `fabric` bytes (indexed by actor)
/// and the messages of its instruction stream.
pub fn actor_comm(plan: &Plan, fabric: &[FabricBytes], model: &CostModel) -> Vec<ActorComm> {
    let islands = Islands(&plan.program.islands);
    // Without islands every link is in-process, so an actor's routes are its class's; with them
    // they depend on who its peers are.
    let mut by_class: HashMap<ActorId, Tally> = HashMap::new();
    plan.actors
        .iter()
        .map(|a| {
            let tally_of = |instructions: &[Instruction]| {
                let mut tally = Tally::default();
                for instruction in instructions {
                    if let Some((kind, route)) = route(instruction, a.actor, &islands) {
                        tally.add(kind, &route);
                    }
                }
                tally
            };
            let tally = if islands.0.is_empty() {
                (by_class.entry(plan.streams.representative(a.actor)))
                    .or_insert_with(|| tally_of(plan.class_stream(a.actor)))
                    .clone()
            } else {
                tally_of(&plan.stream(a.actor).instructions)
            };
            let bytes = fabric.get(a.actor).copied().unwrap_or_default();
            ActorComm {
                pipeline_s: tally.seconds(&bytes, model, Traffic::Pipeline),
                hand_offs: tally.hand_offs,
                data_parallel_s: tally.seconds(&bytes, model, Traffic::DataParallel),
                tensor_parallel_s: tally.seconds(&bytes, model, Traffic::TensorParallel),
            }
        })
        .collect()
}

/// The plan printout's line: each stage's communication, the step and the link rates.
pub fn describe(prediction: &Prediction, model: &CostModel) -> String {
    let stages: Vec<String> = (prediction.comm_s.iter().enumerate())
        .map(|(s, c)| format!("stage {s} {:.3} ms", 1e3 * c))
        .collect();
    let rate = |r: LinkRate| format!("{} GB/s + {} µs", r.bytes_per_s / 1e9, 1e6 * r.latency_s);
    format!(
        "predicted communication per step: {} of a {:.3} ms step (links: in-process {}, network {} per message)",
        stages.join(", "),
        1e3 * prediction.step_s,
        rate(model.in_process),
        rate(model.network)
    )
}

/// Each actor's island name, by actor; none named: one island.
struct Islands<'a>(&'a [String]);

impl Islands<'_> {
    fn link(&self, a: ActorId, b: ActorId) -> LinkKind {
        if self.0.get(a) == self.0.get(b) {
            LinkKind::InProcess
        } else {
            LinkKind::Network
        }
    }

    /// The slowest link from `me` to any member of `group`.
    fn slowest(&self, me: ActorId, group: &[ActorId]) -> LinkKind {
        let spans = !self.0.is_empty() && group.iter().any(|&g| self.link(me, g) == LinkKind::Network);
        if spans {
            LinkKind::Network
        } else {
            LinkKind::InProcess
        }
    }
}

/// Where one instruction's reads travel.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Route {
    /// Share of its bytes over the network.
    network_share: f64,
    /// Messages in-process and over the network.
    messages: [u64; 2],
}

impl Route {
    /// All of it on `link`, in `messages` messages.
    fn on(link: LinkKind, messages: u64) -> Route {
        let mut m = [0; 2];
        m[link as usize] = messages;
        Route {
            network_share: if link == LinkKind::Network { 1.0 } else { 0.0 },
            messages: m,
        }
    }
}

/// The fabric kind and route of what `me` reads in `instruction`; `None` when it reads nothing
/// from its peers.
fn route(instruction: &Instruction, me: ActorId, islands: &Islands) -> Option<(FabricKind, Route)> {
    match instruction {
        Instruction::Recv { tensor, from, .. } => {
            Some((FabricKind::of(tensor)?, Route::on(islands.link(me, *from), 1)))
        }
        Instruction::StartCollective {
            kind, tensor, group, ..
        } => Some((
            FabricKind::of_collective(tensor)?,
            collective_route(*kind, group, me, islands),
        )),
        _ => None,
    }
}

/// The route of a collective `kind` over `group` for member `me`.
fn collective_route(kind: CollectiveKind, group: &[ActorId], me: ActorId, islands: &Islands) -> Route {
    let n = group.len() as u64;
    if n < 2 {
        return Route::on(LinkKind::InProcess, 0);
    }
    let steps = match kind {
        CollectiveKind::AllReduceSum => 2 * (n - 1),
        CollectiveKind::ReduceScatterSum | CollectiveKind::AllGather | CollectiveKind::AllReduceMax => n - 1,
        CollectiveKind::HierarchicalAllReduceSum { island_size } => {
            let k = (island_size as u64).clamp(1, n);
            let i = n / k;
            return Route {
                network_share: (i - 1) as f64 / (n - 1) as f64,
                messages: [2 * (k - 1), 2 * (i - 1)],
            };
        }
    };
    Route::on(islands.slowest(me, group), steps)
}

/// One actor's routes, summed.
#[derive(Debug, Default, Clone)]
struct Tally {
    /// Per fabric kind ([`FabricBytes::KINDS`] order): the sum of its instructions' network
    /// shares, and how many there were.
    shares: [(f64, u64); FabricBytes::KINDS.len()],
    /// Messages in-process and over the network, per [`Traffic`].
    messages: [[u64; 2]; 3],
    /// Pipeline receives.
    hand_offs: u64,
}

impl Tally {
    fn add(&mut self, kind: FabricKind, route: &Route) {
        let traffic = Traffic::of(kind);
        let i = kind_index(kind);
        self.shares[i].0 += route.network_share;
        self.shares[i].1 += 1;
        for link in 0..2 {
            self.messages[traffic as usize][link] += route.messages[link];
        }
        self.hand_offs += (traffic == Traffic::Pipeline) as u64;
    }

    /// Seconds of the kinds of `bytes` that are `traffic`.
    fn seconds(&self, bytes: &FabricBytes, model: &CostModel, traffic: Traffic) -> f64 {
        let (near, far) = (model.link(LinkKind::InProcess), model.link(LinkKind::Network));
        let moved: f64 = (FabricBytes::KINDS.iter().enumerate())
            .filter(|(_, k)| Traffic::of(**k) == traffic)
            .map(|(i, k)| {
                let (sum, count) = self.shares[i];
                let share = if count > 0 { sum / count as f64 } else { 0.0 };
                let b = bytes.of_kind(*k) as f64;
                b * (1.0 - share) / near.bytes_per_s + b * share / far.bytes_per_s
            })
            .sum();
        let [m_near, m_far] = self.messages[traffic as usize];
        moved + m_near as f64 * near.latency_s + m_far as f64 * far.latency_s
    }
}

/// Which term of an actor's communication a fabric kind is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Traffic {
    DataParallel = 0,
    Pipeline = 1,
    TensorParallel = 2,
}

impl Traffic {
    fn of(kind: FabricKind) -> Traffic {
        match kind {
            FabricKind::Activations | FabricKind::ActivationGrads => Traffic::Pipeline,
            FabricKind::TensorParallel => Traffic::TensorParallel,
            _ => Traffic::DataParallel,
        }
    }
}

fn kind_index(kind: FabricKind) -> usize {
    (FabricBytes::KINDS.iter())
        .position(|k| *k == kind)
        .expect("every kind is listed")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::schedule::{PassCosts, PipelineShape, Schedule, orders};
    use crate::simulate::simulate_with_comm;
    use crate::{ModelSpec, ParallelPlan, Program, compile};

    /// Round rates, so that the expected seconds are plain arithmetic.
    const MODEL: CostModel = CostModel {
        flops_per_s: 1e9,
        backward_over_forward: 2.0,
        optimizer_params_per_s: 1e8,
        in_process: LinkRate {
            bytes_per_s: 1e6,
            latency_s: 1e-3,
        },
        network: LinkRate {
            bytes_per_s: 1e5,
            latency_s: 1e-2,
        },
        compute_units: None,
    };

    fn plan(dp: usize, pp: usize, islands: &[&str]) -> Plan {
        let model = ModelSpec::parse("mlp:in=16,hidden=32,layers=4,out=4").unwrap();
        let mut program = Program::new(model).with_plan(ParallelPlan {
            dp,
            pp,
            microbatches: pp,
            batch: 8,
            ..ParallelPlan::default()
        });
        program.islands = islands.iter().map(|s| s.to_string()).collect();
        compile(&program).unwrap()
    }

    fn collectives(plan: &Plan, actor: ActorId) -> u64 {
        (plan.stream(actor).instructions.iter())
            .filter(|i| matches!(i, Instruction::StartCollective { .. }))
            .count() as u64
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn one_actor_communicates_nothing() {
        let p = plan(1, 1, &[]);
        assert_eq!(actor_comm(&p, &p.fabric, &MODEL), vec![ActorComm::default()]);
        assert_eq!(p.prediction.comm_s, vec![0.0]);
        assert!(close(p.prediction.step_s, p.prediction.busy_s[0]));
        assert!(!p.summary().contains("communication"));
    }

    /// dp = 2 in one island: every all-reduce reads its whole bucket (4 bytes a value) in
    /// 2(n − 1) = 2 in-process messages; with pp = 1 the step is the compute plus that.
    #[test]
    fn in_process_reduction_is_bytes_over_bandwidth_plus_ring_steps() {
        let p = plan(2, 1, &[]);
        let trained: u64 = p.program.model.blocks.iter().map(|b| b.trained_params()).sum();
        for a in 0..2 {
            assert_eq!(p.fabric[a].gradients, 4 * trained);
            let c = actor_comm(&p, &p.fabric, &MODEL)[a];
            let expected = p.fabric[a].total() as f64 / 1e6 + 2.0 * collectives(&p, a) as f64 * 1e-3;
            assert!(close(c.data_parallel_s, expected), "{c:?} vs {expected}");
            assert_eq!((c.pipeline_s, c.hand_offs), (0.0, 0));
        }
        let (pred, default) = (&p.prediction, CostModel::default());
        let dp_s = actor_comm(&p, &p.fabric, &default)[0].data_parallel_s;
        assert!(close(pred.comm_s[0], dp_s) && dp_s > 0.0, "{pred:?}");
        assert!(close(pred.step_s, pred.busy_s[0] + dp_s), "{pred:?}");
        assert!(p.summary().contains("predicted communication per step: stage 0 "));
    }

    /// dp = 4 reads 2(n − 1)/n = 3/2 of each bucket (dp = 2: 1) in 2(n − 1) = 6 ring steps.
    #[test]
    fn more_replicas_read_more_gradient_bytes() {
        let seconds = |dp| {
            let p = plan(dp, 1, &[]);
            (actor_comm(&p, &p.fabric, &MODEL)[0], p.prediction.comm_s[0])
        };
        let (two, four) = (seconds(2), seconds(4));
        assert!(four.0.data_parallel_s > two.0.data_parallel_s, "{two:?} {four:?}");
        assert!(four.1 > two.1, "{two:?} {four:?}");
        let p = plan(4, 1, &[]);
        let expected = p.fabric[0].total() as f64 / 1e6 + 6.0 * collectives(&p, 0) as f64 * 1e-3;
        assert!(close(four.0.data_parallel_s, expected), "{four:?} vs {expected}");
    }

    /// The same dp = 2 plan on two islands: the same bytes, all over the (slower) network.
    #[test]
    fn the_network_is_slower_than_in_process_for_the_same_bytes() {
        let (near, far) = (plan(2, 1, &[]), plan(2, 1, &["a", "b"]));
        assert_eq!(near.fabric, far.fabric);
        let c = actor_comm(&far, &far.fabric, &MODEL)[1];
        let expected = far.fabric[1].total() as f64 / 1e5 + 2.0 * collectives(&far, 1) as f64 * 1e-2;
        assert!(close(c.data_parallel_s, expected), "{c:?} vs {expected}");
        assert!(c.data_parallel_s > actor_comm(&near, &near.fabric, &MODEL)[1].data_parallel_s);
        assert!(far.prediction.step_s > near.prediction.step_s);
    }

    /// dp = 4 on islands a, a, b, b: hierarchical, (I − 1)/(n − 1) = 1/3 of the gradient bytes
    /// cross, in 2(I − 1) = 2 network and 2(k − 1) = 2 in-process messages per bucket.
    #[test]
    fn a_hierarchical_all_reduce_sends_a_third_across_two_islands_of_two() {
        let p = plan(4, 1, &["a", "a", "b", "b"]);
        let c = actor_comm(&p, &p.fabric, &MODEL)[0];
        let g = p.fabric[0].gradients as f64;
        let buckets = p.buckets.len() as f64;
        let mut expected = g * (2.0 / 3.0) / 1e6 + g / 3.0 / 1e5 + buckets * (2.0 * 1e-3 + 2.0 * 1e-2);
        if p.fabric[0].norms > 0 {
            // A norm all-reduce over the 4 spans the islands: a flat ring, all network.
            expected += p.fabric[0].norms as f64 / 1e5 + 6.0 * 1e-2;
        }
        assert!(close(c.data_parallel_s, expected), "{c:?} vs {expected}");
    }

    /// pp = 2: the hand-offs are received and predicted, one hop per receive on stage 1's
    /// forward and stage 0's backward.
    #[test]
    fn pipeline_hand_offs_are_received_and_predicted() {
        let p = plan(1, 2, &[]);
        let c = actor_comm(&p, &p.fabric, &MODEL);
        assert_eq!((c[0].hand_offs, c[1].hand_offs), (2, 2));
        let f = &p.fabric;
        assert!(close(c[1].pipeline_s, f[1].activations as f64 / 1e6 + 2.0 * 1e-3));
        assert!(close(
            c[0].pipeline_s,
            f[0].activation_grads as f64 / 1e6 + 2.0 * 1e-3
        ));
        assert!(p.prediction.comm_s.iter().all(|s| *s > 0.0), "{:?}", p.prediction);
    }

    /// Predictions and cost models written before the communication term still read.
    #[test]
    fn old_json_reads_with_no_communication_and_the_default_links() {
        let old = r#"{"step_s":1.0,"busy_s":[1.0],"bubble":[0.0],"peak_in_flight":[1]}"#;
        let p: Prediction = serde_json::from_str(old).unwrap();
        assert!(p.comm_s.is_empty());
        let old = r#"{"flops_per_s":1.0,"backward_over_forward":2.0,"optimizer_params_per_s":3.0}"#;
        let m: CostModel = serde_json::from_str(old).unwrap();
        assert_eq!(
            (m.in_process, m.network),
            (LinkRate::IN_PROCESS, LinkRate::NETWORK)
        );
    }

    /// One micro-batch over two stages (forward 1 s, backward 2 s): each hand-off waits its hop
    /// (0.5 s), then the data-parallel traffic (0.25 s) runs before the optimizer (0.1 s).
    #[test]
    fn hops_are_on_the_critical_path_and_traffic_precedes_the_optimizer() {
        let shape = PipelineShape { pp: 2, v: 1, m: 1 };
        let costs = PassCosts {
            forward: vec![1.0; 2],
            backward: vec![2.0; 2],
            weight: None,
        };
        let o = orders(Schedule::OneFOneB, shape, &costs);
        let comm = StageComm {
            hop_s: vec![0.5, 0.5],
            after_s: vec![0.25, 0.25],
            total_s: vec![0.75, 0.75],
            in_pass_s: vec![0.0, 0.0],
        };
        let p = simulate_with_comm(Schedule::OneFOneB, shape, &o, &costs, &[0.1, 0.1], &comm);
        // F0 1, hop, F1 1, B1 2, hop, B0 2, traffic, optimizer.
        assert!(
            close(p.step_s, 1.0 + 0.5 + 1.0 + 2.0 + 0.5 + 2.0 + 0.25 + 0.1),
            "{p:?}"
        );
        assert_eq!(p.busy_s, vec![3.1, 3.1]);
        assert_eq!(p.comm_s, vec![0.75, 0.75]);
    }
}
