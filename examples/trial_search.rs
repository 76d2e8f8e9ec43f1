//! Successive halving over gpt learning rates, then a scaling ladder fitted to a power law: see
//! `programs/trial_search.rs`. `cargo run --example trial_search -- [--quick]`.
//!
//! With no `ARCHIPELAGO_*` variable set the trials run on 4 CPU devices of this process. Like
//! `actors_cluster`, the same binary also runs on a cluster: start `archipelago controller`, hosts
//! of this binary offering 4 devices in all (`ARCHIPELAGO_ROLE=host ARCHIPELAGO_CONTROLLER=…
//! ARCHIPELAGO_TOKEN_FILE=… ARCHIPELAGO_DEVICES=cpu:0,cpu:1`, twice), then this binary with
//! `ARCHIPELAGO_CONTROLLER` and `ARCHIPELAGO_TOKEN_FILE` set: one trial per device of the hosts,
//! each checkpointing into its directory under the temporary directory (on one machine, or a
//! shared file system), with the same rungs and winner (`bash examples/multi_host.sh
//! trial_search --quick` does all of it).

use archipelago_dataflow::DeviceSpec;
use archipelago_examples::programs::trial_search::{
    TrialConfig, registry, scaling_ladder, successive_halving,
};

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    // One device per trial (4 learning rates, 4 ladder sizes); on a cluster: wait for 4.
    let runtime = archipelago_controller::runtime::init(registry(), DeviceSpec::cpus(4))?;
    let root = std::env::temp_dir().join(format!("archipelago-trials-{}", std::process::id()));
    let (model, first_rung) = if quick {
        ("gpt:vocab=64,ctx=16,d=32,layers=1,heads=2", 4)
    } else {
        ("gpt-tiny", 20)
    };
    let configs = [3e-4f32, 1e-3, 3e-3, 1e-2]
        .iter()
        .map(|lr| TrialConfig {
            name: format!("lr={lr}"),
            model: model.to_string(),
            lr: *lr,
            batch: if quick { 4 } else { 16 },
            seed: 0,
            dir: root.join(format!("lr-{lr}")),
        })
        .collect();
    let halving = successive_halving(&runtime, configs, first_rung)?;
    for (k, rung) in halving.rungs.iter().enumerate() {
        let line: Vec<String> = rung.iter().map(|r| format!("{} {:.4}", r.name, r.loss)).collect();
        println!("rung {k} ({} steps): {}", rung[0].steps, line.join(", "));
    }
    let on: Vec<String> = (halving.placement.iter())
        .map(|(host, device)| format!("{host} {device}"))
        .collect();
    println!("trials on: {}", on.join(", "));
    println!(
        "stopped early: {:?}; best {} (loss {:.4})",
        halving.stopped, halving.best.name, halving.best.loss
    );
    // (width, Adam's rate): each width's best of 3e-3, 1e-3 and 3e-4 in a 200-step sweep on this
    // data (2026-11-27, the tail loss of each run): wider models want smaller rates; at one rate
    // for all, the widest ended worst and the fit's exponent came out negative. The quick ladder's
    // 20 steps are too few for any but the largest rate.
    let widths: &[(usize, f32)] = if quick {
        &[(8, 3e-3), (16, 3e-3), (32, 3e-3), (64, 3e-3)]
    } else {
        &[(32, 3e-3), (64, 3e-3), (128, 1e-3), (256, 3e-4)]
    };
    let ladder = widths
        .iter()
        .map(|&(d, lr)| TrialConfig {
            name: format!("d={d} lr={lr}"),
            model: format!("gpt:vocab=64,ctx=16,d={d},layers=2,heads=2"),
            lr,
            batch: 8,
            seed: 0,
            dir: root.join(format!("ladder-{d}")),
        })
        .collect();
    let (results, law) = scaling_ladder(&runtime, ladder, if quick { 20 } else { 200 })?;
    for r in &results {
        println!(
            "{}: {} parameters, loss {:.4} (the mean of the last tenth of its steps)",
            r.name, r.params, r.tail_loss
        );
    }
    println!("{}", law.describe());
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
