//! The dashboard's timeline of the last steps: one lane per actor, named by its host and device,
//! each instruction a span in its category (the trace's: forward, backward, send, recv, the
//! collectives, optimizer, …), times in seconds after the first step shown began.

use archipelago_actors::executor::StepReport;
use archipelago_dataflow::Plan;

use super::views::{LaneView, SpanView, TimelineView};
use crate::trace::classify_label;

/// The timeline of the `recent` steps of `plan` (`hosts`: each actor's host).
pub fn timeline(plan: &Plan, recent: &[(u64, Vec<StepReport>)], hosts: &[String]) -> TimelineView {
    let origin = recent
        .iter()
        .flat_map(|(_, rs)| rs.iter().map(|r| r.began_unix_s))
        .fold(f64::INFINITY, f64::min);
    let mut lanes: Vec<LaneView> = plan
        .actors
        .iter()
        .map(|a| LaneView {
            actor: a.actor,
            device: a.device.to_string(),
            host: hosts.get(a.actor).cloned().unwrap_or_default(),
            stage: a.stage,
            replica: a.replica,
            spans: Vec::new(),
        })
        .collect();
    let mut end: f64 = 0.0;
    for (step, reports) in recent {
        for r in reports {
            let Some(lane) = lanes.get_mut(r.actor) else {
                continue;
            };
            // Kinds and micro-batches only: the class's stream, not translated.
            let stream = plan.class_stream(r.actor);
            for t in &r.timings {
                let Some(instruction) = stream.get(t.index) else {
                    continue;
                };
                let (cat, name) = classify_label(instruction);
                let start_s = r.began_unix_s - origin + t.start_s;
                end = end.max(start_s + t.seconds);
                lane.spans.push(SpanView {
                    step: *step,
                    name,
                    cat: cat.to_string(),
                    start_s,
                    dur_s: t.seconds,
                });
            }
        }
    }
    TimelineView {
        steps: recent.iter().map(|(s, _)| *s).collect(),
        span_s: end,
        lanes,
    }
}
