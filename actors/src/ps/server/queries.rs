//! What a server answers besides pulls and pushes: its figures and clock log ([`Stats`]), its
//! keys and values ([`Dump`]), and a checkpoint of its state ([`SaveCheckpoint`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{PsServer, ServerFigures};
use crate::ps::checkpoint;
use crate::ps::clock::ClockEvent;
use crate::ps::update::ServerUpdate;
use crate::ps::versions::RangeVersion;
use crate::runtime::{Context, Handler, Message};

/// Asks a server for its figures and, when kept, its clock log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stats;

/// A server's figures and clock log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServerReport {
    /// Traffic and holdings.
    pub figures: ServerFigures,
    /// Every worker's clock.
    pub clocks: Vec<u64>,
    /// The clock log (empty unless `log_clocks`).
    pub log: Vec<ClockEvent>,
    /// The version vector of every key range held.
    #[serde(default)]
    pub versions: Vec<RangeVersion>,
}

impl Message for Stats {
    type Reply = ServerReport;
}

impl<U: ServerUpdate> Handler<Stats> for PsServer<U> {
    async fn handle(&mut self, _: Stats, _ctx: &Context<Self>) -> ServerReport {
        ServerReport {
            figures: self.figures(),
            clocks: self.clocks.clocks().to_vec(),
            log: self.log.clone(),
            versions: self.versions.arcs(),
        }
    }
}

/// Asks a server for the keys whose chains it heads and their values (ascending by key); with
/// `replicas: true`, for every key it holds, replicas included.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Dump {
    /// Every key held, not only those it heads.
    pub replicas: bool,
}

/// A server's keys and values.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Dumped {
    /// The keys, ascending.
    pub keys: Vec<u64>,
    /// Their values, `width` each.
    pub values: Vec<f32>,
    /// The version vector of every key range held.
    #[serde(default)]
    pub versions: Vec<RangeVersion>,
}

impl Message for Dump {
    type Reply = Dumped;
}

impl<U: ServerUpdate> Handler<Dump> for PsServer<U> {
    async fn handle(&mut self, dump: Dump, _ctx: &Context<Self>) -> Dumped {
        let mut dumped = Dumped::default();
        let ring = &self.params.ring;
        for (key, values, _) in self.store.entries() {
            if !dump.replicas && ring.owner(key) != self.params.index {
                continue;
            }
            dumped.keys.push(key);
            dumped.values.extend_from_slice(values);
        }
        dumped.versions = self.versions.arcs();
        dumped
    }
}

/// Writes the server's keys, values, state and clock into `dir` (every worker must have
/// finished the same clock, so that no push is pending).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SaveCheckpoint {
    /// The checkpoint's directory.
    pub dir: PathBuf,
}

impl Message for SaveCheckpoint {
    type Reply = Result<u64, String>;
}

impl<U: ServerUpdate> Handler<SaveCheckpoint> for PsServer<U> {
    async fn handle(&mut self, save: SaveCheckpoint, _ctx: &Context<Self>) -> Result<u64, String> {
        if !self.pending.is_empty() || self.clocks.clocks().iter().any(|&c| c != self.applied) {
            return Err(format!(
                "server {} cannot checkpoint between clocks: workers at {:?}, {} applied",
                self.params.index,
                self.clocks.clocks(),
                self.applied
            ));
        }
        checkpoint::write_server_file(&save.dir, self.params.index, self.applied, &self.store)
    }
}
