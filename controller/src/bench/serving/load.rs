//! The serving load of WORKLOADS.md against a running `archipelago serve` on 127.0.0.1: requests
//! arriving at a fixed rate (Poisson, seeded) or from a fixed number of clients each sending its
//! next request when the last is answered, at most `max_requests` and `max_s` seconds; each a
//! streamed `POST /v1/completions` read as it comes (chunked HTTP/1.1, server-sent events), so
//! that every token's arrival is timed: time to first token, inter-token latency, generated
//! tokens per second.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use archipelago_dataflow::rng::SplitMix64;

/// How requests arrive.
#[derive(Debug, Clone, Copy)]
pub enum Arrivals {
    /// Poisson arrivals at `rate` requests a second (seeded).
    Poisson {
        /// Requests a second.
        rate: f64,
    },
    /// `clients` clients, each sending its next request as soon as its last is answered.
    Closed {
        /// Requests in flight.
        clients: usize,
    },
}

/// One load: how requests arrive, how many at most, for how long at most.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// How they arrive.
    pub arrivals: Arrivals,
    /// The most requests sent.
    pub max_requests: usize,
    /// The most seconds spent sending.
    pub max_s: f64,
    /// Tokens each request asks for: drawn (seeded) from `lo..=hi` per request.
    pub max_tokens: (usize, usize),
    /// The arrivals' seed.
    pub seed: u64,
}

impl Load {
    /// Request `i`'s `max_tokens`.
    fn tokens_of(&self, i: usize) -> usize {
        let (lo, hi) = self.max_tokens;
        let mut rng = SplitMix64::keyed(&[self.seed, i as u64, 0x70_u64]);
        lo + rng.below((hi.max(lo) - lo + 1) as u64) as usize
    }
}

/// What one request saw.
#[derive(Debug, Clone)]
struct Answered {
    /// When it was sent, from the load's start.
    sent_s: f64,
    /// When its tokens arrived, from the load's start.
    token_s: Vec<f64>,
    /// Why it failed, if it did.
    failed: Option<String>,
}

/// Runs `load` against the server at `addr` with `prompts` (taken in turn); its figures.
pub async fn run(addr: SocketAddr, prompts: Arc<Vec<Vec<u32>>>, load: Load) -> Value {
    let start = Instant::now();
    let answers = match load.arrivals {
        Arrivals::Poisson { rate } => poisson(addr, &prompts, load, rate, start).await,
        Arrivals::Closed { clients } => closed(addr, &prompts, load, clients, start).await,
    };
    summarize(&answers, load, start.elapsed().as_secs_f64())
}

/// Requests at exponential gaps of mean `1/rate`, each on its own task.
async fn poisson(
    addr: SocketAddr,
    prompts: &Arc<Vec<Vec<u32>>>,
    load: Load,
    rate: f64,
    start: Instant,
) -> Vec<Answered> {
    let mut rng = SplitMix64::keyed(&[load.seed, 0x5E_u64]);
    let mut at = 0.0;
    let mut tasks = Vec::new();
    for i in 0..load.max_requests {
        if at > load.max_s {
            break;
        }
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        let prompts = prompts.clone();
        tasks.push(tokio::spawn(async move {
            one(addr, &prompts[i % prompts.len()], load.tokens_of(i), start).await
        }));
        at += -(1.0 - rng.uniform()).ln() / rate;
    }
    let mut answers = Vec::with_capacity(tasks.len());
    for task in tasks {
        answers.push(task.await.expect("a request's task"));
    }
    answers
}

/// `clients` loops, each sending the next prompt when its last is answered.
async fn closed(
    addr: SocketAddr,
    prompts: &Arc<Vec<Vec<u32>>>,
    load: Load,
    clients: usize,
    start: Instant,
) -> Vec<Answered> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (prompts, next) = (prompts.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= load.max_requests || start.elapsed().as_secs_f64() > load.max_s {
                    return answers;
                }
                answers.push(one(addr, &prompts[i % prompts.len()], load.tokens_of(i), start).await);
            }
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.extend(task.await.expect("a client's task"));
    }
    answers
}

/// Sends one streamed completion and times its tokens.
async fn one(addr: SocketAddr, prompt: &[u32], max_tokens: usize, start: Instant) -> Answered {
    let sent_s = start.elapsed().as_secs_f64();
    let mut arrived = Vec::new();
    let failed = stream_tokens(addr, prompt, max_tokens, &mut arrived).await.err();
    Answered {
        sent_s,
        token_s: arrived
            .iter()
            .map(|t| t.duration_since(start).as_secs_f64())
            .collect(),
        failed,
    }
}

