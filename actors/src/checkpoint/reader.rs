//! Reading a verified checkpoint, whatever layout wrote it: by parameter name (any range of a
//! parameter's flat elements, gathered from whichever pieces — flat ranges or slices along one
//! dimension — cover it) or, for callers that think in blocks, by block and flat block range.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{Manifest, PieceIndex, numel, verify};

/// Which optimizer state tensors a read asks for.
#[derive(Clone, Copy)]
enum Wanted<'a> {
    /// As many as the pieces hold, which must be this many (the block-wise readers).
    Count(usize),
    /// These, by name.
    Names(&'a [&'a str]),
}

/// A parameter a checkpoint holds (some pieces of it, or all).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredParam {
    /// The block holding it.
    pub block: usize,
    /// Where it starts in the block's flat vector.
    pub block_offset: usize,
    /// Its whole shape.
    pub shape: Vec<usize>,
    /// The names of the optimizer state stored with it.
    pub state: Vec<String>,
}

/// Reads parameters and optimizer state from a verified checkpoint.
pub struct CheckpointReader {
    dir: PathBuf,
    manifest: Manifest,
    files: Mutex<HashMap<String, File>>,
}

impl CheckpointReader {
    /// Opens the checkpoint in `dir` (verifying its files and every piece its manifest lists).
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

    /// The learning-rate schedule's position when it was written.
    pub fn schedule_step(&self) -> u64 {
        self.manifest.files.first().map_or(0, |f| f.header.schedule_step)
    }

    /// f16's loss scale when it was written (`None`: the job did not scale); an error when
    /// two shards disagree (every actor keeps the same scale).
    pub fn loss_scale(&self) -> Result<Option<crate::precision::LossScaler>, String> {
        let mut scales = self.manifest.files.iter().map(|f| (&f.file, f.header.loss_scale));
        let Some((_, first)) = scales.next() else {
            return Ok(None);
        };
        match scales.find(|(_, s)| *s != first) {
            Some((file, other)) => Err(format!(
                "the checkpoint's shards disagree on the loss scale: {first:?}, and {other:?} in {file}"
            )),
            None => Ok(first),
        }
    }

    /// Every parameter it holds, by name.
    pub fn params(&self) -> BTreeMap<String, StoredParam> {
        let mut out = BTreeMap::new();
        for p in self.manifest.files.iter().flat_map(|f| &f.header.pieces) {
            out.entry(p.param.clone()).or_insert_with(|| StoredParam {
                block: p.block,
                block_offset: p.block_offset,
                shape: p.shape.clone(),
                state: p.state.clone(),
            });
        }
        out
    }

    /// Flat elements `range` of parameter `param` (whose shape must be `shape`) and, in the
    /// order asked, its optimizer state tensors `state` of the same elements.
    pub fn read_param(
        &self,
        param: &str,
        shape: &[usize],
        range: Range<usize>,
        state: &[&str],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), String> {
        let n = numel(shape)?;
        if range.start > range.end || range.end > n {
            return Err(format!("elements {range:?} of `{param}` are outside its {n}"));
        }
        for p in self.manifest.files.iter().flat_map(|f| &f.header.pieces) {
            if p.param == param && p.shape != shape {
                return Err(format!(
                    "checkpoint {} holds `{param}` with shape {:?}, this model's is {shape:?}: resume \
                     the model that wrote it",
                    self.dir.display(),
                    p.shape
                ));
            }
        }
        let mut parts = self.gather(
            &format!("`{param}`"),
            &|p| (p.param == param).then_some(0),
            range,
            Wanted::Names(state),
        )?;
        let values = parts.remove(0);
        Ok((values, parts))
    }

    /// Parameters (and, with `state`, the two state tensors of Adam, AdamW or LAMB) of elements
    /// `range` of `block`'s flat parameters.
    pub fn read(&self, block: usize, range: Range<usize>, state: bool) -> Result<[Vec<f32>; 3], String> {
        self.read_values(block, range, if state { 2 } else { 0 })
    }

    /// Parameters of elements `range` of `block`'s flat parameters and the first `values`
    /// optimizer state tensors of each (0: none; 1: SGD's `momentum_buffer`; 2: `exp_avg` and
    /// `exp_avg_sq`); the ones not asked for are empty. A checkpoint whose pieces hold another
    /// number of state tensors (written by another kind of optimizer) is refused.
    pub fn read_values(
        &self,
        block: usize,
        range: Range<usize>,
        values: usize,
    ) -> Result<[Vec<f32>; 3], String> {
        let mut parts = self
            .gather(
                &format!("block {block}"),
                &|p| (p.block == block).then_some(p.block_offset),
                range,
                Wanted::Count(values.min(2)),
            )?
            .into_iter();
        let mut next = || parts.next().unwrap_or_default();
        Ok([next(), next(), next()])
    }

