//! Where an offload actor keeps each segment's state: one flat region per segment holding the
//! master parameter shard followed by the optimizer state of the same range (Adam, AdamW: `m`,
//! `v`; SGD with momentum: its buffer).
//! [`HostStore`] keeps the regions in host memory (ZeRO-Offload); the NVMe tier
//! ([`super::nvme::NvmeStore`]) keeps them in a file.

use std::collections::HashMap;

/// One segment's state region: `[params | m | v]`, each `len` long (`[params | buffer]` for SGD
/// with momentum, just `params` for plain SGD).
#[derive(Debug)]
pub struct SegmentState {
    /// The region.
    pub data: Vec<f32>,
    /// Parameters in the shard.
    pub len: usize,
}

impl SegmentState {
    /// The parameters and the optimizer state as separate slices: `(params, m, v)`, `m` and `v`
    /// empty where the rule keeps less state.
    pub fn split(&mut self) -> (&mut [f32], &mut [f32], &mut [f32]) {
        let (params, state) = self.data.split_at_mut(self.len);
        let first = state.len().min(self.len);
        let (m, v) = state.split_at_mut(first);
        (params, m, v)
    }
}

/// A tier that holds the segments' state regions between optimizer steps.
pub trait StateStore: Send {
    /// Hints that `segment`'s state is needed next (read ahead).
    fn prefetch(&mut self, segment: usize) -> Result<(), String>;
    /// Takes `segment`'s state (waiting for the tier if it is not resident yet).
    fn load(&mut self, segment: usize) -> Result<SegmentState, String>;
    /// Gives `segment`'s updated state back (written behind by tiers below host memory).
    fn save(&mut self, segment: usize, state: SegmentState) -> Result<(), String>;
    /// Copies `segment`'s parameters into `out` (after every update saved before this call);
    /// the caller sized `out` to [`StateStore::shard_len`].
    fn read_params(&mut self, segment: usize, out: &mut [f32]) -> Result<(), String>;
    /// Parameters in the shard of `segment`.
    fn shard_len(&self, segment: usize) -> Result<usize, String>;
    /// What the tier holds and has moved.
    fn stats(&self) -> TierStats;
}

/// Bytes a tier holds and moves, and the time it took.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TierStats {
    /// Host memory held at the peak.
    pub host_bytes: u64,
    /// Bytes on disk.
    pub disk_bytes: u64,
    /// Bytes read from disk so far.
    pub read_bytes: u64,
    /// Seconds spent in those reads.
    pub read_s: f64,
    /// Bytes written to disk so far.
    pub written_bytes: u64,
    /// Seconds spent in those writes.
    pub write_s: f64,
    /// Seconds the optimizer waited for the tier (reads not read ahead in time, write backlog).
    pub wait_s: f64,
}

/// Segment states in host memory.
pub struct HostStore {
    regions: HashMap<usize, SegmentState>,
    bytes: u64,
}

impl HostStore {
    /// A store holding `regions`, by segment.
    pub fn new(regions: HashMap<usize, SegmentState>) -> HostStore {
        let bytes = regions.values().map(|r| 4 * r.data.len() as u64).sum();
        HostStore { regions, bytes }
    }

    fn region(&self, segment: usize) -> Result<&SegmentState, String> {
        self.regions
            .get(&segment)
            .ok_or_else(|| format!("the offload actor holds no segment starting at block {segment}"))
    }
}

impl StateStore for HostStore {
    fn prefetch(&mut self, _segment: usize) -> Result<(), String> {
        Ok(())
    }

    fn load(&mut self, segment: usize) -> Result<SegmentState, String> {
        self.region(segment)?;
        Ok(self.regions.remove(&segment).expect("checked above"))
    }

    fn save(&mut self, segment: usize, state: SegmentState) -> Result<(), String> {
        self.regions.insert(segment, state);
        Ok(())
    }

    fn shard_len(&self, segment: usize) -> Result<usize, String> {
        Ok(self.region(segment)?.len)
    }

    fn read_params(&mut self, segment: usize, out: &mut [f32]) -> Result<(), String> {
        let region = self.region(segment)?;
        out.copy_from_slice(&region.data[..region.len]);
        Ok(())
    }

    fn stats(&self) -> TierStats {
        TierStats {
            host_bytes: self.bytes,
            ..TierStats::default()
        }
    }
}
