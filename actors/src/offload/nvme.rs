//! The NVMe tier of an offload actor (ZeRO-Infinity, Rajbhandari et al., SC 2021): every
//! segment's state region lives in one preallocated file; an I/O thread reads regions ahead of
//! the optimizer and writes updated ones behind it, in submission order, so a read issued after
//! a write of the same region sees the new bytes.
//!
//! Reads and writes are positioned (`pread`/`pwrite`) on a file written in full at start (no
//! sparse holes). They go through the OS page cache (no `O_DIRECT`), as a plain sequential copy
//! of the same bytes does; the bench compares the two in one run.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::store::{SegmentState, StateStore, TierStats};

/// Write-behind depth: the optimizer waits when this many regions are still being written.
const WRITES_IN_FLIGHT: usize = 1;

/// Where a segment's region sits in the file, in f32 elements.
#[derive(Debug, Clone, Copy)]
struct Region {
    at: u64,
    /// Parameters in the shard.
    len: usize,
    /// Elements of the region (parameters and optimizer state).
    total: usize,
}

enum Io {
    Read {
        region: Region,
        reply: Sender<io::Result<SegmentState>>,
    },
    Write {
        region: Region,
        state: SegmentState,
    },
    ReadParams {
        region: Region,
        buf: Vec<f32>,
        reply: Sender<io::Result<Vec<f32>>>,
    },
}

#[derive(Default)]
struct IoCounters {
    read_bytes: u64,
    read_s: f64,
    written_bytes: u64,
    write_s: f64,
}

/// Segment states in a file under a directory, moved by an I/O thread.
pub struct NvmeStore {
    path: PathBuf,
    regions: HashMap<usize, Region>,
    io: Option<Sender<Io>>,
    written: Receiver<io::Result<()>>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<Mutex<IoCounters>>,
    ahead: HashMap<usize, Receiver<io::Result<SegmentState>>>,
    /// Sizes (bytes) of the regions submitted for writing and not yet written, oldest first.
    writes_in_flight: VecDeque<u64>,
    wait_s: f64,
    peak_resident: u64,
    disk_bytes: u64,
}

/// Distinguishes the files of stores created by one process.
static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

