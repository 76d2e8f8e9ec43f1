//! The dashboard's serving jobs: a job appears when the controller places it, shows its
//! replicas' load while it serves, and stays (stopped, or failed with why) once it ends; the
//! newest [`SERVING_KEPT`] are kept.

use super::{Dashboard, ServingView, push_failure, unix_now};
use crate::cluster::serve_part::LoadFigures;

/// Serving jobs the page keeps; past that, the oldest that ended go first.
const SERVING_KEPT: usize = 50;

impl Dashboard {
    /// A serving job placed on `host`, starting.
    pub fn serving_placed(&self, job: &str, host: &str) {
        self.update(|v| {
            v.serving.retain(|s| s.job != job);
            v.serving.push(ServingView {
                job: job.to_string(),
                host: host.to_string(),
                state: "starting".into(),
                started_unix_s: unix_now(),
                ..ServingView::default()
            });
            // The oldest that ended go first.
            while v.serving.len() > SERVING_KEPT {
                match v.serving.iter().position(|s| s.ended_unix_s.is_some()) {
                    Some(i) => v.serving.remove(i),
                    None => v.serving.remove(0),
                };
            }
        });
    }

    /// The job's service listens at `url`.
    pub fn serving_started(&self, job: &str, url: &str, summary: &str) {
        self.change_serving(job, |s| {
            s.state = "serving".into();
            s.url = url.to_string();
            s.summary = summary.to_string();
        });
    }

    /// The job's replicas' figures now.
    pub fn serving_load(&self, job: &str, f: LoadFigures) {
        self.change_serving(job, |s| s.load = f);
    }

    /// The job ended: `None` when its client stopped it, else why it failed (also a failure
    /// of the page's list).
    pub fn serving_ended(&self, job: &str, failure: Option<&str>) {
        self.update(|v| {
            if let Some(s) = v.serving.iter_mut().find(|s| s.job == job) {
                s.state = if failure.is_some() { "failed" } else { "stopped" }.into();
                s.reason = failure.unwrap_or_default().to_string();
                s.ended_unix_s = Some(unix_now());
                (s.load.waiting, s.load.running, s.load.blocks_used) = (0, 0, 0);
            }
            if let Some(why) = failure {
                push_failure(v, why.to_string());
            }
        });
    }

    fn change_serving(&self, job: &str, change: impl FnOnce(&mut ServingView)) {
        self.update(|v| {
            if let Some(s) = v.serving.iter_mut().find(|s| s.job == job) {
                change(s);
            }
        });
    }
}
