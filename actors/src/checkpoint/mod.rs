//! Sharded checkpoints that any later layout can load (resharding on load, like DeepSpeed's
//! universal checkpoints and torch.distributed.checkpoint).
//!
//! A checkpoint is a directory `step-NNNNNNNN/` holding one shard file per actor that owns state
//! and, written last by the controller, `manifest.json`. A shard file holds *pieces*: one named
//! parameter ([`archipelago_dataflow::ParamDesc`]'s name, e.g. `layers.0.qkv.weight`), or a slice
//! of one — a flat range of its row-major elements (what a ZeRO shard holds of it) or a range of
//! indices along one dimension (what a tensor-parallel rank holds) — with the optimizer state of
//! the same elements, each state tensor named as PyTorch names it (`exp_avg` and `exp_avg_sq` for
//! Adam, AdamW and LAMB; `momentum_buffer` for SGD with momentum; none for plain SGD). Each
//! shard also records the optimizer's step count and the learning-rate schedule's position. So
//! the layout of the writer (dp, pp, ZeRO shards) does not matter to the reader: an actor of any
//! new layout reads the elements it needs from whichever pieces cover them.
//!
//! Every file is written to a temporary name, fsynced and renamed; the manifest carries each
//! file's size and CRC-32C, and a checkpoint whose manifest is missing or whose files do not
//! match it is skipped for the previous complete one. Opening a checkpoint checks every piece the
//! manifest lists against its file's size before anything is allocated or read (a manifest is
//! input: a piece reaching past its file, an impossible slice or an overflowing shape is refused).
//!
//! File layout: `ARCHCKPT`, a little-endian u64 header length, the header (JSON of
//! [`ShardHeader`], format [`FORMAT`]), then each piece's values and its state tensors, in the
//! order its index names them, as little-endian f32.

use std::fs::File;
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use archipelago_dataflow::ActorId;

mod reader;
#[cfg(test)]
mod tests;

pub use reader::{CheckpointReader, StoredParam};

const MAGIC: &[u8; 8] = b"ARCHCKPT";
/// The shard format this build writes and reads: named parameter pieces with named state.
pub const FORMAT: u32 = 2;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// Which elements of a parameter a piece holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Slice {
    /// Row-major elements `start..end` of the flattened parameter (all of it, or the part of it
    /// a ZeRO shard holds).
    Flat {
        /// First element.
        start: usize,
        /// One past the last.
        end: usize,
    },
    /// Indices `start..end` along dimension `dim`, with every index of the other dimensions
    /// (a tensor-parallel rank's part of a split parameter); values row-major over the slice.
    Dim {
        /// The dimension cut.
        dim: usize,
        /// First index along it.
        start: usize,
        /// One past the last.
        end: usize,
    },
    /// Row-major elements `start..end` of tensor-parallel rank `rank`'s local slice (of `size`
    /// ranks) of a parameter split as `split` (Megatron's per-head qkv split included): the
    /// rank's part, or the ZeRO shard of it a replica holds. Local positions that pad a split
    /// extent `size` does not divide have no element of the parameter and are not stored.
    Tp {
        /// How the parameter is split.
        split: archipelago_dataflow::Split,
        /// The rank.
        rank: usize,
        /// The ranks of the group.
        size: usize,
        /// First element of the local slice.
        start: usize,
        /// One past the last.
        end: usize,
    },
}

impl Slice {
    /// The flat row-major elements `range` of a parameter.
    pub fn flat(range: Range<usize>) -> Slice {
        Slice::Flat {
            start: range.start,
            end: range.end,
        }
    }

