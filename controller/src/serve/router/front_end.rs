//! The router's front end in the client of `serve --controller ADDR --replicas R`: its listener,
//! bound on the client's `--listen` before the job is asked for (a bad or taken address fails
//! first, and nothing starts on the hosts), and the job's replicas as the controller's events
//! announce them. Once every replica serves or was lost on the way, the routes
//! ([`super::app`]) start on the listener and `listening on http://ADDR` is printed, as the
//! local `serve` prints it; a replica lost afterwards is taken out of the router.

use std::sync::Arc;

use archipelago_actors::trust::Credentials;

use super::{ReplicaAddress, ReplicaSet};
use crate::serve::ServeArgs;

/// The router's listener and what it knows of the job's replicas so far.
pub struct FrontEnd {
    /// The job's replicas (`--replicas`).
    replicas: usize,
    /// Bound, not yet serving (taken when the routes start).
    listener: Option<tokio::net::TcpListener>,
    /// The cluster token, forwarded to the replicas and demanded off loopback.
    credentials: Credentials,
    /// `--max-body-bytes`.
    max_body_bytes: usize,
    max_connections: usize,
    /// The replicas serving so far.
    serving: Vec<ReplicaAddress>,
    /// Replicas lost before the routes started: index and why.
    lost_early: Vec<(usize, String)>,
    /// The routes' replicas, once they serve.
    set: Option<Arc<ReplicaSet>>,
}

impl FrontEnd {
    /// Binds the router's `--listen` (a token is required off loopback, and the client always
    /// has the cluster's).
    pub async fn bind(args: &ServeArgs, credentials: &Credentials) -> anyhow::Result<FrontEnd> {
        let listener = tokio::net::TcpListener::bind(&args.listen)
            .await
            .map_err(|e| anyhow::anyhow!("the router cannot listen on --listen {}: {e}", args.listen))?;
        Ok(FrontEnd {
            replicas: args.replicas,
            listener: Some(listener),
            credentials: credentials.clone(),
            max_body_bytes: args.max_body_bytes,
            max_connections: args.max_connections,
            serving: Vec::new(),
            lost_early: Vec::new(),
            set: None,
        })
    }

    /// Replica `address` of job `job` serves; the routes start once every replica is accounted
    /// for.
    pub fn serving(&mut self, job: &str, address: ReplicaAddress) -> anyhow::Result<()> {
        self.serving.push(address);
        self.start_when_all_known(job)
    }

    /// Starts the routes once every replica serves or was lost.
    fn start_when_all_known(&mut self, job: &str) -> anyhow::Result<()> {
        if self.serving.is_empty() || self.serving.len() + self.lost_early.len() < self.replicas {
            return Ok(());
        }
        let Some(listener) = self.listener.take() else {
            return Ok(());
        };
        self.serving.sort_by_key(|a| a.index);
        let set = ReplicaSet::new(
            job,
            self.serving.clone(),
            self.credentials.token(),
            self.credentials.tls().cloned(),
            (self.max_body_bytes, self.max_connections),
        )
        .map_err(anyhow::Error::msg)?;
        let set = Arc::new(set);
        for (index, why) in &self.lost_early {
            set.lose(*index, why);
        }
        let addr = listener.local_addr()?;
        let token = crate::dashboard::access::token_for(addr, Some(self.credentials.token()))?;
        let app = super::app(set.clone(), token);
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app.into_make_service()).await {
                tracing::error!("the router stopped: {e}");
            }
        });
        let replicas: Vec<String> = (self.serving.iter())
            .map(|a| format!("replica {} on host `{}` at {}", a.index, a.host, a.url))
            .collect();
        println!(
            "listening on http://{addr} (serving job {job}: a router in front of {} of {} replicas: {}; POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health)",
            set.live(),
            self.replicas,
            replicas.join(", ")
        );
        self.set = Some(set);
        Ok(())
    }

    /// The controller lost replica `index` on `host` for `why`: out of the router, its requests
    /// in flight failing naming the host.
    pub fn lost(&mut self, job: &str, index: usize, host: &str, why: &str) -> anyhow::Result<()> {
        match &self.set {
            Some(set) => {
                set.lose(index, why);
                println!(
                    "replica {index} on host `{host}` was lost ({} of {} replicas live): {why}",
                    set.live(),
                    self.replicas
                );
            }
            None => {
                println!("replica {index} on host `{host}` was lost before serving: {why}");
                self.lost_early.push((index, why.to_string()));
                return self.start_when_all_known(job);
            }
        }
        Ok(())
    }
}
