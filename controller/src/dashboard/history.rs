//! The dashboard's loss curve, bounded however long the job runs: every step is kept until the
//! curve holds [`MAX_POINTS`]; then the stride doubles and only steps that are multiples of it
//! stay (older detail is thinned evenly, as a decimating buffer does), and the newest step is
//! always shown. Memory stays constant over 10,000 or 10 million steps. The step times, learning
//! rates and gradient norms are kept for the same steps as the losses.

use super::views::JobView;

/// Points kept at most (plus the newest step).
pub const MAX_POINTS: usize = 1024;

/// One step's figures.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Point {
    /// The step.
    pub step: u64,
    /// Its loss.
    pub loss: f32,
    /// Its wall time in seconds.
    pub time_s: f64,
    /// The learning rate of its update.
    pub lr: Option<f32>,
    /// The gradient norm before clipping.
    pub grad_norm: Option<f32>,
}

/// Keeps the entries of `v` whose flag is set.
fn keep<T>(v: &mut Vec<T>, flags: &[bool]) {
    let mut flags = flags.iter();
    v.retain(|_| *flags.next().unwrap_or(&true));
}

/// Cuts every series of `job` to its first `len` points.
fn truncate(job: &mut JobView, len: usize) {
    job.losses.truncate(len);
    job.step_times.truncate(len);
    job.lrs.truncate(len);
    job.grad_norms.truncate(len);
}

/// A step's figures, into a curve of at most [`MAX_POINTS`] + 1 points that keeps one step in
/// `job.history_stride`. A step at or before the last one recorded (a resumed job repeating
/// steps) replaces what follows it.
pub fn record(job: &mut JobView, p: Point) {
    job.history_stride = job.history_stride.max(1);
    // Series written before the learning rate was recorded are padded, so all stay parallel.
    job.lrs.resize(job.losses.len(), None);
    job.grad_norms.resize(job.losses.len(), None);
    let kept_from = job.losses.partition_point(|(s, _)| *s < p.step);
    truncate(job, kept_from);
    // The previous newest point stays only if the stride keeps it.
    if let Some((last, _)) = job.losses.last()
        && last % job.history_stride != 0
    {
        truncate(job, job.losses.len() - 1);
    }
    job.losses.push((p.step, p.loss));
    job.step_times.push(p.time_s);
    job.lrs.push(p.lr);
    job.grad_norms.push(p.grad_norm);
    while job.losses.len() > MAX_POINTS + 1 {
        job.history_stride *= 2;
        let stride = job.history_stride;
        let n = job.losses.len();
        let flags: Vec<bool> = (job.losses.iter().enumerate())
            .map(|(i, (s, _))| s % stride == 0 || i + 1 == n)
            .collect();
        keep(&mut job.losses, &flags);
        keep(&mut job.step_times, &flags);
        keep(&mut job.lrs, &flags);
        keep(&mut job.grad_norms, &flags);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: u64, loss: f32) -> Point {
        Point {
            step,
            loss,
            time_s: 0.1,
            lr: Some(step as f32),
            grad_norm: None,
        }
    }

    #[test]
    fn ten_thousand_steps_stay_bounded_evenly_spaced_and_end_at_the_newest() {
        let mut job = JobView::default();
        for step in 0..10_000u64 {
            record(&mut job, point(step, step as f32));
            assert!(job.losses.len() <= MAX_POINTS + 1);
            assert_eq!(job.losses.len(), job.step_times.len());
            assert_eq!(job.losses.len(), job.lrs.len());
            assert_eq!(job.losses.last().unwrap().0, step, "the newest step is shown");
        }
        assert_eq!(job.history_stride, 16);
        let older = &job.losses[..job.losses.len() - 1];
        let stride = job.history_stride;
        assert!(
            older.iter().all(|(s, _)| s % stride == 0),
            "older points every {stride} steps"
        );
        assert_eq!(older.first().unwrap().0, 0, "the start of the curve stays");
        let lrs_match = (job.losses.iter().zip(&job.lrs)).all(|((s, _), lr)| *lr == Some(*s as f32));
        assert!(lrs_match, "each learning rate stays with its step");
        // Short jobs keep every step.
        let mut job = JobView::default();
        for step in 0..500u64 {
            record(&mut job, point(step, 1.0));
        }
        assert_eq!(job.losses.len(), 500);
    }

    #[test]
    fn a_repeated_step_replaces_what_followed_it() {
        let mut job = JobView::default();
        for step in 0..10 {
            record(&mut job, point(step, 1.0));
        }
        record(&mut job, point(6, 2.0));
        assert_eq!(job.losses.last(), Some(&(6, 2.0)));
        assert_eq!(job.losses.len(), 7);
        assert_eq!(job.lrs.len(), 7);
    }
}
