//! The `archipelago` binary: `train`, `plan` and `bench` (see `archipelago --help`).

use clap::Parser;

use archipelago_controller::cli::{self, Cli, Command};

fn main() {
    let cli = Cli::parse();
    // Services log what they do (registrations, refusals, lost hosts); jobs only warnings.
    let level = match &cli.command {
        Command::Controller(_) | Command::Host(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let result = match &cli.command {
        Command::Train(args) => cli::train(args),
        Command::Plan(args) => cli::plan(args),
        Command::Bench(args) => archipelago_controller::bench::run(args),
        Command::Controller(args) => archipelago_controller::cluster::commands::controller(args),
        Command::Host(args) => archipelago_controller::cluster::commands::host(args),
        Command::BenchPeer(args) => archipelago_controller::bench::cross_process::peer_main(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
