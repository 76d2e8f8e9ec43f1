//! The summary of a real `bench --quick --json` output (tests/fixtures/bench_quick.json, a
//! run of the 2-core development machine): short, with the headline figures, every sub-suite's
//! too, and a figure taken out of the JSON reported as missing rather than dropped.

use std::path::Path;

use serde_json::{Value, json};

use super::summary;

fn quick() -> Value {
    serde_json::from_str(include_str!("../../../tests/fixtures/bench_quick.json")).expect("fixture")
}

fn row<'a>(lines: &'a [String], label: &str) -> &'a str {
    let found = lines.iter().find(|l| l.trim_start().starts_with(label));
    found.unwrap_or_else(|| panic!("no row `{label}` in\n{}", lines.join("\n")))
}

#[test]
fn the_quick_suite_fits_in_sixty_lines_with_its_headline_figures() {
    let lines = summary(&quick(), None);
    let text = lines.join("\n");
    assert!(lines.len() <= 60, "{} lines:\n{text}", lines.len());
    assert!(!text.contains("missing"), "{text}");
    assert!(
        lines[0].contains("194 s") && lines[0].contains("3.85 3.54 2.87"),
        "{}",
        lines[0]
    );
    assert!(
        text.contains("78.8 GFLOP/s burn Flex, 145 GFLOP/s OpenBLAS 0.3.21"),
        "{text}"
    );
    // Bandwidths beside memcpy, round trips, calls beside the fabric's, step times.
    assert!(row(&lines, "shared buffers").contains("3.36 (0.897)"), "{text}");
    assert!(
        row(&lines, "raw TCP, 2 processes").contains("2.47 (0.561)"),
        "{text}"
    );
    assert!(row(&lines, "2 processes, TCP").contains("47.6k (1.65)"), "{text}");
    assert!(row(&lines, "gpt-tiny dp=2 ").contains("4331 tokens/s"), "{text}");
    assert!(
        row(&lines, "mlp-8x1024 dp=2 zero=3").contains("4.71 steps/s"),
        "{text}"
    );
    assert!(
        row(&lines, "one step, 1024 no-op actors").contains("0.00637 s"),
        "{text}"
    );
    assert!(
        row(&lines, "offload=nvme:/tmp +params").contains("0.233"),
        "{text}"
    );
    assert!(row(&lines, "4 servers").contains("189k"), "{text}");
    assert!(
        row(&lines, "hang (cycle) to report, aim 5 s").contains("3.02 s"),
        "{text}"
    );
    assert!(text.contains("peers: not run"), "{text}");
    let last = lines.last().unwrap();
    assert!(last.contains("--json FILE"), "{last}");
}

#[test]
fn the_last_line_names_the_json_file_when_there_is_one() {
    let lines = summary(&quick(), Some(Path::new("/tmp/b.json")));
    assert_eq!(
        lines.last().unwrap(),
        "every figure, with its configuration: /tmp/b.json"
    );
}

#[test]
fn a_figure_missing_from_the_json_is_reported_missing_not_dropped() {
    let mut out = quick();
    let full = summary(&out, None);
    out["gpt_tiny"]["runs"][1]
        .as_object_mut()
        .unwrap()
        .remove("tokens_per_s");
    out["collectives"][0]
        .as_object_mut()
        .unwrap()
        .remove("algbw_gb_per_s");
    out.as_object_mut().unwrap().remove("soak");
    let lines = summary(&out, None);
    assert!(row(&lines, "gpt-tiny dp=2 ").contains("missing"), "{lines:#?}");
    assert!(row(&lines, "shared buffers").contains("missing"), "{lines:#?}");
    assert!(lines.iter().any(|l| l.starts_with("soak: missing")), "{lines:#?}");
    assert!(
        lines.iter().any(|l| l.starts_with("3 figure(s) missing")),
        "{lines:#?}"
    );
    // The rows stay: only the soak's table (title and row) became its one line, and the count
    // of missing figures came before the last line.
    assert_eq!(lines.len(), full.len() - 2 + 1 + 1, "{lines:#?}");
}

