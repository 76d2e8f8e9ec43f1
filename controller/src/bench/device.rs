//! Training throughput on one device (`bench --device cuda:0`, or `cpu:0`): gpt-tiny and, on a
//! GPU, a larger gpt (d=1024, 12 layers, 16 heads, ctx 1024) at dp=1 — tokens/s and model FLOP
//! utilisation against the device's f32 matmul rate measured in the same run and, for GPUs whose
//! datasheet we know, against the datasheet's f32 and TF32 peaks. The training state is placed as
//! `train --state auto` places it (on a GPU, on the device).

use serde_json::{Value, json};

use archipelago_dataflow::{DeviceSpec, ModelSpec, Offload, ParallelPlan, StatePlacement};

use super::training::timed_model_on;
use crate::process_stats::load_avg;

/// The larger gpt of issue 8 (≈ 151M parameters; 8 sequences of 1024 tokens per step).
pub const GPT_LARGE: &str = "gpt:vocab=256,ctx=1024,d=1024,layers=12,heads=16";

/// Datasheet dense f32 (CUDA cores) and TF32 (tensor cores) peaks in TFLOP/s, by GPU name.
pub fn datasheet_tflops(name: &str) -> Option<(f64, f64)> {
    let n = name.to_ascii_uppercase();
    if n.contains("H100") && n.contains("PCIE") {
        Some((51.2, 378.0))
    } else if n.contains("H100") || n.contains("H200") || n.contains("GH200") {
        Some((66.9, 494.7))
    } else if n.contains("A100") {
        Some((19.5, 156.0))
    } else if n.contains("L4") && !n.contains("L40") {
        Some((30.3, 60.0))
    } else {
        None
    }
}

/// The runs on `device`: each model's tokens/s and MFU.
pub fn gpt_on_device(device: DeviceSpec, quick: bool) -> anyhow::Result<Value> {
    archipelago_actors::check_devices(&[device]).map_err(anyhow::Error::msg)?;
    let gpu = device.cuda_ordinal().and_then(|n| {
        archipelago_actors::gpus::list()
            .ok()
            .and_then(|g| g.into_iter().find(|g| g.index == n))
    });
    let on_gpu = device.cuda_ordinal().is_some();
    let (n, reps) = if on_gpu { (4096, 20) } else { (512, 5) };
    let matmul_gflops =
        archipelago_actors::peak::device_matmul_gflops(device, n, reps).map_err(anyhow::Error::msg)?;
    let datasheet = gpu.as_ref().and_then(|g| datasheet_tflops(&g.name));
    let mut models = vec![("gpt-tiny", 16usize)];
    if on_gpu {
        models.push((GPT_LARGE, 8));
    }
    let (warmup, timed) = if quick { (2, 5) } else { (5, 30) };
    // What `train --state auto` picks: the state on a GPU, flat vectors on a CPU.
    let state = StatePlacement::auto_for(&[device], &Offload::None);
    let optimizer = match state {
        StatePlacement::Device => "Adam (tensors on the device, updated there)",
        StatePlacement::Host | StatePlacement::Auto => "Adam (flat, on the host)",
    };
    let mut runs = Vec::new();
    for (model, batch) in models {
        let spec = ModelSpec::parse(model)?;
        let tokens = (batch * spec.input().tokens_per_sample()) as f64;
        let plan = ParallelPlan {
            batch,
            state,
            ..ParallelPlan::default()
        };
        let (report, step_s) = timed_model_on(
            model,
            plan,
            vec![device],
            warmup,
            timed,
            format!("bench-{device}-{model}"),
        )?;
        let model_tflops = spec.training_flops_per_token() * tokens / step_s / 1e12;
        runs.push(json!({
            "name": format!("{model} dp=1 on {device}"),
            "config": { "model": model, "params": spec.desc().params(), "device": device.to_string(), "global_batch": batch, "tokens_per_step": tokens, "dtype": "f32", "optimizer": optimizer, "state": state.to_string(), "warmup_steps": warmup, "timed_steps": timed },
            "median_step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "model_flops_per_token": spec.training_flops_per_token(),
            "model_tflops_per_s": model_tflops,
            "mfu_vs_measured_matmul": model_tflops * 1e3 / matmul_gflops,
            "mfu_vs_datasheet_f32": datasheet.map(|(f32_peak, _)| model_tflops / f32_peak),
            "mfu_vs_datasheet_tf32": datasheet.map(|(_, tf32)| model_tflops / tf32),
            "final_loss": report.final_loss,
            "host_device_bytes_per_step": report.steps.last().map(|s| s.transfers),
            "fabric_bytes_per_step": report.steps.last().map(|s| s.fabric),
            "predicted_fabric_bytes_per_step": report.predicted_fabric_bytes_per_step(),
            "device_memory": report.actors.first().and_then(|a| a.device_memory),
            "estimated_device_bytes": report.actors.first().map(|a| a.estimated_device_bytes),
            "load_avg": load_avg(),
        }));
    }
    Ok(json!({
        "device": device.to_string(),
        "gpu": gpu,
        "matmul_gflops": matmul_gflops,
        "matmul_config": { "n": n, "dtype": "f32", "reps": reps },
        "datasheet_tflops": datasheet.map(|(f, t)| json!({ "f32": f, "tf32": t })),
        "runs": runs,
    }))
}
