//! The dashboard's loss curve, bounded however long the job runs: every step is kept until the
//! curve holds [`MAX_POINTS`]; then the stride doubles and only steps that are multiples of it
//! stay (older detail is thinned evenly, as a decimating buffer does), and the newest step is
//! always shown. Memory stays constant over 10,000 or 10 million steps.

/// Points kept at most (plus the newest step).
pub const MAX_POINTS: usize = 1024;

/// A step's loss and wall time, into a curve of at most [`MAX_POINTS`] + 1 points that keeps one
/// step in `stride`. A step at or before the last one recorded (a resumed job repeating steps)
/// replaces what follows it.
pub fn record(
    losses: &mut Vec<(u64, f32)>,
    times: &mut Vec<f64>,
    stride: &mut u64,
    step: u64,
    loss: f32,
    time_s: f64,
) {
    *stride = (*stride).max(1);
    let kept_from = losses.partition_point(|(s, _)| *s < step);
    losses.truncate(kept_from);
    times.truncate(kept_from);
    // The previous newest point stays only if the stride keeps it.
    if let Some((last, _)) = losses.last()
        && last % *stride != 0
    {
        losses.pop();
        times.pop();
    }
    losses.push((step, loss));
    times.push(time_s);
    while losses.len() > MAX_POINTS + 1 {
        *stride *= 2;
        let keep: Vec<bool> = (losses.iter().enumerate())
            .map(|(i, (s, _))| s % *stride == 0 || i + 1 == losses.len())
            .collect();
        let mut flags = keep.iter();
        losses.retain(|_| *flags.next().expect("one flag per point"));
        let mut flags = keep.iter();
        times.retain(|_| *flags.next().expect("one flag per point"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_thousand_steps_stay_bounded_evenly_spaced_and_end_at_the_newest() {
        let (mut losses, mut times, mut stride) = (Vec::new(), Vec::new(), 1);
        for step in 0..10_000u64 {
            record(&mut losses, &mut times, &mut stride, step, step as f32, 0.1);
            assert!(losses.len() <= MAX_POINTS + 1);
            assert_eq!(losses.len(), times.len());
            assert_eq!(losses.last().unwrap().0, step, "the newest step is shown");
        }
        assert_eq!(stride, 16);
        let older = &losses[..losses.len() - 1];
        assert!(
            older.iter().all(|(s, _)| s % stride == 0),
            "older points every {stride} steps"
        );
        assert_eq!(older.first().unwrap().0, 0, "the start of the curve stays");
        // Short jobs keep every step.
        let (mut losses, mut times, mut stride) = (Vec::new(), Vec::new(), 1);
        for step in 0..500u64 {
            record(&mut losses, &mut times, &mut stride, step, 1.0, 0.1);
        }
        assert_eq!(losses.len(), 500);
    }

    #[test]
    fn a_repeated_step_replaces_what_followed_it() {
        let (mut losses, mut times, mut stride) = (Vec::new(), Vec::new(), 1);
        for step in 0..10 {
            record(&mut losses, &mut times, &mut stride, step, 1.0, 0.1);
        }
        record(&mut losses, &mut times, &mut stride, 6, 2.0, 0.1);
        assert_eq!(losses.last(), Some(&(6, 2.0)));
        assert_eq!(losses.len(), 7);
    }
}
