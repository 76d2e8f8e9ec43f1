//! Checkpoints of a parameter-server job (Li et al., OSDI 2014, §4.4 keeps ranges durable by
//! replication; a checkpoint lets a job stop and resume): one file per server with its keys,
//! values, update state and clock, then `manifest.json`, written last by the driver once every
//! server file is in — a directory without a manifest is not a checkpoint.
//!
//! A server file is `ARCPS001`, then little-endian `u64`s (server, width, state floats per key,
//! clock, keys), then per key its `u64` key, `width` values and its state as `f32`s, then the
//! CRC32C of everything before. It is written to a temporary name and renamed. Reading trusts
//! nothing: sizes are checked against the file's length before any allocation, and the checksum
//! before any value is used. A resumed server reads every server file and keeps the keys its ring
//! gives it, so a job may resume with another number of servers.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::server::ServerParams;
use super::store::KeyStore;
use super::update::ServerUpdate;

const MAGIC: &[u8; 8] = b"ARCPS001";
const HEADER: usize = 8 + 5 * 8;
/// The largest width or state length a file may announce.
const MAX_WIDTH: u64 = 1 << 24;

/// The checkpoint's description, written last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The clock every worker had finished.
    pub clock: u64,
    /// Servers of the job that wrote it (`server-0.ps` …, one per server unless `files` says).
    pub servers: usize,
    /// The server files written, by server index, when not every server wrote one (after a
    /// failover only the live servers do: their ranges hold every key); empty: `0..servers`.
    #[serde(default)]
    pub files: Vec<usize>,
    /// Workers of the job.
    pub workers: usize,
    /// Values per key.
    pub width: usize,
    /// The update rule, in words.
    pub update: String,
}

/// The path of server `index`'s file in `dir`.
pub fn server_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("server-{index}.ps"))
}

/// Writes `manifest` into `dir` (after every server file).
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), String> {
    let text = serde_json::to_string_pretty(manifest).map_err(|e| e.to_string())?;
    let path = dir.join("manifest.json");
    std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Reads the manifest of the checkpoint in `dir`.
pub fn read_manifest(dir: &Path) -> Result<Manifest, String> {
    let path = dir.join("manifest.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "{} is not a complete parameter-server checkpoint (its manifest: {e}); point --resume at a directory a job checkpointed into",
            dir.display()
        )
    })?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Writes `store` as server `index`'s file at `clock`; returns its bytes.
pub fn write_server_file(dir: &Path, index: usize, clock: u64, store: &KeyStore) -> Result<u64, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let entries = store.entries();
    let mut bytes = Vec::with_capacity(HEADER + store.bytes() as usize + 4);
    bytes.extend_from_slice(MAGIC);
    for field in [
        index as u64,
        store.width() as u64,
        store.state_len() as u64,
        clock,
        entries.len() as u64,
    ] {
        bytes.extend_from_slice(&field.to_le_bytes());
    }
    for (key, values, state) in entries {
        bytes.extend_from_slice(&key.to_le_bytes());
        values
            .iter()
            .chain(state)
            .for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
    }
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let path = server_path(dir, index);
    let partial = path.with_extension("ps.partial");
    std::fs::write(&partial, &bytes).map_err(|e| format!("cannot write {}: {e}", partial.display()))?;
    std::fs::rename(&partial, &path).map_err(|e| format!("cannot rename to {}: {e}", path.display()))?;
    Ok(bytes.len() as u64)
}

/// One server file, read and checked.
#[derive(Debug, Clone)]
pub struct ServerFile {
    /// The server that wrote it.
    pub index: usize,
    /// Values per key.
    pub width: usize,
    /// State floats per key.
    pub state_len: usize,
    /// Clocks applied.
    pub applied: u64,
    keys: Vec<u64>,
    floats: Vec<f32>,
}