    /// Gathers elements `range` (in the coordinates `select` gives each piece's element 0, or
    /// `None` for pieces of other parameters) from every piece: the values, then the state asked.
    fn gather(
        &self,
        what: &str,
        select: &dyn Fn(&PieceIndex) -> Option<usize>,
        range: Range<usize>,
        wanted: Wanted,
    ) -> Result<Vec<Vec<f32>>, String> {
        let tensors = 1 + match wanted {
            Wanted::Count(n) => n,
            Wanted::Names(names) => names.len(),
        };
        let mut out = vec![vec![0.0f32; range.len()]; tensors];
        let mut covered = 0;
        for f in &self.manifest.files {
            for p in &f.header.pieces {
                let Some(base) = select(p) else { continue };
                let runs = p.slice.runs(&p.shape);
                // A block offset is input: sums saturate rather than wrap.
                let span = |at: usize, len: usize| {
                    let start = base.saturating_add(at);
                    (start, start.saturating_add(len))
                };
                let touches = runs.iter().any(|&(at, len)| {
                    let (start, end) = span(at, len);
                    start < range.end && range.start < end
                });
                if !touches {
                    continue;
                }
                let state_at = self.state_positions(what, p, wanted)?;
                let piece_len: usize = runs.iter().map(|r| r.1).sum();
                let mut in_piece = 0;
                for (at, len) in runs {
                    let (start, end) = span(at, len);
                    let (from, to) = (start.max(range.start), end.min(range.end));
                    if from < to {
                        let element = in_piece + from - start;
                        for (k, tensor) in std::iter::once(0)
                            .chain(state_at.iter().map(|s| 1 + s))
                            .enumerate()
                        {
                            let offset = f.data_offset + p.offset + 4 * (tensor * piece_len + element) as u64;
                            let into = &mut out[k][from - range.start..to - range.start];
                            self.read_at(&f.file, offset, bytemuck::cast_slice_mut(into))?;
                        }
                        covered += to - from;
                    }
                    in_piece += len;
                }
            }
        }
        // Pieces of one checkpoint never overlap (each element has one owner).
        if covered != range.len() {
            return Err(format!(
                "checkpoint {} covers {covered} of the {} elements {range:?} of {what}",
                self.dir.display(),
                range.len()
            ));
        }
        Ok(out)
    }

    /// Where the state tensors asked for lie among piece `p`'s.
    fn state_positions(&self, what: &str, p: &PieceIndex, wanted: Wanted) -> Result<Vec<usize>, String> {
        let refuse = |keeps: String| {
            format!(
                "checkpoint {} holds optimizer state {:?} for `{}` of {what}, this optimizer keeps {keeps} \
                 (Adam, AdamW and LAMB keep exp_avg and exp_avg_sq, SGD with momentum its momentum_buffer, \
                 plain SGD none): resume with an optimizer of the kind that wrote it",
                self.dir.display(),
                p.state,
                p.param
            )
        };
        let asks_state = !matches!(wanted, Wanted::Count(0) | Wanted::Names(&[]));
        if asks_state && p.state.is_empty() && self.some_piece_has_state() {
            return Err(format!(
                "checkpoint {} holds `{}` of {what} without optimizer state: it was frozen in the run \
                 that wrote it; freeze it here too, or start from the checkpoint's weights (`--init` \
                 with the file `archipelago export` writes) to train it",
                self.dir.display(),
                p.param
            ));
        }
        match wanted {
            Wanted::Count(0) => Ok(Vec::new()),
            Wanted::Count(n) if p.state.len() == n => Ok((0..n).collect()),
            Wanted::Count(n) => Err(refuse(format!("{n} state tensors"))),
            Wanted::Names(names) => names
                .iter()
                .map(|name| {
                    p.state
                        .iter()
                        .position(|s| s == name)
                        .ok_or_else(|| refuse(format!("{names:?}")))
                })
                .collect(),
        }
    }

    /// Whether any piece holds optimizer state: then a piece without any was frozen (a run
    /// whose optimizer keeps no state, plain SGD, writes none for any piece).
    fn some_piece_has_state(&self) -> bool {
        let mut pieces = self.manifest.files.iter().flat_map(|f| &f.header.pieces);
        pieces.any(|p| !p.state.is_empty())
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
