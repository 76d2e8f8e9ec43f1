//! What `train` prints: a banner that confirms every setting the run resolved (model, layout,
//! optimizer, schedule, clipping, ZeRO, state, precision, data, start), the progress lines (loss,
//! learning rate, gradient norm, time) and the closing summary. Plain text without colour codes
//! unless stdout is a terminal (then a progress bar).

use std::path::Path;
use std::sync::Arc;

use archipelago_dataflow::data::DataSpec;
use archipelago_dataflow::{InputKind, ParamGroups, Plan, Program, count};

use crate::report::TrainReport;
use crate::train::{ProgressFn, StepProgress};

/// Where the run starts, for the banner.
pub enum Start<'a> {
    /// From the weights of `--init FILE`, or the seeded initialisation.
    Fresh,
    /// From the newest complete checkpoint under this directory.
    Resume(&'a Path),
}

/// The banner's lines: what is trained where, and every setting that decides the run.
pub fn banner(program: &Program, plan: &Plan, steps: u64, start: Start<'_>) -> Vec<String> {
    let pl = &program.plan;
    let decay = match program.param_groups {
        _ if program.optimizer.weight_decay() == 0.0 => "",
        ParamGroups::NoDecayForVectors => " (none on biases and LayerNorm)",
        ParamGroups::DecayAll => " (on every parameter)",
    };
    let clip = match program.clip_grad_norm {
        Some(c) => format!("clip grad norm {c}"),
        None => "no clipping".into(),
    };
    let zero = match (&pl.offload, pl.offload_params) {
        (o, _) if !o.is_some() => format!("zero {}", pl.zero),
        (o, false) => format!("zero {} (offload {o})", pl.zero),
        (o, true) => format!("zero {} (offload {o}, parameters too)", pl.zero),
    };
    let start = match (start, &program.init) {
        (Start::Resume(dir), _) => format!(
            "resume from the newest complete checkpoint under {}",
            dir.display()
        ),
        (Start::Fresh, Some(init)) => format!("weights from {init}"),
        (Start::Fresh, None) => format!("seeded initialisation (seed {})", program.seed),
    };
    vec![
        format!(
            "training {} ({} parameters) on {} [{}], global batch {}, {}",
            program.model.name,
            program.model.distinct_params(),
            count(plan.actors.len(), "actor"),
            plan.mesh,
            pl.batch,
            count(steps as usize, "step")
        ),
        format!(
            "  optimizer {}{decay}; lr schedule {}; {clip}",
            program.optimizer, program.lr_schedule
        ),
        format!(
            "  {zero}, state {}, precision {}, micro-batches {}; data: {}; start: {start}",
            // As the compiler resolved it (`auto` → host or device).
            plan.program.plan.state,
            precision_words(&program.precision),
            pl.microbatches,
            data_words(program)
        ),
    ]
}

/// How the run's samples are made, in words.
/// "f32", or the compute dtype over its f32 master ("bf16 (f32 master and optimizer state)").
fn precision_words(precision: &archipelago_dataflow::Precision) -> String {
    use archipelago_dataflow::LossScale;
    let scaling = match precision.loss_scaling() {
        Some(LossScale::Dynamic {
            init,
            growth_interval,
        }) => {
            format!("; loss scale dynamic from {init}, ×2 after {growth_interval} clean steps")
        }
        Some(LossScale::Static { scale }) => format!("; loss scale static {scale}"),
        _ => String::new(),
    };
    if precision.is_mixed() {
        format!("{} (f32 master and optimizer state{scaling})", precision.compute)
    } else {
        precision.compute.to_string()
    }
}

fn data_words(program: &Program) -> String {
    match (&program.data, program.model.input) {
        (
            DataSpec::TextFile {
                path,
                tokenizer: Some(tokenizer),
            },
            InputKind::Tokens { ctx, .. },
        ) => format!(
            "text {path} tokenized by {tokenizer} (sequence j of step s is the {} tokens from ((s·batch + j)·{}) \
             mod (tokens − {}))",
            ctx + 1,
            ctx + 1,
            ctx + 1
        ),
        (DataSpec::TextFile { path, .. }, InputKind::Tokens { ctx, .. }) => format!(
            "text {path} (one token per byte; sequence j of step s is the {} bytes from ((s·batch + j)·{}) mod \
             (bytes − {}))",
            ctx + 1,
            ctx + 1,
            ctx + 1
        ),
        (DataSpec::TensorFile { path }, _) => {
            format!("rows of {path} (step s takes rows (s·batch + j) mod n)")
        }
        (DataSpec::Clusters { seed }, _) => format!("synthetic Gaussian clusters (seed {seed})"),
        (DataSpec::SyntheticBytes { seed }, _) => format!("synthetic byte stream (seed {seed})"),
        (DataSpec::TextFile { path, .. }, _) => format!("text {path}"),
    }
}

