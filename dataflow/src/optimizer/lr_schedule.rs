//! Learning-rate schedules: linear warmup (Goyal et al., "Accurate, Large Minibatch SGD", 2017),
//! then constant, cosine (Loshchilov & Hutter, "SGDR", ICLR 2017, without restarts) or linear
//! decay to a final fraction of the peak.
//!
//! A schedule is a pure function of the update's number `t` (from 1), so a resumed run restores
//! its position from the checkpoint's step counter alone. In PyTorch terms it is a `LambdaLR`
//! whose lambda at scheduler index `i` (0 before the first update) is [`LrSchedule::factor`]`(i + 1)`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What follows the warmup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LrDecay {
    /// The peak rate until the end.
    #[default]
    Constant,
    /// Half a cosine from the peak down to the final fraction at the last step.
    Cosine,
    /// A straight line from the peak down to the final fraction at the last step.
    Linear,
}

impl fmt::Display for LrDecay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LrDecay::Constant => "constant",
            LrDecay::Cosine => "cosine",
            LrDecay::Linear => "linear",
        })
    }
}

impl FromStr for LrDecay {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "constant" => Ok(LrDecay::Constant),
            "cosine" => Ok(LrDecay::Cosine),
            "linear" => Ok(LrDecay::Linear),
            other => Err(format!("--lr-schedule `{other}`: use constant, cosine or linear")),
        }
    }
}

/// The learning rate of update `t` as a fraction of the optimizer's rate.
///
/// `t ≤ warmup_steps`: `t / warmup_steps` (the first update already moves; update
/// `warmup_steps` runs at the peak). After it, with `p = (t − warmup) / (total − warmup)` capped
/// at 1: cosine `f + (1 − f)·½(1 + cos πp)`, linear `f + (1 − f)(1 − p)`, constant 1, where `f`
/// is `final_fraction`; update `total_steps` runs at `f`, and later ones stay there.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Updates of linear warmup (0: none).
    pub warmup_steps: u64,
    /// What follows the warmup.
    pub decay: LrDecay,
    /// The update at which the decay reaches `final_fraction` (the job's step count).
    pub total_steps: u64,
    /// The rate at `total_steps` as a fraction of the peak.
    pub final_fraction: f32,
}

impl fmt::Display for LrSchedule {
    /// `constant`, or e.g. `cosine to 0.1×lr at step 30, warmup 5` (the banner's and a refused
    /// resume's words).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.decay {
            LrDecay::Constant => f.write_str("constant")?,
            decay => write!(
                f,
                "{decay} to {}×lr at step {}",
                self.final_fraction, self.total_steps
            )?,
        }
        if self.warmup_steps > 0 {
            write!(f, ", warmup {}", self.warmup_steps)?;
        }
        Ok(())
    }
}

impl Default for LrSchedule {
    /// The optimizer's rate at every step.
    fn default() -> Self {
        LrSchedule::constant()
    }
}

impl LrSchedule {
    /// The optimizer's rate at every step.
    pub fn constant() -> LrSchedule {
        LrSchedule {
            warmup_steps: 0,
            decay: LrDecay::Constant,
            total_steps: 0,
            final_fraction: 1.0,
        }
    }

    /// Linear warmup over `warmup` updates, then cosine decay to 10% of the peak at update
    /// `total` (the "decay to a tenth" of GPT-3, Chinchilla and nanoGPT).
    pub fn cosine(warmup: u64, total: u64) -> LrSchedule {
        LrSchedule {
            warmup_steps: warmup,
            decay: LrDecay::Cosine,
            total_steps: total,
            final_fraction: 0.1,
        }
    }

    /// Linear warmup over `warmup` updates, then linear decay to 10% of the peak at `total`.
    pub fn linear(warmup: u64, total: u64) -> LrSchedule {
        LrSchedule {
            decay: LrDecay::Linear,
            ..LrSchedule::cosine(warmup, total)
        }
    }

    /// The same schedule with warmup over `warmup` updates.
    pub fn with_warmup(mut self, warmup: u64) -> LrSchedule {
        self.warmup_steps = warmup;
        self
    }

