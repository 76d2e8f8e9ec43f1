//! Sharded checkpoints that any later layout can load (resharding on load, like DeepSpeed's
//! universal checkpoints and torch.distributed.checkpoint).
//!
//! A checkpoint is a directory `step-NNNNNNNN/` holding one shard file per actor that owns state
//! and, written last by the controller, `manifest.json`. A shard file holds *pieces*: a range of
//! one block's flat parameters with the optimizer state of the same range (Adam, AdamW and LAMB:
//! `m`, `v`; SGD with momentum: its buffer in `m`; plain SGD: none), so the
//! layout of the writer (dp, pp, ZeRO shards) does not matter to the reader: an actor of any new
//! layout reads the ranges it needs from whichever pieces cover them. Every file is written to a
//! temporary name, fsynced and renamed; the manifest carries each file's size and CRC-32C, and a
//! checkpoint whose manifest is missing or whose files do not match it is skipped for the
//! previous complete one.
//!
//! File layout: `ARCHCKPT`, a little-endian u64 header length, the header (JSON of
//! [`ShardHeader`]), then each piece's parameters, `m` and `v` (those it has) as little-endian f32.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use archipelago_dataflow::ActorId;

const MAGIC: &[u8; 8] = b"ARCHCKPT";
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// A range of one block's parameters with its optimizer state.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The block.
    pub block: usize,
    /// Elements of the block's flat parameters.
    pub range: Range<usize>,
    /// The parameters of the range.
    pub params: Vec<f32>,
    /// The first moments of the range (Adam, AdamW, LAMB), or SGD's momentum buffer; empty for
    /// plain SGD.
    pub m: Vec<f32>,
    /// The second moments of the range (Adam, AdamW, LAMB); empty for SGD.
    pub v: Vec<f32>,
}

/// What one actor saves: its pieces and the optimizer's step counter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardState {
    /// Optimizer steps taken.
    pub steps: i32,
    /// The pieces.
    pub pieces: Vec<Piece>,
}

/// Where a piece lies in its file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceIndex {
    /// The block.
    pub block: usize,
    /// First element of the block's parameters.
    pub start: usize,
    /// One past the last.
    pub end: usize,
    /// Byte offset of its parameters after the header.
    pub offset: u64,
    /// Whether optimizer state follows the parameters.
    pub has_state: bool,
    /// How many state values per parameter follow (`m`, then `v`); absent in files written
    /// before SGD's momentum, where `has_state` meant `m` and `v`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_values: Option<u8>,
}

impl PieceIndex {
    /// State values per parameter that follow the parameters.
    pub fn state_values(&self) -> usize {
        self.state_values
            .map_or(if self.has_state { 2 } else { 0 }, usize::from)
    }
}

/// The header of a shard file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardHeader {
    /// The actor that wrote it.
    pub actor: ActorId,
    /// Optimizer steps taken.
    pub steps: i32,
    /// Its pieces.
    pub pieces: Vec<PieceIndex>,
}

/// A written shard file, as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardFile {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32C of the whole file.
    pub crc32c: u32,
    /// Where the pieces' data begins (after the magic and the header).
    pub data_offset: u64,
    /// The header written into it.
    pub header: ShardHeader,
}

/// The manifest of a complete checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The job that wrote it.
    pub job: String,
    /// The last step whose update it contains.
    pub step: u64,
    /// The data position: the step to run next (its samples are the next ones of the stream).
    pub next_step: u64,
    /// Model spec, for refusing a checkpoint of another model.
    pub model: String,
    /// Initialisation/data seed of the job.
    pub seed: u64,
    /// The layout that wrote it (JSON of the parallel plan), for the record.
    pub layout: serde_json::Value,
    /// The shard files.
    pub files: Vec<ShardFile>,
}

/// Directory of the checkpoint after `step` under `root`.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// Writes `bytes` to `path` through a temporary file: write, fsync, rename, fsync the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let temp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let mut file = File::create(&temp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&temp, path)?;
    File::open(dir)?.sync_all()
}

