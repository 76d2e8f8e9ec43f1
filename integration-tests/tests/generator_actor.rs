//! The generator actor (issue 41: serving through the runtime API): a program spawns the
//! fixture's GPT-2 as an actor on a device of its runtime and calls it with several requests at
//! once; they are batched together and each gets what it gets alone — the greedy one
//! `transformers`' greedy continuation, a text prompt through the tokenizer the same as its ids,
//! two requests with one seed the same sampled answer — while a request past the context is
//! refused by itself, naming `max_tokens`.

use std::path::{Path, PathBuf};

use archipelago_actors::generate::Finish;
use archipelago_actors::generator::{Generate, GenerationRequest, Generator, GeneratorParams, Prompt};
use archipelago_actors::runtime::{Registry, Runtime, SpawnOptions};
use archipelago_actors::sampling::Sampling;
use archipelago_actors::tensor_file::TensorFile;
use archipelago_actors::text_tokens;
use archipelago_dataflow::DeviceSpec;
use archipelago_dataflow::family::gpt2_from_config;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

#[test]
fn a_generator_actor_answers_requests_batched_as_it_answers_them_alone() {
    let config = std::fs::read_to_string(fixture("gpt2/config.json")).unwrap();
    let spec = gpt2_from_config(&serde_json::from_str(&config).unwrap()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gpt2/expected.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = (expected["prompt"].as_array().unwrap().iter())
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let file = TensorFile::open(&fixture("gpt2/expected.safetensors")).unwrap();
    let want: Vec<u32> = (file.read_ints("ids").unwrap().iter())
        .map(|&i| i as u32)
        .collect();
    let new = want.len() - prompt.len();
    let tokenizer_path = fixture("tokenizer/tokenizer.json");
    let path = tokenizer_path.display().to_string();
    let tokenizer = text_tokens::load(&path, spec.get("vocab").unwrap()).unwrap();
    let decode = |ids: &[u32]| tokenizer.decode(ids, false).unwrap();

    // Registered as a program that may run it on other hosts does (CI runs in strict mode).
    Registry::new()
        .actor::<Generator>()
        .handles::<Generator, Generate>()
        .install();
    let runtime = Runtime::local(DeviceSpec::cpus(1));
    let params = GeneratorParams {
        model: spec.explicit(),
        weights: fixture("gpt2/model.safetensors"),
        tokenizer: Some(tokenizer_path.clone()),
        max_sequences: 4,
        cache_blocks: 32,
        block_tokens: 8,
    };
    let generator =
        (runtime.spawn_with::<Generator>(DeviceSpec::Cpu(0), params, SpawnOptions::named("generator")))
            .get()
            .expect("the generator starts");
    let request = |prompt: Prompt, max_tokens: usize, sampling: Sampling| GenerationRequest {
        prompt,
        max_tokens,
        sampling,
        stop: Vec::new(),
    };
    let seeded = Sampling {
        temperature: 1.0,
        top_k: Some(50),
        top_p: Some(0.95),
        seed: 11,
    };
    let text = "The quick brown fox";
    let text_ids = text_tokens::token_ids(&tokenizer, text, &path).unwrap();
    let ctx = spec.get("ctx").unwrap();
    let answers = generator
        .call(Generate(vec![
            request(Prompt::Ids(prompt.clone()), new, Sampling::greedy()),
            request(Prompt::Text(text.into()), 6, Sampling::greedy()),
            request(Prompt::Ids(text_ids.clone()), 6, Sampling::greedy()),
            request(Prompt::Ids(prompt.clone()), 8, seeded),
            request(Prompt::Ids(prompt.clone()), ctx, Sampling::greedy()),
            request(Prompt::Ids(prompt.clone()), 8, seeded),
        ]))
        .get()
        .expect("the call");
    assert_eq!(answers.len(), 6);
    let greedy = answers[0].as_ref().unwrap();
    assert_eq!(
        greedy.text,
        decode(&want[prompt.len()..]),
        "transformers' continuation"
    );
    assert_eq!(
        (greedy.finish, greedy.prompt_tokens, greedy.completion_tokens),
        (Finish::Length, prompt.len(), new)
    );
    assert_eq!(answers[1], answers[2], "a text prompt answers as its token ids");
    assert_eq!(answers[3], answers[5], "one seed, one sampled answer");
    let refused = answers[4].as_ref().unwrap_err();
    assert!(refused.contains("max_tokens"), "{refused}");
}
