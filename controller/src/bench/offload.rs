//! Offload benchmark: mlp-8x1024 at dp=2 under ZeRO-3 with the state offloaded to host memory
//! and to files (with the parameter shards too), beside a plain sequential write and read of the
//! same number of bytes in the same directory in the same run — the physical limit the NVMe
//! tier's traffic is bounded by. Both go through the OS page cache.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use serde_json::{Value, json};

use archipelago_dataflow::{Offload, ParallelPlan};

use super::training::timed_mlp;
use crate::process_stats::load_avg;

/// Runs the offloaded configurations with the NVMe tier under `dir`.
pub fn mlp_offload(warmup: u64, timed: u64, dir: &Path) -> anyhow::Result<Value> {
    let nvme = Offload::Nvme {
        dir: dir.display().to_string(),
    };
    let mut runs = Vec::new();
    let mut state_bytes = 0;
    for (offload, params) in [(Offload::Cpu, false), (nvme.clone(), false), (nvme, true)] {
        let plan = ParallelPlan {
            dp: 2,
            zero: 3,
            offload: offload.clone(),
            offload_params: params,
            ..ParallelPlan::default()
        };
        let name = format!(
            "mlp-8x1024 dp=2 zero=3 offload={offload}{}",
            if params { " +params" } else { "" }
        );
        let (report, step_s) = timed_mlp(plan, warmup, timed, format!("bench-offload-{}", runs.len()))?;
        let steps = report.steps.len() as f64;
        let o: Vec<_> = report.actors.iter().filter_map(|a| a.offload.clone()).collect();
        let sum = |f: &dyn Fn(&crate::report::OffloadRecord) -> f64| o.iter().map(f).sum::<f64>();
        state_bytes = state_bytes.max(o.iter().map(|r| r.disk_bytes).sum::<u64>());
        runs.push(json!({
            "name": name,
            "config": { "model": "mlp-8x1024", "dp": 2, "zero": 3, "offload": offload.to_string(), "offload_params": params, "global_batch": 64, "warmup_steps": warmup, "timed_steps": timed, "cores_per_actor": 1 },
            "median_step_s": step_s,
            "steps_per_s": 1.0 / step_s,
            "device_model_state_bytes_per_actor": report.actors.iter().map(|a| a.model_state_bytes).collect::<Vec<_>>(),
            "host_bytes_per_actor": o.iter().map(|r| r.host_bytes).collect::<Vec<_>>(),
            "disk_bytes_per_actor": o.iter().map(|r| r.disk_bytes).collect::<Vec<_>>(),
            "read_gb_s_while_reading": o.iter().map(|r| r.read_gb_s).collect::<Vec<_>>(),
            "write_gb_s_while_writing": o.iter().map(|r| r.write_gb_s).collect::<Vec<_>>(),
            "read_bytes_per_step": sum(&|r| r.read_bytes as f64) / steps,
            "written_bytes_per_step": sum(&|r| r.written_bytes as f64) / steps,
            "optimizer_wait_s_per_step_per_actor": sum(&|r| r.wait_s) / steps / o.len().max(1) as f64,
            "host_optimizer_s_per_step_per_actor": sum(&|r| r.optimizer_s) / steps / o.len().max(1) as f64,
            "final_loss": report.final_loss,
            "load_avg": load_avg(),
        }));
    }
    let sequential = sequential_io(dir, state_bytes.max(1 << 20))?;
    Ok(json!({ "runs": runs, "sequential_file_io": sequential }))
}

/// Writes `bytes` to a new file under `dir` in 8 MiB blocks (allocating), writes them again over
/// the same blocks (as the offload tier does every step), reads them back, and removes the file.
fn sequential_io(dir: &Path, bytes: u64) -> anyhow::Result<Value> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("archipelago-bench-seq-{}.bin", std::process::id()));
    let block = vec![0x5au8; 8 << 20];
    let write = |create: bool| -> anyhow::Result<f64> {
        let began = Instant::now();
        let mut file = if create {
            std::fs::File::create(&path)?
        } else {
            std::fs::OpenOptions::new().write(true).open(&path)?
        };
        let mut left = bytes;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            file.write_all(&block[..n])?;
            left -= n as u64;
        }
        file.flush()?;
        Ok(began.elapsed().as_secs_f64())
    };
    let allocate_s = write(true)?;
    let rewrite_s = write(false)?;
    let mut buf = vec![0u8; 8 << 20];
    let began = Instant::now();
    let mut file = std::fs::File::open(&path)?;
    let mut read = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        read += n as u64;
    }
    let read_s = began.elapsed().as_secs_f64();
    std::fs::remove_file(&path)?;
    Ok(json!({
        "bytes": bytes,
        "dir": dir.display().to_string(),
        "write_new_file_gb_s": bytes as f64 / allocate_s / 1e9,
        "rewrite_gb_s": bytes as f64 / rewrite_s / 1e9,
        "read_gb_s": read as f64 / read_s / 1e9,
        "note": "buffered I/O through the page cache, like the offload tier (which rewrites a preallocated file)",
        "load_avg": load_avg(),
    }))
}
