//! The summary's training sections: step times and throughputs of the training runs (with
//! ours over PyTorch's throughput where `--peers` measured it), the CPU matmul per workload,
//! the offload tier beside plain file I/O, the soak, the parameter server and `--device`.

use serde_json::Value;

use super::comm::clip;
use super::table::{MISSING, Table, at, fig, fig_unit, list, load, mean, missing_section, num, plain};

/// The training runs of the full suite: mlp-8x1024 at dp=1 and 2, pipelined, ZeRO, gpt-tiny.
pub(super) fn training(out: &Value) -> Vec<String> {
    let ratios = out["peers"]["training_ours_over_torch"].as_array();
    let mut heads = vec!["step s", "throughput"];
    if ratios.is_some() {
        heads.push("× PyTorch");
    }
    heads.push("load");
    let mut table = Table::new("training, 1 core per actor", &heads);
    let sections = [
        ("training", "samples_per_s", "samples/s"),
        ("pipeline", "samples_per_s", "samples/s"),
        ("zero", "steps_per_s", "steps/s"),
        ("gpt_tiny", "tokens_per_s", "tokens/s"),
    ];
    for (key, throughput, unit) in sections {
        let Some(runs) = list(&out[key], "runs") else {
            table.row(format!("{key}: runs"), vec![MISSING.into()]);
            continue;
        };
        // The peers' ratios are of the plain data-parallel runs (training and gpt_tiny).
        let ratios = ratios.filter(|_| key == "training" || key == "gpt_tiny");
        for run in runs {
            let mut cells = vec![
                fig(run["median_step_s"].as_f64()),
                fig_unit(run[throughput].as_f64(), unit),
            ];
            if heads.len() == 4 {
                cells.push(match ratios {
                    Some(ratios) if is_plain_dp(run) => fig(ratio_for(ratios, &run["config"])),
                    _ => String::new(),
                });
            }
            cells.push(load(run));
            table.row(run["name"].as_str().unwrap_or("?"), cells);
        }
    }
    let speedup = at(&out["training"], "/dp2_speedup_over_dp1");
    table.row(
        "mlp dp=2 over dp=1",
        vec![String::new(), fig_unit(speedup, "× speedup")],
    );
    let mut lines = table.lines();
    lines.extend(torch_errors(&out["peers"]["torch_training"]));
    lines
}

/// Whether `run` is one the peers' ratios pair with PyTorch's (no pipeline, no ZeRO, no tp).
fn is_plain_dp(run: &Value) -> bool {
    let config = &run["config"];
    config["pp"].as_u64().unwrap_or(1) == 1
        && config["zero"].as_u64().unwrap_or(0) == 0
        && config["tp"].as_u64().unwrap_or(1) == 1
}

/// `--layouts-only`: gpt-tiny under each layout, its tokens/s and the fabric bytes its actors
/// read per step, measured against the plan's.
pub(super) fn layouts(out: &Value) -> Vec<String> {
    let Some(runs) = list(&out["gpt_tiny"], "runs") else {
        return missing_section("gpt_tiny layouts");
    };
    let heads = ["step s", "throughput", "fabric B/step", "plan's", "load"];
    let mut table = Table::new("gpt-tiny layouts, 1 core per actor", &heads);
    let total = |bytes: &Value| {
        (bytes.as_object()).map(|kinds| kinds.values().filter_map(Value::as_f64).sum::<f64>())
    };
    for run in runs {
        let cells = vec![
            fig(run["median_step_s"].as_f64()),
            fig_unit(run["tokens_per_s"].as_f64(), "tokens/s"),
            plain(total(&run["fabric_bytes_per_step"])),
            plain(total(&run["predicted_fabric_bytes_per_step"])),
            load(run),
        ];
        table.row(run["name"].as_str().unwrap_or("?"), cells);
    }
    table.lines()
}

/// Ours over PyTorch's throughput for the run of `config`'s model and dp.
fn ratio_for(ratios: &[Value], config: &Value) -> Option<f64> {
    ratios
        .iter()
        .find(|r| r["model"] == config["model"] && r["dp"] == config["dp"])?["ours_over_torch_throughput"]
        .as_f64()
}

/// A line per PyTorch run that failed (its figures are then missing from the ratios).
fn torch_errors(torch: &Value) -> Vec<String> {
    let runs = torch["runs"].as_array().cloned().unwrap_or_default();
    (runs.iter())
        .filter_map(|r| r["error"].as_str().map(|e| (r["dp"].clone(), e)))
        .map(|(dp, error)| format!("  PyTorch dp={dp} failed: {}", clip(error, 70)))
        .collect()
}

