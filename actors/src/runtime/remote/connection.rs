//! A caller's connection to one host's actor port: spawns and calls go out as frames, replies
//! come back matched by number. It watches the host: a closed socket (the process died) or
//! silence past its patience loses the host, failing every pending call and ending every actor
//! of that host seen through here, each with an [`ActorFailure`](crate::error::ActorFailure)
//! naming the host; an actor with a hook for it (`OnLost`) is re-placed instead.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use archipelago_dataflow::ActorId;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use super::links::unreachable;
use super::wire::{Frame, FrameView, Outgoing, read_frame_bytes, view_frame};
use crate::runtime::TensorError;
use crate::runtime::call_wire::answer;
use crate::runtime::supervision::{ActorEnd, ActorShared, CallError};
use crate::runtime::tensor_store::Meta;
use crate::runtime::{ActorInfo, ActorStats};
use crate::trust::Credentials;
use crate::typed_tensor::{DType, TypedTensor};

/// A fetched tensor's bytes are read in pieces of this size, each counting as a sign of life.
const PAYLOAD_CHUNK: usize = 4 << 20;
/// Bytes read from the socket at a time.
pub(crate) const READ_BUFFER: usize = 256 << 10;

/// How often a connection probes its host, and how long silence means the host is lost.
#[derive(Debug, Clone, Copy)]
pub struct Liveness {
    /// Probe period.
    pub ping_every: Duration,
    /// Silence after which the host is declared lost.
    pub patience: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            ping_every: Duration::from_millis(250),
            patience: Duration::from_secs(2),
        }
    }
}

/// What to do with a call's reply bytes (decode them into the caller's typed channel; the
/// bytes are borrowed from the connection's read buffer).
pub(crate) type Deliver = Box<dyn FnOnce(Result<&[u8], CallError>) + Send>;

struct PendingCall {
    deliver: Deliver,
    actor: Arc<ActorShared>,
    message: &'static str,
}

/// Takes an actor over when its host is lost (`why`): re-places it, or gives `false` and the
/// actor ends.
pub(crate) type OnLost = Box<dyn FnOnce(&str) -> bool + Send>;

/// An actor spawned through here, followed until it ends.
struct Tracked {
    actor: Weak<ActorShared>,
    on_lost: Option<OnLost>,
}

/// A fetch waiting for its tensor.
type PendingFetch = (Meta, oneshot::Sender<Result<TypedTensor, TensorError>>);

#[derive(Default)]
struct State {
    calls: HashMap<u64, PendingCall>,
    spawns: HashMap<u64, oneshot::Sender<Result<ActorInfo, String>>>,
    actors: HashMap<ActorId, Tracked>,
    fetches: HashMap<u64, PendingFetch>,
    stats: HashMap<u64, oneshot::Sender<Vec<ActorStats>>>,
    /// Compiled programs' streams being installed on the host, by (program, participant).
    installs: HashMap<(u64, usize), oneshot::Sender<Result<(), String>>>,
    /// Compiled programs with interpreters on the host: broken if it is lost.
    programs: Vec<u64>,
    lost: Option<String>,
    last_heard: Option<Instant>,
}

/// One connection to a host's actor port.
pub struct HostConnection {
    host: String,
    addr: String,
    out: UnboundedSender<Outgoing>,
    /// Closes the connection's writer (and so the connection) once the host is lost.
    close: tokio::sync::watch::Sender<bool>,
    state: Mutex<State>,
    next: AtomicU64,
}

impl HostConnection {
    /// Connects to the actor port of `host` at `addr` with the cluster's `credentials`; fails
    /// when the port cannot be reached.
    pub async fn connect(
        host: &str,
        addr: &str,
        credentials: &Credentials,
        liveness: Liveness,
    ) -> Result<Arc<HostConnection>, String> {
        let (connection, connected) = HostConnection::start(
            host,
            addr,
            credentials,
            liveness,
            &tokio::runtime::Handle::current(),
        );
        connected
            .await
            .unwrap_or_else(|_| Err("the connection task ended".into()))?;
        Ok(connection)
    }

