//! Futures of replies: [`Call`] (await it, or block with [`Call::get`]; a timeout; cancel) and
//! [`wait`], Ray's `wait`: the first `k` of many calls.
//!
//! Dropping a `Call` does not take the message back (like dropping a Ray `ObjectRef`): the
//! actor still handles it. [`Call::cancel`] and an expired [`Call::timeout`] do: a message not
//! yet started is skipped by the actor; one already running finishes, its reply discarded.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::remote::HostConnection;
use super::supervision::{ActorShared, CallError};

/// The future reply of a call.
pub struct Call<R> {
    state: CallState<R>,
    driver: Handle,
}

/// How a call is taken back: a flag the actor's cell checks before it starts the message, or a
/// `Cancel` frame to the host of a remote actor (which sets that flag there).
pub(crate) enum Canceller {
    /// The local letter's flag.
    Flag(Arc<AtomicBool>),
    /// A call to an actor of another host.
    Remote(Arc<RemoteCall>),
}

impl Canceller {
    fn cancel(&self) {
        match self {
            Canceller::Flag(flag) => flag.store(true, Ordering::Release),
            Canceller::Remote(call) => call.cancel(),
        }
    }
}

/// A call to an actor of another host: waiting to be sent (while the actor is re-placed after
/// its host was lost), sent as a numbered call on a connection, or cancelled before it was.
#[derive(Default)]
pub(crate) struct RemoteCall(Mutex<RemoteCallState>);

#[derive(Default)]
enum RemoteCallState {
    #[default]
    Waiting,
    Sent(Arc<HostConnection>, u64),
    Cancelled,
}

impl RemoteCall {
    /// Sends the call with `send` (which gives its number on `connection`), unless it was
    /// cancelled first.
    pub(crate) fn send(&self, connection: &Arc<HostConnection>, send: impl FnOnce() -> u64) {
        let mut state = self.0.lock().expect("remote call");
        if matches!(*state, RemoteCallState::Waiting) {
            *state = RemoteCallState::Sent(connection.clone(), send());
        }
    }

    fn cancel(&self) {
        let mut state = self.0.lock().expect("remote call");
        if let RemoteCallState::Sent(connection, call) =
            std::mem::replace(&mut *state, RemoteCallState::Cancelled)
        {
            connection.cancel(call);
        }
    }
}

enum CallState<R> {
    Waiting {
        /// Locked only to pass the call to another process (see `call_wire`); polled through
        /// `get_mut`.
        reply: Mutex<oneshot::Receiver<Result<R, CallError>>>,
        cancel: Canceller,
        actor: Arc<ActorShared>,
        message: &'static str,
        deadline: Option<(Instant, Duration)>,
        sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    },
    Done(Option<CallError>),
}

impl<R> Call<R> {
    pub(crate) fn waiting(
        reply: oneshot::Receiver<Result<R, CallError>>,
        cancel: Canceller,
        actor: Arc<ActorShared>,
        message: &'static str,
        driver: Handle,
    ) -> Call<R> {
        Call {
            state: CallState::Waiting {
                reply: Mutex::new(reply),
                cancel,
                actor,
                message,
                deadline: None,
                sleep: None,
            },
            driver,
        }
    }

    pub(crate) fn failed(error: CallError, driver: Handle) -> Call<R> {
        Call {
            state: CallState::Done(Some(error)),
            driver,
        }
    }

    /// The actor called, while the call waits.
    pub(crate) fn callee(&self) -> Option<&Arc<ActorShared>> {
        match &self.state {
            CallState::Waiting { actor, .. } => Some(actor),
            CallState::Done(_) => None,
        }
    }

    /// The reply, taken from this call (which then resolves as if its actor had ended), or the
    /// error it already resolved to: how a call passed to another process leaves its sender.
    /// `None` once it has been awaited.
    pub(crate) fn take_reply(&self) -> Option<BoxFuture<'static, Result<R, CallError>>>
    where
        R: Send + 'static,
    {
        let (reply, actor, message) = match &self.state {
            CallState::Waiting {
                reply,
                actor,
                message,
                ..
            } => (reply, actor.clone(), *message),
            CallState::Done(Some(error)) => return Some(Box::pin(std::future::ready(Err(error.clone())))),
            CallState::Done(None) => return None,
        };
        let (_, closed) = oneshot::channel();
        let reply = std::mem::replace(&mut *reply.lock().expect("call reply"), closed);
        Some(Box::pin(async move {
            reply.await.unwrap_or_else(|_| Err(actor.ended_error(message)))
        }))
    }

    /// The same call, failing with [`CallError::Timeout`] when no reply came within `after` of
    /// now (and then cancelled, so the actor skips it if it had not started).
    pub fn timeout(mut self, after: Duration) -> Call<R> {
        if let CallState::Waiting { deadline, .. } = &mut self.state {
            *deadline = Some((Instant::now() + after, after));
        }
        self
    }

