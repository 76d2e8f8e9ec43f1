//! A serving job's part on a host: an actor of the runtime API that the controller spawns on
//! the host's actor port (as it spawns a training job's [`HostPart`](super::host_part::HostPart))
//! for `archipelago serve --controller`. [`StartServing`] loads the model and starts the same
//! service `archipelago serve` runs locally (the replicas, the router, OpenAI's routes) on a
//! thread of its own, listening where the job's `--listen` says on this host, and answers where
//! it listens; [`ServingLoad`] answers what the replicas are doing (for the dashboard). The
//! service stops when the part does: the controller's connection closing (its client went
//! away, the job was stopped) stops the part, and with it the listener, the open streams and the
//! replicas' threads.
//!
//! The service takes the host's credentials, as the dashboard takes the controller's: on a
//! loopback address it is open to that machine; anywhere else every request carries the
//! cluster token, and with mutual TLS in the cluster it speaks HTTPS under the host's identity.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};

use archipelago_actors::runtime::{Actor, Context, Handler, Message, Registry};

use super::host_part::HostResources;
use crate::serve::http::Service;
use crate::serve::{self, ServeArgs, tls_listener::TlsListener};

/// What a serving part is built from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServingParams {
    /// The serving job's name.
    pub job: String,
    /// `serve`'s flags, as the client gave them.
    pub args: ServeArgs,
}

/// Loads the model and starts the service; where it listens.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartServing;
impl Message for StartServing {
    type Reply = Result<ServingStarted, String>;
}

/// A started service.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServingStarted {
    /// `http://ADDR` or `https://ADDR`, as bound on the host.
    pub url: String,
    /// The model, its weights and its cache pool, in one line.
    pub summary: String,
}

/// What the service's replicas are doing, summed over them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServingLoad;
impl Message for ServingLoad {
    type Reply = Result<LoadFigures, String>;
}

/// A serving job's figures at one moment (sums over its replicas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadFigures {
    /// Requests waiting for cache blocks.
    pub waiting: usize,
    /// Sequences in the running batch.
    pub running: usize,
    /// Cache blocks held.
    pub blocks_used: usize,
    /// Cache blocks in the pools.
    pub blocks_total: usize,
    /// Tokens generated so far.
    pub generated_tokens: u64,
    /// Requests finished so far.
    pub finished: u64,
}

/// The part's service while it runs: stopping it drops the sender, which ends the thread.
struct Running {
    service: Arc<Service>,
    /// Why the service stopped on its own, once it has.
    ended: Ended,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Why a service stopped on its own (its listener failed), set by its thread.
type Ended = Arc<std::sync::Mutex<Option<String>>>;

/// A serving job's part on this host.
pub struct ServePart {
    params: ServingParams,
    host: Arc<HostResources>,
    running: Option<Running>,
}

impl Actor for ServePart {
    type Params = ServingParams;

    async fn new(params: ServingParams, _ctx: &Context<Self>) -> Result<Self, String> {
        let host = HostResources::current().ok_or_else(|| {
            "this process is not an `archipelago host`: a serving job's part runs only there".to_string()
        })?;
        Ok(ServePart {
            params,
            host,
            running: None,
        })
    }

