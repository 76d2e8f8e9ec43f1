//! Training batches from a safetensors file (`--data FILE.safetensors`).
//!
//! An mlp's file holds `inputs` `[n, features]` f32 and `targets` `[n]` integer classes; a gpt's
//! holds `tokens` `[n, ctx + 1]` integer ids (a row's first `ctx` tokens are the inputs, its last
//! `ctx` the next-token targets). As for every data source, a batch is a pure function of
//! (step, global batch, rows): step `s` with global batch `b` takes file rows `(s·b + j) mod n`
//! for `j` in `0..b`, and each data-parallel rank its slice of that, so every layout sees the
//! same global batch.

use std::ops::Range;
use std::path::Path;

use safetensors::Dtype;

use archipelago_dataflow::InputKind;
use archipelago_dataflow::data::{DenseBatch, TokenBatch};

use crate::tensor_file::TensorFile;

/// The rows of a checked batch file.
#[derive(Debug, Clone)]
pub enum BatchFile {
    /// Feature rows with class labels.
    Dense {
        /// Features per row.
        features: usize,
        /// Row-major `n × features`.
        inputs: Vec<f32>,
        /// One class per row.
        targets: Vec<u32>,
    },
    /// Token rows of `ctx + 1` ids.
    Tokens {
        /// Context length.
        ctx: usize,
        /// Row-major `n × (ctx + 1)`.
        tokens: Vec<u32>,
    },
}

fn is_int(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::I64 | Dtype::I32 | Dtype::U8)
}

/// Checks the tensor names, dtypes and shapes of a batch file for a model that takes `input`
/// (header only); returns the number of rows.
fn check_header(file: &TensorFile, input: InputKind) -> Result<usize, String> {
    let shown = file.path().display();
    let expected: &[&str] = match input {
        InputKind::Dense { .. } => &["inputs", "targets"],
        InputKind::Tokens { .. } => &["tokens"],
    };
    let extra: Vec<&str> = file
        .names()
        .into_iter()
        .filter(|n| !expected.contains(n))
        .collect();
    if !extra.is_empty() {
        return Err(format!(
            "--data {shown} holds {}, which this model does not read; it reads only {}",
            extra.join(", "),
            expected.join(" and ")
        ));
    }
    let want = |name: &str, what: &str| format!("--data {shown} needs `{name}`: {what}");
    let rows = match input {
        InputKind::Dense { features, .. } => {
            let inputs_want = format!("F32 [n, {features}]");
            let rows = match file.info("inputs") {
                Some((Dtype::F32, &[n, f])) if f == features && n > 0 => n,
                Some((dtype, shape)) => {
                    return Err(want(
                        "inputs",
                        &format!("{inputs_want}, it is {dtype:?} {shape:?}"),
                    ));
                }
                None => return Err(want("inputs", &inputs_want)),
            };
            match file.info("targets") {
                Some((dtype, &[n])) if is_int(dtype) && n == rows => rows,
                Some((dtype, shape)) => {
                    return Err(want(
                        "targets",
                        &format!("I64, I32 or U8 [{rows}], it is {dtype:?} {shape:?}"),
                    ));
                }
                None => return Err(want("targets", &format!("I64, I32 or U8 [{rows}]"))),
            }
        }
        InputKind::Tokens { ctx, .. } => {
            let tokens_want = format!(
                "I64, I32 or U8 [n, {}] (ctx + 1 = {} ids a row)",
                ctx + 1,
                ctx + 1
            );
            match file.info("tokens") {
                Some((dtype, &[n, c])) if is_int(dtype) && c == ctx + 1 && n > 0 => n,
                Some((dtype, shape)) => {
                    return Err(want(
                        "tokens",
                        &format!("{tokens_want}, it is {dtype:?} {shape:?}"),
                    ));
                }
                None => return Err(want("tokens", &tokens_want)),
            }
        }
    };
    Ok(rows)
}

/// The ids of `name` as `u32`, each below `limit` (classes or vocabulary).
fn read_ids(file: &TensorFile, name: &str, limit: usize, what: &str) -> Result<Vec<u32>, String> {
    let ids = file.read_ints(name)?;
    if let Some(bad) = ids.iter().find(|&&t| t < 0 || t as u64 >= limit as u64) {
        return Err(format!(
            "--data {}: `{name}` holds {bad}, outside the model's {limit} {what} (0..{limit})",
            file.path().display()
        ));
    }
    Ok(ids.into_iter().map(|t| t as u32).collect())
}

impl BatchFile {
    /// Reads the batch file at `path` for a model that takes `input`, refusing missing or
    /// misshapen tensors and ids outside the model's classes or vocabulary.
    pub fn open(path: &Path, input: InputKind) -> Result<BatchFile, String> {
        let file = TensorFile::open(path).map_err(|e| format!("--data: {e}"))?;
        check_header(&file, input)?;
        Ok(match input {
            InputKind::Dense { features, classes } => BatchFile::Dense {
                features,
                inputs: file.read_f32("inputs")?,
                targets: read_ids(&file, "targets", classes, "classes")?,
            },
            InputKind::Tokens { vocab, ctx } => BatchFile::Tokens {
                ctx,
                tokens: read_ids(&file, "tokens", vocab, "token ids")?,
            },
        })
    }

