//! A host's actor port: the TCP service through which other processes spawn, call, cast to and
//! stop the actors of this host's runtime. The first frame of a connection must carry the
//! cluster token (a refusal is logged with the peer's address); every later frame is handled in
//! arrival order, so each caller's messages reach each actor in the order sent. With TLS in the
//! credentials, a caller must first pass mutual TLS under the cluster CA.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use archipelago_dataflow::ActorId;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc::{UnboundedSender, WeakUnboundedSender, unbounded_channel};
use tokio::sync::watch;

use super::registry::{Cancels, ErasedActor, Registry, RemoteReply};
use super::wire::{Frame, FrameView, Outgoing, read_frame_bytes, read_frame_within, view_frame, write_frame};

/// The largest first frame (the token) read before the caller is known.
const HELLO_LIMIT: usize = 4 << 10;
use crate::fabric::OTHER_PROCESS;
use crate::runtime::call_wire::Inbound;
use crate::runtime::compiled;
use crate::runtime::{CallError, RuntimeHandle, SpawnOptions};
use crate::trust::{AsyncStream, Credentials};

/// The actors of this host that remote callers can reach, by id.
type Reachable = Arc<Mutex<HashMap<ActorId, Arc<dyn ErasedActor>>>>;

/// A served actor port; dropping it closes the port (keep it as long as the host serves).
pub struct ActorPort {
    /// Where it listens.
    pub addr: SocketAddr,
    close: watch::Sender<bool>,
}

impl ActorPort {
    /// Stops accepting and drops every connection at once, as if the host had died (callers
    /// see their connection close).
    pub fn close(&self) {
        let _ = self.close.send(true);
    }
}

/// Serves `runtime`'s actors on `listener` (on the current tokio runtime) to callers holding
/// the cluster's `credentials` (its token, a `&str`, or [`Credentials`] with mutual TLS).
pub fn serve_actor_port(
    listener: TcpListener,
    runtime: RuntimeHandle,
    credentials: impl Into<Credentials>,
) -> std::io::Result<ActorPort> {
    let addr = listener.local_addr()?;
    let credentials: Credentials = credentials.into();
    let reachable: Reachable = Arc::default();
    let (close, closed) = watch::channel(false);
    super::links::serve_home(
        runtime.host(),
        &addr.to_string(),
        &runtime.inner,
        &credentials,
        tokio::runtime::Handle::current(),
    );
    let mut accepting = closed.clone();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::error!("the actor port on {addr} stopped accepting: {e}");
                        return;
                    }
                },
                _ = accepting.changed() => return,
            };
            let (runtime, credentials, reachable) = (runtime.clone(), credentials.clone(), reachable.clone());
            let mut closed = closed.clone();
            tokio::spawn(async move {
                let _ = stream.set_nodelay(true);
                let stream = match credentials.accept(stream).await {
                    Ok(stream) => stream,
                    Err(e) => {
                        tracing::warn!(%peer, "the actor port refused a connection at the TLS handshake: {e}");
                        return;
                    }
                };
                let token = credentials.token();
                tokio::select! {
                    outcome = serve_connection(stream, peer, runtime, token, reachable, closed.clone()) => {
                        if let Err(reason) = outcome {
                            tracing::warn!(%peer, "actor port connection ended: {reason}");
                        }
                    }
                    _ = closed.changed() => {}
                }
            });
        }
    });
    Ok(ActorPort { addr, close })
}

/// Writes the frames queued on the returned sender, flushing when the queue runs dry, until
/// the senders are gone or `closed` (when given) changes (then the write half is dropped).
pub(crate) fn spawn_frame_writer(
    half: impl AsyncWrite + Send + Unpin + 'static,
    closed: Option<watch::Receiver<bool>>,
) -> UnboundedSender<Outgoing> {
    let (tx, rx) = unbounded_channel::<Outgoing>();
    tokio::spawn(write_frames(half, rx, closed));
    tx
}

/// Bytes of queued frames gathered before they are written.
const WRITE_BATCH: usize = 64 << 10;