/// `POST /v1/completions` (greedy, streamed), noting when each token's chunk arrives.
async fn stream_tokens(
    addr: SocketAddr,
    prompt: &[u32],
    max_tokens: usize,
    arrived: &mut Vec<Instant>,
) -> Result<(), String> {
    let body =
        json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true }).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut socket = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    socket.set_nodelay(true).map_err(|e| e.to_string())?;
    socket
        .write_all(format!("{head}{body}").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(socket);
    let mut line = String::new();
    reader.read_line(&mut line).await.map_err(|e| e.to_string())?;
    if !line.contains(" 200 ") {
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest).await;
        return Err(format!("{} {}", line.trim(), rest.lines().last().unwrap_or("")));
    }
    loop {
        line.clear();
        reader.read_line(&mut line).await.map_err(|e| e.to_string())?;
        if line.trim().is_empty() {
            break;
        }
    }
    // The chunked body: a hex size line, that many bytes, CRLF; server-sent events inside.
    let mut events = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await.map_err(|e| e.to_string())? == 0 {
            return Err("the stream ended before [DONE]".into());
        }
        let size_text = line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size_text, 16).map_err(|_| format!("a chunk size {size_text:?}"))?;
        if size == 0 {
            return Err("the stream ended before [DONE]".into());
        }
        let mut chunk = vec![0; size + 2];
        reader.read_exact(&mut chunk).await.map_err(|e| e.to_string())?;
        let now = Instant::now();
        events.push_str(&String::from_utf8_lossy(&chunk[..size]));
        while let Some(end) = events.find("\n\n") {
            let event: String = events.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                return Ok(());
            }
            let value: Value = serde_json::from_str(data).map_err(|e| format!("a chunk: {e}"))?;
            if let Some(error) = value.get("error") {
                return Err(format!("failed mid-stream: {error}"));
            }
            let choice = &value["choices"][0];
            if choice.is_object() && choice["finish_reason"].is_null() {
                arrived.push(now);
            }
        }
    }
}

/// The `q` quantile (nearest rank) of `values`, in milliseconds.
fn quantile_ms(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1] * 1e3
}

/// The load's figures from what each request saw.
fn summarize(answers: &[Answered], load: Load, wall_s: f64) -> Value {
    let ok: Vec<&Answered> = answers.iter().filter(|a| a.failed.is_none()).collect();
    let mut ttft: Vec<f64> = (ok.iter())
        .filter_map(|a| Some(a.token_s.first()? - a.sent_s))
        .collect();
    let mut itl: Vec<f64> = (ok.iter())
        .flat_map(|a| a.token_s.windows(2).map(|w| w[1] - w[0]))
        .collect();
    let tokens: usize = ok.iter().map(|a| a.token_s.len()).sum();
    let first_sent = answers.iter().map(|a| a.sent_s).fold(f64::INFINITY, f64::min);
    let last_token = (ok.iter().filter_map(|a| a.token_s.last().copied())).fold(0.0, f64::max);
    let span = (last_token - first_sent).max(1e-9);
    let arrivals = match load.arrivals {
        Arrivals::Poisson { rate } => json!({ "poisson_rate_per_s": rate }),
        Arrivals::Closed { clients } => json!({ "closed_clients": clients }),
    };
    json!({
        "arrivals": arrivals,
        "max_tokens": [load.max_tokens.0, load.max_tokens.1],
        "requests": answers.len(),
        "answered": ok.len(),
        "failures": answers.iter().filter_map(|a| a.failed.clone()).take(3).collect::<Vec<_>>(),
        "generated_tokens": tokens,
        "generated_tokens_per_s": tokens as f64 / span,
        "ttft_ms_p50": quantile_ms(&mut ttft, 0.5),
        "ttft_ms_p99": quantile_ms(&mut ttft, 0.99),
        "itl_ms_p50": quantile_ms(&mut itl, 0.5),
        "itl_ms_p99": quantile_ms(&mut itl, 0.99),
        "wall_s": wall_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(|i| i as f64 / 1e3).collect();
        assert_eq!(quantile_ms(&mut v, 0.5), 50.0);
        assert_eq!(quantile_ms(&mut v, 0.99), 99.0);
        assert_eq!(quantile_ms(&mut [0.004], 0.99), 4.0);
        assert_eq!(quantile_ms(&mut [], 0.5), 0.0);
    }
}
