//! Failures of an actor, carrying job, step, actor, device and instruction.

use archipelago_dataflow::{ActorId, DeviceSpec};

/// Why an actor could not finish a step (or could not start), or why an actor of the runtime
/// API failed a message. A training device actor's failure names job, step, actor, device and
/// instruction; a runtime actor's (its `actor_type` set) speaks of actors and messages only:
/// actor, type, device, host and the message, counted from 1 (`step` holds that number).
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("{}actor {actor}{} on {device}{}, {}: {message}", job_step(job, *step, actor_type), type_label(actor_type), host_label(host), instruction_label(*index, instruction))]
pub struct ActorFailure {
    /// The job's name.
    pub job: String,
    /// The step (0 while starting); for a runtime actor, the message's number (from 1; 0 when
    /// no message was running).
    pub step: u64,
    /// The actor.
    pub actor: ActorId,
    /// Its device.
    pub device: DeviceSpec,
    /// Index of the instruction in the stream, when one was running.
    pub index: Option<usize>,
    /// The instruction, printed (or what the actor was doing).
    pub instruction: String,
    /// What went wrong.
    pub message: String,
    /// Whether this actor only stopped because another one failed first.
    pub secondary: bool,
    /// The actor's type, for actors of the runtime API (empty for training device actors).
    #[serde(default)]
    pub actor_type: String,
    /// The host it ran on, when known.
    #[serde(default)]
    pub host: String,
}

/// `job J, step S, ` for a training device actor; nothing for a runtime actor.
fn job_step(job: &str, step: u64, actor_type: &str) -> String {
    if actor_type.is_empty() {
        format!("job {job}, step {step}, ")
    } else {
        String::new()
    }
}

fn type_label(actor_type: &str) -> String {
    if actor_type.is_empty() {
        String::new()
    } else {
        format!(" (`{actor_type}`)")
    }
}

fn host_label(host: &str) -> String {
    if host.is_empty() {
        String::new()
    } else {
        format!(" of host {host}")
    }
}

fn instruction_label(index: Option<usize>, instruction: &str) -> String {
    match index {
        Some(i) => format!("instruction {i} `{instruction}`"),
        None => instruction.to_string(),
    }
}

/// The text of a caught panic.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}