    /// Elements of a parameter of `shape` this slice holds, or why it cannot be a slice of it.
    pub fn len_in(&self, shape: &[usize]) -> Result<usize, String> {
        let numel = numel(shape)?;
        match *self {
            Slice::Flat { start, end } if start <= end && end <= numel => Ok(end - start),
            Slice::Dim { dim, start, end } if dim < shape.len() && start <= end && end <= shape[dim] => {
                Ok(numel / shape[dim].max(1) * (end - start))
            }
            Slice::Tp { .. } => self.tp_len(shape),
            _ => Err(format!("{self:?} is not a slice of shape {shape:?}")),
        }
    }

    /// The elements a `Tp` slice stores (its local range less padding), counted without walking
    /// its runs; refuses one that is not a slice of a parameter of `shape` (a manifest is
    /// input): a rank outside its group, a split dimension the shape lacks, a per-head split
    /// whose groups the ranks do not divide, a range past the local slice.
    fn tp_len(&self, shape: &[usize]) -> Result<usize, String> {
        let Slice::Tp {
            split,
            rank,
            size,
            start,
            end,
        } = *self
        else {
            return self.len_in(shape);
        };
        let refuse = |why: &str| Err(format!("{self:?} is not a slice of shape {shape:?}: {why}"));
        if size == 0 || rank >= size {
            return refuse("its rank is outside its group");
        }
        let Some(dim) = split.dim(shape.len()) else {
            // Replicated: every rank holds the whole parameter.
            return match start <= end && end <= numel(shape)? {
                true => Ok(end - start),
                false => refuse("its range is past the parameter"),
            };
        };
        if shape.is_empty() {
            return refuse("a split parameter has a dimension");
        }
        let n = shape[dim];
        // The rank's steps along the split dimension: per head group, or a padded share.
        let width = match split {
            archipelago_dataflow::Split::HeadColumns { parts } => match parts.checked_mul(size) {
                Some(cut) if parts > 0 && n > 0 && n.is_multiple_of(cut) => n / cut,
                _ => return refuse("its per-head groups do not divide by the ranks"),
            },
            _ => n.div_ceil(size),
        };
        if rank.checked_add(1).and_then(|r| r.checked_mul(width)).is_none() {
            return refuse("its rank's place overflows");
        }
        let local_shape = archipelago_dataflow::tensor_parallel::local_shape(split, shape, size);
        let local = numel(&local_shape)?;
        if start > end || end > local {
            return refuse("its range is past the rank's slice");
        }
        if size == 1 {
            return Ok(end - start);
        }
        // Each step along the split dimension spans `inner` elements; of the rank's local steps
        // in a row, the first `valid` are the parameter's, the rest padding.
        let inner: usize = shape[dim + 1..].iter().product();
        let valid = match split {
            archipelago_dataflow::Split::HeadColumns { .. } => local_shape[dim],
            _ => n.saturating_sub(rank * width).min(width),
        };
        let row = local_shape[dim] * inner;
        let before = |x: usize| match row {
            0 => 0,
            _ => x / row * valid * inner + (x % row).min(valid * inner),
        };
        Ok(before(end) - before(start))
    }

    /// The slice as contiguous runs of the flattened parameter of `shape`, in the order its
    /// values are stored: `(first element, length)`. The shape must have been checked with
    /// [`Slice::len_in`].
    pub fn runs(&self, shape: &[usize]) -> Vec<(usize, usize)> {
        match *self {
            Slice::Flat { start, end } => vec![(start, end - start)],
            Slice::Dim { dim, start, end } => {
                let inner: usize = shape[dim + 1..].iter().product();
                if inner * (end - start) == 0 {
                    // Nothing to read (and a huge outer count of empty runs is not walked).
                    return Vec::new();
                }
                let outer: usize = shape[..dim].iter().product();
                (0..outer)
                    .map(|o| ((o * shape[dim] + start) * inner, (end - start) * inner))
                    .filter(|&(_, len)| len > 0)
                    .collect()
            }
            Slice::Tp {
                split,
                rank,
                size,
                start,
                end,
            } => {
                let runs = archipelago_dataflow::tensor_parallel::global_runs_within(
                    split,
                    shape,
                    rank,
                    size,
                    start..end,
                );
                runs.iter().map(|r| (r.global, r.len)).collect()
            }
        }
    }
}