impl ServerFile {
    /// Every key with its values and state.
    pub fn entries(&self) -> impl Iterator<Item = (u64, &[f32], &[f32])> {
        let per = self.width + self.state_len;
        self.keys.iter().enumerate().map(move |(i, &key)| {
            let at = &self.floats[i * per..(i + 1) * per];
            (key, &at[..self.width], &at[self.width..])
        })
    }
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads server `index`'s file in `dir`, whose keys must carry `state_len` state floats (the
/// update rule of the resuming job).
pub fn read_server_file(dir: &Path, index: usize, state_len: usize) -> Result<ServerFile, String> {
    let path = server_path(dir, index);
    let bytes = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_server_file(&bytes, state_len).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses a server file's bytes (hostile: every size checked before use).
pub fn parse_server_file(bytes: &[u8], state_len: usize) -> Result<ServerFile, String> {
    if bytes.len() < HEADER + 4 || &bytes[..8] != MAGIC {
        return Err("not a parameter-server checkpoint file (bad magic or too short)".into());
    }
    let (body, tail) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body).to_le_bytes() != tail {
        return Err("checksum mismatch: the file is damaged".into());
    }
    let (index, width, stored_state, applied, keys) = (
        u64_at(bytes, 8),
        u64_at(bytes, 16),
        u64_at(bytes, 24),
        u64_at(bytes, 32),
        u64_at(bytes, 40),
    );
    if width == 0 || width > MAX_WIDTH || stored_state > MAX_WIDTH {
        return Err(format!(
            "implausible width {width} or state length {stored_state}"
        ));
    }
    if stored_state != state_len as u64 {
        return Err(format!(
            "its keys carry {stored_state} state floats, the resuming update rule {state_len}: resume with the rule that wrote it"
        ));
    }
    let per_key = 8 + 4 * (width + stored_state);
    let expected = keys
        .checked_mul(per_key)
        .and_then(|b| b.checked_add((HEADER + 4) as u64));
    if expected != Some(bytes.len() as u64) {
        return Err(format!(
            "{keys} keys announced, but the file is {} bytes",
            bytes.len()
        ));
    }
    let (width, per) = (width as usize, (width + stored_state) as usize);
    let mut file = ServerFile {
        index: index as usize,
        width,
        state_len,
        applied,
        keys: Vec::with_capacity(keys as usize),
        floats: Vec::with_capacity(keys as usize * per),
    };
    let mut at = HEADER;
    for _ in 0..keys {
        file.keys.push(u64_at(bytes, at));
        at += 8;
        for chunk in bytes[at..at + 4 * per].chunks_exact(4) {
            file.floats
                .push(f32::from_le_bytes(chunk.try_into().expect("4 bytes")));
        }
        at += 4 * per;
    }
    Ok(file)
}

/// Loads into `store` the keys `params.ring` gives this server, from every server file of the
/// checkpoint in `dir` (any number of servers may have written it).
pub(super) fn restore<U: ServerUpdate>(
    store: &mut KeyStore,
    params: &ServerParams<U>,
    dir: &std::path::Path,
) -> Result<(), String> {
    let manifest = read_manifest(dir)?;
    if manifest.workers != params.workers
        || manifest.width != params.width
        || manifest.clock != params.first_clock
    {
        return Err(format!(
            "the checkpoint in {} has {} workers, width {} at clock {}; this job has {} workers, width {} from clock {}",
            dir.display(),
            manifest.workers,
            manifest.width,
            manifest.clock,
            params.workers,
            params.width,
            params.first_clock
        ));
    }
    let files: Vec<usize> = if manifest.files.is_empty() {
        (0..manifest.servers).collect()
    } else {
        manifest.files.clone()
    };
    for server in files {
        let file: ServerFile = read_server_file(dir, server, store.state_len())?;
        if file.applied != manifest.clock || file.width != params.width {
            return Err(format!(
                "server file {server} in {} is at clock {} (width {}), the manifest at {}",
                dir.display(),
                file.applied,
                file.width,
                manifest.clock
            ));
        }
        for (key, values, state) in file.entries() {
            if params.ring.chain(key, params.replicas).contains(&params.index) {
                store.assign(key, values, Some(state), &params.update);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::update::{ServerUpdate, Sgd};

    #[test]
    fn a_server_file_round_trips_and_damage_is_refused() {
        let rule = Sgd { lr: 0.1 };
        let mut store = KeyStore::new(2, rule.state_len(2));
        store.assign(5, &[1.0, 2.0], None, &rule);
        store.assign(3, &[3.0, 4.0], None, &rule);
        let dir = tempfile::tempdir().unwrap();
        write_server_file(dir.path(), 1, 7, &store).unwrap();
        let file = read_server_file(dir.path(), 1, 0).unwrap();
        assert_eq!((file.index, file.width, file.applied), (1, 2, 7));
        let entries: Vec<_> = file.entries().map(|(k, v, _)| (k, v.to_vec())).collect();
        assert_eq!(entries, vec![(3, vec![3.0, 4.0]), (5, vec![1.0, 2.0])]);

        let bytes = std::fs::read(server_path(dir.path(), 1)).unwrap();
        let mut flipped = bytes.clone();
        flipped[HEADER + 9] ^= 1;
        assert!(parse_server_file(&flipped, 0).unwrap_err().contains("checksum"));
        // A huge key count with a matching checksum is refused before any allocation.
        let mut huge = bytes[..bytes.len() - 4].to_vec();
        huge[40..48].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        let crc = crc32c::crc32c(&huge);
        huge.extend_from_slice(&crc.to_le_bytes());
        assert!(
            parse_server_file(&huge, 0)
                .unwrap_err()
                .contains("keys announced")
        );
        assert!(parse_server_file(&bytes, 5).unwrap_err().contains("state floats"));
        assert!(parse_server_file(b"short", 0).is_err());
        assert!(read_manifest(dir.path()).unwrap_err().contains("not a complete"));
    }
}
