//! Where a compiled program's values go. Every participant has a [`Door`] in its process's
//! table, keyed by (program, participant): its interpreter's inbox or, on the
//! [`direct`](super::direct) path, its actor's mailbox. A value for a participant of the same
//! process goes straight through its door (shared, no copy); one for another process is encoded
//! with its type's registered codec and travels as a [`Frame::Value`] on an actor-port
//! connection, to be decoded and handed to the door on arrival. Doors are made by whichever
//! comes first — the value or the participant — since a peer host may send before this host has
//! installed its stream.

use archipelago_dataflow::TensorId;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::Shared;
use super::direct::Direct;
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
    /// Values that arrived before the stream asked for them (a value asked for is taken
    /// straight from the channel).
    waiting: HashMap<(usize, u64), VecDeque<Result<Shared, CallError>>>,
    /// How many values `waiting` holds.
    held: usize,
    broken: Option<CallError>,
    /// Per value the program's own stream receives (by the receive's counter): the runs
    /// expecting one that have not taken it yet. Values of runs whose caller stopped waiting
    /// are skipped, so a later run gets its own.
    pub(crate) unclaimed: Vec<usize>,
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
            held: 0,
            broken: None,
            unclaimed: Vec::new(),
        }
    }

    /// The next value from `from` on `tag`; `None` once the program is dropped; the error that
    /// broke the program (`Some(Err(_))`, with `broken()` set) once a process of it was lost.
    pub(crate) async fn take(&mut self, from: usize, tag: u64) -> Option<Result<Shared, CallError>> {
        if self.held > 0
            && let Some(value) = self.waiting.get_mut(&(from, tag)).and_then(VecDeque::pop_front)
        {
            self.held -= 1;
            return Some(value);
        }
        loop {
            if let Some(error) = &self.broken {
                return Some(Err(error.clone()));
            }
            match self.rx.recv().await? {
                Parcel::Value(f, t, value) if (f, t) == (from, tag) => return Some(value),
                Parcel::Value(f, t, value) => {
                    self.waiting.entry((f, t)).or_default().push_back(value);
                    self.held += 1;
                }
                Parcel::Broken(error) => self.broken = Some(error),
                Parcel::Stop => return None,
            }
        }
    }
}

/// The way into one participant of this process: its interpreter's inbox or, on the direct
/// path, its actor's mailbox.
pub(crate) struct Door {
    tx: UnboundedSender<Parcel>,
    direct: OnceLock<Direct>,
    /// Set once the participant is ended (the program dropped): values are refused.
    ended: AtomicBool,
}

impl Door {
    fn new(tx: UnboundedSender<Parcel>) -> Door {
        Door {
            tx,
            direct: OnceLock::new(),
            ended: AtomicBool::new(false),
        }
    }

    /// Hands the participant a value from `from` on `tag`; an error once it has ended.
    pub(crate) fn deliver(&self, from: usize, tag: u64, value: Result<Shared, CallError>) -> Result<(), ()> {
        if self.ended.load(Ordering::Acquire) {
            return Err(());
        }
        match self.direct.get() {
            Some(direct) if (direct.from, direct.tag) == (from, tag) => {
                direct.take(value);
                Ok(())
            }
            _ => self.tx.send(Parcel::Value(from, tag, value)).map_err(|_| ()),
        }
    }
}

/// How an interpreter reaches one peer.
#[derive(Clone)]
pub(crate) enum Route {
    /// A participant of this process.
    Local(Arc<Door>),
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
    /// The way out of the value named `tensor` to participant `to`, resolved once.
    pub(crate) fn port(&self, tensor: &TensorId, to: usize) -> Port {
        let base = value_name(tensor);
        Port {
            program: self.program,
            me: self.me,
            to,
            route: self.routes.get(&to).cloned(),
            codec: self.codecs.get(base).cloned(),
            name: base.to_string(),
        }
    }
}

/// The error of a send whose peer is gone (the program was dropped, the runtime shut down).
fn gone() -> CallError {
    CallError::Program {
        reason: "its interpreters have stopped (the runtime shut down); compile it again on a live runtime"
            .into(),
    }
}

/// Where one send of a stream goes: its peer's route and, for another process, the value's
/// type name and codec.
pub(crate) struct Port {
    program: u64,
    me: usize,
    to: usize,
    route: Option<Route>,
    codec: Option<(String, ValueCodec)>,
    /// The value's name in the recording (for errors).
    name: String,
}