    /// A connection that connects in the background on `executor` (frames sent meanwhile wait
    /// in order); usable at once, e.g. from a reference decoded inside a message. A port that
    /// cannot be reached loses the host, failing what was sent.
    pub(crate) fn lazy(
        host: &str,
        addr: &str,
        credentials: &Credentials,
        liveness: Liveness,
        executor: &tokio::runtime::Handle,
    ) -> Arc<HostConnection> {
        HostConnection::start(host, addr, credentials, liveness, executor).0
    }

    fn start(
        host: &str,
        addr: &str,
        credentials: &Credentials,
        liveness: Liveness,
        executor: &tokio::runtime::Handle,
    ) -> (Arc<HostConnection>, oneshot::Receiver<Result<(), String>>) {
        let (out, outgoing) = tokio::sync::mpsc::unbounded_channel::<Outgoing>();
        let _ = out.send(Outgoing::from(Frame::Hello {
            token: credentials.token().to_string(),
        }));
        let credentials = credentials.clone();
        let (close, closed) = tokio::sync::watch::channel(false);
        let connection = Arc::new(HostConnection {
            host: host.to_string(),
            addr: addr.to_string(),
            out,
            close,
            state: Mutex::new(State {
                last_heard: Some(Instant::now()),
                ..State::default()
            }),
            next: AtomicU64::new(1),
        });
        let (ready, connected) = oneshot::channel();
        let reader = connection.clone();
        executor.spawn(async move {
            let opened = async {
                let tcp = TcpStream::connect(&reader.addr).await?;
                let _ = tcp.set_nodelay(true);
                credentials.connect(&reader.addr, tcp).await
            };
            let stream = match opened.await {
                Ok(stream) => stream,
                Err(e) => {
                    let why = format!(
                        "cannot reach the actor port of host {} at {} (connection or TLS handshake): {e}",
                        reader.host, reader.addr
                    );
                    reader.lose(&why);
                    let _ = ready.send(Err(why));
                    return;
                }
            };
            let (input, output) = tokio::io::split(stream);
            tokio::spawn(super::host_port::write_frames(output, outgoing, Some(closed)));
            let _ = ready.send(Ok(()));
            // Frames are small and many: read them through a buffer, not a syscall each.
            let mut input = tokio::io::BufReader::with_capacity(READ_BUFFER, input);
            let mut scratch = Vec::new();
            let reason = loop {
                match read_frame_bytes(&mut input, &mut scratch).await {
                    Ok(true) => {}
                    Ok(false) => {
                        break "its actor port closed the connection (the host process ended?)".to_string();
                    }
                    Err(e) => break format!("its actor port failed: {e}"),
                }
                match view_frame(&scratch) {
                    Ok(FrameView::Reply { call, result }) => reader.replied(call, result),
                    Ok(FrameView::Other(Frame::Refused { reason })) => break reason,
                    Ok(FrameView::Other(Frame::Tensor { request, result })) => {
                        if let Err(reason) = reader.tensor_arrived(&mut input, request, result).await {
                            break reason;
                        }
                    }
                    Ok(FrameView::Other(frame)) => reader.received(frame),
                    // A host sends no messages to its callers (ignored, as unknown frames are).
                    Ok(FrameView::Deliver { .. }) => {}
                    Err(e) => break format!("its actor port failed: {e}"),
                }
            };
            reader.lose(&reason);
        });
        let prober = Arc::downgrade(&connection);
        executor.spawn(async move {
            loop {
                tokio::time::sleep(liveness.ping_every).await;
                let Some(connection) = prober.upgrade() else {
                    return;
                };
                let heard = connection.state.lock().expect("connection").last_heard;
                if heard.is_none() {
                    return;
                }
                if heard.is_some_and(|at| at.elapsed() > liveness.patience) {
                    connection.lose(&format!("it did not answer for {:?}", liveness.patience));
                    return;
                }
                connection.send(Frame::Ping);
            }
        });
        (connection, connected)
    }

