//! `archipelago plan`: compiles and verifies a job without starting any actor, and prints what
//! it would run — a summary by default (mesh, schedule, predicted step, memory and bytes per
//! actor), the instruction streams with `--streams`, the plan as JSON with `--json`, or several
//! layouts side by side with `--compare`. It takes every flag of `train`; those that matter only
//! while running (`--report`, `--resume`, `--dashboard`, …) are ignored. `plan serve` takes
//! every flag of `serve` instead and prints a serving job's plan: weight and cache memory per
//! replica and how many positions of cache fit (the model and its weights are read and checked;
//! no replica starts).

use clap::{Args, Subcommand};

use archipelago_dataflow::{CostModel, Plan};

use super::TrainArgs;
use super::console;
use crate::Controller;
use crate::calibrate::Calibration;

/// Flags of `plan`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlanArgs {
    /// A job other than training (`plan serve <serve's flags>`).
    #[command(subcommand)]
    pub job: Option<PlanJob>,
    /// The job, with every flag `train` takes.
    #[command(flatten)]
    pub train: TrainArgs,
    /// Print the plan as JSON instead of the summary.
    #[arg(long)]
    pub json: bool,
    /// Print every actor's instruction stream after the summary.
    #[arg(long)]
    pub streams: bool,
    /// Put layouts side by side, each the flags it changes from the others given (e.g.
    /// `--compare "--dp 4" "--dp 2 --pp 2 --microbatches 4" "--dp 4 --zero 3"`): memory per
    /// device, predicted step, bubble and bytes read from peers per step.
    /// Give it last: every word after it is a layout.
    #[arg(long, num_args = 1.., allow_hyphen_values = true, value_name = "FLAGS")]
    pub compare: Vec<String>,
    /// The cost model's rates: `measure` (a few real training steps of the model on one actor of
    /// this process, on a CPU or on the plan's first GPU, at the plan's micro-batch size give the
    /// forward's flop rate, the backward over the forward and the optimizer's rate), `default`
    /// (the fixed rates of the project's 2-core CPU machine) or a compute rate in GFLOP/s (the
    /// other rates default).
    #[arg(long, default_value = "measure")]
    pub rate: String,
}