    /// The same schedule decaying to `fraction` of the peak.
    pub fn with_final_fraction(mut self, fraction: f32) -> LrSchedule {
        self.final_fraction = fraction;
        self
    }

    /// The fraction of the peak rate that update `t` (from 1) uses.
    pub fn factor(&self, t: u64) -> f32 {
        let t = t.max(1);
        let w = self.warmup_steps;
        if t <= w {
            return (t as f64 / w as f64) as f32;
        }
        let f = self.final_fraction as f64;
        let p = if self.total_steps > w {
            ((t - w) as f64 / (self.total_steps - w) as f64).min(1.0)
        } else {
            1.0
        };
        let shape = match self.decay {
            LrDecay::Constant => return 1.0,
            LrDecay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
            LrDecay::Linear => 1.0 - p,
        };
        (f + (1.0 - f) * shape) as f32
    }

    /// Refuses a fraction outside [0, 1] and a decay without an end.
    pub fn check(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.final_fraction) {
            return Err(format!(
                "--lr-final-fraction {}: must lie in [0, 1]",
                self.final_fraction
            ));
        }
        if self.decay != LrDecay::Constant && self.total_steps == 0 {
            return Err(format!(
                "--lr-schedule {}: the decay needs the step at which it ends (total_steps, the job's --steps)",
                self.decay
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) -> bool {
        (a as f64 - b).abs() < 1e-6
    }

    /// Values at chosen steps, each written out by hand: warmup's first and last update, the
    /// cosine's midpoint and end, the linear decay's midpoint, and after the end.
    #[test]
    fn schedules_at_chosen_steps() {
        let cosine = LrSchedule::cosine(10, 110).with_final_fraction(0.0);
        assert!(close(cosine.factor(1), 0.1), "first warmup update");
        assert!(close(cosine.factor(5), 0.5));
        assert!(close(cosine.factor(10), 1.0), "warmup ends at the peak");
        assert!(close(cosine.factor(60), 0.5), "cosine midpoint: ½(1 + cos π/2)");
        assert!(close(
            cosine.factor(35),
            0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos())
        ));
        assert!(
            close(cosine.factor(110), 0.0),
            "the last update runs at the final fraction"
        );
        assert!(close(cosine.factor(500), 0.0), "and stays there");
        let tenth = LrSchedule::cosine(10, 110);
        assert!(close(tenth.factor(60), 0.1 + 0.9 * 0.5));
        assert!(close(tenth.factor(110), 0.1));
        let linear = LrSchedule::linear(0, 100).with_final_fraction(0.2);
        assert!(close(linear.factor(1), 0.2 + 0.8 * 0.99));
        assert!(close(linear.factor(50), 0.6), "linear midpoint");
        assert!(close(linear.factor(100), 0.2));
        let warm = LrSchedule::constant().with_warmup(4);
        assert!(close(warm.factor(2), 0.5) && close(warm.factor(4), 1.0) && close(warm.factor(9), 1.0));
        assert!(close(LrSchedule::default().factor(1), 1.0));
    }

    /// Negative control: the comparison above would catch a warmup counted from 0 (the first
    /// update at rate 0) and a cosine running a full period instead of half.
    #[test]
    fn the_checks_catch_a_wrong_schedule() {
        let s = LrSchedule::cosine(10, 110).with_final_fraction(0.0);
        let from_zero = |t: u64| (t - 1) as f64 / 10.0;
        assert!(!close(s.factor(1), from_zero(1)));
        let full_period = |t: u64| 0.5 * (1.0 + (2.0 * std::f64::consts::PI * (t - 10) as f64 / 100.0).cos());
        assert!(!close(s.factor(60), full_period(60)));
    }

    #[test]
    fn refuses_a_decay_without_an_end() {
        let mut s = LrSchedule::cosine(0, 0);
        assert!(s.check().unwrap_err().contains("--steps"));
        s.total_steps = 10;
        assert!(s.check().is_ok());
        assert!(s.with_final_fraction(1.5).check().is_err());
        assert_eq!("cosine".parse::<LrDecay>().unwrap(), LrDecay::Cosine);
        assert!("step".parse::<LrDecay>().is_err());
    }
}