    /// The host's name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The host's actor port.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// A call's reply arrived (its bytes borrowed from the read buffer).
    fn replied(&self, call: u64, result: Result<&[u8], CallError>) {
        let mut state = self.state.lock().expect("connection");
        state.last_heard = Some(Instant::now());
        if let Some(pending) = state.calls.remove(&call) {
            drop(state);
            (pending.deliver)(result);
        }
    }

    fn received(&self, frame: Frame) {
        let mut state = self.state.lock().expect("connection");
        state.last_heard = Some(Instant::now());
        match frame {
            Frame::Reply { call, result } => {
                drop(state);
                match result {
                    Ok(bytes) => self.replied(call, Ok(&bytes)),
                    Err(error) => self.replied(call, Err(error)),
                }
            }
            Frame::Spawned { request, result } => {
                if let Some(tx) = state.spawns.remove(&request) {
                    let _ = tx.send(result);
                }
            }
            Frame::Value {
                program,
                from,
                to,
                tag,
                value_type,
                value,
            } => {
                drop(state);
                crate::runtime::compiled::routes::arrive(program, from, to, tag, &value_type, value);
            }
            Frame::ProgramReady { program, me, result } => {
                if let Some(tx) = state.installs.remove(&(program, me)) {
                    let _ = tx.send(result);
                }
            }
            Frame::Await { request, future } => answer(request, future, &self.out),
            Frame::StatsReply { request, stats } => {
                if let Some(tx) = state.stats.remove(&request) {
                    let _ = tx.send(stats);
                }
            }
            Frame::Ended { actor, end } => {
                let shared = state.actors.remove(&actor).and_then(|t| t.actor.upgrade());
                // Calls still pending on the ended actor will not be answered by it.
                let orphans = state.calls.extract_if(|_, c| c.actor.info.id == actor);
                let orphans: Vec<PendingCall> = orphans.map(|(_, c)| c).collect();
                drop(state);
                if let Some(shared) = &shared {
                    shared.set_end(end);
                    shared.publish_end();
                }
                for call in orphans {
                    let error = call.actor.ended_error(call.message);
                    (call.deliver)(Err(error));
                }
            }
            _ => {}
        }
    }

    /// Reads a fetched tensor's bytes straight into its buffer and hands it to the fetch.
    async fn tensor_arrived(
        &self,
        input: &mut (impl tokio::io::AsyncRead + Unpin),
        request: u64,
        result: Result<(DType, Vec<usize>, u64), TensorError>,
    ) -> Result<(), String> {
        let pending = self.state.lock().expect("connection").fetches.remove(&request);
        let Some((meta, reply)) = pending else {
            return Err(format!(
                "the host answered fetch {request}, which nobody asked for"
            ));
        };
        let (dtype, shape, bytes) = match result {
            Ok(header) => header,
            Err(error) => {
                let _ = reply.send(Err(error));
                return Ok(());
            }
        };
        // Hostile input: allocate only what the reference said it holds.
        if (dtype, &shape, bytes) != (meta.dtype, &meta.shape, meta.bytes) {
            return Err(format!(
                "the host sent {bytes} bytes of {dtype} {shape:?} for {} ({} {:?}, {} bytes)",
                meta.id, meta.dtype, meta.shape, meta.bytes
            ));
        }
        let mut tensor = TypedTensor::zeros(dtype, shape).map_err(|e| e.to_string())?;
        // In chunks, each one a sign of life: a long transfer is not a silent host.
        for chunk in tensor.bytes_mut().chunks_mut(PAYLOAD_CHUNK) {
            input
                .read_exact(chunk)
                .await
                .map_err(|e| format!("the tensor's bytes did not arrive: {e}"))?;
            self.state.lock().expect("connection").last_heard = Some(Instant::now());
        }
        let _ = reply.send(Ok(tensor));
        Ok(())
    }