impl NvmeStore {
    /// Creates the state file for `actor` under `dir` and writes every segment's initial region:
    /// its parameter shard (from `initial`, dropped as soon as written) followed by
    /// `floats − 1` zeroed optimizer-state ranges of the same length.
    pub fn create(
        dir: &Path,
        actor: usize,
        mut initial: HashMap<usize, Vec<f32>>,
        floats: usize,
    ) -> Result<NvmeStore, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create the offload directory {}: {e}", dir.display()))?;
        let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!(
            "archipelago-offload-{}-{n}-actor{actor}.f32",
            std::process::id()
        ));
        let fail = |what: &str, e: io::Error| format!("offload file {}: {what}: {e}", path.display());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| fail("cannot create", e))?;
        let mut keys: Vec<usize> = initial.keys().copied().collect();
        keys.sort_unstable();
        let mut regions = HashMap::new();
        let mut at = 0u64;
        for &k in &keys {
            let len = initial[&k].len();
            let total = floats * len;
            regions.insert(k, Region { at, len, total });
            at += total as u64;
        }
        file.set_len(4 * at).map_err(|e| fail("cannot size", e))?;
        // Every byte is written once now, so the file has no holes to fill during steps.
        let zeros = vec![0u8; 1 << 20];
        for &k in &keys {
            let region = regions[&k];
            let params = initial.remove(&k).expect("a key of the map");
            file.write_all_at(bytemuck::cast_slice(&params), 4 * region.at)
                .map_err(|e| fail("cannot write the initial state", e))?;
            let mut pos = 4 * (region.at + region.len as u64);
            let end = 4 * (region.at + region.total as u64);
            while pos < end {
                let n = (end - pos).min(zeros.len() as u64) as usize;
                file.write_all_at(&zeros[..n], pos)
                    .map_err(|e| fail("cannot write the initial state", e))?;
                pos += n as u64;
            }
        }
        let counters = Arc::new(Mutex::new(IoCounters::default()));
        let (io, requests) = channel();
        let (done, written) = channel();
        let thread_counters = counters.clone();
        let thread = std::thread::Builder::new()
            .name(format!("offload-io-{actor}"))
            .spawn(move || io_thread(file, requests, done, thread_counters))
            .map_err(|e| format!("cannot start the offload I/O thread: {e}"))?;
        Ok(NvmeStore {
            path,
            regions,
            io: Some(io),
            written,
            thread: Some(thread),
            counters,
            ahead: HashMap::new(),
            writes_in_flight: VecDeque::new(),
            wait_s: 0.0,
            peak_resident: 0,
            disk_bytes: 4 * at,
        })
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn region(&self, segment: usize) -> Result<Region, String> {
        self.regions
            .get(&segment)
            .copied()
            .ok_or_else(|| format!("the offload file holds no segment starting at block {segment}"))
    }

    fn submit(&self, op: Io) -> Result<(), String> {
        self.io
            .as_ref()
            .and_then(|io| io.send(op).ok())
            .ok_or_else(|| format!("the offload I/O thread of {} has stopped", self.path.display()))
    }

    fn read(&mut self, segment: usize) -> Result<Receiver<io::Result<SegmentState>>, String> {
        let region = self.region(segment)?;
        let (reply, result) = channel();
        self.submit(Io::Read { region, reply })?;
        Ok(result)
    }

    /// Counts finished writes; waits while more than `keep` are in flight.
    fn drain_writes(&mut self, keep: usize) -> Result<(), String> {
        loop {
            let must_wait = self.writes_in_flight.len() > keep;
            let finished = if must_wait {
                let began = Instant::now();
                let r = self.written.recv();
                self.wait_s += began.elapsed().as_secs_f64();
                r.ok()
            } else {
                self.written.try_recv().ok()
            };
            match finished {
                // One I/O thread: writes finish in the order they were submitted.
                Some(Ok(())) => {
                    self.writes_in_flight.pop_front();
                }
                Some(Err(e)) => return Err(format!("offload write to {} failed: {e}", self.path.display())),
                None if must_wait => {
                    return Err(format!(
                        "the offload I/O thread of {} has stopped",
                        self.path.display()
                    ));
                }
                None => return Ok(()),
            }
        }
    }

    /// Records the host bytes resident now: regions read ahead, the one being updated, those
    /// being written, and the I/O thread's spare buffer (at most the largest region).
    fn note_resident(&mut self, current: Region) {
        let bytes = |r: &Region| 4 * r.total as u64;
        let ahead: u64 = self.ahead.keys().map(|k| bytes(&self.regions[k])).sum();
        let writing: u64 = self.writes_in_flight.iter().sum();
        let spare = self.regions.values().map(bytes).max().unwrap_or(0);
        self.peak_resident = self.peak_resident.max(ahead + bytes(&current) + writing + spare);
    }
}

impl StateStore for NvmeStore {
    fn prefetch(&mut self, segment: usize) -> Result<(), String> {
        if !self.ahead.contains_key(&segment) {
            let pending = self.read(segment)?;
            self.ahead.insert(segment, pending);
        }
        Ok(())
    }

    fn load(&mut self, segment: usize) -> Result<SegmentState, String> {
        let region = self.region(segment)?;
        let pending = match self.ahead.remove(&segment) {
            Some(p) => p,
            None => self.read(segment)?,
        };
        self.note_resident(region);
        let began = Instant::now();
        let state = pending
            .recv()
            .map_err(|_| format!("the offload I/O thread of {} has stopped", self.path.display()))?
            .map_err(|e| format!("offload read from {} failed: {e}", self.path.display()))?;
        self.wait_s += began.elapsed().as_secs_f64();
        Ok(state)
    }

    fn save(&mut self, segment: usize, state: SegmentState) -> Result<(), String> {
        let region = self.region(segment)?;
        if state.data.len() != region.total {
            return Err(format!(
                "segment {segment}: state of {} values, its region holds {}",
                state.data.len(),
                region.total
            ));
        }
        self.drain_writes(WRITES_IN_FLIGHT - 1)?;
        self.submit(Io::Write { region, state })?;
        self.writes_in_flight.push_back(4 * region.total as u64);
        Ok(())
    }

    fn shard_len(&self, segment: usize) -> Result<usize, String> {
        Ok(self.region(segment)?.len)
    }

    fn read_params(&mut self, segment: usize, out: &mut [f32]) -> Result<(), String> {
        let region = self.region(segment)?;
        let (reply, result) = channel();
        self.submit(Io::ReadParams {
            region,
            buf: vec![0.0; region.len],
            reply,
        })?;
        let began = Instant::now();
        let params = result
            .recv()
            .map_err(|_| format!("the offload I/O thread of {} has stopped", self.path.display()))?
            .map_err(|e| format!("offload read from {} failed: {e}", self.path.display()))?;
        self.wait_s += began.elapsed().as_secs_f64();
        out.copy_from_slice(&params);
        self.drain_writes(WRITES_IN_FLIGHT)?;
        Ok(())
    }