#[test]
fn the_peers_ratios_land_beside_our_figures() {
    let mut out = quick();
    out["peers"] = json!({
        "gloo": { "runs": [{ "collective": "all_reduce", "algbw_gb_per_s": 0.5 }] },
        "torch_training": { "runs": [{ "dp": 1, "error": "torch_reference.py exited with 1" }] },
        "training_ours_over_torch": [{ "model": "gpt-tiny", "dp": 2, "ours_over_torch_throughput": 1.25 }],
    });
    let lines = summary(&out, None);
    let text = lines.join("\n");
    assert!(lines.len() <= 60, "{text}");
    assert!(row(&lines, "PyTorch gloo").contains("0.5"), "{text}");
    assert!(row(&lines, "all_reduce shm / gloo").contains("1.70"), "{text}");
    assert!(row(&lines, "gpt-tiny dp=2 ").contains("1.25"), "{text}");
    // A plain run PyTorch did not pair is missing its ratio; a pipelined one has none to have.
    assert!(row(&lines, "gpt-tiny dp=1").contains("missing"), "{text}");
    assert!(!row(&lines, "gpt-tiny pp=2 1f1b").contains("missing"), "{text}");
    assert!(
        text.contains("PyTorch dp=1 failed: torch_reference.py exited with 1"),
        "{text}"
    );
    assert!(!text.contains("peers: not run"), "{text}");
}

/// Each `--*-only` suite's JSON, shaped as `bench::run` writes it, from the fixture's sections.
fn sub_suites(q: &Value) -> Vec<Value> {
    let cp = &q["cross_process"];
    let scale =
        json!({ "plan": q["controller_at_scale"]["plan"], "dispatch": q["controller_at_scale"]["dispatch"] });
    let tcp = json!({ "plain": cp["tcp_2_processes"], "tls": cp["tcp_tls_2_processes"], "all_reduce_tls_over_plain": 0.43 });
    let paths = json!({ "shm_2_processes": cp["shm_2_processes"], "tcp_2_processes": cp["tcp_2_processes"], "grpc_2_processes": cp["grpc_2_processes"], "ratios": { "all_reduce_shm_over_tcp": 0.81, "tensor_move_shm_over_tcp": 1.39 } });
    vec![
        json!({ "suite": "collectives", "collectives": q["collectives"], "wall_s": 9.0 }),
        json!({ "suite": "actor_api", "actor_api": q["actor_api"], "wall_s": 9.0 }),
        json!({ "suite": "scale", "scale": scale, "wall_s": 9.0 }),
        json!({ "suite": "soak", "soak": q["soak"], "wall_s": 9.0 }),
        json!({ "suite": "layouts", "quick": true, "gpt_tiny": { "runs": [
            { "name": "gpt-tiny dp=2", "median_step_s": 1.2, "tokens_per_s": 1700.0, "load_avg": [1.0, 1.0, 1.0],
              "fabric_bytes_per_step": { "gradients": 5.0e6, "tensor_parallel": 0.0 }, "predicted_fabric_bytes_per_step": { "gradients": 5.0e6, "tensor_parallel": 0.0 } },
            { "name": "gpt-tiny tp=2", "median_step_s": 1.1, "tokens_per_s": 1860.0, "load_avg": [1.0, 1.0, 1.0],
              "fabric_bytes_per_step": { "gradients": 0.0, "tensor_parallel": 3.8e7 }, "predicted_fabric_bytes_per_step": { "gradients": 0.0, "tensor_parallel": 3.8e7 } } ] },
            "load_avg_end": [1.0, 1.0, 1.0], "wall_s": 9.0 }),
        json!({ "suite": "parameter_server", "quick": true, "parameter_server": q["parameter_server"], "load_avg_end": [1.0, 1.0, 1.0], "wall_s": 9.0 }),
        json!({ "suite": "kernels", "quick": true, "cpu_matmul": q["physical_limits"]["cpu_matmul"], "kernels": q["kernels"], "peers": null, "wall_s": 9.0 }),
        json!({ "suite": "tls", "tcp_2_processes": tcp, "wall_s": 9.0 }),
        json!({ "suite": "data_paths", "data_paths": paths, "peers": null, "wall_s": 9.0 }),
        json!({ "suite": "device", "quick": true, "device_training": { "device": "cpu:0", "gpu": null, "matmul_gflops": 80.0, "datasheet_tflops": null,
            "runs": [{ "name": "gpt-tiny dp=1 on cpu:0", "median_step_s": 0.6, "tokens_per_s": 3400.0, "model_tflops_per_s": 0.01, "mfu_vs_measured_matmul": 0.12, "mfu_vs_datasheet_f32": null }] }, "wall_s": 9.0 }),
    ]
}

#[test]
fn every_sub_suite_prints_its_own_short_summary() {
    for out in sub_suites(&quick()) {
        let lines = summary(&out, None);
        let text = lines.join("\n");
        assert!(lines.len() <= 12, "{text}");
        assert!(!text.contains("missing"), "{text}");
        assert!(
            lines[0].starts_with("bench") && lines[0].contains("9.00 s"),
            "{text}"
        );
        assert!(lines.last().unwrap().contains("--json FILE"), "{text}");
    }
}