/// Elements of a tensor of `shape`, refusing an overflow.
pub(crate) fn numel(shape: &[usize]) -> Result<usize, String> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} overflows"))
}

/// One parameter, or a slice of one, with the optimizer state of the same elements.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The block holding the parameter.
    pub block: usize,
    /// Where the parameter starts in its block's flat vector (the block-wise readers use it).
    pub block_offset: usize,
    /// The parameter's name (unique in the model).
    pub param: String,
    /// The whole parameter's shape.
    pub shape: Vec<usize>,
    /// Which of its elements this piece holds.
    pub slice: Slice,
    /// Their values.
    pub values: Vec<f32>,
    /// Named optimizer state of the same elements (`exp_avg`, `exp_avg_sq`; `momentum_buffer`;
    /// none for plain SGD), each as long as `values`.
    pub state: Vec<(String, Vec<f32>)>,
}

/// What one actor saves: its pieces, the optimizer's step count and the schedule's position.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardState {
    /// Optimizer steps taken (bias correction, SGD's first momentum step).
    pub steps: i32,
    /// Steps the learning-rate schedule has advanced (the rate of the next step is the
    /// schedule's at this + 1).
    pub schedule_step: u64,
    /// f16's loss scale and its clean-step count (`None` when the job does not scale).
    pub loss_scale: Option<crate::precision::LossScaler>,
    /// The pieces.
    pub pieces: Vec<Piece>,
}

/// Where a piece lies in its file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceIndex {
    /// The block holding the parameter.
    pub block: usize,
    /// Where the parameter starts in its block's flat vector.
    pub block_offset: usize,
    /// The parameter's name.
    pub param: String,
    /// The whole parameter's shape.
    pub shape: Vec<usize>,
    /// Which of its elements the piece holds.
    pub slice: Slice,
    /// Byte offset of its values after the header.
    pub offset: u64,
    /// The names of the state tensors that follow the values, in order.
    pub state: Vec<String>,
}

/// The header of a shard file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardHeader {
    /// The shard format ([`FORMAT`]; absent, and refused, in files of the block-piece format).
    #[serde(default)]
    pub format: u32,
    /// The actor that wrote it.
    pub actor: ActorId,
    /// Optimizer steps taken.
    pub steps: i32,
    /// The learning-rate schedule's position.
    #[serde(default)]
    pub schedule_step: u64,
    /// f16's loss scale and its clean-step count, when the job scales its loss. Always written
    /// (`None` too): the header also crosses processes in a format without field names.
    #[serde(default)]
    pub loss_scale: Option<crate::precision::LossScaler>,
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
    /// What the run was, beside its model and seed: what a resume must not change without
    /// saying so (absent in checkpoints written before it was recorded).
    #[serde(default)]
    pub run: Option<RunRecord>,
    /// The shard files.
    pub files: Vec<ShardFile>,
}

/// The settings of the run that wrote a checkpoint which decide what its next steps compute:
/// a resume with other values would quietly become another run (the controller refuses one
/// unless told which to override).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// The optimizer and its hyper-parameters.
    pub optimizer: archipelago_dataflow::OptimizerSpec,
    /// The learning-rate schedule (its `total_steps` is the job's).
    pub lr_schedule: archipelago_dataflow::LrSchedule,
    /// Gradient clipping's bound.
    pub clip_grad_norm: Option<f32>,
    /// The step the job runs to (`--steps`: the total, not the steps to add).
    pub total_steps: u64,
    /// The data source.
    pub data: archipelago_dataflow::data::DataSpec,
    /// The dtype forward and backward compute in (f32 until mixed precision).
    pub precision: archipelago_dataflow::DType,
    /// The frozen base's weights file and its SHA-256, for a run with frozen parameters from
    /// `--init` (LoRA): a checkpoint holds no frozen values, so a resume must start from the same
    /// file (absent in checkpoints written before it was recorded, and for runs without one).
    #[serde(default)]
    pub base: Option<BaseWeights>,
    /// `--compress`: what crosses the data-parallel all-reduce (and, for top-k, the residuals
    /// each replica keeps); absent, none, in checkpoints written before it was recorded.
    #[serde(default)]
    pub compression: archipelago_dataflow::Compression,
}