impl Port {
    /// Sends `value` on `tag`; an error once the peer's inbox is gone (the program was
    /// dropped) or its host was lost.
    pub(crate) fn send(&self, tag: u64, value: Result<Shared, CallError>) -> Result<(), CallError> {
        match &self.route {
            None => Err(gone()),
            Some(Route::Local(door)) => door.deliver(self.me, tag, value).map_err(|_| gone()),
            Some(Route::Host(connection)) => match connection.lost() {
                Some(reason) => Err(CallError::Program { reason }),
                None => {
                    connection.send(self.frame(tag, value));
                    Ok(())
                }
            },
            Some(Route::Caller(out)) => out
                .send(Outgoing::from(self.frame(tag, value)))
                .map_err(|_| gone()),
        }
    }

    /// The value as a [`Frame::Value`], encoded with its type's codec.
    fn frame(&self, tag: u64, value: Result<Shared, CallError>) -> Frame {
        let base = &self.name;
        let (value_type, value) = match &self.codec {
            Some((value_type, codec)) => (
                value_type.clone(),
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
            to: self.to,
            tag,
            value_type,
            value,
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
    /// Interpreters ended lately (oldest first, and as a set): values still arriving for them
    /// are dropped, not kept.
    ended: VecDeque<(u64, usize)>,
    ended_set: HashSet<(u64, usize)>,
}

struct Slot {
    door: Arc<Door>,
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
        Slot {
            door: Arc::new(Door::new(tx)),
            rx: Some(rx),
        }
    })
}

/// The way into `participant` of `program` in this process.
pub(crate) fn door(program: u64, participant: usize) -> Arc<Door> {
    slot(&mut table(), program, participant).door.clone()
}

/// Puts `participant` of `program` on the direct path (before any value can reach it).
pub(crate) fn set_direct(program: u64, participant: usize, direct: Direct) {
    let _ = door(program, participant).direct.set(direct);
}

/// The inbox of `participant` of `program`, for its interpreter (once).
pub(crate) fn claim_inbox(program: u64, participant: usize) -> Option<Inbox> {
    slot(&mut table(), program, participant).rx.take().map(Inbox::new)
}

/// A value that arrived from another process: decoded with its type's codec (an undecodable
/// value becomes the error the run ends with) and handed to its participant's door.
pub(crate) fn arrive(
    program: u64,
    from: usize,
    to: usize,
    tag: u64,
    value_type: &str,
    value: Result<Vec<u8>, CallError>,
) {
    let value = value.and_then(|bytes| {
        let codec = known_codec(value_type).ok_or_else(|| CallError::Program {
            reason: format!(
                "a value of type `{value_type}` arrived, which this process has not registered (`Registry::program_value`)"
            ),
        })?;
        (codec.decode)(&bytes).map_err(|e| CallError::Program {
            reason: format!("a value of type `{value_type}` did not decode: {e}"),
        })
    });
    let door = {
        let mut table = table();
        match table.slots.get(&(program, to)) {
            Some(slot) => slot.door.clone(),
            None if table.ended_set.contains(&(program, to)) => return,
            None => slot(&mut table, program, to).door.clone(),
        }
    };
    let _ = door.deliver(from, tag, value);
}

/// The registered codec of `value_type`, remembered by each thread that decodes (a connection's
/// reader meets the same few types again and again; a type's codec never changes).
fn known_codec(value_type: &str) -> Option<ValueCodec> {
    thread_local! {
        static KNOWN: std::cell::RefCell<Vec<(String, ValueCodec)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    KNOWN.with(|known| {
        if let Some((_, codec)) = known.borrow().iter().find(|(name, _)| name == value_type) {
            return Some(*codec);
        }
        let codec = value_codec(value_type)?;
        known.borrow_mut().push((value_type.to_string(), codec));
        Some(codec)
    })
}

/// Tells every interpreter of `program` in this process that it is broken by `error`.
pub(crate) fn break_program(program: u64, error: CallError) {
    for ((p, _), slot) in table().slots.iter() {
        if *p == program {
            let _ = slot.door.tx.send(Parcel::Broken(error.clone()));
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
            slot.door.ended.store(true, Ordering::Release);
            let _ = slot.door.tx.send(Parcel::Stop);
        }
        if table.ended.len() == REMEMBERED_ENDS
            && let Some(oldest) = table.ended.pop_front()
        {
            table.ended_set.remove(&oldest);
        }
        if table.ended_set.insert((program, *p)) {
            table.ended.push_back((program, *p));
        }
    }
}