    /// The controller's connection closed or the part was stopped: the service ends with it.
    async fn stopping(&mut self, _ctx: &Context<Self>) {
        if self.running.take().is_some() {
            tracing::info!(job = %self.params.job, "serving job stopped");
        }
    }
}

impl Handler<StartServing> for ServePart {
    async fn handle(&mut self, _: StartServing, _ctx: &Context<Self>) -> Result<ServingStarted, String> {
        if self.running.is_some() {
            return Err(format!("serving job {} already runs here", self.params.job));
        }
        let (ready, started) = tokio::sync::oneshot::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (params, host) = (self.params.clone(), self.host.clone());
        let ended = Ended::default();
        let thread_ended = ended.clone();
        std::thread::Builder::new()
            .name("serving job".into())
            .spawn(move || run_service(params, host, ready, stopped, thread_ended))
            .map_err(|e| format!("cannot start the service's thread: {e}"))?;
        let named = |why: String| {
            format!(
                "serving job {} on host `{}`: {why}",
                self.params.job, self.host.name
            )
        };
        let (service, started) = started
            .await
            .map_err(|_| named("the service's thread ended before it listened".into()))?
            .map_err(named)?;
        self.running = Some(Running {
            service,
            ended,
            _stop: stop,
        });
        Ok(started)
    }
}

impl Handler<ServingLoad> for ServePart {
    async fn handle(&mut self, _: ServingLoad, _ctx: &Context<Self>) -> Result<LoadFigures, String> {
        let named = |why: &str| {
            format!(
                "serving job {} on host `{}`: {why}",
                self.params.job, self.host.name
            )
        };
        let running = (self.running.as_ref()).ok_or_else(|| named("it has not started here"))?;
        if let Some(why) = running.ended.lock().expect("service end").as_deref() {
            return Err(named(&format!("its service stopped: {why}")));
        }
        let mut figures = LoadFigures::default();
        for replica in running.service.replicas.replicas() {
            let s = replica.stats();
            figures.waiting += s.waiting.load(Ordering::Relaxed);
            figures.running += s.running.load(Ordering::Relaxed);
            figures.blocks_used += s.blocks_used.load(Ordering::Relaxed);
            figures.blocks_total += s.blocks_total.load(Ordering::Relaxed);
            figures.generated_tokens += s.generated.load(Ordering::Relaxed);
            figures.finished += s.finished.load(Ordering::Relaxed);
        }
        Ok(figures)
    }
}

/// The service's answer to [`StartServing`]: the routes' state and where it listens.
type Ready = Result<(Arc<Service>, ServingStarted), String>;

/// A bound listener: plain TCP, or TLS over it under the host's identity.
enum Bound {
    Plain(tokio::net::TcpListener),
    Tls(TlsListener),
}

/// The service's thread: builds it, listens, answers `ready`, serves until `stopped` (or its
/// sender's drop) — then its runtime, the open connections and the replicas go with it.
fn run_service(
    params: ServingParams,
    host: Arc<HostResources>,
    ready: tokio::sync::oneshot::Sender<Ready>,
    stopped: tokio::sync::oneshot::Receiver<()>,
    ended: Ended,
) {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot start the service's runtime: {e}")));
            return;
        }
    };
    runtime.block_on(async move {
        let started = listen(&params, &host).await;
        let (listener, service) = match started {
            Ok((listener, service, started)) => {
                let _ = ready.send(Ok((service.clone(), started)));
                (listener, service)
            }
            Err(why) => {
                let _ = ready.send(Err(why));
                return;
            }
        };
        let served = async {
            match listener {
                Bound::Tls(listener) => serve::serve_on(listener, service).await,
                Bound::Plain(listener) => serve::serve_on(listener, service).await,
            }
        };
        tokio::select! {
            result = served => if let Err(e) = result {
                tracing::error!(job = %params.job, "the service stopped: {e}");
                *ended.lock().expect("service end") = Some(e.to_string());
            },
            _ = stopped => {}
        }
    });
}

/// Builds the service of `params` under the host's credentials and binds its listener.
async fn listen(
    params: &ServingParams,
    host: &HostResources,
) -> Result<(Bound, Arc<Service>, ServingStarted), String> {
    let mut args = params.args.clone();
    // The client's token file and TLS files are its way to the controller: the service takes
    // the host's.
    (args.token_file, args.tls, args.controller) = (None, Default::default(), None);
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on --listen {}: {e}", args.listen))?;
    let addr: SocketAddr = listener.local_addr().map_err(|e| e.to_string())?;
    let token = crate::dashboard::access::token_for(addr, Some(host.credentials.token()))
        .map_err(|e| e.to_string())?;
    let (service, summary) = tokio::task::block_in_place(|| serve::build_with_token(&args, token))?;
    let (listener, scheme) = match host.credentials.tls() {
        Some(tls) => {
            let listener =
                TlsListener::new(listener, tls.clone()).map_err(|e| format!("cannot serve TLS: {e}"))?;
            (Bound::Tls(listener), "https")
        }
        None => (Bound::Plain(listener), "http"),
    };
    // Bound to every interface: the address the host publishes is where clients reach it.
    let reach = match addr.ip().is_unspecified() {
        true => {
            let published = host.fabric_addr.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
            format!("{published}:{}", addr.port())
        }
        false => addr.to_string(),
    };
    let started = ServingStarted {
        url: format!("{scheme}://{reach}"),
        summary: summary.line(),
    };
    Ok((listener, service, started))
}

/// The serving part's types, installed by the controller and by every `archipelago host`.
pub fn registry() -> Registry {
    Registry::new()
        .actor::<ServePart>()
        .handles::<ServePart, StartServing>()
        .handles::<ServePart, ServingLoad>()
}