    /// Rows in the file.
    pub fn rows(&self) -> usize {
        match self {
            BatchFile::Dense { inputs, features, .. } => inputs.len() / features,
            BatchFile::Tokens { tokens, ctx } => tokens.len() / (ctx + 1),
        }
    }

    fn file_row(&self, step: u64, batch: usize, j: usize) -> usize {
        ((step as usize).wrapping_mul(batch).wrapping_add(j)) % self.rows()
    }

    /// Rows `rows` (indices within the global batch) of step `step` with global batch `batch`,
    /// for an mlp; `None` for a token file.
    pub fn dense(&self, step: u64, batch: usize, rows: Range<usize>) -> Option<DenseBatch> {
        let BatchFile::Dense {
            features,
            inputs,
            targets,
        } = self
        else {
            return None;
        };
        let mut x = Vec::with_capacity(rows.len() * features);
        let mut labels = Vec::with_capacity(rows.len());
        for j in rows.clone() {
            let i = self.file_row(step, batch, j);
            x.extend_from_slice(&inputs[i * features..(i + 1) * features]);
            labels.push(targets[i]);
        }
        Some(DenseBatch {
            rows: rows.len(),
            x,
            labels,
        })
    }

    /// Sequences `seqs` of step `step` with global batch `batch`, for a gpt; `None` for a
    /// dense file.
    pub fn tokens(&self, step: u64, batch: usize, seqs: Range<usize>) -> Option<TokenBatch> {
        let BatchFile::Tokens { ctx, tokens } = self else {
            return None;
        };
        let mut inputs = Vec::with_capacity(seqs.len() * ctx);
        let mut targets = Vec::with_capacity(seqs.len() * ctx);
        for j in seqs.clone() {
            let i = self.file_row(step, batch, j);
            let row = &tokens[i * (ctx + 1)..(i + 1) * (ctx + 1)];
            inputs.extend_from_slice(&row[..*ctx]);
            targets.extend_from_slice(&row[1..]);
        }
        Some(TokenBatch {
            seqs: seqs.len(),
            inputs,
            targets,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use safetensors::tensor::TensorView;

    use super::*;

    fn write(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let views: HashMap<&str, TensorView> = tensors
            .iter()
            .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, f.path()).unwrap();
        f
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn i64s(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Rows wrap around the file; slices of a step concatenate to its global batch; a gpt row
    /// splits into inputs and shifted targets.
    #[test]
    fn batches_are_rows_of_the_file_by_step() {
        let dense = InputKind::Dense {
            features: 2,
            classes: 3,
        };
        let f = write(&[
            ("inputs", Dtype::F32, vec![3, 2], f32s(&[0., 1., 2., 3., 4., 5.])),
            ("targets", Dtype::I64, vec![3], i64s(&[0, 1, 2])),
        ]);
        let file = BatchFile::open(f.path(), dense).unwrap();
        let whole = file.dense(1, 2, 0..2).unwrap();
        assert_eq!((whole.x, whole.labels), (vec![4., 5., 0., 1.], vec![2, 0]));
        let second = file.dense(1, 2, 1..2).unwrap();
        assert_eq!(second.labels, [0]);
        let tokens = InputKind::Tokens { vocab: 10, ctx: 3 };
        let f = write(&[("tokens", Dtype::I64, vec![2, 4], i64s(&[1, 2, 3, 4, 5, 6, 7, 8]))]);
        let file = BatchFile::open(f.path(), tokens).unwrap();
        let b = file.tokens(1, 1, 0..1).unwrap();
        assert_eq!((b.inputs, b.targets), (vec![5, 6, 7], vec![6, 7, 8]));
    }

    /// Wrong names, shapes, dtypes and ids are refused naming the tensor and what it must be.
    #[test]
    fn malformed_batch_files_are_refused_with_the_fix() {
        let tokens = InputKind::Tokens { vocab: 8, ctx: 3 };
        let cases = [
            (
                vec![("tokens", Dtype::I64, vec![2, 3], i64s(&[1, 2, 3, 4, 5, 6]))],
                "needs `tokens`: I64, I32 or U8 [n, 4] (ctx + 1 = 4 ids a row), it is I64 [2, 3]",
            ),
            (
                vec![("tokens", Dtype::I64, vec![1, 4], i64s(&[1, 2, 3, 9]))],
                "`tokens` holds 9, outside the model's 8 token ids",
            ),
            (
                vec![("ids", Dtype::I64, vec![1, 4], i64s(&[1, 2, 3, 4]))],
                "holds ids, which this model does not read; it reads only tokens",
            ),
            (
                vec![("tokens", Dtype::F32, vec![1, 4], f32s(&[1., 2., 3., 4.]))],
                "it is F32 [1, 4]",
            ),
        ];
        for (tensors, why) in cases {
            let f = write(&tensors);
            let err = BatchFile::open(f.path(), tokens).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
        let dense = InputKind::Dense {
            features: 2,
            classes: 3,
        };
        let f = write(&[("inputs", Dtype::F32, vec![1, 2], f32s(&[0., 1.]))]);
        let err = BatchFile::open(f.path(), dense).unwrap_err();
        assert!(err.contains("needs `targets`: I64, I32 or U8 [1]"), "{err}");
    }
}