    /// The figures of the host's actors (`None` when the host is lost).
    pub(crate) async fn stats(&self) -> Option<Vec<ActorStats>> {
        let request = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.state.lock().expect("connection");
            if state.lost.is_some() {
                return None;
            }
            state.stats.insert(request, tx);
        }
        self.send(Frame::Stats { request });
        rx.await.ok()
    }

    /// Queues a frame.
    pub(crate) fn send(&self, frame: Frame) {
        let _ = self.out.send(frame.into());
    }

    /// Asks the host for the tensor `meta` describes; `reply` gets it (or why not).
    pub(crate) fn fetch(&self, meta: Meta, reply: oneshot::Sender<Result<TypedTensor, TensorError>>) {
        let request = self.next.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock().expect("connection");
        if let Some(lost) = state.lost.clone() {
            drop(state);
            let _ = reply.send(Err(unreachable(&meta, &self.host, &lost)));
            return;
        }
        let tensor = meta.id;
        state.fetches.insert(request, (meta, reply));
        drop(state);
        self.send(Frame::Fetch { request, tensor });
    }

    /// The host is lost: every pending call fails, every actor seen through here ends — but
    /// those re-placed elsewhere, taken over first, so that a caller's next call already waits
    /// for the new incarnation.
    fn lose(&self, reason: &str) {
        let mut state = self.state.lock().expect("connection");
        if state.lost.is_some() {
            return;
        }
        let why = format!("host {} ({}) was lost: {reason}", self.host, self.addr);
        tracing::error!("{why}");
        state.lost = Some(why.clone());
        state.last_heard = None;
        let _ = self.close.send(true);
        let calls: Vec<PendingCall> = state.calls.drain().map(|(_, c)| c).collect();
        let spawns: Vec<_> = state.spawns.drain().map(|(_, s)| s).collect();
        let tracked: Vec<Tracked> = state.actors.drain().map(|(_, t)| t).collect();
        let fetches: Vec<PendingFetch> = state.fetches.drain().map(|(_, f)| f).collect();
        state.stats.clear();
        let installs: Vec<_> = state.installs.drain().map(|(_, tx)| tx).collect();
        let programs = std::mem::take(&mut state.programs);
        drop(state);
        let (replaced, ending) = take_over(tracked, &why);
        for install in installs {
            let _ = install.send(Err(why.clone()));
        }
        for program in programs {
            let reason = format!("{why} while the program ran there");
            crate::runtime::compiled::routes::break_program(program, CallError::Program { reason });
        }
        for (meta, reply) in fetches {
            let _ = reply.send(Err(unreachable(&meta, &self.host, &why)));
        }
        let again = format!(
            "{why}; the call is not retried, and the actor is being re-placed on another host: call it again"
        );
        for pending in calls {
            let why = if replaced.contains(&pending.actor.info.id) {
                &again
            } else {
                &why
            };
            let failure = pending
                .actor
                .host_lost(&format!("waiting for `{}`", pending.message), why);
            (pending.deliver)(Err(CallError::Failed(failure)));
        }
        for spawn in spawns {
            let _ = spawn.send(Err(why.clone()));
        }
        for actor in ending {
            actor.set_end(ActorEnd::Failed(actor.host_lost("running", &why)));
            actor.publish_end();
        }
    }

    /// Installs a participant's stream of a compiled program (a [`Frame::Program`]) on the
    /// host; resolves when the host has (or why not). The program is broken if the host is lost.
    pub(crate) fn install_program(
        &self,
        program: u64,
        me: usize,
        frame: Frame,
    ) -> oneshot::Receiver<Result<(), String>> {
        let (tx, rx) = oneshot::channel();
        let mut state = self.state.lock().expect("connection");
        if let Some(lost) = state.lost.clone() {
            let _ = tx.send(Err(lost));
            return rx;
        }
        state.installs.insert((program, me), tx);
        if !state.programs.contains(&program) {
            state.programs.push(program);
        }
        drop(state);
        self.send(frame);
        rx
    }

    /// Forgets `program` (dropped) and tells the host to stop its interpreters.
    pub(crate) fn end_program(&self, program: u64) {
        self.state
            .lock()
            .expect("connection")
            .programs
            .retain(|p| *p != program);
        self.send(Frame::ProgramEnd { program });
    }

    /// Whether frames sent now can still go out: the host is not lost and the connection's
    /// writer still runs (it ends with the runtime it was started on).
    pub(crate) fn usable(&self) -> bool {
        self.lost().is_none() && !self.out.is_closed()
    }

    /// Why the host is unusable, once it is.
    pub(crate) fn lost(&self) -> Option<String> {
        self.state.lock().expect("connection").lost.clone()
    }

    /// Asks the host to spawn; resolves to the actor's identity.
    pub(crate) fn spawn(
        &self,
        frame: impl FnOnce(u64) -> Frame,
    ) -> oneshot::Receiver<Result<ActorInfo, String>> {
        let request = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let mut state = self.state.lock().expect("connection");
        if let Some(lost) = &state.lost {
            let _ = tx.send(Err(lost.clone()));
            return rx;
        }
        state.spawns.insert(request, tx);
        drop(state);
        self.send(frame(request));
        rx
    }

    /// Follows `actor` (spawned, found or referred to through here) so that its end and the
    /// host's loss reach it; `on_lost` takes it over if the host is lost. An actor already
    /// followed keeps its state, which is returned: every reference then sees its one end.
    pub(crate) fn track(&self, actor: &Arc<ActorShared>, on_lost: Option<OnLost>) -> Arc<ActorShared> {
        let mut state = self.state.lock().expect("connection");
        let known = (state.actors.get(&actor.info.id)).and_then(|t| t.actor.upgrade());
        if let Some(known) = known.filter(|_| on_lost.is_none()) {
            return known;
        }
        let tracked = Tracked {
            actor: Arc::downgrade(actor),
            on_lost,
        };
        state.actors.insert(actor.info.id, tracked);
        actor.clone()
    }

    /// Sends a call; `deliver` gets the reply bytes or the error.
    pub(crate) fn call(
        &self,
        actor: &Arc<ActorShared>,
        message: &'static str,
        message_type: &'static str,
        payload: Vec<u8>,
        deliver: Deliver,
    ) -> u64 {
        let call = self.next.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock().expect("connection");
        if let Some(lost) = state.lost.clone() {
            drop(state);
            deliver(Err(CallError::Failed(
                actor.host_lost(&format!("sending `{message}`"), &lost),
            )));
            return call;
        }
        state.calls.insert(
            call,
            PendingCall {
                deliver,
                actor: actor.clone(),
                message,
            },
        );
        drop(state);
        let _ = self.out.send(Outgoing::deliver(
            Some(call),
            actor.info.id,
            message_type,
            payload,
        ));
        call
    }

    /// Gives up on call `call`: its reply will be ignored, and the host skips the message if
    /// it has not started it.
    pub(crate) fn cancel(&self, call: u64) {
        self.state.lock().expect("connection").calls.remove(&call);
        self.send(Frame::Cancel { call });
    }

    /// Sends a cast (fails only when the host is already lost).
    pub(crate) fn cast(
        &self,
        actor: &Arc<ActorShared>,
        message: &'static str,
        message_type: &'static str,
        payload: Vec<u8>,
    ) -> Result<(), CallError> {
        if let Some(lost) = self.lost() {
            return Err(CallError::Failed(
                actor.host_lost(&format!("sending `{message}`"), &lost),
            ));
        }
        let _ = self
            .out
            .send(Outgoing::deliver(None, actor.info.id, message_type, payload));
        Ok(())
    }

    /// Asks the host to stop `actor` (to kill it, with `kill`).
    pub(crate) fn stop(&self, actor: ActorId, reason: &str, kill: bool) {
        self.send(Frame::Stop {
            actor,
            reason: reason.to_string(),
            kill,
        });
    }
}

/// Hands each actor followed on a lost host (`why`) to its hook: the ids of those re-placed,
/// and the actors that end.
fn take_over(tracked: Vec<Tracked>, why: &str) -> (Vec<ActorId>, Vec<Arc<ActorShared>>) {
    let (mut replaced, mut ending) = (Vec::new(), Vec::new());
    for Tracked { actor, on_lost } in tracked {
        let Some(actor) = actor.upgrade() else { continue };
        match on_lost.is_some_and(|take_over| take_over(why)) {
            true => replaced.push(actor.info.id),
            false => ending.push(actor),
        }
    }
    (replaced, ending)
}
