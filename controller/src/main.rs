//! The `archipelago` binary: `train`, `plan`, `bench`, `controller` and `host` (see
//! `archipelago --help`).

use clap::Parser;

use archipelago_controller::cli::{self, Cli, Command};
use archipelago_controller::telemetry::Telemetry;

/// Zeroed buffers written (no zero-page faults later), large freed buffers kept for the next of
/// the same size (see `TensorAllocator`).
#[global_allocator]
static ALLOCATOR: archipelago_actors::allocator::TensorAllocator =
    archipelago_actors::allocator::TensorAllocator;

fn main() {
    let cli = Cli::parse();
    // Services log what they do (registrations, refusals, lost hosts); jobs only warnings.
    let (service, level) = match &cli.command {
        Command::Controller(_) => ("archipelago-controller", "info"),
        Command::Host(_) => ("archipelago-host", "info"),
        Command::Serve(_) => ("archipelago-serve", "info"),
        Command::Train(_) => ("archipelago-train", "warn"),
        _ => ("archipelago", "warn"),
    };
    // The CPU matmul (`ARCHIPELAGO_CPU_MATMUL`) is chosen before any actor starts: a bad value, or
    // `openblas` where it cannot be loaded, is an error here. It runs before telemetry too, while
    // this is the process's only thread: choosing OpenBLAS's core type sets an environment
    // variable for the library's load (kernels/openblas.rs, `open_as`).
    if matches!(
        &cli.command,
        Command::Train(_)
            | Command::Host(_)
            | Command::Ps(_)
            | Command::Bench(_)
            | Command::BenchPeer(_)
            | Command::Serve(_)
    ) && let Err(why) = archipelago_actors::kernels::select_from_env()
    {
        eprintln!("error: {why}");
        std::process::exit(2);
    }
    let telemetry = Telemetry::init(service, level);
    let result = match &cli.command {
        Command::Train(args) => cli::train(args),
        Command::Plan(args) => cli::plan(args),
        Command::Ps(args) => archipelago_controller::ps_job::cli::ps(args).map(|_| ()),
        Command::Bench(args) => archipelago_controller::bench::run(args),
        Command::Controller(args) => archipelago_controller::cluster::commands::controller(args),
        Command::Host(args) => archipelago_controller::cluster::commands::host(args),
        Command::Devices(args) => archipelago_controller::host_devices::devices(args),
        Command::Export(args) => archipelago_controller::export::run(args),
        Command::Eval(args) => archipelago_controller::eval::run(args),
        Command::Serve(args) => archipelago_controller::serve::run(args),
        Command::Certs(args) => archipelago_controller::cluster::security::certs(args),
        Command::Health(args) => archipelago_controller::cluster::health::health(args),
        Command::BenchPeer(args) => archipelago_controller::bench::cross_process::peer_main(args),
        Command::BenchActorHost(args) => archipelago_controller::bench::actor_api::host_main(args),
        Command::BenchSlowLink(args) => archipelago_controller::bench::slow_link::inner_main(args),
    };
    telemetry.shutdown();
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
