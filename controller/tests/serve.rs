//! `archipelago serve` as a user runs it (issue 41): a real process on 127.0.0.1, asked over
//! HTTP in OpenAI's shapes. The fixture's GPT-2 answers a greedy completion with
//! `transformers`' greedy continuation, whole and streamed (a chunk per token, adding up to the
//! whole text; `[DONE]` last; the usage chunk when asked); a chat request goes through the plain
//! template; requests sent at once get what each gets alone; every bad input is a 4xx in
//! OpenAI's error shape naming the field while the server goes on serving; `/v1/models`,
//! `/health` and `/metrics` (OpenMetrics) answer. A client that disconnects mid-stream gives its
//! cache blocks back (the metrics show it), and a request past `--max-connections` gets 503.
//! `archipelago plan serve` prints the pool the server then holds and the weights' bytes.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use archipelago_actors::block::initial_params;
use archipelago_actors::text_tokens::codec;
use archipelago_actors::weights_file::write_weights;
use archipelago_dataflow::ModelSpec;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../integration-tests/fixtures")
        .join(path)
}

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `archipelago serve` with `args` on a free port; returns once it listens.
fn serve(args: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_archipelago"))
        .arg("serve")
        .args(args)
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("archipelago serve starts");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let listening = stdout.lines().map_while(Result::ok).find_map(|line| {
        let rest = line.strip_prefix("listening on http://")?;
        rest.split_whitespace().next().map(str::to_string)
    });
    let mut server = Server {
        child,
        addr: String::new(),
    };
    server.addr = listening.unwrap_or_else(|| panic!("archipelago serve {args:?} ended before listening"));
    server
}

/// Sends an HTTP/1.0 request; the status and the body.
fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(body).unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("a response");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status");
    (status, body.to_string())
}

fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