/// The CPU matmul per workload: auto's step beside the fastest other variant, in child
/// processes one after the other (and ours over PyTorch's throughput under `--peers`).
pub(super) fn kernels(out: &Value) -> Vec<String> {
    let Some(workloads) = list(&out["kernels"], "workloads") else {
        return missing_section("CPU kernels");
    };
    let ratios = out["peers"]["auto_over_torch"].as_array();
    let aim = format!("≤ {}×", plain(at(&out["kernels"], "/aim_auto_step_over_fastest")));
    let mut heads = vec![
        "auto step s",
        "fastest other",
        "its step s",
        "auto / it",
        aim.as_str(),
    ];
    if ratios.is_some() {
        heads.push("× PyTorch");
    }
    let mut table = Table::new("CPU matmul per workload", &heads);
    for workload in workloads {
        let variant = |name: &Value| {
            let variants = workload["variants"].as_array();
            let found = variants.and_then(|v| v.iter().find(|x| &x["name"] == name));
            fig(found.and_then(|x| x["median_step_s"].as_f64()))
        };
        let fastest = &workload["fastest_other"];
        let mut cells = vec![
            variant(&Value::from("auto")),
            fastest.as_str().unwrap_or(MISSING).to_string(),
            variant(fastest),
            fig(workload["auto_step_over_fastest"].as_f64()),
            workload["within_aim"]
                .as_bool()
                .map_or(MISSING, |w| if w { "yes" } else { "no" })
                .into(),
        ];
        if let Some(ratios) = ratios {
            cells.push(fig(ratio_for(ratios, &workload["config"])));
        }
        table.row(workload["name"].as_str().unwrap_or("?"), cells);
    }
    let mut lines = table.lines();
    lines.extend(torch_errors(&out["peers"]["torch_training"]));
    lines
}

/// The offload tier's runs beside a sequential write and read of the same bytes.
pub(super) fn offload(out: &Value) -> Vec<String> {
    let Some(runs) = list(&out["offload"], "runs") else {
        return missing_section("offload");
    };
    let heads = ["step s", "read GB/s", "write GB/s", "load"];
    let mut table = Table::new("offload, mlp-8x1024 dp=2 zero=3", &heads);
    for run in runs {
        let name = run["name"].as_str().unwrap_or("?");
        let label = name.find("offload=").map_or(name, |i| &name[i..]);
        let cells = vec![
            fig(run["median_step_s"].as_f64()),
            fig(mean(&run["read_gb_s_while_reading"])),
            fig(mean(&run["write_gb_s_while_writing"])),
            load(run),
        ];
        table.row(label, cells);
    }
    let io = &out["offload"]["sequential_file_io"];
    let cells = vec![
        String::new(),
        fig(at(io, "/read_gb_s")),
        fig(at(io, "/rewrite_gb_s")),
        load(io),
    ];
    table.row("file I/O, sequential", cells);
    table.lines()
}

/// The soak: memory from step 1,000 to the end with the dashboard attached.
pub(super) fn soak(out: &Value) -> Vec<String> {
    let Some(soak) = out.get("soak") else {
        return missing_section("soak");
    };
    let heads = ["median step ms", "RSS MB at end", "RSS growth %", "aim %", "load"];
    let steps = plain(at(soak, "/config/steps"));
    let mut table = Table::new(format!("soak, {steps} steps, dashboard on"), &heads);
    let samples = soak["samples"].as_array();
    let rss = samples
        .and_then(|s| s.last())
        .and_then(|s| s["rss_bytes"].as_f64());
    let cells = vec![
        fig(at(soak, "/median_step_s").map(|s| s * 1e3)),
        fig(rss.map(|b| b / 1e6)),
        fig(at(soak, "/rss_growth_fraction_1k_to_end").map(|f| f * 100.0)),
        plain(at(soak, "/aim_growth_fraction").map(|f| f * 100.0)),
        load(soak),
    ];
    table.row("mlp dp=2, 1k → end", cells);
    table.lines()
}

/// The parameter server: sparse logistic regression at 1, 2 and 4 servers, and at millions of
/// features.
pub(super) fn parameter_server(out: &Value) -> Vec<String> {
    let ps = &out["parameter_server"];
    let Some(scaling) = list(ps, "scaling") else {
        return missing_section("parameter server");
    };
    let heads = ["examples/s", "pushes/s", "payload MB/s", "final loss"];
    let mut table = Table::new("parameter server, sparse LR", &heads);
    for run in scaling {
        let count = |key: &str, what: &str| match run[key].as_u64() {
            Some(1) => format!("1 {what}"),
            Some(n) => format!("{n} {what}s"),
            None => format!("{MISSING} {what}s"),
        };
        let cells = vec![
            fig(run["examples_per_s"].as_f64()),
            fig(run["pushes_per_s"].as_f64()),
            fig(run["payload_bytes_per_s"].as_f64().map(|b| b / 1e6)),
            fig(run["final_loss"].as_f64()),
        ];
        table.row(
            format!("{}, {}", count("servers", "server"), count("workers", "worker")),
            cells,
        );
    }
    let big = &ps["convergence_at_millions"];
    let features = plain(at(big, "/features").map(|f| f / 1e6));
    let cells = vec![
        fig(at(big, "/examples_per_s")),
        String::new(),
        String::new(),
        fig(at(big, "/summary/objective_end")),
    ];
    table.row(format!("{features}M features"), cells);
    table.lines()
}