/// One progress line: step, loss, learning rate, gradient norm (when the step computed it), time.
pub fn progress_line(p: &StepProgress, batch: f64) -> String {
    let mut line = format!("step {:>5}/{}  loss {:.4}", p.step, p.steps, p.loss);
    if let Some(lr) = p.lr {
        line.push_str(&format!("  lr {lr:.3e}"));
    }
    if let Some(norm) = p.grad_norm {
        line.push_str(&format!("  grad norm {norm:.4}"));
    }
    if let Some(scale) = p.loss_scale {
        line.push_str(&format!("  loss scale {scale}"));
    }
    if p.skipped {
        line.push_str("  skipped (gradients overflowed)");
    }
    line.push_str(&format!(
        "  {:.3} s/step  {:.1} samples/s",
        p.time_s,
        batch / p.time_s.max(1e-9)
    ));
    line
}

/// The progress callback and the bar it drives (on a terminal; plain lines every `every` steps
/// otherwise, and at the first and last step; nothing when `quiet`).
pub fn progress(
    steps: u64,
    batch: f64,
    every: u64,
    quiet: bool,
) -> (ProgressFn, Option<indicatif::ProgressBar>) {
    let bar = (!quiet && std::io::IsTerminal::is_terminal(&std::io::stdout())).then(|| {
        let bar = indicatif::ProgressBar::new(steps);
        let style = indicatif::ProgressStyle::with_template(
            "{bar:30.cyan/blue} step {pos}/{len}  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .expect("a valid template");
        bar.set_style(style);
        bar
    });
    let shown = bar.clone();
    let every = every.max(1);
    let on_step = Arc::new(move |p: &StepProgress| {
        if let Some(bar) = &shown {
            bar.set_position(p.step);
            let line = progress_line(p, batch);
            bar.set_message(
                line.split_once("  ")
                    .map_or(line.clone(), |(_, rest)| rest.to_string()),
            );
            if p.step.is_multiple_of(every) || p.step == 1 || p.step == p.steps {
                bar.println(line);
            }
        } else if !quiet && (p.step.is_multiple_of(every) || p.step == 1 || p.step == p.steps) {
            println!("{}", progress_line(p, batch));
        }
    });
    (on_step, bar)
}

/// The closing lines: the last step's loss, the parameters' norm, throughput, memory.
pub fn summary(report: &TrainReport) -> Vec<String> {
    let last = report.steps.last().map_or(0, |s| s.step);
    let mut lines = vec![format!(
        "done: final loss {:.4} (step {last}'s batch, before its update), parameter L2 {:.6}, {:.1} samples/s{}, \
         peak RSS {:.0} MiB",
        report.final_loss,
        report.param_l2,
        report.samples_per_s,
        report
            .tokens_per_s
            .map(|t| format!(" ({t:.0} tokens/s)"))
            .unwrap_or_default(),
        report.peak_rss_bytes as f64 / (1u64 << 20) as f64
    )];
    let gb = |b: u64| b as f64 / 1e9;
    for a in &report.actors {
        if let Some(memory) = a.device_memory {
            lines.push(format!(
                "actor {} on {}: device memory pool {:.2} GB at its high-water mark, live tensors {:.2} GB \
                 at most between instructions; the plan estimated {:.2} GB",
                a.actor,
                a.device,
                gb(memory.reserved),
                gb(memory.peak_in_use),
                gb(a.estimated_device_bytes)
            ));
        }
    }
    lines
}

/// Per pipeline stage: the bubble measured, predicted and replayed, and the micro-batches held.
pub fn pipeline_lines(report: &TrainReport) -> Vec<String> {
    (report.actors.iter())
        .filter(|a| a.replica == 0)
        .map(|a| {
            format!(
                "stage {}: bubble {:.3} measured, {:.3} predicted by the cost model, {:.3} replayed with the \
                 measured pass times; micro-batches held at peak {} (schedule bound {})",
                a.stage,
                a.bubble,
                a.predicted_bubble,
                a.replayed_bubble,
                a.peak_microbatches_held,
                a.predicted_peak_microbatches_held
            )
        })
        .collect()
}

/// A warning when the plan's CPU actors (all in this process when it runs here) outnumber this
/// machine's cores: they share them, so each runs slower than alone and step times are not what
/// a machine with a core per actor would see.
pub fn cores_warning(plan: &Plan) -> Option<String> {
    let actors = cpu_actors(plan);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (actors > cores).then(|| {
        format!(
            "warning: {} share this machine's {}: each step runs them in turns (fewer actors, or \
             --controller with more hosts, give each its own)",
            count(actors, "CPU actor"),
            count(cores, "core")
        )
    })
}

/// The plan's actors on CPU devices.
pub fn cpu_actors(plan: &Plan) -> usize {
    (plan.actors.iter())
        .filter(|a| a.device.cuda_ordinal().is_none())
        .count()
}
