//! A client of a running controller: `Controller::connect(addr, token)` in the Rust API and
//! `archipelago train --controller ADDR`. The program and options go to the controller in one
//! `Submit`; progress comes back as the steps finish, then the report.

use archipelago_actors::fabric::grpc::{MAX_MESSAGE_BYTES, with_token};
use archipelago_actors::proto::controller_client::ControllerClient;
use archipelago_actors::proto::{JobRequest, job_event};
use archipelago_actors::trust::Credentials;
use archipelago_dataflow::Program;

use super::remote_job::RemoteOptions;
use crate::JobError;
use crate::report::TrainReport;
use crate::train::{StepProgress, TrainOptions};

/// How long a client waits for a controller that does not listen yet.
const CONNECT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// Where a remote controller listens and what it expects: the token, and TLS when it runs with it.
#[derive(Debug, Clone)]
pub struct RemoteTarget {
    /// `host:port`.
    pub addr: String,
    /// The cluster token (and TLS).
    pub credentials: Credentials,
}

/// Submits `program` to the controller and follows it to its end.
pub async fn submit(
    target: &RemoteTarget,
    program: &Program,
    options: &TrainOptions,
) -> Result<TrainReport, JobError> {
    let runtime = |e: String| JobError::Runtime(e);
    // A controller started beside the client (a Slurm batch script) may not listen yet.
    let channel = super::host_agent::connect(&target.addr, &target.credentials, CONNECT_PATIENCE)
        .await
        .map_err(|e| runtime(format!("{e:#}")))?;
    let mut client = ControllerClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let request = JobRequest {
        program: serde_json::to_vec(program)
            .map_err(|e| runtime(e.to_string()))?
            .into(),
        options: serde_json::to_vec(&RemoteOptions::from_train(options))
            .map_err(|e| runtime(e.to_string()))?
            .into(),
    };
    let request =
        with_token(target.credentials.token(), request).map_err(|e| runtime(e.message().to_string()))?;
    let mut events = client
        .submit(request)
        .await
        .map_err(|e| {
            runtime(format!(
                "the controller at {} refused the job: {}",
                target.addr,
                e.message()
            ))
        })?
        .into_inner();
    loop {
        let event = events
            .message()
            .await
            .map_err(|e| runtime(format!("the controller's job stream broke: {}", e.message())))?
            .ok_or_else(|| runtime("the controller ended the job stream without a report".into()))?;
        match event.kind {
            Some(job_event::Kind::Progress(p)) => {
                if let Some(callback) = &options.on_step {
                    callback(&StepProgress {
                        step: p.step,
                        steps: p.steps,
                        loss: p.loss,
                        time_s: p.time_s,
                        lr: p.lr,
                        grad_norm: p.grad_norm,
                        loss_scale: p.loss_scale,
                        skipped: p.skipped,
                    });
                }
            }
            Some(job_event::Kind::Info(line)) => println!("{line}"),
            Some(job_event::Kind::Trace(json)) => {
                if let Some(path) = &options.trace {
                    std::fs::write(path, &json)
                        .map_err(|e| runtime(format!("cannot write the trace to {}: {e}", path.display())))?;
                }
            }
            Some(job_event::Kind::Report(json)) => {
                return serde_json::from_slice(&json).map_err(|e| runtime(format!("unreadable report: {e}")));
            }
            Some(job_event::Kind::Error(message)) => return Err(JobError::Remote(message)),
            Some(job_event::Kind::Serving(_) | job_event::Kind::ReplicaLost(_)) | None => {}
        }
    }
}
