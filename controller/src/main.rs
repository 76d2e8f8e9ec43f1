//! The `archipelago` binary: `train`, `plan` and `bench` (see `archipelago --help`).

use clap::Parser;

use archipelago_controller::cli::{self, Cli, Command};

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Train(args) => cli::train(args),
        Command::Plan(args) => cli::plan(args),
        Command::Bench(args) => archipelago_controller::bench::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
