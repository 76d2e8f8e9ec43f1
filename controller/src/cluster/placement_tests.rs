//! Unit tests of placing a job on registered hosts and of re-planning it on fewer
//! (`remote_job::place`): stage-major placement keeping a stage's replicas inside an island, the
//! smallest device memory taken as the budget, the refusal that names what to change, and the
//! smaller dp a restart takes where the devices or the batch allow no other.

use archipelago_dataflow::{DeviceSpec, ModelSpec, ParallelPlan, Program};

use super::place;
use crate::JobError;
use crate::cluster::registry::HostInfo;

fn host(id: u32, island: &str, devices: u32, memory: u64) -> HostInfo {
    HostInfo {
        id,
        name: format!("h{id}"),
        island: island.into(),
        devices: (0..devices).map(DeviceSpec::Cpu).collect(),
        device_memory: memory,
        fabric_addr: String::new(),
        tcp_addr: String::new(),
        pid: 0,
        actor_addr: String::new(),
    }
}

fn program(dp: usize, pp: usize, batch: usize) -> Program {
    Program::new(ModelSpec::parse("mlp:in=8,hidden=16,layers=4,out=3").unwrap()).with_plan(ParallelPlan {
        dp,
        pp,
        microbatches: if pp > 1 { 2 } else { 1 },
        batch,
        ..ParallelPlan::default()
    })
}

/// dp=2 × pp=2 on two 2-device hosts of two islands: each stage's replicas share an island
/// (stage 0 on h1, stage 1 on h2), the plan knows each actor's island, and the budget is the
/// smaller host's device memory.
#[test]
fn a_stage_keeps_its_replicas_inside_an_island() {
    let hosts = [host(1, "a", 2, 1 << 30), host(2, "b", 2, 1 << 29)];
    let (plan, placed) = place(&program(2, 2, 8), &hosts, false).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=2 × pp=2");
    // Actor r·pp + s: actors 0 and 2 are stage 0, 1 and 3 stage 1.
    let names: Vec<&str> = placed.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["h1", "h2", "h1", "h2"]);
    assert_eq!(plan.program.islands, ["a", "b", "a", "b"]);
    assert_eq!(plan.program.plan.device_memory, Some(1 << 29));
    let devices: Vec<DeviceSpec> = plan.actors.iter().map(|a| a.device).collect();
    assert_eq!(
        devices,
        [
            DeviceSpec::Cpu(0),
            DeviceSpec::Cpu(0),
            DeviceSpec::Cpu(1),
            DeviceSpec::Cpu(1)
        ]
    );
}

/// Too few devices for a first launch is refused, saying what there is and what to change; no
/// smaller dp is taken unless re-planning after a loss.
#[test]
fn too_few_devices_are_refused_unless_replanning() {
    let hosts = [host(1, "a", 1, 0), host(2, "a", 1, 0), host(3, "b", 1, 0)];
    let err = place(&program(4, 1, 24), &hosts, false).unwrap_err();
    let JobError::Runtime(why) = err else {
        panic!("{err}")
    };
    assert!(
        why.contains("needs 4 devices (dp 4 × pp 1)")
            && why.contains("offer 3")
            && why.contains("lower --dp"),
        "{why}"
    );
    // Re-planning takes the largest dp the devices hold: 3 divides the batch of 24.
    let (plan, _) = place(&program(4, 1, 24), &hosts, true).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=3");
    assert_eq!(plan.program.plan.batch, 24, "the global batch is kept");
}

/// Re-planning skips a dp that does not divide the batch (3 ∤ 20) for the next that does, and
/// keeps pp: dp=4 × pp=2 on 6 devices with a batch of 20 goes on at dp=2 × pp=2.
#[test]
fn replanning_takes_a_smaller_dp_that_divides_the_batch() {
    let hosts = [host(1, "a", 2, 0), host(2, "b", 2, 0), host(3, "c", 2, 0)];
    let (plan, placed) = place(&program(4, 2, 20), &hosts, true).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=2 × pp=2");
    assert_eq!(placed.len(), 4);
    let (plan, _) = place(&program(4, 2, 24), &hosts, true).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=3 × pp=2");
}

/// tp=2 × dp=2 on a 3-device and a 2-device host: each tp group takes two devices of one host
/// (h1's third device stays unused), the replicas go across hosts; a tp no host holds is refused
/// naming the largest host, before any actor starts.
#[test]
fn a_tp_group_takes_devices_of_one_host() {
    let hosts = [host(1, "a", 3, 0), host(2, "b", 2, 0)];
    let mut tp2 = program(2, 1, 8);
    tp2.plan.tp = 2;
    let (plan, placed) = place(&tp2, &hosts, false).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=2 × tp=2");
    // Actor r·tp + t: actors 0 and 1 are replica 0's group, 2 and 3 replica 1's.
    let names: Vec<&str> = placed.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["h1", "h1", "h2", "h2"]);
    let devices: Vec<DeviceSpec> = plan.actors.iter().map(|a| a.device).collect();
    assert_eq!(
        devices,
        [
            DeviceSpec::Cpu(0),
            DeviceSpec::Cpu(1),
            DeviceSpec::Cpu(0),
            DeviceSpec::Cpu(1)
        ]
    );
    let mut tp4 = program(1, 1, 8);
    tp4.plan.tp = 4;
    let why = place(&tp4, &hosts, false).unwrap_err().to_string();
    assert!(why.contains("--tp 4") && why.contains("lower --tp to 3"), "{why}");
}
