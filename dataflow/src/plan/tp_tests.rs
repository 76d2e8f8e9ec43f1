//! Tests of the plan's tensor-parallel checks: shapes the model cannot be cut by, groups that
//! would span islands, models without splits, each refused naming `--tp` and the fix.

use super::*;
use crate::{BlockInfo, InputKind, ModelDesc, ModelSpec, ParallelPlan};

fn with_tp(spec: &str, dp: usize, tp: usize) -> Program {
    Program::new(ModelSpec::parse(spec).unwrap()).with_plan(ParallelPlan {
        dp,
        tp,
        batch: 4 * dp,
        ..ParallelPlan::default()
    })
}

fn refusal(program: &Program) -> String {
    compile(program).unwrap_err().to_string()
}

const GPT: &str = "gpt:vocab=64,ctx=16,d=32,layers=2,heads=4";

/// Heads (gpt) and the hidden width (mlp) must divide by tp; the refusal names the divisors.
#[test]
fn refuses_a_tp_the_heads_or_widths_do_not_divide() {
    let why = refusal(&with_tp(GPT, 1, 3));
    assert!(
        why.contains("--tp 3") && why.contains("4 attention heads"),
        "{why}"
    );
    assert!(why.contains("(2, 4)"), "{why}");
    let why = refusal(&with_tp("mlp:in=12,hidden=24,layers=3,out=6", 1, 5));
    assert!(why.contains("--tp 5") && why.contains("24 hidden width"), "{why}");
    assert!(
        matches!(
            compile(&with_tp(GPT, 1, 0)),
            Err(PlanError::Zero { what: "--tp" })
        ),
        "--tp 0"
    );
}

/// The vocabulary need not divide (it is padded): only the heads decide for gpt.
#[test]
fn a_vocabulary_tp_does_not_divide_is_not_refused_for_its_shape() {
    let why = refusal(&with_tp("gpt:vocab=65,ctx=16,d=32,layers=2,heads=4", 1, 2));
    assert!(why.contains("not built yet"), "{why}");
}

/// A tp group is consecutive actors and must share an island; dp may span islands.
#[test]
fn refuses_a_tp_group_across_islands() {
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut p = with_tp(GPT, 2, 2);
    p.islands = names(&["a", "b", "a", "b"]);
    let why = refusal(&p);
    assert!(why.contains("--tp 2") && why.contains("spans islands"), "{why}");
    assert!(why.contains("at most 1"), "{why}");
    p.islands = names(&["a", "a", "b", "b"]);
    assert!(refusal(&p).contains("not built yet"));
}

/// A model given only by parameter counts has no splits for tp to follow.
#[test]
fn refuses_tp_for_a_model_without_described_parameters() {
    let model = ModelDesc {
        name: "counted".into(),
        input: InputKind::Dense {
            features: 4,
            classes: 2,
        },
        blocks: vec![BlockInfo {
            name: "dense".into(),
            params: 10,
            param_descs: Vec::new(),
            activation_floats_per_sample: 4,
            output_floats_per_sample: 2,
        }],
    };
    let p = Program::custom(model, crate::data::DataSpec::Clusters { seed: 0 }).with_plan(ParallelPlan {
        tp: 2,
        ..ParallelPlan::default()
    });
    let why = refusal(&p);
    assert!(why.contains("--tp 2") && why.contains("`dense`"), "{why}");
}

/// Until the tp layers and collectives exist, a tp above 1 that passes every check is refused
/// plainly, never planned as if it were tp=1; tp=1 plans as before (a `dp × pp` mesh).
#[test]
fn a_valid_tp_is_refused_until_built_and_tp_1_is_unchanged() {
    let why = refusal(&with_tp(GPT, 2, 2));
    assert!(why.contains("--tp 2") && why.contains("not built yet"), "{why}");
    let plan = compile(&with_tp(GPT, 2, 1)).unwrap();
    assert_eq!(plan.mesh.to_string(), "dp=2");
    assert_eq!(plan.actors.len(), 2);
}