/// A weights file a run's frozen parameters come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseWeights {
    /// Its path as the run gave it.
    pub path: String,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
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
        .map(|p| 4 * p.values.len() * (1 + p.state.len()))
        .sum();
    let mut data = Vec::with_capacity(data_bytes);
    for p in &state.pieces {
        let len = p
            .slice
            .len_in(&p.shape)
            .map_err(|e| format!("piece `{}`: {e}", p.param))?;
        if p.values.len() != len || p.state.iter().any(|(_, s)| s.len() != len) {
            return Err(format!(
                "piece `{}` ({:?}) holds {len} elements but has {} values and state {:?}",
                p.param,
                p.slice,
                p.values.len(),
                p.state.iter().map(|(n, s)| (n, s.len())).collect::<Vec<_>>()
            ));
        }
        pieces.push(PieceIndex {
            block: p.block,
            block_offset: p.block_offset,
            param: p.param.clone(),
            shape: p.shape.clone(),
            slice: p.slice.clone(),
            offset: data.len() as u64,
            state: p.state.iter().map(|(n, _)| n.clone()).collect(),
        });
        data.extend_from_slice(bytemuck::cast_slice(&p.values));
        for (_, values) in &p.state {
            data.extend_from_slice(bytemuck::cast_slice(values));
        }
    }
    let header = ShardHeader {
        format: FORMAT,
        actor,
        steps: state.steps,
        schedule_step: state.schedule_step,
        loss_scale: state.loss_scale,
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

/// Reads the manifest of `dir` and checks every file it lists (size and CRC-32C) and every
/// piece it lists (format, slice within the shape, data within the file).
pub fn verify(dir: &Path) -> Result<Manifest, String> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).map_err(|e| format!("no manifest ({}: {e})", path.display()))?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| format!("unreadable manifest {}: {e}", path.display()))?;
    for f in &manifest.files {
        let path = dir.join(&f.file);
        check_pieces(f).map_err(|e| format!("shard {}: {e}", path.display()))?;
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

/// Checks a listed shard's pieces against the file size the manifest gives: the format, each
/// slice within its shape, each piece's data (values and state) inside the file.
fn check_pieces(f: &ShardFile) -> Result<(), String> {
    if f.header.format != FORMAT {
        return Err(format!(
            "format {} (this build reads format {FORMAT}: named parameter pieces with named optimizer \
             state); resume it with the archipelago that wrote it, or start afresh",
            f.header.format
        ));
    }
    for p in &f.header.pieces {
        let len = p
            .slice
            .len_in(&p.shape)
            .map_err(|e| format!("piece `{}`: {e}", p.param))? as u64;
        let tensors = 1 + p.state.len() as u64;
        let end = len
            .checked_mul(4 * tensors)
            .and_then(|bytes| bytes.checked_add(p.offset))
            .and_then(|bytes| bytes.checked_add(f.data_offset));
        if end.is_none_or(|end| end > f.bytes) {
            return Err(format!(
                "piece `{}` ({} elements × {tensors} tensors at offset {}) reaches past the file's {} bytes",
                p.param, len, p.offset, f.bytes
            ));
        }
        let mut names: Vec<&String> = p.state.iter().collect();
        names.sort();
        names.dedup();
        if names.len() != p.state.len() {
            return Err(format!(
                "piece `{}` names a state tensor twice: {:?}",
                p.param, p.state
            ));
        }
    }
    Ok(())
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