/// `--device D`: the training runs on the device, with model FLOP utilisation.
pub(super) fn device(out: &Value) -> Vec<String> {
    let device = &out["device_training"];
    let Some(runs) = list(device, "runs") else {
        return missing_section("training on the device");
    };
    let name = (device["gpu"]["name"].as_str().or(device["device"].as_str())).unwrap_or(MISSING);
    let matmul = fig_unit(at(device, "/matmul_gflops"), "GFLOP/s");
    let title = format!("training on {name} (matmul {matmul})");
    let heads = [
        "step s",
        "tokens/s",
        "model TFLOP/s",
        "MFU of matmul",
        "MFU of f32 peak",
    ];
    let mut table = Table::new(title, &heads);
    for run in runs {
        let cells = vec![
            fig(run["median_step_s"].as_f64()),
            fig(run["tokens_per_s"].as_f64()),
            fig(run["model_tflops_per_s"].as_f64()),
            fig(run["mfu_vs_measured_matmul"].as_f64()),
            run["mfu_vs_datasheet_f32"]
                .as_f64()
                .map_or_else(|| "no datasheet".into(), num),
        ];
        table.row(run["name"].as_str().unwrap_or("?"), cells);
    }
    table.lines()
}

/// Communication compression (`--compression-only`): each run's mean loss of the last steps, its
/// distance to the uncompressed run of its layout and how many times fewer gradient and
/// parameter bytes it moved (measured; whether they equal the plan's prediction).
pub(super) fn compression(out: &Value) -> Vec<String> {
    let Some(runs) = list(&out["compression"], "runs") else {
        return missing_section("compression: runs");
    };
    let heads = [
        "last-20 loss",
        "gap",
        "grads ×fewer",
        "params ×fewer",
        "as planned",
        "step s",
    ];
    let mut table = Table::new("compression, gpt-tiny dp=2", &heads);
    for run in runs {
        let gap =
            at(run, "/against_uncompressed/relative_loss_gap").map_or("—".into(), |g| format!("{g:.2e}"));
        // "—": the reference run itself, or a kind of bytes neither run moves.
        let fewer = |key: &str| {
            at(run, &format!("/against_uncompressed/{key}")).map_or("—".into(), |x| fig(Some(x)))
        };
        let planned = run["measured_equals_predicted"]
            .as_bool()
            .map_or(MISSING.into(), |b| b.to_string());
        let cells = vec![
            fig(at(run, "/mean_last_loss")),
            gap,
            fewer("gradient_bytes_fewer"),
            fewer("parameter_bytes_fewer"),
            planned,
            fig(at(run, "/median_step_s")),
        ];
        table.row(run["run"].as_str().unwrap_or(MISSING), cells);
    }
    table.lines()
}

/// The slow link (`--slow-link-only`): each run's step time, steps/s against the uncompressed
/// run's, and the gradient bytes the fabric moved and the link carried per step.
pub(super) fn slow_link(out: &Value) -> Vec<String> {
    if let Some(why) = out["slow_link"]["not_run"].as_str() {
        return vec![format!("slow link: not run: {why}")];
    }
    let Some(runs) = list(&out["slow_link"], "runs") else {
        return missing_section("slow_link: runs");
    };
    let heads = [
        "step s",
        "steps/s",
        "× uncompressed",
        "grad bytes/step",
        "link bytes/step",
    ];
    let rate = out["slow_link"]["rate_mbit"].as_u64().unwrap_or(0);
    let mut table = Table::new(format!("slow link, mlp-8x1024 dp=2 over {rate} Mbit/s"), &heads);
    for run in runs {
        let cells = vec![
            fig(at(run, "/median_step_s")),
            fig(at(run, "/steps_per_s")),
            fig(at(run, "/steps_per_s_over_uncompressed")),
            fig(at(run, "/gradient_fabric_bytes_per_step")),
            fig(at(run, "/link_bytes_per_step")),
        ];
        table.row(run["run"].as_str().unwrap_or(MISSING), cells);
    }
    table.lines()
}
