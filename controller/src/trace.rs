//! `--trace FILE.json`: the steps' instruction timings as a Chrome / Perfetto trace.
//!
//! The Trace Event Format's complete events (`"ph": "X"`), one track (`tid`) per actor, named by
//! metadata events; every span carries the step, the micro-batch and the instruction's category
//! (forward, backward, loss, send, recv, all-reduce / reduce-scatter / all-gather starts and
//! collective waits, optimizer), so pipeline bubbles show as gaps.
//! Open the file in <https://ui.perfetto.dev> or `chrome://tracing`.

use serde_json::{Value, json};

use archipelago_actors::executor::StepReport;
use archipelago_dataflow::{CollectiveKind, ComputeOp, Instruction, Plan};

/// Collects spans of the steps it is shown and writes them as one trace.
#[derive(Debug, Default)]
pub struct TraceRecorder {
    events: Vec<Value>,
    origin_unix_s: Option<f64>,
}

impl TraceRecorder {
    /// An empty trace.
    pub fn new() -> TraceRecorder {
        TraceRecorder::default()
    }

    /// Adds every instruction of `reports` (one step, all actors) as a span.
    pub fn record(&mut self, plan: &Plan, step: u64, reports: &[StepReport]) {
        let origin = *self.origin_unix_s.get_or_insert_with(|| {
            reports
                .iter()
                .map(|r| r.began_unix_s)
                .fold(f64::INFINITY, f64::min)
        });
        for r in reports {
            // Kinds and micro-batches only: the class's stream, not translated.
            let stream = plan.class_stream(r.actor);
            for t in &r.timings {
                let Some(instruction) = stream.get(t.index) else {
                    continue;
                };
                let (category, mb) = classify(instruction);
                let mut args = json!({ "step": step, "instruction": t.label, "index": t.index });
                if let Some(mb) = mb {
                    args["mb"] = json!(mb);
                }
                self.events.push(json!({
                    "name": short_name(instruction, mb),
                    "cat": category,
                    "ph": "X",
                    "ts": 1e6 * (r.began_unix_s - origin + t.start_s),
                    "dur": 1e6 * t.seconds,
                    "pid": 1,
                    "tid": r.actor,
                    "args": args,
                }));
            }
        }
    }

    /// The trace as JSON, with a named track per actor of `plan`.
    pub fn to_json(&self, plan: &Plan) -> Value {
        let mut events: Vec<Value> = plan
            .actors
            .iter()
            .map(|a| {
                json!({
                    "name": "thread_name", "ph": "M", "pid": 1, "tid": a.actor,
                    "args": { "name": format!("actor {} ({}, stage {}, replica {})", a.actor, a.device, a.stage, a.replica) },
                })
            })
            .collect();
        events.push(json!({
            "name": "process_name", "ph": "M", "pid": 1,
            "args": { "name": format!("{} on {}", plan.program.model.name, plan.mesh) },
        }));
        events.extend(self.events.iter().cloned());
        json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}

/// The span category and micro-batch of an instruction.
pub fn classify(instruction: &Instruction) -> (&'static str, Option<usize>) {
    let category = match instruction {
        Instruction::Compute { op, .. } => match op {
            ComputeOp::Forward { .. } => "forward",
            ComputeOp::Backward { .. } | ComputeOp::BackwardInput { .. } => "backward",
            ComputeOp::BackwardWeight { .. } => "backward-weight",
            ComputeOp::Loss { .. } | ComputeOp::LossMax { .. } | ComputeOp::LossSums { .. } => "loss",
            ComputeOp::LoadBatch { .. } => "load",
            ComputeOp::OptimizerStep { .. }
            | ComputeOp::OffloadGrads { .. }
            | ComputeOp::ReplicatedGrads { .. }
            | ComputeOp::GradNorm { .. }
            | ComputeOp::TrustNorms { .. }
            | ComputeOp::AddTiedGrads { .. } => "optimizer",
            ComputeOp::LoadParams { .. }
            | ComputeOp::ShardParams { .. }
            | ComputeOp::KeepSecondary { .. }
            | ComputeOp::SecondaryShard { .. }
            | ComputeOp::DropParams { .. }
            | ComputeOp::TiedValues { .. }
            | ComputeOp::LoadTied { .. } => "params",
            ComputeOp::User { .. } | ComputeOp::Output { .. } => "user",
        },
        Instruction::Send { .. } => "send",
        Instruction::Recv { .. } => "recv",
        Instruction::StartCollective { kind, .. } => collective_category(*kind),
        Instruction::WaitCollective { .. } => "collective-wait",
    };
    (category, instruction.microbatch())
}

fn collective_category(kind: CollectiveKind) -> &'static str {
    match kind {
        CollectiveKind::AllReduceSum => "all-reduce",
        CollectiveKind::ReduceScatterSum => "reduce-scatter",
        CollectiveKind::AllGather => "all-gather",
        CollectiveKind::HierarchicalAllReduceSum { .. } => "hierarchical-all-reduce",
        CollectiveKind::AllReduceMax => "all-reduce-max",
    }
}

fn short_name(instruction: &Instruction, mb: Option<usize>) -> String {
    let kind = match instruction {
        Instruction::Compute { op, .. } => match op {
            ComputeOp::Forward { .. } => "F",
            ComputeOp::Backward { .. } | ComputeOp::BackwardInput { .. } => "B",
            ComputeOp::BackwardWeight { .. } => "W",
            ComputeOp::Loss { .. } => "loss",
            ComputeOp::LossMax { .. } => "loss max",
            ComputeOp::LossSums { .. } => "loss sums",
            ComputeOp::LoadBatch { .. } => "load",
            ComputeOp::OptimizerStep { .. } => "optimizer",
            ComputeOp::GradNorm { .. } => "grad norm",
            ComputeOp::TrustNorms { .. } => "trust norms",
            ComputeOp::OffloadGrads { .. } => "offload grads",
            ComputeOp::ReplicatedGrads { .. } => "replicated grads",
            ComputeOp::AddTiedGrads { .. } => "tied grads",
            ComputeOp::TiedValues { .. } => "tied values",
            ComputeOp::LoadTied { .. } => "load tied",
            ComputeOp::LoadParams { .. } => "load params",
            ComputeOp::ShardParams { .. } => "shard params",
            ComputeOp::DropParams { .. } => "drop params",
            ComputeOp::KeepSecondary { .. } => "keep secondary",
            ComputeOp::SecondaryShard { .. } => "secondary shard",
            ComputeOp::User { .. } => "user",
            ComputeOp::Output { .. } => "output",
        },
        Instruction::Send { .. } => "send",
        Instruction::Recv { .. } => "recv",
        Instruction::StartCollective { kind, .. } => collective_category(*kind),
        Instruction::WaitCollective { .. } => "collective wait",
    };
    match mb {
        Some(mb) => format!("{kind}{mb}"),
        None => kind.to_string(),
    }
}

/// The category and short name of an instruction (the dashboard's timeline uses the trace's).
pub(crate) fn classify_label(instruction: &Instruction) -> (&'static str, String) {
    let (category, mb) = classify(instruction);
    (category, short_name(instruction, mb))
}
