//! A sharded key-value store on an actor mesh — the program `examples/actors_cluster.rs` runs
//! on this process or on a cluster of hosts running its own binary, unchanged. Each shard actor
//! owns the keys `k` with `k % shards == shard`; the program writes keys with casts, reads them
//! back with calls (`wait` on all of them), and asks every shard for its sum at once.

use serde::{Deserialize, Serialize};

use archipelago_controller::prelude::*;

/// One shard of the store.
pub struct Shard {
    index: usize,
    shards: usize,
    values: std::collections::BTreeMap<u64, f64>,
}

impl Actor for Shard {
    type Params = (usize, usize);
    async fn new((index, shards): (usize, usize), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Shard {
            index,
            shards,
            values: Default::default(),
        })
    }
}

/// Stores a value (cast: no reply).
#[derive(Serialize, Deserialize)]
pub struct Put(pub u64, pub f64);
impl Message for Put {
    type Reply = ();
}
impl Handler<Put> for Shard {
    async fn handle(&mut self, Put(key, value): Put, _ctx: &Context<Self>) {
        assert_eq!(
            key as usize % self.shards,
            self.index,
            "key {key} sent to the wrong shard"
        );
        *self.values.entry(key).or_default() += value;
    }
}

/// Reads a value.
#[derive(Serialize, Deserialize)]
pub struct Get(pub u64);
impl Message for Get {
    type Reply = Option<f64>;
}
impl Handler<Get> for Shard {
    async fn handle(&mut self, Get(key): Get, _ctx: &Context<Self>) -> Option<f64> {
        self.values.get(&key).copied()
    }
}

/// The shard's sum, key count, host and device.
#[derive(Clone, Serialize, Deserialize)]
pub struct Summary;
impl Message for Summary {
    type Reply = (f64, usize, String, DeviceSpec);
}
impl Handler<Summary> for Shard {
    async fn handle(&mut self, _: Summary, ctx: &Context<Self>) -> (f64, usize, String, DeviceSpec) {
        let sum = self.values.values().sum();
        (sum, self.values.len(), ctx.info().host.clone(), ctx.device())
    }
}

/// Stores a value through another shard: the receiving shard calls `to` itself (an actor
/// reference passed in a message — across hosts, shard to shard, not through the program).
#[derive(Serialize, Deserialize)]
pub struct PutVia {
    /// The shard that owns the key.
    pub to: ActorRef<Shard>,
    /// The key.
    pub key: u64,
    /// The value.
    pub value: f64,
}
impl Message for PutVia {
    type Reply = Result<String, String>;
}
impl Handler<PutVia> for Shard {
    async fn handle(
        &mut self,
        PutVia { to, key, value }: PutVia,
        ctx: &Context<Self>,
    ) -> Result<String, String> {
        to.call(Put(key, value)).await.map_err(|e| e.to_string())?;
        Ok(format!("{} → {}", ctx.info().host, to.info().host))
    }
}

/// Holds the shard busy for a while (to have a call pending when a host dies).
#[derive(Serialize, Deserialize)]
pub struct Busy(pub u64);
impl Message for Busy {
    type Reply = ();
}
impl Handler<Busy> for Shard {
    async fn handle(&mut self, Busy(ms): Busy, _ctx: &Context<Self>) {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}

/// The types the program sends across processes.
pub fn registry() -> Registry {
    Registry::new()
        .actor::<Shard>()
        .handles::<Shard, Put>()
        .handles::<Shard, Get>()
        .handles::<Shard, Summary>()
        .handles::<Shard, Busy>()
        .handles::<Shard, PutVia>()
}

/// What the program computed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Each shard's `(sum, keys)`, by rank.
    pub shards: Vec<(f64, usize)>,
    /// The values read back, by key.
    pub read_back: Vec<f64>,
    /// Where each shard ran: `(host, device)`.
    pub placement: Vec<(String, DeviceSpec)>,
}

/// Writes `keys` keys into a `2 × shards/2` mesh of shards and reads them back.
pub fn run(runtime: &Runtime, keys: u64) -> anyhow::Result<(Outcome, ActorMesh<Shard>)> {
    let devices = runtime.slots().len();
    let mesh = Mesh::new(&[("replica_group", 2), ("shard", devices / 2)])?;
    let shards = mesh.size();
    let store = runtime
        .spawn_mesh::<Shard>(mesh, |c| (c[0] * (devices / 2) + c[1], shards))
        .get()?;
    for key in 0..keys {
        let value = (key * key % 97) as f64 / 4.0;
        store.members()[key as usize % shards].cast(Put(key, value))?;
    }
    let reads: Vec<_> = (0..keys)
        .map(|k| store.members()[k as usize % shards].call(Get(k)))
        .collect();
    let read_back = runtime.wait(reads, keys as usize, None).ready.into_iter().fold(
        vec![f64::NAN; keys as usize],
        |mut v, (i, r)| {
            v[i] = r.ok().flatten().unwrap_or(f64::NAN);
            v
        },
    );
    let mut shard_sums = Vec::new();
    let mut placement = Vec::new();
    for summary in store.call_all(Summary) {
        let (sum, count, host, device) = summary.get()?;
        shard_sums.push((sum, count));
        placement.push((host, device));
    }
    let outcome = Outcome {
        shards: shard_sums,
        read_back,
        placement,
    };
    Ok((outcome, store))
}
