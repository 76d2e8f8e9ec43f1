//! `archipelago plan`'s printout of a [`Plan`]: mesh, placement, schedule, prediction (with its
//! communication term and the rates it assumed), and per actor its memory, the bytes it reads
//! from its peers and its offload traffic ([`Plan::summary`]); the instruction streams apart
//! ([`Plan::streams`]).

use crate::memory;
use crate::passes::partition;
use crate::plan::Plan;
use crate::program::Offload;
use crate::simulate_comm;
use crate::state_layout;

impl Plan {
    /// A human-readable summary: mesh, placement, schedule, prediction and memory.
    pub fn summary(&self) -> String {
        let p = &self.program;
        let pl = &p.plan;
        let mut out = format!(
            "model {} ({} parameters, {} blocks)\nmesh {} ({})   global batch {}   micro-batches {}   zero {}   buckets {}\n",
            p.model.name,
            p.model.distinct_params(),
            p.model.blocks.len(),
            self.mesh,
            count(self.actors.len(), "actor"),
            pl.batch,
            pl.microbatches,
            match (&pl.offload, pl.offload_params) {
                (Offload::None, _) => pl.zero.to_string(),
                (o, false) => format!("{} (offload {o})", pl.zero),
                (o, true) => format!("{} (offload {o}, parameters too)", pl.zero),
            },
            self.buckets
                .iter()
                .map(|b| format!("[blocks {}..{}: {}]", b.start, b.end, memory::mib(b.bytes)))
                .collect::<Vec<_>>()
                .join(" ")
        );
        if pl.pp > 1 || pl.microbatches > 1 {
            out.push_str(&format!(
                "pipeline: schedule {}, pp={}, virtual stages {}, chunks --stages {}{}\n",
                pl.schedule,
                pl.pp,
                pl.virtual_stages,
                partition::format_stages(&self.chunks),
                if pl.checkpoint_activations {
                    ", activation checkpointing"
                } else {
                    ""
                }
            ));
            for (s, order) in self.schedule.iter().enumerate() {
                out.push_str(&format!(
                    "  stage {s}: bubble {:.3}, peak micro-batches held {}: {}\n",
                    self.prediction.bubble[s],
                    self.prediction.peak_in_flight[s],
                    order
                        .iter()
                        .map(|slot| slot.label(pl.virtual_stages))
                        .collect::<Vec<_>>()
                        .join(" ")
                ));
            }
        }
        let rates = p.cost_model.unwrap_or_default();
        out.push_str(&format!(
            "predicted step {:.1} ms (cost model: {:.1} GFLOP/s per device{}, backward {:.2}× its forward, \
             optimizer {:.0}M parameters/s)\n",
            1e3 * self.prediction.step_s,
            rates.flops_per_s / 1e9,
            if p.cost_model.is_some() {
                ""
            } else {
                ", the project machine's default"
            },
            rates.backward_over_forward,
            rates.optimizer_params_per_s / 1e6
        ));
        if self.prediction.comm_s.iter().any(|c| *c > 0.0) {
            let line = simulate_comm::describe(&self.prediction, &rates);
            out.push_str(&format!("{line}\n"));
        }
        for (a, m) in self.actors.iter().zip(&self.memory) {
            out.push_str(&format!(
                "\nactor {} on {} {:?}: blocks {}, {} instructions, memory ≈ {} ({})\n",
                a.actor,
                a.device,
                a.coords,
                partition::format_stages(&a.chunks),
                self.class_stream(a.actor).len(),
                memory::mib(m.total()),
                m.breakdown()
            ));
            if !a.training.slices.is_empty() {
                out.push_str(&format!(
                    "  state: {}
",
                    state_layout::layout_line(&a.training.slices)
                ));
            }
            if let Some(f) = self.fabric.get(a.actor).filter(|f| f.total() > 0) {
                let program = &self.program;
                let codecs: Vec<String> = [
                    (program.compression != crate::Compression::None)
                        .then(|| format!("gradient all-reduces as {}", program.compression)),
                    program
                        .quantize_grads
                        .then(|| "gradient reduce-scatters as int8".to_string()),
                    program
                        .quantize_weights
                        .then(|| "parameter gathers as int8".to_string()),
                ]
                .into_iter()
                .flatten()
                .collect();
                let codec = match codecs.is_empty() {
                    true => String::new(),
                    false => format!(" ({})", codecs.join(", ")),
                };
                out.push_str(&format!("  reads from peers per step: {f}{codec}\n"));
            }
            if let Some(t) = self.offload_traffic.get(a.actor).filter(|t| t.total() > 0) {
                out.push_str(&format!("  offload traffic per step: {t}\n"));
            }
        }
        out
    }

    /// Every actor's instruction stream, numbered.
    pub fn streams(&self) -> String {
        let mut out = String::new();
        for a in &self.actors {
            let stream = self.stream(a.actor);
            out.push_str(&format!(
                "\nactor {} on {} {:?}: {} instructions\n",
                a.actor,
                a.device,
                a.coords,
                stream.instructions.len()
            ));
            for (i, instruction) in stream.instructions.iter().enumerate() {
                out.push_str(&format!("  {i:>3}  {instruction}\n"));
            }
        }
        out
    }
}

/// `n` and `noun`, the noun in the plural unless `n` is 1 ("1 actor", "2 actors").
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}