/// Writes actor `actor`'s `state` into checkpoint directory `dir`.
pub fn write_shard(dir: &Path, actor: ActorId, state: &ShardState) -> Result<ShardFile, String> {
    let mut pieces = Vec::with_capacity(state.pieces.len());
    let data_bytes: usize = state
        .pieces
        .iter()
        .map(|p| 4 * (p.params.len() + p.m.len() + p.v.len()))
        .sum();
    let mut data = Vec::with_capacity(data_bytes);
    for p in &state.pieces {
        let values = usize::from(!p.m.is_empty()) + usize::from(!p.v.is_empty());
        let fits = |s: &[f32]| s.is_empty() || s.len() == p.range.len();
        if p.params.len() != p.range.len()
            || !fits(&p.m)
            || !fits(&p.v)
            || (p.m.is_empty() && !p.v.is_empty())
        {
            return Err(format!(
                "piece of block {} ({:?}) has {} parameters and {}/{} state values",
                p.block,
                p.range,
                p.params.len(),
                p.m.len(),
                p.v.len()
            ));
        }
        pieces.push(PieceIndex {
            block: p.block,
            start: p.range.start,
            end: p.range.end,
            offset: data.len() as u64,
            has_state: values > 0,
            state_values: Some(values as u8),
        });
        for values in [&p.params, &p.m, &p.v] {
            data.extend_from_slice(bytemuck::cast_slice(values));
        }
    }
    let header = ShardHeader {
        actor,
        steps: state.steps,
        pieces,
    };
    let json = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
    let data_offset = (MAGIC.len() + 8 + json.len()) as u64;
    let mut bytes = Vec::with_capacity(data_offset as usize + data.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    bytes.extend_from_slice(&data);
    let file = format!("actor-{actor:05}.shard");
    let path = dir.join(&file);
    write_atomically(&path, &bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(ShardFile {
        file,
        bytes: bytes.len() as u64,
        crc32c: crc32c::crc32c(&bytes),
        data_offset,
        header,
    })
}

/// Writes the manifest last: the checkpoint is complete from this moment.
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), String> {
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| e.to_string())?;
    let path = dir.join(MANIFEST);
    write_atomically(&path, &json).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Reads the manifest of `dir` and checks every file it lists (size and CRC-32C).
pub fn verify(dir: &Path) -> Result<Manifest, String> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).map_err(|e| format!("no manifest ({}: {e})", path.display()))?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| format!("unreadable manifest {}: {e}", path.display()))?;
    for f in &manifest.files {
        let path = dir.join(&f.file);
        // The manifest is input: its sizes are checked against the file before anything is read.
        let on_disk = std::fs::metadata(&path)
            .map_err(|e| format!("shard {} unreadable: {e}", path.display()))?
            .len();
        if on_disk != f.bytes {
            return Err(format!(
                "shard {} has {on_disk} bytes, the manifest says {}",
                path.display(),
                f.bytes
            ));
        }
        let mut bytes = Vec::new();
        File::open(&path)
            .and_then(|mut file| file.read_to_end(&mut bytes))
            .map_err(|e| format!("shard {} unreadable: {e}", path.display()))?;
        if bytes.len() as u64 != f.bytes {
            return Err(format!(
                "shard {} has {} bytes, the manifest says {}",
                path.display(),
                bytes.len(),
                f.bytes
            ));
        }
        let crc = crc32c::crc32c(&bytes);
        if crc != f.crc32c {
            return Err(format!(
                "shard {} has CRC-32C {crc:08x}, the manifest says {:08x}",
                path.display(),
                f.crc32c
            ));
        }
    }
    Ok(manifest)
}

/// The newest complete checkpoint under `root` (by step), with the reasons older or broken ones
/// were passed over; `None` when there is none.
pub fn latest_complete(root: &Path) -> (Option<(PathBuf, Manifest)>, Vec<String>) {
    let mut dirs: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    dirs.sort();
    let mut skipped = Vec::new();
    for (_, dir) in dirs.into_iter().rev() {
        match verify(&dir) {
            Ok(manifest) => return (Some((dir, manifest)), skipped),
            Err(why) => skipped.push(format!("{} skipped: {why}", dir.display())),
        }
    }
    (None, skipped)
}

/// Reads ranges of blocks from a verified checkpoint, whatever layout wrote it.
pub struct CheckpointReader {
    dir: PathBuf,
    manifest: Manifest,
    files: Mutex<HashMap<String, File>>,
}