    fn stats(&self) -> TierStats {
        let c = self.counters.lock().expect("I/O counters");
        TierStats {
            host_bytes: self.peak_resident,
            disk_bytes: self.disk_bytes,
            read_bytes: c.read_bytes,
            read_s: c.read_s,
            written_bytes: c.written_bytes,
            write_s: c.write_s,
            wait_s: self.wait_s,
        }
    }
}

impl Drop for NvmeStore {
    fn drop(&mut self) {
        self.io = None; // the I/O thread ends when its queue closes
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs reads and writes in submission order; keeps written buffers for the next reads.
fn io_thread(
    file: File,
    requests: Receiver<Io>,
    done: Sender<io::Result<()>>,
    counters: Arc<Mutex<IoCounters>>,
) {
    let mut spare: Vec<Vec<f32>> = Vec::new();
    for op in requests {
        match op {
            Io::Read { region, reply } => {
                let mut data = match spare.iter().position(|b| b.len() == region.total) {
                    Some(i) => spare.swap_remove(i),
                    None => vec![0.0; region.total],
                };
                let began = Instant::now();
                let r = file.read_exact_at(bytemuck::cast_slice_mut(&mut data), 4 * region.at);
                count(&counters, true, 4 * region.total as u64, began);
                let _ = reply.send(r.map(|()| SegmentState {
                    data,
                    len: region.len,
                }));
            }
            Io::Write { region, state } => {
                let began = Instant::now();
                let r = file.write_all_at(bytemuck::cast_slice(&state.data), 4 * region.at);
                count(&counters, false, 4 * region.total as u64, began);
                if spare.is_empty() {
                    spare.push(state.data);
                }
                let _ = done.send(r);
            }
            Io::ReadParams {
                region,
                mut buf,
                reply,
            } => {
                let began = Instant::now();
                let r = file.read_exact_at(bytemuck::cast_slice_mut(&mut buf), 4 * region.at);
                count(&counters, true, 4 * region.len as u64, began);
                let _ = reply.send(r.map(|()| buf));
            }
        }
    }
}

fn count(counters: &Mutex<IoCounters>, read: bool, bytes: u64, began: Instant) {
    let s = began.elapsed().as_secs_f64();
    let mut c = counters.lock().expect("I/O counters");
    if read {
        c.read_bytes += bytes;
        c.read_s += s;
    } else {
        c.written_bytes += bytes;
        c.write_s += s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &Path) -> NvmeStore {
        let initial = HashMap::from([(0, vec![1.0f32; 5]), (5, vec![2.0f32; 3])]);
        NvmeStore::create(dir, 0, initial, 3).unwrap()
    }

    #[test]
    fn regions_start_as_parameters_and_zeroed_state_and_keep_what_is_saved() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        assert_eq!(std::fs::metadata(s.path()).unwrap().len(), 4 * 3 * 8);
        s.prefetch(5).unwrap();
        let mut a = s.load(0).unwrap();
        assert_eq!(a.data, [vec![1.0; 5], vec![0.0; 10]].concat());
        a.split().1.fill(7.0);
        s.save(0, a).unwrap();
        // A read submitted after the write sees it (one I/O queue, in order).
        let again = s.load(0).unwrap();
        assert_eq!(&again.data[5..10], &[7.0; 5]);
        let b = s.load(5).unwrap();
        assert_eq!(b.len, 3);
        let mut params = vec![0.0; 3];
        s.read_params(5, &mut params).unwrap();
        assert_eq!(params, vec![2.0; 3]);
        let stats = s.stats();
        assert_eq!(stats.disk_bytes, 96);
        assert_eq!(stats.written_bytes, 60);
        assert_eq!(stats.read_bytes, 60 + 60 + 36 + 12);
        let path = s.path().to_path_buf();
        drop(s);
        assert!(!path.exists(), "the state file outlives its store");
    }

    #[test]
    fn unknown_segments_and_wrong_sizes_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        assert!(s.load(3).unwrap_err().contains("block 3"));
        let wrong = SegmentState {
            data: vec![0.0; 4],
            len: 2,
        };
        assert!(s.save(0, wrong).unwrap_err().contains("region holds 15"));
        assert_eq!(s.shard_len(0).unwrap(), 5);
        assert!(s.shard_len(3).is_err());
    }
}
