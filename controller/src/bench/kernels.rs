//! The `kernels` section (`bench --kernels-only`, and a one-round version in the full suite):
//! the training step of gpt-tiny and mlp-8x1024 at dp=1 and dp=2 with every CPU matmul this
//! machine has — Flex's gemm, OpenBLAS as it detected the CPU, OpenBLAS with each core type of
//! AVX2 and newer the CPU's features allow, and `auto` (what jobs run) — so that `auto` is shown
//! beside the fastest. OpenBLAS's core type is fixed when a process loads it, so each run is a
//! child process (`archipelago train --report`, the environment naming the kernel). Each round
//! runs every other variant right beside a run of auto (auto first, then second, in turn; the
//! variants' order rotated from round to round), so that auto is compared with each variant in
//! adjacent pairs: on a shared machine the step moves by a third from one minute to the next,
//! and a pooled median compares runs minutes apart. Each variant's median step pools its timed
//! steps over the rounds; auto's ratio to a variant is the median of the pairs' ratios (the aim:
//! at most 1.10 against the fastest), each variant's pooled median over auto's is given too.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use archipelago_actors::kernels::core_type::{CpuFeatures, Level};
use archipelago_actors::kernels::{CPU_MATMUL_ENV, openblas};

use crate::process_stats::load_avg;
use crate::report::{TrainReport, median};

/// The workloads (model, dp) of the section.
const WORKLOADS: [(&str, usize); 4] = [
    ("gpt-tiny", 1),
    ("gpt-tiny", 2),
    ("mlp-8x1024", 1),
    ("mlp-8x1024", 2),
];

/// Auto's step over the fastest variant's that the section aims at.
const AIM: f64 = 1.10;

/// Rounds and steps of a run.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Rounds (each runs every variant of every workload once).
    pub rounds: usize,
    /// Warm-up and timed steps for gpt-tiny.
    pub gpt_steps: (u64, u64),
    /// Warm-up and timed steps for mlp-8x1024.
    pub mlp_steps: (u64, u64),
}

impl Settings {
    /// `--kernels-only`: three rounds (about 15 minutes on 2 cores), WORKLOADS.md's 5 + 30 steps for the
    /// mlp, 3 + 12 for gpt-tiny (Flex takes 2–3 s a step there); `quick`: one round of fewer
    /// steps (about 2.5 minutes).
    pub fn new(quick: bool) -> Settings {
        if quick {
            Settings {
                rounds: 1,
                gpt_steps: (2, 5),
                mlp_steps: (3, 12),
            }
        } else {
            Settings {
                rounds: 3,
                gpt_steps: (3, 12),
                mlp_steps: (5, 30),
            }
        }
    }
}

/// One way of running the CPU matmul: a name and the environment of its child process.
#[derive(Debug, Clone)]
struct Variant {
    name: String,
    matmul: &'static str,
    coretype: Option<String>,
}

/// The variants this machine has: auto and Flex always; with OpenBLAS, the core it detects and
/// each core of AVX2 and newer the CPU's features allow.
fn variants() -> Vec<Variant> {
    let variant = |name: String, matmul, coretype| Variant {
        name,
        matmul,
        coretype,
    };
    let mut all = vec![
        variant("auto".into(), "auto", None),
        variant("flex".into(), "flex", None),
    ];
    let Ok(blas) = openblas::library() else {
        return all;
    };
    let detected = blas.detected.clone();
    if let Some(core) = &detected {
        all.push(variant(
            format!("openblas {core} (detected)"),
            "openblas",
            Some(core.clone()),
        ));
    }
    let allowed = CpuFeatures::of_this_cpu().level();
    for level in [Level::Avx512, Level::Avx2]
        .into_iter()
        .filter(|l| Some(*l) <= allowed)
    {
        let Some(core) = level.core() else { continue };
        if !detected.as_deref().is_some_and(|d| d.eq_ignore_ascii_case(core)) {
            all.push(variant(
                format!("openblas {core}"),
                "openblas",
                Some(core.to_string()),
            ));
        }
    }
    all
}

/// One child run's figures: its timed steps, what multiplied, the load at its end.
struct Run {
    steps: Vec<f64>,
    cpu_matmul: String,
    final_loss: f32,
    load_avg: [f64; 3],
}

