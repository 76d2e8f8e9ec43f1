//! `archipelago serve --controller ADDR`: the client of a serving job on a cluster. The flags
//! are checked here first (ranges, combinations, that the files exist), their paths made
//! absolute (the host reads them at the same place), and sent in one `Serve` call; the
//! controller places the job on a host and answers where its service listens, which this
//! prints as the local `serve` does (`listening on http://ADDR`). The job lasts as long as this
//! process: Ctrl-C (or a kill) closes the call and the controller stops the service; a lost
//! host ends it with an error naming the host, and this exits with status 1.
//!
//! With `--replicas R` (R > 1) the controller places one replica on each of R distinct hosts,
//! and this process runs the [`router`](super::router) in front of them on its own `--listen`
//! (bound before the job is asked for): it prints each replica's host and address, then
//! `listening on http://ADDR` once every replica serves (or was lost on the way). A replica the
//! controller reports lost is taken out of the router (its requests in flight fail naming its
//! host) and the others serve on; the job fails, and this exits 1 naming the hosts, only when
//! every replica is lost.

use std::path::{Path, PathBuf};
use std::time::Duration;

use archipelago_actors::fabric::grpc::{MAX_MESSAGE_BYTES, with_token};
use archipelago_actors::proto::controller_client::ControllerClient;
use archipelago_actors::proto::{JobEvent, ServeRequest, job_event};

use super::ServeArgs;
use super::router::ReplicaAddress;

/// How long the client waits for a controller that does not listen yet.
const CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// The flags as the host gets them: paths absolute, this client's own flags dropped.
pub fn flags_for_host(args: &ServeArgs) -> Result<ServeArgs, String> {
    super::check_flags(args)?;
    let mut sent = args.clone();
    let weights = &mut sent.weights;
    for (flag, path) in [
        ("--init", &mut weights.init),
        ("--checkpoint", &mut weights.checkpoint),
        ("--lora-init", &mut weights.lora_init),
        ("--tokenizer", &mut sent.tokenizer),
    ] {
        if let Some(p) = path {
            *p = absolute(flag, p)?;
        }
    }
    if let Some(template) = &mut sent.chat_template
        && template != "plain"
    {
        *template = absolute("--chat-template", Path::new(template))?
            .display()
            .to_string();
    }
    (sent.controller, sent.job, sent.token_file, sent.plan) = (None, None, None, false);
    sent.tls = Default::default();
    Ok(sent)
}

/// `path` made absolute, refused when it does not exist here (the hosts see this machine's
/// files at the same paths).
fn absolute(flag: &str, path: &Path) -> Result<PathBuf, String> {
    std::path::absolute(path)
        .ok()
        .filter(|p| p.exists())
        .ok_or_else(|| format!("{flag} {}: no such file or directory", path.display()))
}

/// Runs the serving job on the cluster of `controller` until this process ends or the job fails.
pub fn serve_on_cluster(args: &ServeArgs, controller: &str) -> anyhow::Result<()> {
    let sent = flags_for_host(args).map_err(anyhow::Error::msg)?;
    let token_file = (args.token_file.as_ref())
        .ok_or_else(|| anyhow::anyhow!("--controller needs --token-file (the cluster token)"))?;
    let credentials = args.tls.credentials(token_file)?;
    let request = ServeRequest {
        job: args.job.clone().unwrap_or_default(),
        args: serde_json::to_vec(&sent)?.into(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut follower = match args.replicas {
            1 => Follower::Single,
            _ => Follower::Routed(Box::new(
                super::router::front_end::FrontEnd::bind(args, &credentials).await?,
            )),
        };
        let channel = crate::cluster::host_agent::connect(controller, &credentials, CONNECT_PATIENCE).await?;
        let mut client = ControllerClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
        let request =
            with_token(credentials.token(), request).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
        let mut events = (client.serve(request).await)
            .map_err(|e| {
                anyhow::anyhow!(
                    "the controller at {controller} refused the serving job: {}",
                    e.message()
                )
            })?
            .into_inner();
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        loop {
            let event = tokio::select! {
                event = events.message() => event,
                _ = &mut ctrl_c => {
                    println!("stopping: the controller ends the serving job");
                    return Ok(());
                }
            };
            let event = event
                .map_err(|e| anyhow::anyhow!("the controller's stream broke: {}", e.message()))?
                .ok_or_else(|| anyhow::anyhow!("the controller ended the serving job without saying why"))?;
            follower.follow(event)?;
        }
    })
}

/// What the client does with the controller's events.
enum Follower {
    /// One replica: print where it listens.
    Single,
    /// Several: the router in front of them.
    Routed(Box<super::router::front_end::FrontEnd>),
}

impl Follower {
    /// Follows one event; an error ends the client (the job failed).
    fn follow(&mut self, event: JobEvent) -> anyhow::Result<()> {
        match (event.kind, self) {
            (Some(job_event::Kind::Info(line)), _) => println!("{line}"),
            (Some(job_event::Kind::Error(message)), _) => anyhow::bail!("{message}"),
            (Some(job_event::Kind::Serving(at)), Follower::Single) => {
                println!("serving {}", at.summary);
                println!(
                    "listening on {} (serving job {} on host `{}`; POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics)",
                    at.url, at.job, at.host
                );
            }
            (Some(job_event::Kind::Serving(at)), Follower::Routed(router)) => {
                println!(
                    "replica {} of serving job {} serves on host `{}` at {} ({})",
                    at.replica, at.job, at.host, at.url, at.summary
                );
                let address = ReplicaAddress {
                    index: at.replica as usize,
                    host: at.host,
                    url: at.url,
                };
                router.serving(&at.job, address)?;
            }
            (Some(job_event::Kind::ReplicaLost(lost)), Follower::Routed(router)) => {
                router.lost(&lost.job, lost.replica as usize, &lost.host, &lost.why)?;
            }
            (Some(job_event::Kind::ReplicaLost(lost)), Follower::Single) => {
                eprintln!("{}", lost.why);
            }
            (Some(_) | None, _) => {}
        }
        Ok(())
    }
}
