//! The peers measured beside the bench, in the same window (`archipelago bench --peers PYTHON`):
//! PyTorch's gloo collectives and its DDP training steps, run by the repository's `scripts/` with
//! the Python of the environment `scripts/peers_venv.sh` made (outside the repository; never in
//! CI). Each figure lands in the bench JSON beside ours, with the ratio the aims are
//! stated in. A peer that cannot run is reported as such; the bench goes on.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

/// Where the peer scripts are: the repository's `scripts/` (the bench is run from a build of it).
fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts")
        .join(name)
}

/// Runs `python script args…` and returns the JSON lines it printed, or why it could not.
fn run_script(python: &Path, name: &str, args: &[String]) -> Result<Vec<Value>, String> {
    let path = script(name);
    let output = Command::new(python)
        .arg(&path)
        .args(args)
        .output()
        .map_err(|e| format!("{} {}: {e}", python.display(), path.display()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: String = stderr.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
        return Err(format!("{name} exited with {}: {tail}", output.status));
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(Value::is_object)
        .collect())
}

/// gloo's all-reduce and all-gather of `bytes` between two processes, `reps` times (median).
pub fn gloo(python: &Path, bytes: usize, reps: usize) -> Value {
    let args = [format!("--bytes={bytes}"), format!("--reps={reps}")];
    match run_script(python, "collective_peers.py", &args) {
        Ok(lines) => json!({ "system": "PyTorch gloo, 2 processes on 127.0.0.1", "runs": lines }),
        Err(why) => json!({ "error": why }),
    }
}

/// The algbw of gloo's `collective` in a [`gloo`] result.
pub fn gloo_gb_per_s(gloo: &Value, collective: &str) -> Option<f64> {
    gloo["runs"]
        .as_array()?
        .iter()
        .find(|r| r["collective"] == collective)?["algbw_gb_per_s"]
        .as_f64()
}

/// PyTorch's median training step, one thread per rank, for `models` at dp = 1 and 2 (DDP over
/// gloo), with `warmup` and `timed` steps.
pub fn torch_training(python: &Path, models: &str, warmup: u64, timed: u64) -> Value {
    let runs: Vec<Value> = [1, 2]
        .iter()
        .flat_map(|dp| {
            let args = [
                "--device=cpu".to_string(),
                "--threads=1".to_string(),
                format!("--dp={dp}"),
                format!("--models={models}"),
                format!("--warmup={warmup}"),
                format!("--timed={timed}"),
            ];
            run_script(python, "torch_reference.py", &args)
                .unwrap_or_else(|why| vec![json!({ "dp": dp, "error": why })])
        })
        .collect();
    json!({ "system": "PyTorch (one intra-op thread per rank; dp=2 is DDP over gloo)", "runs": runs })
}

/// Ours over PyTorch in throughput (PyTorch's step time over ours) for each run of ours
/// (`runs[].config.{model,dp}`, `runs[].median_step_s`) that PyTorch also ran.
pub fn throughput_ratios(ours: &Value, torch: &Value) -> Value {
    let theirs = torch["runs"].as_array().cloned().unwrap_or_default();
    let ratios: Vec<Value> = (ours["runs"].as_array().cloned().unwrap_or_default())
        .iter()
        .filter(|run| {
            run["config"]["pp"].as_u64().unwrap_or(1) == 1 && run["config"]["zero"].as_u64().unwrap_or(0) == 0
        })
        .filter_map(|run| {
            let (model, dp) = (&run["config"]["model"], &run["config"]["dp"]);
            let peer = theirs.iter().find(|t| &t["model"] == model && &t["dp"] == dp)?;
            let ratio = peer["median_step_s"].as_f64()? / run["median_step_s"].as_f64()?;
            Some(json!({ "model": model, "dp": dp, "ours_over_torch_throughput": ratio, "aim_at_dp2": 1.0 }))
        })
        .collect();
    Value::Array(ratios)
}

/// `transformers`' `generate` with its KV cache on the GPT-2 in `model_dir` (its
/// `model.safetensors` and `config.json`), greedy, `max_tokens` new tokens for each prompt of
/// `prompts` (a JSON list of token-id lists), one at a time and 16 at once (`serve_peer.py`);
/// its answers one at a time as `greedy_tokens`.
pub fn transformers_generate(python: &Path, model_dir: &Path, prompts: &Path, max_tokens: usize) -> Value {
    let tokens_out = model_dir.join("peer_tokens.json");
    let args = [
        format!("--model-dir={}", model_dir.display()),
        format!("--prompts={}", prompts.display()),
        format!("--max-tokens={max_tokens}"),
        format!("--tokens-out={}", tokens_out.display()),
    ];
    match run_script(python, "serve_peer.py", &args) {
        Ok(mut lines) if !lines.is_empty() => {
            let mut peer = lines.remove(0);
            let tokens = std::fs::read(&tokens_out).ok();
            peer["greedy_tokens"] =
                (tokens.and_then(|t| serde_json::from_slice(&t).ok())).unwrap_or(Value::Null);
            peer
        }
        Ok(_) => json!({ "error": "serve_peer.py printed no JSON line" }),
        Err(why) => json!({ "error": why }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_pair_each_run_with_the_peers_run_of_the_same_model_and_dp() {
        let ours = json!({ "runs": [
            { "config": { "model": "gpt-tiny", "dp": 2 }, "median_step_s": 0.25 },
            { "config": { "model": "gpt-tiny", "dp": 2, "pp": 2 }, "median_step_s": 0.5 },
            { "config": { "model": "mlp-8x1024", "dp": 1 }, "median_step_s": 0.1 },
        ]});
        let torch = json!({ "runs": [
            { "model": "gpt-tiny", "dp": 1, "median_step_s": 0.4 },
            { "model": "gpt-tiny", "dp": 2, "median_step_s": 0.2 },
        ]});
        let ratios = throughput_ratios(&ours, &torch);
        let ratios = ratios.as_array().unwrap();
        // Only gpt-tiny dp=2 without pipeline has a peer (not dp=1's, not the mlp's).
        assert_eq!(ratios.len(), 1, "{ratios:?}");
        assert_eq!(ratios[0]["model"], "gpt-tiny");
        assert!((ratios[0]["ours_over_torch_throughput"].as_f64().unwrap() - 0.8).abs() < 1e-12);
        let gloo = json!({ "runs": [{ "collective": "all_reduce", "algbw_gb_per_s": 1.1 }] });
        assert_eq!(gloo_gb_per_s(&gloo, "all_reduce"), Some(1.1));
        assert_eq!(gloo_gb_per_s(&gloo, "all_gather"), None);
    }
}