/// `archipelago train` of `model` at `dp` in a child process with `variant`'s environment.
fn run_child(
    variant: &Variant,
    (model, dp): (&str, usize),
    (warmup, timed): (u64, u64),
) -> Result<Run, String> {
    let report = std::env::temp_dir().join(format!(
        "archipelago-bench-kernels-{}-{model}-dp{dp}.json",
        std::process::id()
    ));
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut command = Command::new(exe);
    command
        .args(["train", "--model", model, "--quiet"])
        .args(["--dp", &dp.to_string(), "--steps", &(warmup + timed).to_string()])
        .arg("--report")
        .arg(&report)
        .env(CPU_MATMUL_ENV, variant.matmul);
    match &variant.coretype {
        Some(core) => command.env(openblas::CORETYPE_ENV, core),
        None => command.env_remove(openblas::CORETYPE_ENV),
    };
    let out = command.output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        return Err(format!("train exited with {}: {}", out.status, tail.join(" | ")));
    }
    let run = read_report(&report, warmup);
    let _ = std::fs::remove_file(&report);
    run
}

fn read_report(path: &Path, warmup: u64) -> Result<Run, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let report: TrainReport = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    Ok(Run {
        steps: report
            .steps
            .iter()
            .skip(warmup as usize)
            .map(|s| s.time_s)
            .collect(),
        cpu_matmul: report.cpu_matmul,
        final_loss: report.final_loss,
        load_avg: report.load_avg,
    })
}

/// Everything one variant gave on one workload over the rounds.
#[derive(Default)]
struct Tally {
    steps: Vec<f64>,
    round_medians: Vec<f64>,
    cpu_matmul: String,
    final_losses: Vec<f32>,
    load_avgs: Vec<[f64; 3]>,
    errors: Vec<String>,
    /// Auto's median step over this variant's, in each adjacent pair of runs.
    auto_over_this: Vec<f64>,
}

impl Tally {
    fn add(&mut self, run: Result<Run, String>) {
        match run {
            Ok(mut run) => {
                self.round_medians.push(median(&mut run.steps.clone()));
                self.steps.append(&mut run.steps);
                self.cpu_matmul = run.cpu_matmul;
                self.final_losses.push(run.final_loss);
                self.load_avgs.push(run.load_avg);
            }
            Err(why) => self.errors.push(why),
        }
    }

    /// The median of every timed step (None when no run finished).
    fn median_step_s(&self) -> Option<f64> {
        (!self.steps.is_empty()).then(|| median(&mut self.steps.clone()))
    }

    /// The median over the pairs of auto's step over this variant's (None without a pair).
    fn paired_auto_over_this(&self) -> Option<f64> {
        (!self.auto_over_this.is_empty()).then(|| median(&mut self.auto_over_this.clone()))
    }
}

/// The section: every variant of every workload, `settings.rounds` times, then the figures.
pub fn kernels(settings: Settings) -> Value {
    let variants = variants();
    let start = load_avg();
    let mut tallies: Vec<Vec<Tally>> = WORKLOADS
        .iter()
        .map(|_| variants.iter().map(|_| Tally::default()).collect())
        .collect();
    for round in 0..settings.rounds {
        for (w, &(model, dp)) in WORKLOADS.iter().enumerate() {
            let steps = if model == "gpt-tiny" {
                settings.gpt_steps
            } else {
                settings.mlp_steps
            };
            let others = variants.len() - 1;
            for i in 0..others {
                let v = 1 + (i + round) % others;
                let order = if (i + round) % 2 == 0 { [0, v] } else { [v, 0] };
                let mut medians = [None, None];
                for x in order {
                    let run = run_child(&variants[x], (model, dp), steps);
                    let step = run.as_ref().ok().map(|r| median(&mut r.steps.clone()));
                    let said = step.map_or_else(|| "failed".into(), |s| format!("{s:.3} s a step"));
                    eprintln!("bench: kernels, {model} dp={dp} {}: {said}", variants[x].name);
                    medians[usize::from(x != 0)] = step;
                    tallies[w][x].add(run);
                }
                if let [Some(auto), Some(other)] = medians {
                    tallies[w][v].auto_over_this.push(auto / other);
                }
            }
        }
    }
    let workloads: Vec<Value> = WORKLOADS
        .iter()
        .zip(&tallies)
        .map(|(&(model, dp), tallies)| workload_figures(model, dp, &variants, tallies, settings))
        .collect();
    json!({
        "system": "archipelago train in a child process per run (OPENBLAS_CORETYPE is per process), variants alternated",
        "cpu_features": CpuFeatures::of_this_cpu().of_level(),
        "rounds": settings.rounds,
        "workloads": workloads,
        "aim_auto_step_over_fastest": AIM,
        "load_avg_start": start,
        "load_avg_end": load_avg(),
    })
}