/// Opens a streamed request; the reader positioned after the headers.
fn open_stream(addr: &str, path: &str, body: &Value) -> BufReader<TcpStream> {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.to_string();
    write!(
        stream,
        "POST {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains(" 200 "), "the stream's status: {line}");
    loop {
        line.clear();
        reader.read_line(&mut line).unwrap();
        if line == "\r\n" {
            return reader;
        }
    }
}

/// Every `data:` of a stream, to its end.
fn events(mut reader: BufReader<TcpStream>) -> Vec<String> {
    let mut out = Vec::new();
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap() > 0 {
        if let Some(data) = line.trim_end().strip_prefix("data: ") {
            out.push(data.to_string());
        }
        line.clear();
    }
    out
}

/// The value of metric `name` (no labels) in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixture("gpt2/expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn serve_answers_in_openai_shapes_and_refuses_bad_input_by_field() {
    let tokenizer = fixture("tokenizer/tokenizer.json");
    let init = fixture("gpt2/model.safetensors");
    let server = serve(&[
        "--init",
        init.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--max-body-bytes",
        "4096",
        "--served-model-name",
        "tiny-gpt2",
    ]);
    let addr = server.addr.as_str();
    let (encode, decode) = codec(tokenizer.to_str(), 320).unwrap();
    // transformers' greedy continuation of the fixture's prompt.
    let expected = expected();
    let (prompt, greedy) = (ids(&expected["prompt"]), ids(&expected["greedy"]));
    let continuation = decode(&greedy[prompt.len()..]).unwrap();
    let request = json!({"model": "tiny-gpt2", "prompt": prompt, "max_tokens": 8, "temperature": 0});
    let (status, whole) = post(addr, "/v1/completions", &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    assert_eq!(whole["model"], "tiny-gpt2");
    assert_eq!(whole["choices"][0]["text"], continuation.as_str());
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(
        whole["usage"],
        json!({"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14})
    );

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let data = events(open_stream(addr, "/v1/completions", &streamed));
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = (chunks.iter())
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, continuation);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");
    // A chunk per generated token (as vLLM sends), then the finish and the usage.
    let token_chunks = (chunks.iter())
        .filter(|c| c["choices"][0]["finish_reason"].is_null() && c["usage"].is_null())
        .count();
    assert_eq!(token_chunks, 8);

    // A chat through the plain template.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0});
    let (status, answer) = post(addr, "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    let templated = encode("user: hi\nassistant:").unwrap();
    assert_eq!(answer["usage"]["prompt_tokens"], templated.len());

    // Requests at once get what each gets alone (seeded sampling).
    let sampled = |seed: u64| json!({"prompt": "the", "max_tokens": 10, "temperature": 0.9, "seed": seed});
    let alone: Vec<Value> = (0..6)
        .map(|s| post(addr, "/v1/completions", &sampled(s)).1)
        .collect();
    let together: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|s| scope.spawn(move || post(addr, "/v1/completions", &sampled(s)).1))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"]);
    }
    let texts: std::collections::BTreeSet<String> = alone
        .iter()
        .map(|a| a["choices"][0]["text"].to_string())
        .collect();
    assert!(
        texts.len() > 1,
        "different seeds sample different answers: {texts:?}"
    );

    refusals_name_their_field(addr);
    // Still serving.
    assert_eq!(
        post(addr, "/v1/completions", &request).1["choices"][0]["text"],
        continuation.as_str()
    );

    let (status, models) = http(addr, "GET", "/v1/models", b"");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-gpt2");
    assert_eq!(http(addr, "GET", "/health", b"").0, 200);
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    assert!(
        text.to_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{text}"
    );
    assert!(metric(&text, "archipelago_serve_generated_tokens_total") >= 8.0 * 3.0 + 1.0 + 120.0);
    assert!(metric(&text, "archipelago_serve_time_to_first_token_seconds_count") >= 16.0);
    assert_eq!(metric(&text, "archipelago_serve_cache_blocks_used"), 0.0);
}

/// Each bad request is a 4xx in OpenAI's error shape naming the field.
fn refusals_name_their_field(addr: &str) {
    let long: Vec<u32> = (0..20).collect();
    for (body, status, param) in [
        (json!({"prompt": long}), 400, "prompt"),
        (json!({"prompt": [1, 2, 3], "max_tokens": 14}), 400, "max_tokens"),
        (json!({"prompt": "a", "n": 2}), 400, "n"),
        (json!({"prompt": "a", "logprobs": 2}), 400, "logprobs"),
        (json!({"prompt": "a", "echo": true}), 400, "echo"),
        (json!({"prompt": "a", "best_of": 2}), 400, "best_of"),
        (json!({"prompt": "a", "temperature": -1}), 400, "temperature"),
        (json!({"prompt": "a", "top_p": 0}), 400, "top_p"),
        (json!({"prompt": "a", "top_p": 1.5}), 400, "top_p"),
        (json!({"prompt": "x".repeat(5000)}), 413, ""),
    ] {
        let (got, answer) = post(addr, "/v1/completions", &body);
        let error = &answer["error"];
        assert_eq!(got, status, "{answer}");
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{answer}"
        );
        assert!(error["type"].is_string(), "{answer}");
        if !param.is_empty() {
            assert_eq!(error["param"], param, "{answer}");
        }
    }
    let (status, text) = http(addr, "POST", "/v1/completions", b"{\"prompt\": ");
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("not valid JSON"), "{text}");
}

