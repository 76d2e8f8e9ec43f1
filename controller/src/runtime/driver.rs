//! The driver's side of a cluster: ask the controller where actors may go (it places them by
//! island and waits for enough hosts), then connect to those hosts' actor ports.

use archipelago_actors::fabric::grpc::with_token;
use archipelago_actors::proto::ClusterRequest;
use archipelago_actors::proto::controller_client::ControllerClient;
use archipelago_actors::runtime::remote::Liveness;
use archipelago_actors::runtime::{Runtime, Slot};
use archipelago_actors::trust::Credentials;

/// A runtime on the cluster of the controller at `addr`, with at least `min_devices` devices
/// (the controller waits for them up to its `--wait-for-hosts-s`).
/// `credentials`: the cluster's token (a `&str` will do), with mutual TLS when they carry it.
pub fn connect(
    addr: &str,
    credentials: impl Into<Credentials>,
    min_devices: usize,
) -> anyhow::Result<Runtime> {
    let credentials = credentials.into();
    let rpc = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let slots = rpc.block_on(ask_for_slots(addr, &credentials, min_devices))?;
    drop(rpc);
    Runtime::on_cluster(&super::job_name(), slots, credentials, Liveness::default())
        .map_err(anyhow::Error::msg)
}

/// The cluster's slots, as the controller at `addr` gives them once it has `min_devices`.
pub(super) async fn ask_for_slots(
    addr: &str,
    credentials: &Credentials,
    min_devices: usize,
) -> anyhow::Result<Vec<Slot>> {
    // A controller started beside the driver (a Slurm batch script) may not listen yet.
    let channel =
        crate::cluster::host_agent::connect(addr, credentials, std::time::Duration::from_secs(30)).await?;
    let request = with_token(
        credentials.token(),
        ClusterRequest {
            min_devices: min_devices as u32,
        },
    )?;
    let reply = ControllerClient::new(channel)
        .cluster(request)
        .await
        .map_err(|status| anyhow::anyhow!("the controller at {addr}: {}", status.message()))?
        .into_inner();
    reply
        .slots
        .into_iter()
        .map(|s| {
            Ok(Slot {
                device: s.device.parse()?,
                host: s.host,
                island: s.island,
                addr: s.addr,
            })
        })
        .collect()
}
