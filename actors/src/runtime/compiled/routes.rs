//! Where a compiled program's values go. Every interpreter has an inbox in its process's table,
//! keyed by (program, participant); a value for an interpreter of the same process goes straight
//! into its inbox (shared, no copy), one for another process is encoded with its type's
//! registered codec and travels as a [`Frame::Value`] on an actor-port connection, to be decoded
//! and put into the inbox on arrival. Inboxes are made by whichever comes first — the value or
//! the interpreter — since a peer host may send before this host has installed its stream.

use archipelago_dataflow::TensorId;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::Shared;
use super::registered::{ValueCodec, value_codec};
use crate::runtime::CallError;
use crate::runtime::remote::HostConnection;
use crate::runtime::remote::wire::{Frame, Outgoing};

/// What arrives in an interpreter's inbox.
pub(crate) enum Parcel {
    /// A value (or the error that replaced it) from participant `from` on `tag`.
    Value(usize, u64, Result<Shared, CallError>),
    /// A process the program ran on was lost: every value still awaited is this error.
    Broken(CallError),
    /// The program was dropped: the interpreter ends.
    Stop,
}

/// An interpreter's mailbox, matching values by `(from, tag)` in arrival order.
pub(crate) struct Inbox {
    rx: UnboundedReceiver<Parcel>,
    waiting: HashMap<(usize, u64), VecDeque<Result<Shared, CallError>>>,
    broken: Option<CallError>,
    /// Per value the program's own stream receives (by sender and tag): the runs expecting one
    /// that have not taken it yet. Values of runs whose caller stopped waiting are skipped, so
    /// a later run gets its own.
    pub(crate) unclaimed: HashMap<(usize, u64), usize>,
}

impl Inbox {
    /// Whether a process of the program was lost (every later value is that error).
    pub(crate) fn broken(&self) -> Option<&CallError> {
        self.broken.as_ref()
    }

    pub(crate) fn new(rx: UnboundedReceiver<Parcel>) -> Inbox {
        Inbox {
            rx,
            waiting: HashMap::new(),
            broken: None,
            unclaimed: HashMap::new(),
        }
    }

    /// The next value from `from` on `tag`; `None` once the program is dropped; the error that
    /// broke the program (`Some(Err(_))`, with `broken()` set) once a process of it was lost.
    pub(crate) async fn take(&mut self, from: usize, tag: u64) -> Option<Result<Shared, CallError>> {
        loop {
            if let Some(value) = self.waiting.get_mut(&(from, tag)).and_then(VecDeque::pop_front) {
                return Some(value);
            }
            if let Some(error) = &self.broken {
                return Some(Err(error.clone()));
            }
            match self.rx.recv().await? {
                Parcel::Value(f, t, value) => self.waiting.entry((f, t)).or_default().push_back(value),
                Parcel::Broken(error) => self.broken = Some(error),
                Parcel::Stop => return None,
            }
        }
    }
}

/// How an interpreter reaches one peer.
#[derive(Clone)]
pub(crate) enum Route {
    /// An interpreter of this process.
    Local(UnboundedSender<Parcel>),
    /// An interpreter of the host at the other end of this connection.
    Host(Arc<HostConnection>),
    /// An interpreter of the process that installed the program (frames go back on its
    /// connection).
    Caller(UnboundedSender<Outgoing>),
}

/// The participants `stream` sends to.
pub(crate) fn destinations(
    stream: &[archipelago_dataflow::Instruction],
) -> std::collections::BTreeSet<usize> {
    (stream.iter())
        .filter_map(|i| match i {
            archipelago_dataflow::Instruction::Send { to, .. } => Some(*to),
            _ => None,
        })
        .collect()
}

/// One interpreter's way out: its routes, and the codecs of the values it sends to other
/// processes (by the value's name in its stream).
pub(crate) struct Outbox {
    pub(crate) program: u64,
    pub(crate) me: usize,
    /// By participant, only those its stream sends to (a route to every participant from every
    /// interpreter would cost n² at dispatch).
    pub(crate) routes: HashMap<usize, Route>,
    pub(crate) codecs: HashMap<String, (String, ValueCodec)>,
}

