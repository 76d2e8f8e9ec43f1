//! The dashboard's serving jobs, a row per replica: a replica appears when the controller places
//! it on its host, shows its load while it serves, and stays (stopped, or failed with why) once
//! it ends — a lost replica shows failed while the job's others serve on; the newest
//! [`SERVING_KEPT`] rows are kept.

use super::{Dashboard, DashboardView, ServingView, push_failure, unix_now};
use crate::cluster::serve_part::LoadFigures;

/// Serving jobs the page keeps; past that, the oldest that ended go first.
const SERVING_KEPT: usize = 50;

impl Dashboard {
    /// Replica `replica` of the `replicas` of serving job `job` placed on `host`, starting
    /// (the first replica's placement clears the rows of an earlier job of that name).
    pub fn serving_placed(&self, job: &str, replica: usize, replicas: usize, host: &str) {
        self.update(|v| {
            v.serving
                .retain(|s| s.job != job || (replica > 0 && s.ended_unix_s.is_none()));
            v.serving.push(ServingView {
                job: job.to_string(),
                replica,
                replicas,
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

    /// The replica's service listens at `url`.
    pub fn serving_started(&self, job: &str, replica: usize, url: &str, summary: &str) {
        self.change_serving(job, replica, |s| {
            s.state = "serving".into();
            s.url = url.to_string();
            s.summary = summary.to_string();
        });
    }

    /// The replica's figures now.
    pub fn serving_load(&self, job: &str, replica: usize, f: LoadFigures) {
        self.change_serving(job, replica, |s| s.load = f);
    }

    /// The replica ended: `None` when its client stopped it, else why it failed (also a failure
    /// of the page's list).
    pub fn serving_ended(&self, job: &str, replica: usize, failure: Option<&str>) {
        self.update(|v| {
            if let Some(s) = serving_row(v, job, replica) {
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

    fn change_serving(&self, job: &str, replica: usize, change: impl FnOnce(&mut ServingView)) {
        self.update(|v| {
            if let Some(s) = serving_row(v, job, replica) {
                change(s);
            }
        });
    }
}

/// The row of replica `replica` of the running job `job`.
fn serving_row<'v>(v: &'v mut DashboardView, job: &str, replica: usize) -> Option<&'v mut ServingView> {
    (v.serving.iter_mut()).find(|s| s.job == job && s.replica == replica && s.ended_unix_s.is_none())
}
