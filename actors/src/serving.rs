//! A model replica serving requests: one thread owns a [`StepModel`] (one device's, or
//! tensor-parallel ranks') and its [`Batcher`], takes requests from any thread or task, steps the
//! batch while it has work (Orca's iteration-level loop) and streams each request's text back as
//! its tokens come ([`TextStream`]: no split character, no stop sequence sent). A request whose
//! receiver is dropped (its client went away) is cancelled at its next token and its cache blocks
//! go back to the pool at once. A [`Router`] spreads requests over replicas, to the least loaded.
//! What the HTTP service and a program's generator actor both stand on.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc as tokio_mpsc, oneshot};

use archipelago_dataflow::ModelSpec;

use crate::batching::{Batcher, CachePool, Event};
use crate::generate::{Finish, Request};
use crate::step_model::StepModel;
use crate::text_stream::TextStream;

/// Decodes a whole token sequence to text, from the replica's thread.
pub type SendDecode = dyn Fn(&[u32]) -> Result<String, String> + Send + Sync;

/// What a request's receiver gets.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// One more generated token, and the text that can go out with it (maybe empty: a partial
    /// character or a possible stop sequence is held back).
    Token {
        /// The text released with this token.
        text: String,
    },
    /// The answer ended: the text still held back, why it ended and the token counts.
    Done {
        /// The rest of the text.
        text: String,
        /// `max_tokens` or a stop sequence.
        finish: Finish,
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Tokens generated.
        completion_tokens: usize,
    },
    /// The replica failed while running it (the message names the model).
    Failed(String),
}

/// A replica's figures, read at any time (the metrics endpoint).
#[derive(Debug, Default)]
pub struct ReplicaStats {
    /// Requests waiting for a place in the batch.
    pub waiting: AtomicUsize,
    /// Sequences in the batch.
    pub running: AtomicUsize,
    /// Cache blocks held by running sequences.
    pub blocks_used: AtomicUsize,
    /// Cache blocks in the pool.
    pub blocks_total: AtomicUsize,
    /// Tokens generated so far.
    pub generated: AtomicU64,
    /// Requests that finished (length or stop).
    pub finished: AtomicU64,
    /// Requests cancelled because their receiver went away.
    pub cancelled: AtomicU64,
    /// Sequences preempted (and recomputed later).
    pub preemptions: AtomicU64,
    /// Requests handed over but not yet seen by the replica's thread.
    pub in_transit: AtomicUsize,
}

impl ReplicaStats {
    /// Requests the replica holds or is about to: how loaded it is.
    pub fn load(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
            + self.running.load(Ordering::Relaxed)
            + self.in_transit.load(Ordering::Relaxed)
    }
}

/// How a replica forms its batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheduling {
    /// Orca's iteration-level scheduling: requests join and leave at every step.
    Continuous {
        /// The most positions a pass computes, prompts prefilled in chunks within it
        /// ([`Batcher::step_tokens`]); `None`: whole prompts.
        step_tokens: Option<usize>,
    },
    /// Static batching (the baseline): wait for a full batch or `wait` after the first request,
    /// then run that batch until its longest request ends; later requests wait for the next.
    Static {
        /// The longest a request waits for others to fill the batch.
        wait: Duration,
    },
}

/// A request and where its updates go.
struct Submission {
    request: Request,
    updates: tokio_mpsc::UnboundedSender<Update>,
    admitted: oneshot::Sender<Result<(), String>>,
}

/// A request the replica is running: its receiver and its text so far.
struct Live<'d> {
    updates: tokio_mpsc::UnboundedSender<Update>,
    stream: TextStream<'d>,
    prompt_tokens: usize,
    completion_tokens: usize,
}

/// One model replica on its own thread.
pub struct Replica {
    submissions: mpsc::Sender<Submission>,
    stats: Arc<ReplicaStats>,
    spec: ModelSpec,
    pool: CachePool,
}

