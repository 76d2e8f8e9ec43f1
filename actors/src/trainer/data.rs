//! The trainer's data: the sample source of the job and the batches it loads per micro-batch.

use archipelago_dataflow::TensorId;
use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Float, Int, Tensor, TensorData};

use archipelago_dataflow::InputKind;
use archipelago_dataflow::data::{ClusterPool, DataSpec, DenseBatch, TokenBatch, TokenStream};

use super::Trainer;
use crate::batch_file::BatchFile;
use crate::block::Activation;
use crate::transfer::{TransferKind, upload};

pub(super) enum Samples {
    Clusters(ClusterPool),
    Tokens(TokenStream),
    /// Rows of a safetensors file (`--data FILE.safetensors`).
    File(BatchFile),
}

/// One micro-batch's rows, from whichever source.
enum Rows {
    Dense(DenseBatch),
    Tokens(TokenBatch),
}

pub(super) struct Batch<B: AutodiffBackend> {
    pub(super) input: Activation<B>,
    pub(super) targets: Tensor<B, 1, Int>,
    /// The targets in host memory too (the vocabulary-parallel loss picks each rank's own).
    pub(super) labels: Vec<i32>,
}

impl<B: AutodiffBackend> Trainer<B> {
    pub(super) fn load_batch(&mut self, step: u64, rows: Range<usize>, name: &TensorId) {
        let n = rows.len();
        // Tokens per sequence (a gpt; 1 for dense rows, which do not use it).
        let ctx = self.stage.desc.input.tokens_per_sample();
        let rows = match &self.samples {
            Samples::Clusters(pool) => Rows::Dense(pool.batch(step, self.global_batch, rows)),
            Samples::Tokens(stream) => Rows::Tokens(stream.batch(step, self.global_batch, ctx, rows)),
            Samples::File(file) => match file.dense(step, self.global_batch, rows.clone()) {
                Some(dense) => Rows::Dense(dense),
                None => Rows::Tokens(
                    file.tokens(step, self.global_batch, rows)
                        .expect("a batch file holds dense or token rows"),
                ),
            },
        };
        let batch = match rows {
            Rows::Dense(b) => {
                let features = b.x.len() / n.max(1);
                let x = upload::<B, 2, Float>(
                    TensorData::new(b.x, [n, features]),
                    &self.stage.device,
                    TransferKind::Batch,
                );
                let labels: Vec<i32> = b.labels.iter().map(|&l| l as i32).collect();
                Batch {
                    input: Activation::Rows(x),
                    targets: upload(
                        TensorData::new(labels.clone(), [n]),
                        &self.stage.device,
                        TransferKind::Batch,
                    ),
                    labels,
                }
            }
            Rows::Tokens(b) => {
                let ids: Vec<i32> = b.inputs.iter().map(|&t| t as i32).collect();
                let targets: Vec<i32> = b.targets.iter().map(|&t| t as i32).collect();
                Batch {
                    input: Activation::Tokens(upload(
                        TensorData::new(ids, [n, ctx]),
                        &self.stage.device,
                        TransferKind::Batch,
                    )),
                    targets: upload(
                        TensorData::new(targets.clone(), [n * ctx]),
                        &self.stage.device,
                        TransferKind::Batch,
                    ),
                    labels: targets,
                }
            }
        };
        self.step.batches.insert(name.clone(), batch);
    }
}

pub(super) fn samples(data: &DataSpec, input: InputKind) -> Result<Samples, String> {
    Ok(match (data, input) {
        (DataSpec::Clusters { seed }, InputKind::Dense { features, classes }) => {
            Samples::Clusters(ClusterPool::new(*seed, features, classes))
        }
        (DataSpec::SyntheticBytes { seed }, InputKind::Tokens { vocab, .. }) => {
            Samples::Tokens(TokenStream::synthetic(*seed, vocab))
        }
        (DataSpec::TextFile { path, tokenizer }, InputKind::Tokens { ctx, vocab }) => Samples::Tokens(
            crate::text_tokens::text_stream(path, tokenizer.as_deref(), ctx, vocab)?,
        ),
        (DataSpec::TensorFile { path }, input) => {
            Samples::File(BatchFile::open(std::path::Path::new(path), input)?)
        }
        (data, input) => return Err(format!("data {data:?} does not fit a model that takes {input:?}")),
    })
}
