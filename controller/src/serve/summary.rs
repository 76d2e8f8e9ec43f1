//! What `serve --plan` and `plan serve` print, and what a started service reports: the weights
//! and cache each replica holds, and under `--tp`/`--pp` each actor (a rank of a stage) — its
//! blocks, its share of the weights and of the cache pool.

use std::ops::Range;

use archipelago_actors::batching::CachePool;
use archipelago_actors::inference_sharded::Layout;
use archipelago_dataflow::ModelSpec;
use archipelago_dataflow::passes::partition::balanced;
use archipelago_dataflow::tensor_parallel::local_model;

/// What a started service is.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The model.
    pub spec: ModelSpec,
    /// Where its weights came from.
    pub source: String,
    /// Bytes of weights per replica.
    pub weight_bytes: u64,
    /// Each replica's cache pool.
    pub pool: CachePool,
    /// Bytes of one cache block.
    pub block_bytes: u64,
    /// Replicas.
    pub replicas: usize,
    /// How the pool was sized.
    pub sized_by: String,
    /// How each replica is cut.
    pub layout: Layout,
    /// What each actor (a rank of a stage) of a replica holds.
    pub actors: Vec<ActorMemory>,
}

impl Summary {
    /// One line for the log.
    pub fn line(&self) -> String {
        format!(
            "{} ({}): {} replica(s){}, weights {:.1} MiB each, cache pool {} blocks × {} positions \
             ({} positions, {:.1} MiB) each",
            self.spec,
            self.source,
            self.replicas,
            match self.actors.len() {
                0 | 1 => String::new(),
                n => format!(" cut {} ({n} actors each)", self.layout),
            },
            mib(self.weight_bytes),
            self.pool.total,
            self.pool.block_tokens,
            self.pool.tokens(),
            mib(self.cache_bytes()),
        )
    }

    /// Bytes of one replica's cache pool.
    pub fn cache_bytes(&self) -> u64 {
        self.block_bytes * self.pool.total as u64
    }

    /// The plan as data (`plan serve --json`): bytes per replica and in all, the pool, how many
    /// full-context sequences it holds.
    pub fn to_json(&self) -> serde_json::Value {
        let ctx = self.spec.get("ctx").unwrap_or(0);
        let r = self.replicas as u64;
        serde_json::json!({
            "model": self.spec.explicit(),
            "weights_from": self.source,
            "replicas": self.replicas,
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "actors": self.actors.iter().map(ActorMemory::to_json).collect::<Vec<_>>(),
            "weight_bytes_per_replica": self.weight_bytes,
            "cache": {
                "blocks": self.pool.total,
                "block_tokens": self.pool.block_tokens,
                "block_bytes": self.block_bytes,
                "tokens": self.pool.tokens(),
                "bytes_per_replica": self.cache_bytes(),
                "sized_by": self.sized_by,
                "full_context_sequences": self.pool.total / self.pool.blocks_for(ctx).max(1),
            },
            "context": ctx,
            "bytes_in_all": (self.weight_bytes + self.cache_bytes()) * r,
        })
    }

    /// The plan, as `plan serve` (and `serve --plan`) prints it.
    pub fn plan(&self) -> String {
        let ctx = self.spec.get("ctx").unwrap_or(0);
        let r = self.replicas as u64;
        format!(
            "serve plan: {} ({})\n\
             \x20 weights: {:.1} MiB per replica × {} = {:.1} MiB\n\
             \x20 cache:   {} blocks × {} positions × {:.1} KiB = {} positions, {:.1} MiB per replica ({}), {:.1} MiB in all\n\
             \x20 a full context ({ctx} positions) takes {} blocks: the pool holds {} full-context sequences at once\n\
             \x20 memory:  {:.1} MiB of weights and cache in all{}",
            self.spec,
            self.source,
            mib(self.weight_bytes),
            self.replicas,
            mib(self.weight_bytes * r),
            self.pool.total,
            self.pool.block_tokens,
            self.block_bytes as f64 / 1024.0,
            self.pool.tokens(),
            mib(self.cache_bytes()),
            self.sized_by,
            mib(self.cache_bytes() * r),
            self.pool.blocks_for(ctx),
            self.pool.total / self.pool.blocks_for(ctx).max(1),
            mib((self.weight_bytes + self.cache_bytes()) * r),
            self.actor_lines(),
        )
    }
}