impl Outbox {
    /// Sends `value` (named `tensor` in this stream) to participant `to` on `tag`; an error
    /// once that peer's inbox is gone (the program was dropped) or its host was lost.
    pub(crate) fn send(
        &self,
        tensor: &TensorId,
        to: usize,
        tag: u64,
        value: Result<Shared, CallError>,
    ) -> Result<(), CallError> {
        let gone = || CallError::Program {
            reason:
                "its interpreters have stopped (the runtime shut down); compile it again on a live runtime"
                    .into(),
        };
        let remote = |value: Result<Shared, CallError>| {
            let base = value_name(tensor);
            let (value_type, value) = match self.codecs.get(base) {
                Some((name, codec)) => (
                    name.clone(),
                    value.and_then(|v| {
                        (codec.encode)(&v).map_err(|e| CallError::Program {
                            reason: format!("value `{base}` could not be encoded: {e}"),
                        })
                    }),
                ),
                None => (
                    String::new(),
                    Err(CallError::Program {
                        reason: format!("value `{base}` has no registered codec in this process"),
                    }),
                ),
            };
            Frame::Value {
                program: self.program,
                from: self.me,
                to,
                tag,
                value_type,
                value,
            }
        };
        let Some(route) = self.routes.get(&to) else {
            return Err(gone());
        };
        match route {
            Route::Local(inbox) => inbox.send(Parcel::Value(self.me, tag, value)).map_err(|_| gone()),
            Route::Host(connection) => match connection.lost() {
                Some(reason) => Err(CallError::Program { reason }),
                None => {
                    connection.send(remote(value));
                    Ok(())
                }
            },
            Route::Caller(out) => out.send(Outgoing::from(remote(value))).map_err(|_| gone()),
        }
    }
}

/// A value's name in the recording (`input`, `v3`), without the lowering's `@actor` suffix.
/// Programs name every value ([`TensorId::Named`]); a training step's typed ids are no program
/// value and have the empty name (no codec is registered under it).
pub(crate) fn value_name(tensor: &TensorId) -> &str {
    match tensor {
        TensorId::Named(name) => name.split('@').next().unwrap_or(name),
        _ => "",
    }
}

#[derive(Default)]
struct Table {
    slots: HashMap<(u64, usize), Slot>,
    /// Interpreters ended lately: values still arriving for them are dropped, not kept.
    ended: VecDeque<(u64, usize)>,
}

struct Slot {
    tx: UnboundedSender<Parcel>,
    rx: Option<UnboundedReceiver<Parcel>>,
}

const REMEMBERED_ENDS: usize = 4096;

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

fn table() -> std::sync::MutexGuard<'static, Table> {
    TABLE.lock().expect("program inboxes")
}

fn slot(table: &mut Table, program: u64, participant: usize) -> &mut Slot {
    table.slots.entry((program, participant)).or_insert_with(|| {
        let (tx, rx) = unbounded_channel();
        Slot { tx, rx: Some(rx) }
    })
}

/// The sender into the inbox of `participant` of `program` in this process.
pub(crate) fn inbox_sender(program: u64, participant: usize) -> UnboundedSender<Parcel> {
    slot(&mut table(), program, participant).tx.clone()
}

/// The inbox of `participant` of `program`, for its interpreter (once).
pub(crate) fn claim_inbox(program: u64, participant: usize) -> Option<Inbox> {
    slot(&mut table(), program, participant).rx.take().map(Inbox::new)
}

/// A value that arrived from another process: decoded with its type's codec (an undecodable
/// value becomes the error the run ends with) and put into its interpreter's inbox.
pub(crate) fn arrive(
    program: u64,
    from: usize,
    to: usize,
    tag: u64,
    value_type: &str,
    value: Result<Vec<u8>, CallError>,
) {
    let value = value.and_then(|bytes| {
        let codec = value_codec(value_type).ok_or_else(|| CallError::Program {
            reason: format!(
                "a value of type `{value_type}` arrived, which this process has not registered (`Registry::program_value`)"
            ),
        })?;
        (codec.decode)(&bytes).map_err(|e| CallError::Program {
            reason: format!("a value of type `{value_type}` did not decode: {e}"),
        })
    });
    let mut table = table();
    if table.ended.contains(&(program, to)) {
        return;
    }
    let _ = slot(&mut table, program, to)
        .tx
        .send(Parcel::Value(from, tag, value));
}

/// Tells every interpreter of `program` in this process that it is broken by `error`.
pub(crate) fn break_program(program: u64, error: CallError) {
    for ((p, _), slot) in table().slots.iter() {
        if *p == program {
            let _ = slot.tx.send(Parcel::Broken(error.clone()));
        }
    }
}

/// Stops and forgets the interpreters of `participants` of `program` in this process (those
/// one caller installed here, or a program's own on its drop; several roles may share a
/// process).
pub(crate) fn end_participants(program: u64, participants: &[usize]) {
    let mut table = table();
    for p in participants {
        if let Some(slot) = table.slots.remove(&(program, *p)) {
            let _ = slot.tx.send(Parcel::Stop);
        }
        if table.ended.len() == REMEMBERED_ENDS {
            table.ended.pop_front();
        }
        table.ended.push_back((program, *p));
    }
}