/// One workload's figures: each variant's median step and its ratio to auto's, the fastest
/// variant, and auto's ratio to it.
fn workload_figures(
    model: &str,
    dp: usize,
    variants: &[Variant],
    tallies: &[Tally],
    settings: Settings,
) -> Value {
    let steps = if model == "gpt-tiny" {
        settings.gpt_steps
    } else {
        settings.mlp_steps
    };
    let auto = tallies[0].median_step_s();
    let fastest = (variants.iter().zip(tallies).skip(1))
        .filter_map(|(v, t)| Some((v.name.clone(), t.median_step_s()?, t.paired_auto_over_this())))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let rows: Vec<Value> = variants
        .iter()
        .zip(tallies)
        .map(|(v, t)| {
            let step = t.median_step_s();
            json!({
                "name": v.name,
                "env": { CPU_MATMUL_ENV: v.matmul, openblas::CORETYPE_ENV: v.coretype },
                "cpu_matmul": t.cpu_matmul,
                "median_step_s": step,
                "round_median_step_s": t.round_medians,
                "step_over_auto": step.zip(auto).map(|(s, a)| s / a),
                "paired_auto_over_this": t.auto_over_this,
                "paired_auto_over_this_median": t.paired_auto_over_this(),
                "final_loss": t.final_losses,
                "load_avg_at_end": t.load_avgs,
                "errors": t.errors,
            })
        })
        .collect();
    let pooled = auto.zip(fastest.as_ref()).map(|(a, (_, f, _))| a / f);
    let ratio = fastest.as_ref().and_then(|(_, _, paired)| *paired);
    json!({
        "name": format!("{model} dp={dp}"),
        "config": { "model": model, "dp": dp, "warmup_steps": steps.0, "timed_steps": steps.1, "cores_per_actor": 1 },
        "auto_cpu_matmul": tallies[0].cpu_matmul,
        "variants": rows,
        "fastest_other": fastest.as_ref().map(|(name, _, _)| name),
        "auto_step_over_fastest": ratio,
        "auto_step_over_fastest_pooled": pooled,
        "within_aim": ratio.map(|r| r <= AIM),
    })
}

/// Auto's runs in the shape `peers::throughput_ratios` reads (`runs[].config.{model,dp}`,
/// `runs[].median_step_s`).
pub fn auto_runs(section: &Value) -> Value {
    let runs: Vec<Value> = (section["workloads"].as_array().cloned().unwrap_or_default())
        .iter()
        .map(|w| {
            let auto = &w["variants"][0];
            json!({ "config": w["config"], "median_step_s": auto["median_step_s"] })
        })
        .collect();
    json!({ "runs": runs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(steps: &[f64]) -> Tally {
        Tally {
            steps: steps.to_vec(),
            ..Tally::default()
        }
    }

    #[test]
    fn auto_is_set_beside_the_fastest_other_variant_and_read_back_for_the_peers() {
        let variant = |name: &str| Variant {
            name: name.to_string(),
            matmul: "openblas",
            coretype: None,
        };
        let variants = [variant("auto"), variant("flex"), variant("openblas SkylakeX")];
        let mut tallies = [tally(&[0.55, 0.56, 0.60]), tally(&[2.2]), tally(&[0.50, 0.51])];
        tallies[2].auto_over_this = vec![1.02, 0.98, 1.30];
        let figures = workload_figures("gpt-tiny", 2, &variants, &tallies, Settings::new(true));
        assert_eq!(figures["fastest_other"], "openblas SkylakeX");
        // The pairs' median, not the pooled medians' ratio (runs minutes apart).
        let ratio = figures["auto_step_over_fastest"].as_f64().unwrap();
        assert!((ratio - 1.02).abs() < 1e-12, "{ratio}");
        assert_eq!(figures["within_aim"], true);
        let pooled = figures["auto_step_over_fastest_pooled"].as_f64().unwrap();
        assert!((pooled - 0.56 / 0.505).abs() < 1e-12, "{pooled}");
        let section = json!({ "workloads": [figures] });
        let runs = auto_runs(&section);
        assert_eq!(runs["runs"][0]["config"]["dp"], 2);
        assert_eq!(runs["runs"][0]["median_step_s"], 0.56);
    }
}
