//! The resume check of a compressed job whose replicas keep state of their own beside their
//! shards (top-k's residuals, 1-bit Adam's momentum, frozen variance and errors: each actor's
//! `.residuals` file): the job run whole, the same job stopped at a checkpoint, that checkpoint
//! resumed as written, and resumed with the state files removed (the control).

use std::path::{Path, PathBuf};

use archipelago_controller::{TrainOptions, TrainReport};
use archipelago_dataflow::Program;

use crate::precision::{max_abs, params};
use crate::{MARGIN, assert_caught, copy_dir, train_program};

/// The runs of [`state_resumes`].
pub struct StateResumes {
    /// The job run to its last step without stopping.
    pub whole: TrainReport,
    /// The job resumed from its checkpoint with every state file.
    pub resumed: TrainReport,
    /// The same resume with the state files removed (started at zero).
    pub dropped: TrainReport,
    /// The checkpoint directory the stopped run wrote (for other resumes of it).
    pub stopped: PathBuf,
    _root: tempfile::TempDir,
}

/// `options` checkpointing into `dir` every `every` steps, up to `steps`, resuming when
/// `resume` (the total steps may change).
fn checkpointed(steps: u64, every: u64, dir: &Path, resume: bool) -> TrainOptions {
    TrainOptions {
        keep_params: true,
        steps,
        checkpoint_dir: Some(dir.to_path_buf()),
        checkpoint_every: every,
        resume,
        resume_override: vec!["steps".into()],
        ..TrainOptions::default()
    }
}

/// Runs `program` to step `end` whole, and stopped at step `stop` (its checkpoint, one state
/// file per replica, asserted) then resumed to `end` with and without its state files.
pub fn state_resumes(program: &Program, stop: u64, end: u64) -> StateResumes {
    let root = tempfile::tempdir().unwrap();
    let whole = train_program(
        program,
        &TrainOptions {
            keep_params: true,
            steps: end,
            ..TrainOptions::default()
        },
    );
    let stopped = root.path().join("stopped");
    train_program(program, &checkpointed(stop, stop, &stopped, false));
    let at = format!("step-{stop:08}");
    let files: Vec<String> = (std::fs::read_dir(stopped.join(&at)).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".residuals"))
        .collect();
    assert_eq!(
        files.len(),
        program.plan.dp,
        "one state file per replica: {files:?}"
    );
    let resume = |name: &str, remove: &[String]| {
        let dir = root.path().join(name);
        copy_dir(&stopped, &dir);
        for file in remove {
            std::fs::remove_file(dir.join(&at).join(file)).unwrap();
        }
        let report = train_program(program, &checkpointed(end, stop, &dir, true));
        assert_eq!(report.steps.first().map(|s| s.step), Some(stop + 1), "{name}");
        report
    };
    let resumed = resume("resumed", &[]);
    let dropped = resume("dropped", &files);
    StateResumes {
        whole,
        resumed,
        dropped,
        stopped,
        _root: root,
    }
}

impl StateResumes {
    /// The resume with its state equals not stopping, bit for bit; the one without it is
    /// caught (`what` names the state).
    pub fn assert_state_matters(&self, what: &str) {
        assert!(
            params(&self.resumed) == params(&self.whole),
            "the resumed run differs from the one that never stopped"
        );
        let apart = max_abs(&params(&self.dropped), &params(&self.whole));
        assert_caught(
            &format!("a resume without {what}, against not stopping"),
            apart,
            1e-6,
            MARGIN,
        );
    }
}