/// Bytes this process has written on actor-port connections (frames and tensor payloads).
static WIRE_BYTES_OUT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes this process has written on actor-port connections, both ways of calling (to hosts
/// and answering callers), since it started: the wire's own count, not a payload estimate.
pub fn wire_bytes_out() -> u64 {
    WIRE_BYTES_OUT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Writes `bytes` on `out`, counting them.
async fn write_counted(out: &mut (impl AsyncWrite + Unpin), bytes: &[u8]) -> std::io::Result<()> {
    out.write_all(bytes).await?;
    WIRE_BYTES_OUT.fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Writes the frames of `rx` on `half` until the senders are gone or `closed` changes.
pub(crate) async fn write_frames(
    half: impl AsyncWrite + Unpin,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Outgoing>,
    closed: Option<watch::Receiver<bool>>,
) {
    let mut closed = closed;
    let mut scratch = Vec::new();
    {
        let mut out = half;
        loop {
            let close = async {
                match closed.as_mut() {
                    Some(closed) => {
                        let _ = closed.changed().await;
                    }
                    None => std::future::pending().await,
                }
            };
            let frame = tokio::select! {
                frame = rx.recv() => frame,
                _ = close => None,
            };
            let Some(first) = frame else { return };
            // Every frame queued now is encoded into one buffer and written at once (one
            // syscall per batch, not per frame); a tensor's bytes go straight after theirs.
            let mut next = Some(first);
            scratch.clear();
            while let Some(outgoing) = next.take() {
                if let Err(e) = outgoing.encode_into(&mut scratch) {
                    tracing::warn!("an actor-port connection stopped writing: {e}");
                    return;
                }
                if let Some(payload) = &outgoing.payload {
                    if write_counted(&mut out, &scratch).await.is_err()
                        || write_counted(&mut out, payload.bytes()).await.is_err()
                    {
                        return;
                    }
                    scratch.clear();
                }
                if scratch.len() >= WRITE_BATCH {
                    if write_counted(&mut out, &scratch).await.is_err() {
                        return;
                    }
                    scratch.clear();
                }
                next = rx.try_recv().ok();
            }
            if write_counted(&mut out, &scratch).await.is_err() || out.flush().await.is_err() {
                return;
            }
            if scratch.capacity() > 4 * WRITE_BATCH {
                scratch = Vec::new();
            }
        }
    }
}

async fn serve_connection(
    stream: Box<dyn AsyncStream>,
    peer: std::net::SocketAddr,
    runtime: RuntimeHandle,
    token: &str,
    reachable: Reachable,
    closed: watch::Receiver<bool>,
) -> Result<(), String> {
    let (input, output) = tokio::io::split(stream);
    let mut input = tokio::io::BufReader::with_capacity(super::connection::READ_BUFFER, input);
    match read_frame_within(&mut input, HELLO_LIMIT).await {
        Ok(Some(Frame::Hello { token: given })) if given == token => {}
        _ => {
            tracing::warn!(%peer, "refused an actor-port connection without the cluster's token");
            let reason = "it refused this process: wrong or missing cluster token (start every process with the cluster's token file, ARCHIPELAGO_TOKEN_FILE)";
            // Say why before closing, so the caller reports the refusal, not a lost host.
            let mut output = output;
            let _ = write_frame(
                &mut output,
                &Frame::Refused {
                    reason: reason.into(),
                },
            )
            .await;
            let _ = output.flush().await;
            return Err(reason.into());
        }
    }
    let out = spawn_frame_writer(output, Some(closed));
    let mut scratch = Vec::new();
    // The actors this caller spawned are its own: they stop when its connection ends.
    let owned = Owned::default();
    // The compiled programs this caller installed: stopped when its connection ends.
    let mut programs = Programs::default();
    let cancels: Arc<Cancels> = Arc::default();
    // Where the calls passed in this caller's messages ask it for their replies.
    let inbound = Inbound::new(out.clone());
    // The actors whose end this caller is told of after finding them (once each).
    let mut followed = std::collections::HashSet::new();
    loop {
        match read_frame_bytes(&mut input, &mut scratch).await {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
        let frame = match view_frame(&scratch) {
            Ok(FrameView::Other(frame)) => frame,
            Ok(FrameView::Deliver {
                call,
                actor,
                message_type,
                payload,
            }) => {
                let target = reachable.lock().expect("reachable actors").get(&actor).cloned();
                // A call's reply is encoded and queued on the actor's own thread.
                let reply = call.map(|call| RemoteReply::new(call, out.clone(), cancels.clone()));
                let outcome = match target {
                    Some(target) => {
                        inbound.scope(|| Registry::deliver(target.as_ref(), message_type, payload, reply))
                    }
                    None => {
                        let error = CallError::Stopped {
                            actor: format!("actor {actor} of host {}", runtime.host()),
                            message: message_type.to_string(),
                            reason: "no live actor has that id on this host".into(),
                        };
                        match reply {
                            Some(reply) => {
                                reply.send(Err(error));
                                Ok(())
                            }
                            None => Err(error),
                        }
                    }
                };
                if let Err(error) = outcome {
                    tracing::warn!("a cast was dropped: {error}");
                }
                continue;
            }
            Ok(FrameView::Reply { .. }) => return Err("a caller sent a reply".into()),
            Err(e) => return Err(e.to_string()),
        };
        match frame {
            Frame::Spawn {
                request,
                actor_type,
                device,
                params,
                name,
                max_restarts,
                detached,
            } => {
                // Held in `reachable` and, unless detached, in `owned` (stopped when this caller
                // disconnects): the caller's `Release` ends it once it drops its handles.
                let options = SpawnOptions {
                    name,
                    max_restarts,
                    ..SpawnOptions::default()
                };
                let spawning = Registry::spawn(&runtime, &actor_type, device, &params, options);
                let (out, reachable, owned) = (out.clone(), reachable.clone(), owned.0.clone());
                tokio::spawn(async move {
                    let result = match spawning {
                        Ok(pending) => pending.await,
                        Err(e) => Err(e),
                    };
                    let result = result.map(|actor| {
                        let info = actor.info();
                        reachable
                            .lock()
                            .expect("reachable actors")
                            .insert(info.id, actor.clone());
                        if !detached {
                            owned.lock().expect("owned actors").push(actor.clone());
                        }
                        tokio::spawn(report_end(actor, out.downgrade(), reachable));
                        info
                    });
                    send(
                        &out,
                        Frame::Spawned {
                            request,
                            result: result.map_err(|e| e.to_string()),
                        },
                    );
                });
            }
            Frame::Program {
                program,
                me,
                actor,
                stream,
                nodes,
                peers,
                sends,
            } => {
                let target = reachable.lock().expect("reachable actors").get(&actor).cloned();
                let part = compiled::Part {
                    program,
                    me,
                    actor,
                    stream,
                    nodes,
                    peers,
                    sends,
                };
                let result = compiled::install(&runtime, target, &out, part);
                if result.is_ok() {
                    programs.0.push((program, me));
                }
                send(&out, Frame::ProgramReady { program, me, result });
            }
            Frame::Value {
                program,
                from,
                to,
                tag,
                value_type,
                value,
            } => compiled::routes::arrive(program, from, to, tag, &value_type, value),
            Frame::ProgramEnd { program } => {
                let ended: Vec<usize> = programs
                    .0
                    .iter()
                    .filter(|(p, _)| *p == program)
                    .map(|(_, me)| *me)
                    .collect();
                programs.0.retain(|(p, _)| *p != program);
                compiled::routes::end_participants(program, &ended);
            }
            Frame::Stop { actor, reason, kill } => {
                if let Some(target) = reachable.lock().expect("reachable actors").get(&actor) {
                    match kill {
                        true => target.kill(&reason),
                        false => target.stop(&reason),
                    }
                }
            }
            Frame::Find {
                request,
                actor_type,
                name,
            } => {
                let found = (reachable.lock().expect("reachable actors").values())
                    .find(|a| a.type_key() == actor_type && a.info().name == name)
                    .cloned();
                let result = found.as_ref().map(|a| a.info());
                // The finder's reference learns the actor's end, as its spawner's does.
                if let Some(actor) = found.filter(|a| followed.insert(a.info().id)) {
                    tokio::spawn(report_end(actor, out.downgrade(), reachable.clone()));
                }
                let result = result.ok_or_else(|| format!("not on host {}", runtime.host()));
                send(&out, Frame::Spawned { request, result });
            }
            Frame::Awaited { request, result } => inbound.arrived(request, result),
            Frame::Release { actor } => {
                if let Some(target) = reachable.lock().expect("reachable actors").get(&actor) {
                    target.release();
                }
            }
            Frame::Ping => send(&out, Frame::Pong),
            Frame::Cancel { call } => cancels.cancel(call),
            Frame::Stats { request } => {
                let stats = runtime.local_actor_stats();
                send(&out, Frame::StatsReply { request, stats });
            }
            Frame::Borrows { tensor, changes } => {
                runtime.inner().tensors.inner.adjust(tensor, false, &changes);
            }
            Frame::Fetch { request, tensor } => {
                let found = runtime.inner().tensors.inner.lookup(tensor, OTHER_PROCESS);
                let (result, payload) = match found {
                    Ok(t) => (Ok((t.dtype(), t.shape().to_vec(), t.byte_len() as u64)), Some(t)),
                    Err(e) => (Err(e), None),
                };
                let frame = Frame::Tensor { request, result };
                let _ = out.send(Outgoing::with_payload(frame, payload));
            }
            other => return Err(format!("unexpected frame from a caller: {other:?}")),
        }
    }
}

/// The actors spawned over one connection; dropping it (the connection ended, however) stops
/// those still running, as Monarch ties actors to whoever spawned them.
#[derive(Default)]
struct Owned(Arc<Mutex<Vec<Arc<dyn ErasedActor>>>>);

impl Drop for Owned {
    fn drop(&mut self) {
        for actor in self.0.lock().expect("owned actors").drain(..) {
            actor.stop("the program that spawned it disconnected");
        }
    }
}

/// The compiled programs installed over one connection; dropping it (the connection ended)
/// stops their interpreters on this host.
#[derive(Default)]
struct Programs(Vec<(u64, usize)>);

impl Drop for Programs {
    fn drop(&mut self) {
        for (program, me) in self.0.drain(..) {
            compiled::routes::end_participants(program, &[me]);
        }
    }
}

/// Queues a frame without payload (a closed connection drops it).
fn send(out: &UnboundedSender<Outgoing>, frame: Frame) {
    let _ = out.send(frame.into());
}

/// Tells the caller of `out` (while it is connected) that `actor` ended, and makes it
/// unreachable.
async fn report_end(actor: Arc<dyn ErasedActor>, out: WeakUnboundedSender<Outgoing>, reachable: Reachable) {
    let end = actor.ended().await;
    let id = actor.info().id;
    reachable.lock().expect("reachable actors").remove(&id);
    if let Some(out) = out.upgrade() {
        send(&out, Frame::Ended { actor: id, end });
    }
}