/// The jobs `plan` shows besides training.
#[derive(Debug, Subcommand)]
pub enum PlanJob {
    /// A serving job (`archipelago serve`'s flags): weight and cache memory per replica, how many
    /// positions of cache fit and how many full-context sequences the pool holds at once.
    Serve {
        /// The serving job.
        #[command(flatten)]
        serve: Box<crate::serve::ServeArgs>,
        /// Print the plan as JSON instead of the summary.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `archipelago plan`.
pub fn plan(args: &PlanArgs) -> anyhow::Result<()> {
    if let Some(PlanJob::Serve { serve, json }) = &args.job {
        let (summary, _) = crate::serve::plan(serve).map_err(anyhow::Error::msg)?;
        match json {
            true => println!("{}", serde_json::to_string_pretty(&summary.to_json())?),
            false => println!("{}", summary.plan()),
        }
        return Ok(());
    }
    if !args.compare.is_empty() {
        return compare(args);
    }
    let (plan, how) = compile(args, &args.train)?;
    if args.json {
        println!("{}", plan.to_json());
        eprintln!("rates: {how}");
        return Ok(());
    }
    print!("{}", plan.summary());
    println!("rates: {how}");
    if let Some(warning) = console::cores_warning(&plan) {
        println!("\n{warning}");
    }
    if args.streams {
        print!("{}", plan.streams());
    } else {
        println!("\n(--streams prints every actor's instructions)");
    }
    Ok(())
}

/// Compiles the job of `train`'s flags under the cost model `args` asks for; the plan and where
/// its rates come from.
fn compile(args: &PlanArgs, train: &TrainArgs) -> anyhow::Result<(Plan, String)> {
    let mut program = train.job.program()?;
    // Refused before anything is timed.
    Controller::local(program.devices.clone()).plan(&program)?;
    // A precision this host's GPUs cannot run (bf16 below compute capability 8.0), when it has
    // the GPUs the plan names.
    archipelago_actors::backend::check_precision(&program.devices, program.precision.compute)
        .map_err(anyhow::Error::msg)?;
    let calibration = cost_model(&args.rate, &program)?;
    program.cost_model = Some(calibration.cost_model);
    let controller = Controller::local(program.devices.clone());
    Ok((controller.plan(&program)?, calibration.how))
}

/// The cost model `--rate` names.
fn cost_model(rate: &str, program: &archipelago_dataflow::Program) -> anyhow::Result<Calibration> {
    let base = CostModel::default();
    Ok(match rate {
        "default" => Calibration {
            cost_model: base,
            how: "the default rates of the project's 2-core CPU machine (--rate default)".into(),
        },
        "measure" => crate::calibrate::cost_model(program),
        gflops => {
            let g: f64 = gflops.parse().ok().filter(|g: &f64| *g > 0.0).ok_or_else(|| {
                anyhow::anyhow!("--rate `{gflops}`: use measure, default or GFLOP/s (e.g. 25)")
            })?;
            Calibration {
                cost_model: CostModel {
                    flops_per_s: g * 1e9,
                    ..base
                },
                how: format!("--rate {g} GFLOP/s, the other rates the project machine's defaults"),
            }
        }
    })
}

/// `--compare`: each layout compiled from the base flags with its own flags added, then one table.
fn compare(args: &PlanArgs) -> anyhow::Result<()> {
    let base = base_words();
    let mut rows = Vec::new();
    for flags in &args.compare {
        let compiled = with_flags(&base, flags).and_then(|train| compile(args, &train));
        let row = match compiled {
            Ok((plan, _)) => crate::plan_table::Row::of(flags, &plan),
            Err(e) => crate::plan_table::Row::refused(flags, &format!("{e:#}")),
        };
        rows.push(row);
    }
    print!("{}", crate::plan_table::render(&rows));
    Ok(())
}

/// The job of `base` (the words after `plan`, up to `--compare`) with `layout`'s flags in place
/// of the same flags there.
pub(super) fn with_flags(base: &[String], layout: &str) -> anyhow::Result<TrainArgs> {
    let mut cli = <super::Cli as clap::CommandFactory>::command();
    // Built, so that every argument's action (and so whether it takes a value) is final.
    cli.build();
    let plan = cli.find_subcommand("plan").expect("plan is a subcommand");
    let layout: Vec<String> = layout.split_whitespace().map(String::from).collect();
    let replaced: Vec<&str> = (layout.iter())
        .filter_map(|w| w.strip_prefix("--"))
        .map(|w| w.split('=').next().unwrap_or(w))
        .collect();
    let takes_value = |name: &str| {
        (plan.get_arguments())
            .find(|a| a.get_long() == Some(name))
            .is_some_and(|a| a.get_action().takes_values())
    };
    let mut words: Vec<String> = vec!["archipelago".into(), "plan".into()];
    let mut skip_value = false;
    for word in base {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        if let Some(name) = word.strip_prefix("--").map(|w| w.split('=').next().unwrap_or(w))
            && replaced.contains(&name)
        {
            skip_value = !word.contains('=') && takes_value(name);
            continue;
        }
        words.push(word.clone());
    }
    words.extend(layout);
    let cli = <super::Cli as clap::Parser>::try_parse_from(&words)
        .map_err(|e| anyhow::anyhow!("--compare layout `{}`: {e}", words[2..].join(" ")))?;
    match cli.command {
        super::Command::Plan(plan) => Ok(plan.train),
        _ => unreachable!("parsed as plan"),
    }
}

/// The words after `plan` on this process's command line, up to `--compare`.
fn base_words() -> Vec<String> {
    std::env::args_os()
        .map(|w| w.to_string_lossy().into_owned())
        .skip_while(|w| w != "plan")
        .skip(1)
        .take_while(|w| w != "--compare" && !w.starts_with("--compare="))
        .collect()
}
