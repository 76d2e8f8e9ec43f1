//! The seeded data sources of `shared/WORKLOADS.md`, as pure functions of (seed, step, rows).
//!
//! Any actor can build any batch slice on its own: data-parallel rank `r` of `n` takes the `r`-th
//! contiguous slice of the global batch, so a dp=N step sees exactly the rows of the dp=1 step.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::rng::SplitMix64;

/// Where a training job's samples come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataSpec {
    /// Gaussian clusters (the mlp workload), drawn from `seed`.
    Clusters {
        /// Seed of the pool.
        seed: u64,
    },
    /// The nearly predictable byte stream of the gpt workload, drawn from `seed`.
    SyntheticBytes {
        /// Seed of the stream.
        seed: u64,
    },
    /// A text file: its bytes (character-level language modelling), or the token ids a
    /// Hugging Face `tokenizer.json` gives for it.
    TextFile {
        /// Path of the file, read by each actor.
        path: String,
        /// Path of the `tokenizer.json` that turns the text into token ids (`None`: bytes).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tokenizer: Option<String>,
    },
    /// The rows of a safetensors file: `inputs` `[n, features]` f32 and `targets` `[n]` integer
    /// classes for an mlp, `tokens` `[n, ctx + 1]` integer ids for a gpt (each row's first `ctx`
    /// tokens are the inputs, its last `ctx` the next-token targets). Step `s` with global batch
    /// `b` takes rows `(s·b + j) mod n`, `j` in `0..b`.
    TensorFile {
        /// Path of the file, read by each actor.
        path: String,
    },
}

impl DataSpec {
    /// The workload's seeded synthetic data for a model eating `input` (seed 0): Gaussian
    /// clusters for dense rows, the byte stream for tokens.
    pub fn synthetic_for(input: crate::InputKind) -> DataSpec {
        match input {
            crate::InputKind::Dense { .. } => DataSpec::Clusters { seed: 0 },
            crate::InputKind::Tokens { .. } => DataSpec::SyntheticBytes { seed: 0 },
        }
    }
}

/// A slice of a batch of dense rows.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseBatch {
    /// Rows in this slice.
    pub rows: usize,
    /// Row-major features, `rows × features`.
    pub x: Vec<f32>,
    /// One class per row.
    pub labels: Vec<u32>,
}

/// A slice of a batch of token sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBatch {
    /// Sequences in this slice.
    pub seqs: usize,
    /// Row-major inputs, `seqs × ctx`.
    pub inputs: Vec<u32>,
    /// Next-token targets, `seqs × ctx`.
    pub targets: Vec<u32>,
}

/// The mlp workload's pool: `classes` Gaussian clusters in `features` dimensions.
#[derive(Debug, Clone)]
pub struct ClusterPool {
    features: usize,
    points: Vec<f32>,
    labels: Vec<u32>,
}

/// Points in the cluster pool (WORKLOADS.md).
pub const CLUSTER_POOL_ROWS: usize = 4096;

impl ClusterPool {
    /// Draws the pool: centres ~ N(0, 1), point = its centre + N(0, 1), labels uniform.
    pub fn new(seed: u64, features: usize, classes: usize) -> ClusterPool {
        let mut rng = SplitMix64::keyed(&[seed, 0xC1_u64]);
        let centres: Vec<f32> = (0..classes * features).map(|_| rng.gaussian() as f32).collect();
        let mut points = Vec::with_capacity(CLUSTER_POOL_ROWS * features);
        let mut labels = Vec::with_capacity(CLUSTER_POOL_ROWS);
        for _ in 0..CLUSTER_POOL_ROWS {
            let label = rng.below(classes as u64) as usize;
            labels.push(label as u32);
            let centre = &centres[label * features..(label + 1) * features];
            points.extend(centre.iter().map(|c| c + rng.gaussian() as f32));
        }
        ClusterPool {
            features,
            points,
            labels,
        }
    }

    /// Rows `rows` (indices within the global batch) of step `step` with global batch `batch`.
    pub fn batch(&self, step: u64, batch: usize, rows: Range<usize>) -> DenseBatch {
        let start = (step as usize * batch) % CLUSTER_POOL_ROWS;
        let mut x = Vec::with_capacity(rows.len() * self.features);
        let mut labels = Vec::with_capacity(rows.len());
        for r in rows.clone() {
            let i = (start + r) % CLUSTER_POOL_ROWS;
            x.extend_from_slice(&self.points[i * self.features..(i + 1) * self.features]);
            labels.push(self.labels[i]);
        }
        DenseBatch {
            rows: rows.len(),
            x,
            labels,
        }
    }
}

/// A token stream cut into next-token-prediction sequences.
#[derive(Debug, Clone)]
pub struct TokenStream {
    tokens: Vec<u32>,
}

/// Why tokens do not fit a gpt: too few for one context, or an id past its vocabulary.
enum Misfit {
    Short,
    Large,
}

/// Whether `len` tokens, the largest `top`, can train a gpt of context `ctx` and vocabulary
/// `vocab`.
fn fits(len: usize, top: usize, ctx: usize, vocab: usize) -> Result<(), Misfit> {
    if len <= ctx + 1 {
        Err(Misfit::Short)
    } else if top >= vocab {
        Err(Misfit::Large)
    } else {
        Ok(())
    }
}

/// Length of the synthetic byte stream (WORKLOADS.md).
pub const SYNTHETIC_STREAM_LEN: usize = 1 << 20;

