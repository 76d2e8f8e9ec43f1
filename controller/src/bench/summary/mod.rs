//! The summary `archipelago bench` prints on stdout (what a pull request quotes): a line on
//! the run (suite, wall time, load average, peak RSS), then a table per section of its headline
//! figures — throughputs, step times, bandwidths beside memcpy, ratios to the fabric and to
//! the peers where `--peers` measured them, the load average when each was taken — and a last
//! line on where every figure is (`--json FILE`). It reads the suite's JSON, whose keys it
//! leaves as they are; a figure the JSON lacks is shown as `missing`, never left out.

mod comm;
mod table;
mod training;

use std::path::Path;

use serde_json::Value;

use table::{MISSING, at, fig, fig_unit};

/// A section of the summary, drawn from the suite's whole JSON.
type Section = fn(&Value) -> Vec<String>;

/// The summary of the suite's JSON `out`; `json` is where `--json` wrote it (if anywhere).
pub fn summary(out: &Value, json: Option<&Path>) -> Vec<String> {
    let mut lines = vec![run_line(out)];
    for section in sections(out["suite"].as_str().unwrap_or_default()) {
        lines.extend(section(out));
    }
    let missing = lines.iter().map(|l| l.matches(MISSING).count()).sum::<usize>();
    if missing > 0 {
        lines.push(format!(
            "{missing} figure(s) missing from the JSON (shown as `{MISSING}`)"
        ));
    }
    lines.push(match json {
        Some(path) => format!("every figure, with its configuration: {}", path.display()),
        None => "headline figures only: --json FILE writes every figure, with its configuration".into(),
    });
    lines
}

/// The sections of `suite` (the full suite's for one this does not know).
fn sections(suite: &str) -> Vec<Section> {
    match suite {
        "device" => vec![training::device],
        "parameter_server" => vec![training::parameter_server],
        "soak" => vec![training::soak],
        "layouts" => vec![training::layouts],
        "scale" => vec![comm::scale],
        "tls" => vec![comm::tls],
        "data_paths" => vec![comm::data_paths],
        "kernels" => vec![physical, training::kernels],
        "actor_api" => vec![comm::actor_api],
        "collectives" => vec![comm::collectives],
        "compression" => vec![training::compression],
        "slow_link" => vec![training::slow_link],
        _ => vec![
            physical,
            comm::collectives,
            comm::cross_process,
            comm::actor_api,
            comm::scale,
            training::training,
            training::kernels,
            training::offload,
            training::soak,
            training::parameter_server,
            peers,
        ],
    }
}

/// The run: its suite, wall time, the load average at its end and the peak RSS.
fn run_line(out: &Value) -> String {
    let suite = out["suite"].as_str().unwrap_or(MISSING);
    let quick = if out["quick"] == true { " --quick" } else { "" };
    let wall = fig_unit(at(out, "/wall_s"), "s");
    let load = out["load_avg_end"].as_array().map(|l| {
        let figures: Vec<String> = l.iter().map(|x| fig(x.as_f64())).collect();
        format!(", load average at the end {}", figures.join(" "))
    });
    let rss =
        at(out, "/peak_rss_bytes_bench_process").map(|b| format!(", peak RSS {} MB", fig(Some(b / 1e6))));
    format!(
        "bench{quick}, suite {suite}: {wall}{}{}",
        load.unwrap_or_default(),
        rss.unwrap_or_default()
    )
}

/// The matmul rate of one core: burn's Flex and the CPU kernel the runs use.
fn physical(out: &Value) -> Vec<String> {
    let limits = &out["physical_limits"];
    let kernel = (limits["cpu_matmul"].as_str().or(out["cpu_matmul"].as_str()))
        .map(|k| k.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| MISSING.into());
    if limits.is_null() {
        // `--kernels-only` names the kernel but measures no matmul rate.
        return vec![format!("CPU matmul: {kernel}")];
    }
    let flex = fig_unit(at(limits, "/matmul_gflops_one_thread"), "GFLOP/s");
    let cpu = fig_unit(at(limits, "/cpu_matmul_gflops_one_thread"), "GFLOP/s");
    vec![format!(
        "matmul on one core, n=512 f32: {flex} burn Flex, {cpu} {kernel}"
    )]
}

/// Whether `--peers` ran, and where its figures are when it did.
fn peers(out: &Value) -> Vec<String> {
    match &out["peers"] {
        Value::Null => vec!["peers: not run (--peers PYTHON measures PyTorch beside these)".into()],
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests;