    /// Gives up on the call: the actor skips the message if it has not started it, and the
    /// call resolves to [`CallError::Cancelled`].
    pub fn cancel(&mut self) {
        if let CallState::Waiting {
            cancel,
            actor,
            message,
            ..
        } = &self.state
        {
            cancel.cancel();
            let error = CallError::Cancelled {
                actor: actor.label(),
                message: message.to_string(),
            };
            self.state = CallState::Done(Some(error));
        }
    }

    /// Waits for the reply on this thread. Call it from plain threads (a program's `main`);
    /// inside a handler, `.await` the call instead.
    ///
    /// # Panics
    /// When called from inside an async runtime (tokio forbids blocking there).
    pub fn get(mut self) -> Result<R, CallError>
    where
        R: Send + 'static,
    {
        // A reply already here needs no trip through the executor.
        if let CallState::Waiting {
            reply,
            actor,
            message,
            ..
        } = &mut self.state
        {
            match reply.get_mut().expect("call reply").try_recv() {
                Ok(result) => return result,
                Err(oneshot::error::TryRecvError::Closed) => return Err(actor.ended_error(message)),
                Err(oneshot::error::TryRecvError::Empty) => {}
            }
        }
        let driver = self.driver.clone();
        driver.block_on(self)
    }
}

impl<R> Unpin for Call<R> {}

impl<R> Future for Call<R> {
    type Output = Result<R, CallError>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let CallState::Waiting {
            reply,
            cancel,
            actor,
            message,
            deadline,
            sleep,
        } = &mut this.state
        else {
            let CallState::Done(error) = &mut this.state else {
                unreachable!()
            };
            return Poll::Ready(Err(error.take().expect("a Call polled after it completed")));
        };
        match Pin::new(reply.get_mut().expect("call reply")).poll(cx) {
            Poll::Ready(Ok(result)) => return Poll::Ready(result),
            // The reply channel closed without a reply: the actor ended first.
            Poll::Ready(Err(_)) => return Poll::Ready(Err(actor.ended_error(message))),
            Poll::Pending => {}
        }
        if let Some((at, after)) = *deadline {
            let timer = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())));
            if timer.as_mut().poll(cx).is_ready() {
                cancel.cancel();
                let error = CallError::Timeout {
                    actor: actor.label(),
                    message: message.to_string(),
                    after,
                };
                this.state = CallState::Done(None);
                return Poll::Ready(Err(error));
            }
        }
        Poll::Pending
    }
}

/// A future with a way to block on it from a plain thread ([`Pending::get`]).
pub struct Pending<T> {
    future: BoxFuture<'static, T>,
    driver: Handle,
}

impl<T: Send + 'static> Pending<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static, driver: Handle) -> Pending<T> {
        Pending {
            future: Box::pin(future),
            driver,
        }
    }

    /// Waits on this thread (not from inside an async runtime; `.await` there).
    pub fn get(self) -> T {
        let driver = self.driver.clone();
        driver.block_on(self.future)
    }
}

impl<T> Future for Pending<T> {
    type Output = T;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<T> {
        self.future.as_mut().poll(cx)
    }
}

/// What [`wait`] found: the calls that completed (with their index in the input) and those
/// still pending (also with their index), as Ray's `wait` returns ready and not-ready refs.
pub struct Waited<R> {
    /// Completed calls in completion order: `(index, result)`.
    pub ready: Vec<(usize, Result<R, CallError>)>,
    /// Calls still pending, in input order: `(index, call)`.
    pub pending: Vec<(usize, Call<R>)>,
}

/// Waits until `k` of `calls` have completed (or `timeout` passed, when given), and returns
/// them with the rest still pending. `k` larger than the number of calls waits for all.
pub async fn wait<R>(calls: Vec<Call<R>>, k: usize, timeout: Option<Duration>) -> Waited<R> {
    use futures::StreamExt;
    let k = k.min(calls.len());
    // Completions arrive in any order; each wakes only its own call (no rescan of the rest).
    let mut running: futures::stream::FuturesUnordered<Indexed<R>> = (calls.into_iter().enumerate())
        .map(|(index, call)| Indexed { index, call })
        .collect();
    let mut ready = Vec::with_capacity(k);
    let until_k = async {
        while ready.len() < k {
            match running.next().await {
                Some(done) => ready.push(done),
                None => break,
            }
        }
    };
    match timeout {
        Some(limit) => {
            let _ = tokio::time::timeout(limit, until_k).await;
        }
        None => until_k.await,
    }
    let mut pending: Vec<(usize, Call<R>)> = running.into_iter().map(|c| (c.index, c.call)).collect();
    pending.sort_unstable_by_key(|(index, _)| *index);
    Waited { ready, pending }
}

/// A call with its place in the list given to [`wait`].
struct Indexed<R> {
    index: usize,
    call: Call<R>,
}

impl<R> Future for Indexed<R> {
    type Output = (usize, Result<R, CallError>);
    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        Pin::new(&mut this.call)
            .poll(cx)
            .map(|result| (this.index, result))
    }
}
