//! Trial search's test configuration, shared by the local tests (`programs.rs`) and the cluster
//! tests (`cluster.rs`): tiny gpt trials and the successive-halving checks.

use std::path::Path;

use archipelago_examples::programs::trial_search::{Halving, TrialConfig};

/// The model every halving trial trains.
pub const MODEL: &str = "gpt:vocab=64,ctx=16,d=16,layers=1,heads=2";

/// One trial of `model` at learning rate `lr`, checkpointing under `dir/name`.
pub fn config(dir: &Path, name: &str, model: &str, lr: f32) -> TrialConfig {
    TrialConfig {
        name: name.into(),
        model: model.into(),
        lr,
        batch: 4,
        seed: 0,
        dir: dir.join(name),
    }
}

/// Four learning rates of [`MODEL`], checkpointing under `dir`.
pub fn learning_rates(dir: &Path) -> Vec<TrialConfig> {
    [1e-4f32, 3e-3, 1e-2, 3e-2]
        .iter()
        .map(|lr| config(dir, &format!("lr={lr}"), MODEL, *lr))
        .collect()
}

/// Successive halving from a first rung of 2 steps over [`learning_rates`]: rungs of 4, 2 and 1
/// trials at 2, 4 and 8 steps, every kept trial no worse than every stopped one.
pub fn check_halving(halving: &Halving) {
    let sizes: Vec<usize> = halving.rungs.iter().map(Vec::len).collect();
    assert_eq!(sizes, [4, 2, 1]);
    let steps: Vec<u64> = halving.rungs.iter().map(|r| r[0].steps).collect();
    assert_eq!(steps, [2, 4, 8], "survivors continue from their checkpoints");
    for (k, rung) in halving.rungs.iter().enumerate().take(2) {
        let kept: Vec<&str> = halving.rungs[k + 1].iter().map(|r| r.name.as_str()).collect();
        let worst_kept = rung
            .iter()
            .filter(|r| kept.contains(&r.name.as_str()))
            .map(|r| r.loss)
            .fold(f32::MIN, f32::max);
        let best_stopped = rung
            .iter()
            .filter(|r| !kept.contains(&r.name.as_str()))
            .map(|r| r.loss)
            .fold(f32::MAX, f32::min);
        assert!(
            worst_kept <= best_stopped,
            "rung {k}: kept {worst_kept} vs stopped {best_stopped}"
        );
    }
    assert_eq!(halving.stopped.len(), 3);
    assert_eq!(halving.best, halving.rungs[2][0]);
    assert!(halving.best.loss < halving.rungs[0].iter().map(|r| r.loss).fold(f32::MIN, f32::max));
}