impl Replica {
    /// Starts `model`'s thread: at most `max_sequences` a step over a cache of `pool`, batches
    /// formed by `scheduling`, text made by `decode`. The thread ends when the replica is dropped
    /// and its work is done.
    pub fn start(
        name: &str,
        model: impl StepModel + 'static,
        decode: Box<SendDecode>,
        (max_sequences, pool): (usize, CachePool),
        scheduling: Scheduling,
    ) -> std::io::Result<Replica> {
        let (submissions, incoming) = mpsc::channel();
        let stats = Arc::new(ReplicaStats::default());
        stats.blocks_total.store(pool.total, Ordering::Relaxed);
        let spec = model.spec().clone();
        let thread_stats = stats.clone();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut batcher = Batcher::new(&model as &dyn StepModel, max_sequences, pool);
                batcher = match scheduling {
                    Scheduling::Continuous { step_tokens: None } => batcher,
                    Scheduling::Continuous {
                        step_tokens: Some(tokens),
                    } => batcher.step_tokens(tokens),
                    Scheduling::Static { .. } => batcher.whole_batches(),
                };
                serve(&mut batcher, &*decode, scheduling, &incoming, &thread_stats)
            })?;
        Ok(Replica {
            submissions,
            stats,
            spec,
            pool,
        })
    }

    /// The model it runs.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Its cache pool.
    pub fn pool(&self) -> CachePool {
        self.pool
    }

    /// Its figures.
    pub fn stats(&self) -> &ReplicaStats {
        &self.stats
    }

    /// Its figures, shared (a metrics endpoint keeps them).
    pub fn shared_stats(&self) -> Arc<ReplicaStats> {
        self.stats.clone()
    }

    /// Hands `request` over; once the replica has checked it (a bad one is refused with the
    /// reason, before any work), the receiver of its updates.
    pub async fn submit(&self, request: Request) -> Result<tokio_mpsc::UnboundedReceiver<Update>, String> {
        let (updates, receiver) = tokio_mpsc::unbounded_channel();
        let (admitted, answer) = oneshot::channel();
        self.stats.in_transit.fetch_add(1, Ordering::Relaxed);
        let sent = self.submissions.send(Submission {
            request,
            updates,
            admitted,
        });
        if sent.is_err() {
            self.stats.in_transit.fetch_sub(1, Ordering::Relaxed);
            return Err(format!("the replica of {} has stopped", self.spec));
        }
        match answer.await {
            Ok(Ok(())) => Ok(receiver),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!(
                "the replica of {} stopped before taking the request",
                self.spec
            )),
        }
    }
}

/// The replica's loop: wait for work when there is none, take every new request (under static
/// batching, gather the next batch), step.
fn serve(
    batcher: &mut Batcher,
    decode: &SendDecode,
    scheduling: Scheduling,
    incoming: &mpsc::Receiver<Submission>,
    stats: &ReplicaStats,
) {
    let mut live: HashMap<usize, Live> = HashMap::new();
    // When the oldest request waiting for a static batch arrived.
    let mut gathering_since: Option<Instant> = None;
    loop {
        if live.is_empty() {
            match incoming.recv() {
                Ok(submission) => admit(batcher, &mut live, decode, submission, stats),
                Err(_) => return,
            }
        }
        while let Ok(submission) = incoming.try_recv() {
            admit(batcher, &mut live, decode, submission, stats);
        }
        if let Scheduling::Static { wait } = scheduling
            && batcher.waiting() > 0
        {
            let since = *gathering_since.get_or_insert_with(Instant::now);
            if batcher.running() == 0 {
                // The next static batch: up to max_sequences, or whoever came by the deadline.
                while batcher.waiting() < batcher.max_sequences()
                    && let Some(left) = (since + wait).checked_duration_since(Instant::now())
                    && let Ok(submission) = incoming.recv_timeout(left)
                {
                    admit(batcher, &mut live, decode, submission, stats);
                    publish(batcher, stats);
                }
                gathering_since = None;
            }
        }
        publish(batcher, stats);
        match batcher.step() {
            Ok(events) => {
                // The figures first: a client answered by these events may read them at once.
                publish(batcher, stats);
                for event in events {
                    route(batcher, &mut live, event, stats);
                }
            }
            Err(e) => {
                gathering_since = None;
                for (id, request) in live.drain() {
                    batcher.cancel(id);
                    let _ = request
                        .updates
                        .send(Update::Failed(format!("{}: {e}", batcher.spec())));
                }
            }
        }
        publish(batcher, stats);
    }
}