/// What one actor of a replica (rank `rank` of pipeline stage `stage`) holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorMemory {
    /// Its pipeline stage.
    pub stage: usize,
    /// Its tensor-parallel rank.
    pub rank: usize,
    /// The model's blocks it runs.
    pub blocks: Range<usize>,
    /// Bytes of its weights (its slices, padded where a split does not divide, and its copy of
    /// what is replicated).
    pub weight_bytes: u64,
    /// Bytes of its layers of the cache pool (its heads of its blocks' attentions).
    pub cache_bytes: u64,
}

impl ActorMemory {
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "stage": self.stage,
            "rank": self.rank,
            "blocks": [self.blocks.start, self.blocks.end],
            "weight_bytes": self.weight_bytes,
            "cache_bytes": self.cache_bytes,
        })
    }
}

/// Each actor of a replica of `spec` cut as `layout` says (stages balanced as
/// [`ShardedModel::load`](archipelago_actors::inference_sharded::ShardedModel::load) cuts them),
/// weights of `value_bytes`, the cache's share of a pool of `pool_blocks` blocks of
/// `block_bytes` each; refused where the blocks do not cut into `pp` stages.
pub fn actor_memory(
    spec: &ModelSpec,
    layout: Layout,
    value_bytes: u64,
    block_bytes: u64,
    pool_blocks: usize,
) -> Result<Vec<ActorMemory>, String> {
    let desc = spec.desc();
    let stages = balanced(&desc, layout.pp);
    if stages.len() != layout.pp {
        return Err(format!(
            "--pp {}: {spec} has {} blocks, which do not cut into {} stages",
            layout.pp,
            desc.blocks.len(),
            layout.pp
        ));
    }
    let local = local_model(&desc, layout.tp);
    let attentions = (desc.blocks.iter())
        .filter(|b| b.name.starts_with("attn."))
        .count()
        .max(1) as u64;
    let mut actors = Vec::with_capacity(layout.tp * layout.pp);
    for (stage, (start, end)) in stages.into_iter().enumerate() {
        let elements: u64 = local.blocks[start..end].iter().map(|b| b.params).sum();
        let held = (desc.blocks[start..end].iter())
            .filter(|b| b.name.starts_with("attn."))
            .count() as u64;
        for rank in 0..layout.tp {
            actors.push(ActorMemory {
                stage,
                rank,
                blocks: start..end,
                weight_bytes: elements * value_bytes,
                cache_bytes: block_bytes * pool_blocks as u64 * held / attentions / layout.tp as u64,
            });
        }
    }
    Ok(actors)
}

impl Summary {
    /// The actors' lines of the plan (none for one device).
    fn actor_lines(&self) -> String {
        if self.actors.len() < 2 {
            return String::new();
        }
        let mut lines = format!(
            "\n  layout:  {} per replica ({} actors, each rank on a thread of its own; tensor-parallel ranks hold 1/{} of their blocks' heads, cache and MLP)",
            self.layout,
            self.actors.len(),
            self.layout.tp
        );
        for a in &self.actors {
            lines.push_str(&format!(
                "\n    stage {} rank {}: blocks {}-{}, weights {}, cache {}",
                a.stage,
                a.rank,
                a.blocks.start,
                a.blocks.end - 1,
                size(a.weight_bytes),
                size(a.cache_bytes)
            ));
        }
        lines
    }
}

/// `bytes` in KiB, MiB or GiB, whichever reads best.
fn size(bytes: u64) -> String {
    match bytes {
        b if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        b if b < 1 << 30 => format!("{:.1} MiB", mib(b)),
        b => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
    }
}

pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}
