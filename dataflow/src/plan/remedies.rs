//! The remedies `plan` names when a plan does not fit its memory budget: each single change
//! (more ZeRO, offload, activation checkpoints, more stages) that makes it fit, else each pair on
//! different knobs, found by compiling the changed program.

use super::compile_with;
use crate::DeviceSpec;
use crate::program::{Offload, Program};

/// A change that may make a plan fit: its flags, the knobs it turns (two remedies combine only
/// when they turn different knobs) and the change itself.
struct Remedy {
    flags: String,
    knobs: &'static [&'static str],
    apply: Box<dyn Fn(&mut Program)>,
}

impl Remedy {
    fn new(flags: String, knobs: &'static [&'static str], apply: impl Fn(&mut Program) + 'static) -> Remedy {
        Remedy {
            flags,
            knobs,
            apply: Box::new(apply),
        }
    }
}

/// The remedies tried when a plan does not fit its memory budget.
fn remedies(program: &Program) -> Vec<Remedy> {
    let plan = &program.plan;
    let mut out = Vec::new();
    // ZeRO-2/3 reduce-scatter the gradients: `--compress int8` (the all-reduce's) becomes
    // `--quantize-grads int8` there.
    let int8 = program.compression == crate::Compression::Int8;
    let requantized = |p: &mut Program| {
        if p.plan.zero >= 2 && p.compression == crate::Compression::Int8 {
            p.compression = crate::Compression::None;
            p.quantize_grads = true;
        }
    };
    let swap = |z: u8| {
        if int8 && z >= 2 {
            " --compress none --quantize-grads int8"
        } else {
            ""
        }
    };
    if plan.dp > 1 {
        for z in plan.zero + 1..=3 {
            out.push(Remedy::new(
                format!("--zero {z}{}", swap(z)),
                &["zero"],
                move |p| {
                    p.plan.zero = z;
                    requantized(p);
                },
            ));
        }
    }
    if !plan.offload.is_some() {
        for offload in [Offload::Cpu, Offload::Nvme { dir: "DIR".into() }] {
            out.push(Remedy::new(
                format!("--offload {offload}"),
                &["offload"],
                move |p| p.plan.offload = offload.clone(),
            ));
        }
    }
    if plan.dp > 1 && !plan.offload_params {
        // ZeRO-3 with the parameter shards offloaded too (ZeRO-Infinity).
        let tiers = if plan.offload.is_some() {
            vec![plan.offload.clone()]
        } else {
            vec![Offload::Cpu, Offload::Nvme { dir: "DIR".into() }]
        };
        for tier in tiers {
            let flags = format!("--zero 3 --offload {tier} --offload-params{}", swap(3));
            out.push(Remedy::new(flags, &["zero", "offload"], move |p| {
                p.plan.zero = 3;
                p.plan.offload = tier.clone();
                p.plan.offload_params = true;
                requantized(p);
            }));
        }
    }
    if !plan.checkpoint_activations {
        out.push(Remedy::new(
            "--checkpoint-activations".into(),
            &["checkpoint"],
            |p| p.plan.checkpoint_activations = true,
        ));
    }
    for pp in [plan.pp * 2, plan.pp * 4] {
        if pp * plan.virtual_stages <= program.model.blocks.len() {
            let m = plan.microbatches.max(pp);
            let flags = format!(
                "--pp {pp} --microbatches {m} ({} devices)",
                plan.dp * pp * plan.tp
            );
            out.push(Remedy::new(flags, &["pp"], move |p| {
                p.plan.pp = pp;
                p.plan.microbatches = m;
                p.plan.stages = None;
            }));
        }
    }
    out
}

/// `program` changed by `remedies`, compiled on as many devices of the same kind as it needs (a
/// GPU plan's estimate counts GPU-only terms), deciding its state placement afresh (`Auto` with
/// offload is `Host`; a placement the user named stays).
fn remedied(program: &Program, remedies: &[&Remedy]) -> Program {
    let mut p = program.clone();
    for r in remedies {
        (r.apply)(&mut p);
    }
    let actors = p.plan.actors().max(1);
    p.devices = match program.devices.first() {
        Some(DeviceSpec::Cuda(_)) => (0..actors as u32).map(DeviceSpec::Cuda).collect(),
        _ => Vec::new(),
    };
    p
}

/// The flags that make `program` fit: every single remedy that does; when none does, every pair
/// of remedies on different knobs that does (e.g. `--checkpoint-activations` with `--pp 4`).
pub(super) fn fitting_remedies(program: &Program) -> Vec<String> {
    let all = remedies(program);
    let fits = |rs: &[&Remedy]| compile_with(&remedied(program, rs), false, super::Build::Classes).is_ok();
    let singles: Vec<String> = (all.iter())
        .filter(|r| fits(&[r]))
        .map(|r| r.flags.clone())
        .collect();
    if !singles.is_empty() {
        return singles;
    }
    let mut pairs = Vec::new();
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            if a.knobs.iter().all(|k| !b.knobs.contains(k)) && fits(&[a, b]) {
                pairs.push(format!("{} {}", a.flags, b.flags));
            }
        }
    }
    if pairs.len() > MAX_PAIRS_SHOWN {
        let more = pairs.len() - MAX_PAIRS_SHOWN;
        pairs.truncate(MAX_PAIRS_SHOWN);
        pairs.push(format!("{more} other pairs of these"));
    }
    pairs
}

/// Fitting pairs of remedies named in a refusal; the rest are counted.
const MAX_PAIRS_SHOWN: usize = 4;