/// Queues a submission in the batcher, or refuses it with the reason.
fn admit<'d>(
    batcher: &mut Batcher,
    live: &mut HashMap<usize, Live<'d>>,
    decode: &'d SendDecode,
    submission: Submission,
    stats: &ReplicaStats,
) {
    stats.in_transit.fetch_sub(1, Ordering::Relaxed);
    let Submission {
        request,
        updates,
        admitted,
    } = submission;
    let stream = TextStream::new(decode, &request.stop);
    let prompt_tokens = request.prompt.len();
    match batcher.submit(request) {
        Ok(id) => {
            if admitted.send(Ok(())).is_err() {
                batcher.cancel(id);
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
            live.insert(
                id,
                Live {
                    updates,
                    stream,
                    prompt_tokens,
                    completion_tokens: 0,
                },
            );
        }
        Err(e) => {
            let _ = admitted.send(Err(e));
        }
    }
}

/// Sends one batcher event to its request's receiver; a receiver gone or a stop sequence
/// reached ends the request in the batcher at once.
fn route(batcher: &mut Batcher, live: &mut HashMap<usize, Live>, event: Event, stats: &ReplicaStats) {
    let (id, done) = match event {
        Event::Token { id, .. } => (id, false),
        Event::Done { id } => (id, true),
    };
    let Some(request) = live.get_mut(&id) else {
        return;
    };
    let update = if let Event::Token { token, .. } = event {
        stats.generated.fetch_add(1, Ordering::Relaxed);
        request.completion_tokens += 1;
        match request.stream.push(token) {
            Ok(text) => Update::Token { text },
            Err(e) => Update::Failed(e),
        }
    } else {
        finished(request)
    };
    let ended = done || request.stream.stopped() || matches!(update, Update::Failed(_));
    if request.updates.send(update).is_err() {
        batcher.cancel(id);
        live.remove(&id);
        stats.cancelled.fetch_add(1, Ordering::Relaxed);
        return;
    }
    if ended {
        let mut request = live.remove(&id).expect("a live request");
        if !done {
            batcher.cancel(id);
            // Its blocks are free before its client hears it ended.
            publish(batcher, stats);
            if request.stream.stopped() {
                let last = finished(&mut request);
                let _ = request.updates.send(last);
            }
        }
        stats.finished.fetch_add(1, Ordering::Relaxed);
    }
}

/// The last update of a request that ran to its end.
fn finished(request: &mut Live) -> Update {
    match request.stream.finish() {
        Ok(text) => Update::Done {
            text,
            finish: if request.stream.stopped() {
                Finish::Stop
            } else {
                Finish::Length
            },
            prompt_tokens: request.prompt_tokens,
            completion_tokens: request.completion_tokens,
        },
        Err(e) => Update::Failed(e),
    }
}

/// Copies the batcher's figures out.
fn publish(batcher: &Batcher, stats: &ReplicaStats) {
    stats.waiting.store(batcher.waiting(), Ordering::Relaxed);
    stats.running.store(batcher.running(), Ordering::Relaxed);
    stats.blocks_used.store(batcher.blocks_used(), Ordering::Relaxed);
    stats
        .preemptions
        .store(batcher.preemptions() as u64, Ordering::Relaxed);
}

/// Replicas of one model behind one entry: each request goes to the least loaded.
pub struct Router {
    replicas: Vec<Replica>,
}

impl Router {
    /// Routes over `replicas` (one or more, of the same model).
    pub fn new(replicas: Vec<Replica>) -> Result<Router, String> {
        let first = replicas.first().ok_or("a router needs one replica or more")?;
        if let Some(other) = replicas.iter().find(|r| r.spec() != first.spec()) {
            return Err(format!(
                "replicas of different models behind one router: {} and {}",
                first.spec(),
                other.spec()
            ));
        }
        Ok(Router { replicas })
    }

    /// The replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// The model served.
    pub fn spec(&self) -> &ModelSpec {
        self.replicas[0].spec()
    }

    /// Submits `request` to the least loaded replica (the first of equals).
    pub async fn submit(&self, request: Request) -> Result<tokio_mpsc::UnboundedReceiver<Update>, String> {
        let replica = (self.replicas.iter())
            .min_by_key(|r| r.stats().load())
            .expect("a router has a replica");
        replica.submit(request).await
    }
}
