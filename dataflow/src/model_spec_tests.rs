//! Tests of the model specs: parsing, round trips, refusals, parameter counts and descriptions.

use super::*;

#[test]
fn training_flops_count_six_per_matmul_weight_plus_attention() {
    // gpt-tiny: 6 · (4 · 12 · 256² + 256 · 256) + 12 · 4 · 256 · 128.
    assert_eq!(ModelSpec::gpt_tiny().training_flops_per_token(), 20_840_448.0);
    // mlp-8x1024: 6 · (8 · 1024² + 1024 · 10) per sample.
    assert_eq!(
        ModelSpec::mlp_8x1024().training_flops_per_token(),
        6.0 * 8_398_848.0
    );
}

#[test]
fn workload_parameter_counts_match_workloads_md() {
    assert_eq!(ModelSpec::parse("mlp-8x1024").unwrap().desc().params(), 8_407_050);
    assert_eq!(ModelSpec::parse("gpt-tiny").unwrap().desc().params(), 3_323_392);
}

/// Every zoo block is described parameter by parameter, the descriptions add up to its
/// count and pass the model check; a duplicated name or a wrong count is refused.
#[test]
fn zoo_blocks_are_described_parameter_by_parameter() {
    for spec in [
        "mlp-8x1024",
        "gpt-tiny",
        "gpt:vocab=64,ctx=16,d=32,layers=2,heads=2",
    ] {
        let desc = ModelSpec::parse(spec).unwrap().desc();
        desc.check().unwrap();
        for b in &desc.blocks {
            assert!(!b.param_descs.is_empty(), "{spec} {}", b.name);
            assert_eq!(b.param_bytes(), 4 * b.param_count());
            assert_eq!(b.grad_bytes(), b.param_bytes());
        }
    }
    let mut desc = ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3")
        .unwrap()
        .desc();
    let first = desc.blocks[0].param_descs[0].clone();
    desc.blocks[1].param_descs[0].name = first.name.clone();
    assert!(desc.check().unwrap_err().to_string().contains("used twice"));
    let mut desc = ModelSpec::parse("mlp:in=4,hidden=8,layers=2,out=3")
        .unwrap()
        .desc();
    desc.blocks[2].params += 1;
    assert!(desc.check().unwrap_err().to_string().contains("add up to"));
}

#[test]
fn parses_parametric_specs_and_round_trips() {
    let m = ModelSpec::parse("mlp:in=16,hidden=32,layers=3,out=4").unwrap();
    assert_eq!(m.desc().blocks.len(), 4);
    assert_eq!(ModelSpec::parse(&m.to_string()).unwrap(), m);
    let g = ModelSpec::parse("gpt:vocab=64,ctx=16,d=32,layers=2,heads=2").unwrap();
    // The embedding, two blocks per layer (attention, MLP) and the head.
    let names: Vec<String> = g.desc().blocks.into_iter().map(|b| b.name).collect();
    assert_eq!(names, ["embedding", "attn.0", "mlp.0", "attn.1", "mlp.1", "head"]);
    assert_eq!(ModelSpec::parse(&g.to_string()).unwrap(), g);
}

#[test]
fn refuses_bad_specs_with_reasons() {
    for bad in [
        "mlp",
        "cnn:x=1",
        "mlp:in=0",
        "mlp:width=3",
        "gpt:d=30,heads=4",
        "mlp:in=a",
    ] {
        let err = ModelSpec::parse(bad).unwrap_err().to_string();
        assert!(err.contains(bad), "{err}");
    }
    // A near miss is named; a far one lists the options.
    let err = ModelSpec::parse("mlp:layer=4").unwrap_err().to_string();
    assert!(err.contains("did you mean `layers`?"), "{err}");
    let err = ModelSpec::parse("gpt:head=2").unwrap_err().to_string();
    assert!(err.contains("did you mean `heads`?"), "{err}");
    let err = ModelSpec::parse("mlp:width=3").unwrap_err().to_string();
    assert!(
        !err.contains("did you mean") && err.contains("takes in, hidden, layers, out"),
        "{err}"
    );
}