#[test]
fn a_client_that_disconnects_gives_its_cache_blocks_back() {
    let dir = tempfile::tempdir().unwrap();
    let spec = ModelSpec::parse("gpt2:vocab=320,ctx=2048,d=64,layers=4,heads=4").unwrap();
    let values: Vec<Vec<f32>> = (spec.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, 5))
        .collect();
    let init = dir.path().join("model.safetensors");
    write_weights(&init, &spec, &values).unwrap();
    let server = serve(&[
        "--model",
        &spec.explicit(),
        "--init",
        init.to_str().unwrap(),
        "--max-connections",
        "1",
        "--cache-tokens",
        "4096",
    ]);
    let addr = server.addr.as_str();
    let long = json!({"prompt": "once upon a time", "max_tokens": 2000, "stream": true, "temperature": 0});
    let mut reader = open_stream(addr, "/v1/completions", &long);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    // The one connection allowed is taken.
    let (status, busy) = post(addr, "/v1/completions", &json!({"prompt": "a", "max_tokens": 1}));
    assert_eq!(status, 503, "{busy}");
    assert_eq!(busy["error"]["code"], "overloaded");
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, text) = http(addr, "GET", "/metrics", b"");
        let (cancelled, used) = (
            metric(&text, "archipelago_serve_cancelled_requests_total"),
            metric(&text, "archipelago_serve_cache_blocks_used"),
        );
        if cancelled == 1.0 && used == 0.0 {
            assert!(
                metric(&text, "archipelago_serve_cache_blocks_free") == 256.0,
                "{text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "the blocks never came back:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, answer) = post(addr, "/v1/completions", &json!({"prompt": "a", "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
}

/// `archipelago plan serve` prints what the server then holds: the pool `/metrics` counts, and
/// weight bytes of the model's parameters in f32 (half in bf16); a bad flag is refused by name.
#[test]
fn plan_serve_prints_what_the_server_then_holds() {
    let init = fixture("gpt2/model.safetensors");
    let flags = [
        "--init",
        init.to_str().unwrap(),
        "--replicas",
        "2",
        "--cache-tokens",
        "256",
    ];
    let plan = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_archipelago"))
            .args(["plan", "serve"])
            .args(flags)
            .args(extra)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = plan(&[]);
    assert!(ok, "{text}");
    assert!(
        text.contains("the pool holds 16 full-context sequences at once"),
        "{text}"
    );
    let (ok, json) = plan(&["--json"]);
    assert!(ok, "{json}");
    let json: Value = serde_json::from_str(&json).unwrap();
    let spec = ModelSpec::parse(json["model"].as_str().unwrap()).unwrap();
    let elements: usize = (spec.desc().blocks.iter())
        .map(|b| initial_params(&b.param_descs, 5).len())
        .sum();
    assert_eq!(json["weight_bytes_per_replica"], 4 * elements);
    let (_, bf16) = plan(&["--json", "--precision", "bf16"]);
    let bf16: Value = serde_json::from_str(&bf16).unwrap();
    assert_eq!(bf16["weight_bytes_per_replica"], 2 * elements);
    let server = serve(&flags);
    let (_, metrics) = http(&server.addr, "GET", "/metrics", b"");
    let blocks = json["cache"]["blocks"].as_f64().unwrap();
    assert_eq!(
        metric(&metrics, "archipelago_serve_cache_blocks_free"),
        2.0 * blocks,
        "{metrics}"
    );
    assert_eq!(json["cache"]["tokens"], 256);
    let (ok, refused) = plan(&["--max-step-tokens", "0"]);
    assert!(
        !ok && refused.contains("--max-step-tokens must be 1 or more"),
        "{refused}"
    );
}

/// `serve --tp 2` (each replica's model cut over two tensor-parallel ranks) answers the fixture's
/// prompt with `transformers`' greedy continuation, whole and streamed; `--tp 3` (4 heads) is
/// refused at start naming both.
#[test]
fn serve_at_tp_2_answers_as_one_device() {
    let tokenizer = fixture("tokenizer/tokenizer.json");
    let init = fixture("gpt2/model.safetensors");
    let flags = [
        "--init",
        init.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ];
    let server = serve(&[&flags[..], &["--tp", "2", "--cache-tokens", "64"]].concat());
    let (_, decode) = codec(tokenizer.to_str(), 320).unwrap();
    let expected = expected();
    let (prompt, greedy) = (ids(&expected["prompt"]), ids(&expected["greedy"]));
    let continuation = decode(&greedy[prompt.len()..]).unwrap();
    let request = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let (status, whole) = post(&server.addr, "/v1/completions", &request);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["choices"][0]["text"], continuation.as_str());
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let data = events(open_stream(&server.addr, "/v1/completions", &streamed));
    let text: String = (data[..data.len() - 1].iter())
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, continuation);
    let out = Command::new(env!("CARGO_BIN_EXE_archipelago"))
        .arg("serve")
        .args(flags)
        .args(["--tp", "3"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("4 heads") && said.contains("--tp 3"),
        "{said}"
    );
}
