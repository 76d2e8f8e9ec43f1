//! Offload (ZeRO-Offload to host memory, ZeRO-Infinity to files) trains to the same parameters
//! and losses as one device, for every ZeRO stage, with the parameter shards offloaded too and
//! under pipeline stages; the device keeps only its working parameters while the offload actor
//! holds the master shard and Adam's state (12Ψ/N bytes), in host memory or in a real file that
//! is gone after the run. A ~100M-parameter mlp whose states do not fit 256 MiB per device is
//! refused without offload, with the fix named, and trains with ZeRO-3 + NVMe offload.

use archipelago_dataflow::{ModelSpec, Offload, ParallelPlan, Program, compile};
use archipelago_integration_tests::{assert_equivalent, assert_params_moved, train_plan};

const MLP7: &str = "mlp:in=24,hidden=48,layers=6,out=5";
const PARAMS: u64 = 13_205;

fn plan(dp: usize, pp: usize, zero: u8, offload: Offload, offload_params: bool) -> ParallelPlan {
    ParallelPlan {
        dp,
        pp,
        zero,
        offload,
        offload_params,
        microbatches: if pp > 1 { 2 } else { 1 },
        batch: 24,
        bucket_bytes: 8 << 10, // several buckets: several hand-offs, read-aheads and write-behinds
        ..ParallelPlan::default()
    }
}

fn tiers(dir: &tempfile::TempDir) -> [Offload; 2] {
    [
        Offload::Cpu,
        Offload::Nvme {
            dir: dir.path().display().to_string(),
        },
    ]
}

#[test]
fn offloaded_zero_stages_match_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let reference = train_plan(MLP7, plan(1, 1, 0, Offload::None, false), 6);
    assert_params_moved(MLP7, &reference);
    for tier in tiers(&dir) {
        let cases = [
            (1, 0, false),
            (2, 0, false),
            (2, 1, false),
            (2, 2, false),
            (4, 2, false),
            (2, 3, false),
            (2, 3, true),
            (4, 3, true),
        ];
        for (dp, zero, params) in cases {
            let run = train_plan(MLP7, plan(dp, 1, zero, tier.clone(), params), 6);
            let what = format!(
                "--offload {tier} zero {zero} dp={dp}{}",
                if params { " --offload-params" } else { "" }
            );
            assert_equivalent(&reference, &run, 1e-5, &what);
            let n = if zero >= 1 { dp as u64 } else { 1 };
            for a in &run.actors {
                // The device keeps its working parameters only (none under --offload-params).
                let device = match (zero, params) {
                    (3, true) => 0,
                    (3, false) => 4 * PARAMS / dp as u64,
                    _ => 4 * PARAMS,
                };
                let near = |x: u64, y: u64| (x as f64 - y as f64).abs() <= 0.02 * y as f64 + 64.0;
                assert!(
                    near(a.model_state_bytes, device),
                    "{what}: actor {} keeps {} bytes on the device, expected {device}",
                    a.actor,
                    a.model_state_bytes
                );
                let o = a.offload.as_ref().expect("an offload record");
                let offloaded = 12 * PARAMS / n;
                match tier {
                    Offload::Cpu => assert!(near(o.host_bytes, offloaded), "{what}: host {}", o.host_bytes),
                    _ => {
                        assert!(near(o.disk_bytes, offloaded), "{what}: disk {}", o.disk_bytes);
                        assert!(
                            o.written_bytes >= o.disk_bytes,
                            "{what}: every region written each step"
                        );
                        assert!(
                            o.read_bytes >= o.disk_bytes,
                            "{what}: every region read each step"
                        );
                    }
                }
                assert!(
                    near(o.disk_bytes, o.estimated_disk_bytes),
                    "{what}: plan's disk estimate"
                );
            }
        }
    }
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "offload files left behind: {left:?}");
}

#[test]
fn offload_composes_with_pipeline_stages() {
    let dir = tempfile::tempdir().unwrap();
    let reference = train_plan(MLP7, plan(1, 1, 0, Offload::None, false), 6);
    for tier in tiers(&dir) {
        for (zero, params) in [(0, false), (2, false), (3, true)] {
            let run = train_plan(MLP7, plan(2, 2, zero, tier.clone(), params), 6);
            assert_equivalent(
                &reference,
                &run,
                1e-5,
                &format!("--offload {tier} zero {zero} dp=2 pp=2"),
            );
        }
    }
}

/// ~97M parameters: 24 layers of 2048 × 2048 (WORKLOADS.md's "mlp of ~100M parameters").
const MLP_100M: &str = "mlp:in=64,hidden=2048,layers=24,out=10";
const BUDGET: u64 = 256 << 20;

#[test]
fn a_model_too_large_for_the_budget_trains_with_zero3_and_nvme_offload() {
    let base = ParallelPlan {
        dp: 2,
        zero: 3,
        batch: 16,
        device_memory: Some(BUDGET),
        ..ParallelPlan::default()
    };
    let program = Program::new(ModelSpec::parse(MLP_100M).unwrap()).with_plan(base.clone());
    let psi = program.model.params();
    assert!(psi > 90_000_000, "{psi} parameters");
    let err = compile(&program).unwrap_err().to_string();
    assert!(err.contains("does not fit") || err.contains("budget"), "{err}");
    assert!(
        err.contains("--offload nvme:DIR --offload-params"),
        "the fix is not named: {err}"
    );
    // Host-memory offload of the optimizer alone is not enough: the parameter shards stay.
    let mut cpu = program.clone();
    cpu.plan.offload = Offload::Cpu;
    assert!(
        compile(&cpu).is_err(),
        "zero 3 + cpu offload without the parameters should not fit"
    );

    let dir = tempfile::tempdir().unwrap();
    let offloaded = ParallelPlan {
        offload: Offload::Nvme {
            dir: dir.path().display().to_string(),
        },
        offload_params: true,
        ..base
    };
    let run = train_plan(MLP_100M, offloaded, 2);
    assert!(run.final_loss.is_finite(), "loss {}", run.final_loss);
    for a in &run.actors {
        assert!(
            a.estimated_device_bytes <= BUDGET,
            "plan says {}",
            a.estimated_device_bytes
        );
        assert!(
            a.peak_model_state_bytes <= BUDGET,
            "actor {} held {} bytes of model state on its device",
            a.actor,
            a.peak_model_state_bytes
        );
        let o = a.offload.as_ref().unwrap();
        let expected = 12 * psi / 2;
        assert!(
            o.disk_bytes.abs_diff(expected) < expected / 100,
            "actor {}: state file of {} bytes",
            a.actor,
            o.disk_bytes
        );
        assert!(o.read_gb_s > 0.0 && o.write_gb_s > 0.0, "{o:?}");
    }
}
