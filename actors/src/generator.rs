//! A generator actor: the model replica `archipelago serve` runs ([`Replica`]: continuous batching
//! over a paged cache on its own thread), for a program through the runtime API. A program
//! spawns it like any actor (on this process or a host of a cluster: its parameters and messages
//! are serde) and calls it with [`Generate`]; the requests of one call are submitted together and
//! batched continuously (each joins and leaves the batch on its own), the answers come back in
//! order. Handlers of one actor run one at a time, so requests batch within a call, not across
//! callers: send them in one `Generate`, or spawn more generators.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedReceiver;

use archipelago_dataflow::ModelSpec;

use crate::batching::CachePool;
use crate::generate::{Finish, Request};
use crate::inference::{WholeModel, read_weights};
use crate::runtime::{Actor, Context, Handler, Message};
use crate::sampling::Sampling;
use crate::serving::{Replica, Scheduling, Update};
use crate::text_tokens::{Encode, codec};

/// What a generator loads and how it batches.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GeneratorParams {
    /// The model (`gpt2:vocab=…,ctx=…,…`, or a preset).
    pub model: String,
    /// Its weights: a safetensors file (`transformers`' or `export`'s).
    pub weights: PathBuf,
    /// A `tokenizer.json` for text prompts and answers (without: bytes are the tokens).
    pub tokenizer: Option<PathBuf>,
    /// Sequences a step at most.
    pub max_sequences: usize,
    /// Cache blocks in the pool, and positions per block.
    pub cache_blocks: usize,
    /// Positions per cache block.
    pub block_tokens: usize,
}

/// A prompt: text (through the tokenizer) or token ids.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// One request of a [`Generate`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Text that ends the answer (not included).
    pub stop: Vec<String>,
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generation {
    /// The generated text.
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
}

/// Requests to answer together; the reply holds each one's answer (or why it was refused), in
/// order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Generate(pub Vec<GenerationRequest>);

impl Message for Generate {
    type Reply = Vec<Result<Generation, String>>;
}

/// The actor: a replica and the prompt encoder.
pub struct Generator {
    replica: Replica,
    encode: Box<Encode>,
}

impl Actor for Generator {
    type Params = GeneratorParams;

    async fn new(params: GeneratorParams, ctx: &Context<Self>) -> Result<Self, String> {
        let spec = ModelSpec::parse(&params.model).map_err(|e| e.to_string())?;
        let values = read_weights(&spec, &params.weights, None)?;
        let model = WholeModel::load(&spec, &values)?;
        let vocab = spec
            .get("vocab")
            .ok_or_else(|| format!("{spec} does not generate tokens"))?;
        let tokenizer = params
            .tokenizer
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned());
        let (encode, decode) = codec(tokenizer.as_deref(), vocab)?;
        let pool = CachePool {
            block_tokens: params.block_tokens.max(1),
            total: params.cache_blocks,
        };
        let name = ctx.info().name.clone();
        let scheduling = Scheduling::Continuous { step_tokens: None };
        let replica = Replica::start(&name, model, decode, (params.max_sequences, pool), scheduling)
            .map_err(|e| format!("cannot start {name}'s thread: {e}"))?;
        Ok(Generator { replica, encode })
    }
}

impl Handler<Generate> for Generator {
    async fn handle(
        &mut self,
        Generate(requests): Generate,
        _ctx: &Context<Self>,
    ) -> Vec<Result<Generation, String>> {
        // All handed over before the replica's next step (each is sent before its first await),
        // so their prompts are prefilled together.
        let submitted = futures::future::join_all(requests.into_iter().map(|r| self.submit(r))).await;
        let mut answers = Vec::with_capacity(submitted.len());
        for updates in submitted {
            answers.push(match updates {
                Ok(updates) => collect(updates).await,
                Err(e) => Err(e),
            });
        }
        answers
    }
}

impl Generator {
    /// Hands one request to the replica (refused with the reason before any work).
    async fn submit(&self, request: GenerationRequest) -> Result<UnboundedReceiver<Update>, String> {
        let prompt = match request.prompt {
            Prompt::Text(text) => (self.encode)(&text)?,
            Prompt::Ids(ids) => ids,
        };
        let request = Request {
            prompt,
            max_tokens: request.max_tokens,
            sampling: request.sampling,
            stop: request.stop,
        };
        self.replica.submit(request).await
    }
}

/// A request's text as it comes, until it ends.
async fn collect(mut updates: UnboundedReceiver<Update>) -> Result<Generation, String> {
    let mut text = String::new();
    while let Some(update) = updates.recv().await {
        match update {
            Update::Token { text: piece } => text.push_str(&piece),
            Update::Done {
                text: rest,
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                text.push_str(&rest);
                return Ok(Generation {
                    text,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                });
            }
            Update::Failed(e) => return Err(e),
        }
    }
    Err("the generator's replica stopped before the answer ended".into())
}
