//! Unit tests of the command line's argument validation: what clap refuses while parsing and
//! what `JobArgs::program` and the compiler refuse before anything starts, each naming the flag
//! to change (the same refusals run end to end in `tests/cli.rs`).

use clap::Parser;

use super::{Cli, Command};

/// Parses `archipelago train <args>` and builds its program.
fn program(args: &[&str]) -> Result<archipelago_dataflow::Program, String> {
    let argv = [
        "archipelago",
        "train",
        "--model",
        "mlp:in=8,hidden=16,layers=4,out=3",
    ]
    .iter()
    .chain(args)
    .copied();
    let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
    let Command::Train(train) = cli.command else {
        panic!("not a train command")
    };
    train.job.program().map_err(|e| e.to_string())
}

/// The program, compiled (the plan's refusals).
fn compiled(args: &[&str]) -> Result<(), String> {
    archipelago_dataflow::compile(&program(args)?)
        .map(drop)
        .map_err(|e| e.to_string())
}

#[test]
fn values_clap_cannot_read_are_refused_while_parsing() {
    for (args, needle) in [
        (&["--state", "gpu"][..], "gpu"),
        (&["--dp", "two"][..], "two"),
        (&["--optimizer", "adagrad"][..], "adagrad"),
    ] {
        let err = program(args).unwrap_err();
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn plans_that_cannot_work_are_refused_naming_the_flag() {
    for (args, needles) in [
        (&["--dp", "0"][..], &["--dp"][..]),
        (&["--dp", "2", "--zero", "4"][..], &["--zero"][..]),
        (
            &["--dp", "2", "--offload-params"][..],
            &["--offload-params", "--zero 3"][..],
        ),
        (&["--dp", "2", "--batch", "7"][..], &["7"][..]),
        (
            &["--optimizer", "lamb", "--offload", "cpu"][..],
            &["--optimizer lamb", "--offload"][..],
        ),
        (
            &["--dp", "4", "--zero", "2", "--zero-hpz", "--islands", "a,a,b,b"][..],
            &["--zero-hpz", "--zero 3"][..],
        ),
        (
            &["--dp", "4", "--zero", "3", "--zero-hpz"][..],
            &["--zero-hpz", "two islands or more"][..],
        ),
    ] {
        let err = compiled(args).unwrap_err();
        assert!(needles.iter().all(|n| err.contains(n)), "{args:?}: {err}");
    }
    // The control: the same flags with workable values compile.
    for args in [
        &["--dp", "2"][..],
        &["--dp", "2", "--zero", "3", "--offload", "cpu", "--offload-params"][..],
        &["--dp", "2", "--batch", "8"][..],
        &["--optimizer", "lamb", "--state", "device"][..],
        &["--dp", "4", "--zero", "3", "--zero-hpz", "--islands", "a,a,b,b"][..],
    ] {
        compiled(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    }
}

#[test]
fn state_auto_puts_the_training_state_on_gpus_only() {
    use archipelago_dataflow::StatePlacement::{Device, Host};
    for (args, want) in [
        (&[][..], Host),
        (&["--devices", "cpu:0"][..], Host),
        (&["--devices", "cuda:0"][..], Device),
        (&["--devices", "cuda:0,cuda:1", "--dp", "2"][..], Device),
        // One CPU actor among GPUs keeps the host path for all (one placement per job).
        (&["--devices", "cuda:0,cpu:0", "--dp", "2"][..], Host),
        // Devices past the job's actors do not count.
        (&["--devices", "cuda:0,cpu:0"][..], Device),
        (&["--devices", "cuda:0", "--offload", "cpu"][..], Host),
        // The control: an explicit placement wins on either kind of device.
        (&["--devices", "cuda:0", "--state", "host"][..], Host),
        (&["--devices", "cpu:0", "--state", "device"][..], Device),
    ] {
        let program = program(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        let plan = archipelago_dataflow::compile(&program).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        assert_eq!(plan.program.plan.state, want, "{args:?}");
        assert!(plan.actors.iter().all(|a| a.training.state == want), "{args:?}");
    }
}

/// `plan --compare`: a layout's flags replace the same flags of the base line (with a value,
/// as `--x=v`, or a switch), the others stay; an unknown flag is refused naming the layout.
#[test]
fn compare_layouts_replace_the_base_flags_they_name() {
    use super::plan_cmd::with_flags;
    let base: Vec<String> = [
        "--model",
        "gpt-tiny",
        "--dp=2",
        "--checkpoint-activations",
        "--zero",
        "1",
        "--seed",
        "7",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let args = with_flags(&base, "--dp 4 --zero 2").unwrap();
    assert_eq!((args.job.dp, args.job.zero, args.job.seed), (4, 2, 7));
    assert!(args.job.checkpoint_activations, "a base switch not named stays");
    // A replaced switch takes no value: the word after it in the base is kept.
    let args = with_flags(&base, "--checkpoint-activations --pp 2").unwrap();
    assert_eq!((args.job.dp, args.job.zero, args.job.pp), (2, 1, 2));
    assert_eq!(args.job.model, "gpt-tiny");
    // A flag no subcommand has is refused, naming the layout.
    let err = with_flags(&base, "--no-such-flag 3").unwrap_err().to_string();
    assert!(
        err.contains("--compare layout") && err.contains("--no-such-flag"),
        "{err}"
    );
}