impl TokenStream {
    /// The synthetic stream: `t[0] = 0`, `t[i+1] = (5·t[i] + 17 + n_i) mod V`, `n_i ∈ {0..3}`,
    /// with `V = min(vocab, 256)` (WORKLOADS.md's stream for the 256-token models; the same
    /// recurrence in a smaller vocabulary for small test models).
    pub fn synthetic(seed: u64, vocab: usize) -> TokenStream {
        let modulus = vocab.clamp(1, 256) as u32;
        let mut rng = SplitMix64::keyed(&[seed, 0xB7_u64]);
        let mut tokens = Vec::with_capacity(SYNTHETIC_STREAM_LEN);
        let mut t: u32 = 0;
        for _ in 0..SYNTHETIC_STREAM_LEN {
            tokens.push(t);
            t = (5 * t + 17 + rng.below(4) as u32) % modulus;
        }
        TokenStream { tokens }
    }

    /// A stream over the given bytes (e.g. a text file).
    pub fn from_bytes(bytes: Vec<u8>) -> TokenStream {
        TokenStream {
            tokens: bytes.into_iter().map(u32::from).collect(),
        }
    }

    /// A stream over the given token ids (a tokenized text).
    pub fn from_ids(tokens: Vec<u32>) -> TokenStream {
        TokenStream { tokens }
    }

    /// Whether the bytes of text file `path` can train a gpt of context `ctx` and vocabulary
    /// `vocab` (every byte is a token below `vocab`, and there is more than one context); else
    /// why not, with the fix.
    pub fn check_text(path: &str, bytes: &[u8], ctx: usize, vocab: usize) -> Result<(), String> {
        let top = bytes.iter().copied().max().unwrap_or(0) as usize;
        fits(bytes.len(), top, ctx, vocab).map_err(|misfit| match misfit {
            Misfit::Short => format!("--data {path} has {} bytes; it needs more than ctx+1 = {}", bytes.len(), ctx + 1),
            Misfit::Large => format!(
                "--data {path} holds byte values up to {top}, and a gpt with vocab={vocab} has tokens 0..{vocab}: use vocab={} or more (vocab=256 fits any file)",
                top + 1
            ),
        })
    }

    /// Whether the token ids `ids` that `tokenizer` gave for text file `path` can train a gpt of
    /// context `ctx` and vocabulary `vocab`; else why not, with the fix.
    pub fn check_ids(
        path: &str,
        tokenizer: &str,
        ids: &[u32],
        ctx: usize,
        vocab: usize,
    ) -> Result<(), String> {
        let top = ids.iter().copied().max().unwrap_or(0) as usize;
        fits(ids.len(), top, ctx, vocab).map_err(|misfit| match misfit {
            Misfit::Short => format!(
                "--data {path} is {} tokens under --tokenizer {tokenizer}; it needs more than ctx+1 = {}",
                ids.len(),
                ctx + 1
            ),
            Misfit::Large => format!(
                "--tokenizer {tokenizer} gives --data {path} token ids up to {top}, and a gpt with vocab={vocab} has tokens 0..{vocab}: use vocab={} or more",
                top + 1
            ),
        })
    }

    /// Bytes in the stream.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the stream is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The token ids, in order.
    pub fn ids(&self) -> &[u32] {
        &self.tokens
    }

    /// Sequences `seqs` of step `step` with `batch` sequences per global batch and context `ctx`.
    /// Sequence `j` starts at `((step·batch + j)·(ctx+1)) mod (len − ctx − 1)`.
    ///
    /// # Panics
    /// When the stream is not longer than `ctx + 1` bytes (callers check this up front).
    pub fn batch(&self, step: u64, batch: usize, ctx: usize, seqs: Range<usize>) -> TokenBatch {
        let span = self.tokens.len() - (ctx + 1);
        let mut inputs = Vec::with_capacity(seqs.len() * ctx);
        let mut targets = Vec::with_capacity(seqs.len() * ctx);
        for j in seqs.clone() {
            let start = ((step as usize * batch + j) * (ctx + 1)) % span;
            let window = &self.tokens[start..start + ctx + 1];
            inputs.extend_from_slice(&window[..ctx]);
            targets.extend_from_slice(&window[1..]);
        }
        TokenBatch {
            seqs: seqs.len(),
            inputs,
            targets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_parallel_slices_concatenate_to_the_global_batch() {
        let pool = ClusterPool::new(3, 8, 4);
        let whole = pool.batch(70, 64, 0..64);
        let halves = [pool.batch(70, 64, 0..32), pool.batch(70, 64, 32..64)];
        assert_eq!([halves[0].x.clone(), halves[1].x.clone()].concat(), whole.x);
        assert_eq!(
            [halves[0].labels.clone(), halves[1].labels.clone()].concat(),
            whole.labels
        );
    }

    #[test]
    fn synthetic_stream_follows_its_recurrence() {
        let s = TokenStream::synthetic(1, 256);
        assert!(TokenStream::synthetic(1, 64).tokens.iter().all(|t| *t < 64));
        assert_eq!(s.len(), SYNTHETIC_STREAM_LEN);
        assert_eq!(s.tokens[0], 0);
        for w in s.tokens.windows(2).take(1000) {
            let base = (5 * w[0] + 17) % 256;
            assert!((0..4).any(|n| (base + n) % 256 == w[1]));
        }
        let b = s.batch(2, 16, 128, 3..5);
        assert_eq!(b.inputs.len(), 256);
        assert_eq!(b.inputs[1..128], b.targets[..127]);
    }

    #[test]
    fn text_data_must_fit_the_vocabulary_and_the_context() {
        assert!(TokenStream::check_text("f", b"hello world", 4, 128).is_ok());
        let small = TokenStream::check_text("f", b"hello world", 4, 64).unwrap_err();
        assert!(
            small.contains("up to 119") && small.contains("vocab=120"),
            "{small}"
        );
        let short = TokenStream::check_text("f", b"hi", 4, 256).unwrap_err();
        assert!(short.contains("ctx+1 = 5"), "{short}");
    }
}