impl CheckpointReader {
    /// Opens the checkpoint in `dir` (verifying it).
    pub fn open(dir: &Path) -> Result<CheckpointReader, String> {
        let manifest = verify(dir)?;
        Ok(CheckpointReader {
            dir: dir.to_path_buf(),
            manifest,
            files: Mutex::default(),
        })
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Optimizer steps taken when it was written.
    pub fn steps(&self) -> i32 {
        self.manifest.files.first().map_or(0, |f| f.header.steps)
    }

    /// Parameters (and, with `state`, Adam's `m` and `v`) of elements `range` of `block`.
    pub fn read(&self, block: usize, range: Range<usize>, state: bool) -> Result<[Vec<f32>; 3], String> {
        self.read_values(block, range, if state { 2 } else { 0 })
    }

    /// Parameters of elements `range` of `block` and the first `values` state values of each
    /// (0: none; 1: `m`, SGD's momentum buffer; 2: `m` and `v`); the ones not asked for are empty.
    /// A checkpoint whose state has another number of values per parameter (written by another
    /// kind of optimizer) is refused.
    pub fn read_values(
        &self,
        block: usize,
        range: Range<usize>,
        values: usize,
    ) -> Result<[Vec<f32>; 3], String> {
        let len = range.len();
        let state = values > 0;
        let mut out = [vec![0.0f32; len], Vec::new(), Vec::new()];
        for v in out.iter_mut().skip(1).take(values) {
            *v = vec![0.0; len];
        }
        let mut covered = 0;
        for f in &self.manifest.files {
            for p in f.header.pieces.iter().filter(|p| p.block == block) {
                let (from, to) = (p.start.max(range.start), p.end.min(range.end));
                if from >= to {
                    continue;
                }
                if state && !p.has_state {
                    return Err(format!(
                        "checkpoint {} holds no optimizer state for block {block}",
                        self.dir.display()
                    ));
                }
                if state && p.state_values() != values {
                    return Err(format!(
                        "checkpoint {} holds {} optimizer state values per parameter for block {block}, this \
                         optimizer keeps {values} (Adam, AdamW and LAMB keep 2, SGD with momentum 1): resume \
                         with an optimizer of the kind that wrote it",
                        self.dir.display(),
                        p.state_values()
                    ));
                }
                let piece_len = (p.end - p.start) as u64;
                let parts = 1 + values;
                for (k, values) in out.iter_mut().take(parts).enumerate() {
                    let at = f.data_offset + p.offset + 4 * (k as u64 * piece_len + (from - p.start) as u64);
                    let into = &mut values[from - range.start..to - range.start];
                    self.read_at(&f.file, at, bytemuck::cast_slice_mut(into))?;
                }
                covered += to - from;
            }
        }
        // Pieces of one checkpoint never overlap (each element has one owner).
        if covered != len {
            return Err(format!(
                "checkpoint {} covers {covered} of the {len} elements {range:?} of block {block}",
                self.dir.display()
            ));
        }
        Ok(out)
    }

    fn read_at(&self, file: &str, at: u64, into: &mut [u8]) -> Result<(), String> {
        use std::os::unix::fs::FileExt;
        let mut files = self.files.lock().map_err(|_| "checkpoint reader poisoned")?;
        if !files.contains_key(file) {
            let path = self.dir.join(file);
            let opened = File::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            files.insert(file.to_string(), opened);
        }
        files[file]
            .read_exact_at(into, at)
            .map_err(|e| format!("cannot read {}/{file} at {at}: {e}", self.dir.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(block: usize, range: Range<usize>, scale: f32) -> Piece {
        let values = |k: f32| range.clone().map(|i| scale * i as f32 + k).collect::<Vec<_>>();
        Piece {
            block,
            range: range.clone(),
            params: values(0.0),
            m: values(0.25),
            v: values(0.5),
        }
    }

    fn manifest(files: Vec<ShardFile>, step: u64) -> Manifest {
        Manifest {
            job: "t".into(),
            step,
            next_step: step + 1,
            model: "m".into(),
            seed: 0,
            layout: serde_json::Value::Null,
            files,
        }
    }

    /// A manifest is input: a file size it claims (1 PiB here) is checked against the file
    /// before anything is allocated or read.
    #[test]
    fn an_absurd_manifest_size_is_refused_before_reading() {
        let root = tempfile::tempdir().unwrap();
        let dir = step_dir(root.path(), 1);
        let state = ShardState {
            steps: 1,
            pieces: vec![piece(0, 0..4, 1.0)],
        };
        let mut file = write_shard(&dir, 0, &state).unwrap();
        let real = file.bytes;
        file.bytes = 1 << 50;
        write_manifest(&dir, &manifest(vec![file], 1)).unwrap();
        let error = verify(&dir).unwrap_err();
        assert!(
            error.contains(&format!("has {real} bytes, the manifest says {}", 1u64 << 50)),
            "{error}"
        );
    }

    /// SGD's momentum is one state value per parameter: written as `m` alone, read back, and
    /// refused by a reader that keeps two (Adam) — a piece without `v` is not Adam's state.
    #[test]
    fn a_momentum_buffer_is_one_state_value() {
        let root = tempfile::tempdir().unwrap();
        let dir = step_dir(root.path(), 1);
        let mut p = piece(0, 0..4, 1.0);
        p.v.clear();
        let state = ShardState {
            steps: 1,
            pieces: vec![p],
        };
        let files = vec![write_shard(&dir, 0, &state).unwrap()];
        write_manifest(&dir, &manifest(files, 1)).unwrap();
        let reader = CheckpointReader::open(&dir).unwrap();
        let [params, m, v] = reader.read_values(0, 1..3, 1).unwrap();
        assert_eq!((params, m, v), (vec![1.0, 2.0], vec![1.25, 2.25], vec![]));
        let wrong = reader.read_values(0, 0..4, 2).unwrap_err();
        assert!(wrong.contains("holds 1 optimizer state values"), "{wrong}");
        assert_eq!(reader.read(0, 0..4, false).unwrap()[0], vec![0.0, 1.0, 2.0, 3.0]);
    }

    /// Two writers split block 0 at 7; a reader asks for a range across the split and gets the
    /// values back; a corrupted shard makes the checkpoint skipped for the previous one.
    #[test]
    fn reads_across_shards_and_skips_a_corrupt_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        for step in [2, 4] {
            let dir = step_dir(root.path(), step);
            let a = ShardState {
                steps: step as i32,
                pieces: vec![piece(0, 0..7, 1.0), piece(1, 0..3, 2.0)],
            };
            let b = ShardState {
                steps: step as i32,
                pieces: vec![piece(0, 7..12, 1.0)],
            };
            let files = vec![
                write_shard(&dir, 0, &a).unwrap(),
                write_shard(&dir, 1, &b).unwrap(),
            ];
            write_manifest(&dir, &manifest(files, step)).unwrap();
        }
        let reader = CheckpointReader::open(&step_dir(root.path(), 4)).unwrap();
        let [p, m, v] = reader.read(0, 5..10, true).unwrap();
        assert_eq!(p, vec![5.0, 6.0, 7.0, 8.0, 9.0]);
        assert_eq!(m[0], 5.25);
        assert_eq!(v[4], 9.5);
        assert_eq!(reader.read(1, 0..3, false).unwrap()[0], vec![0.0, 2.0, 4.0]);
        assert!(reader.read(0, 10..13, false).is_err(), "beyond the block");
        assert_eq!(reader.steps(), 4);

        let (latest, skipped) = latest_complete(root.path());
        assert_eq!(latest.unwrap().1.step, 4);
        assert!(skipped.is_empty());
        // Flip one byte of a shard of step 4: its checksum no longer matches.
        let shard = step_dir(root.path(), 4).join("actor-00001.shard");
        let mut bytes = std::fs::read(&shard).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&shard, bytes).unwrap();
        let (latest, skipped) = latest_complete(root.path());
        assert_eq!(latest.unwrap().1.step, 2);
        assert!(skipped[0].contains("CRC-32C"), "{skipped:?}");
        // A checkpoint without its manifest (the writer died before it) is not complete.
        std::fs::create_dir_all(step_dir(root.path(), 6)).unwrap();
        let (latest, skipped) = latest_complete(root.path());
        assert_eq!(latest.unwrap().1.step, 2);
        assert!(skipped[0].contains("no manifest"), "{skipped:?}");
    }
}
