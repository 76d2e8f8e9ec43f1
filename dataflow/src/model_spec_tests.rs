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

/// A family not registered is refused with the registered ones listed; a spec serializes as its
/// explicit string and reads back.
#[test]
fn families_are_registered_and_specs_serialize_as_strings() {
    let err = ModelSpec::parse("cnn:x=1").unwrap_err().to_string();
    assert!(err.contains("`mlp`, `gpt`, `gpt2`"), "{err}");
    for spec in ["gpt-tiny", "mlp:in=3,hidden=4,layers=1,out=2", "gpt2"] {
        let spec = ModelSpec::parse(spec).unwrap();
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(json, format!("\"{}\"", spec.explicit()));
        assert_eq!(serde_json::from_str::<ModelSpec>(&json).unwrap(), spec);
    }
    assert!(serde_json::from_str::<ModelSpec>("\"gpt:heads=3\"").is_err());
}

/// GPT-2's parameters are `GPT2LMHeadModel`'s `state_dict` keys in `Conv1D`'s layout, the head a
/// frozen mirror of the token table: a tie the step carries while the table trains, none once it
/// is frozen; a mirror described trainable, or of another shape, is refused.
#[test]
fn gpt2_is_transformers_names_with_a_tied_head() {
    let spec = ModelSpec::parse("gpt2").unwrap();
    assert_eq!(
        spec.explicit(),
        "gpt2:vocab=50257,ctx=1024,d=768,layers=12,heads=12"
    );
    assert_eq!(
        spec.desc().params(),
        124_439_808 + 50257 * 768,
        "GPT-2 small and its mirror"
    );
    assert_eq!(spec.desc().distinct_params(), 124_439_808, "transformers' count");
    let small = ModelSpec::parse("gpt2:vocab=11,ctx=6,d=8,layers=1,heads=2").unwrap();
    let mut desc = small.desc();
    let names: Vec<&str> = desc
        .blocks
        .iter()
        .flat_map(|b| &b.param_descs)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        names[..4],
        [
            "transformer.wte.weight",
            "transformer.wpe.weight",
            "transformer.h.0.ln_1.weight",
            "transformer.h.0.ln_1.bias"
        ]
    );
    let head = desc.blocks.last().unwrap().param_descs.last().unwrap().clone();
    assert_eq!(
        (head.name.as_str(), head.tied_to.as_deref(), head.trainable),
        ("lm_head.weight", Some("transformer.wte.weight"), false)
    );
    let c_attn = &desc.blocks[1].param_descs[2];
    assert_eq!(
        (c_attn.shape.clone(), c_attn.split),
        (vec![8, 24], crate::Split::HeadColumns { parts: 3 })
    );
    // The tie trains with the token table; frozen, it needs no step of its own.
    desc.check().unwrap();
    let last = desc.blocks.len() - 1;
    let tie = crate::Tie {
        mirror: (last, desc.blocks[last].param_descs.len() - 1),
        target: (0, 0),
    };
    assert_eq!(desc.ties(), [tie]);
    desc.blocks[0].param_descs[0].trainable = false;
    desc.check().unwrap();
    assert_eq!(desc.ties(), []);
    desc.blocks[last].param_descs.last_mut().unwrap().trainable = true;
    let err = desc.check().unwrap_err().to_string();
    assert!(err.contains("describe it frozen"), "{err}");
    desc.blocks[last].param_descs.last_mut().unwrap().trainable = false;
    desc.blocks
        .last_mut()
        .unwrap()
        .param_descs
        .last_mut()
        .unwrap()
        .shape = vec![8, 11];
    assert!(desc.check().unwrap_err().to_string().contains("same shape"));
}

/// LoRA adapters (Hu et al., 2021) follow their modules in the description, PEFT's suffix rule
/// picks the modules (`c_proj` matches both GPT-2's), the base is frozen, the spec round-trips
/// through its string, and a target matching nothing or a rank too large is refused naming the
/// fix.
#[test]
fn lora_adapters_follow_their_modules_and_freeze_the_base() {
    let spec =
        ModelSpec::parse("gpt2:vocab=11,ctx=6,d=8,layers=1,heads=2/lora:r=2,alpha=4,targets=c_attn+c_proj")
            .unwrap();
    assert_eq!(ModelSpec::parse(&spec.to_string()).unwrap(), spec);
    let desc = spec.desc();
    desc.check().unwrap();
    let attention: Vec<(&str, bool)> = desc.blocks[1]
        .param_descs
        .iter()
        .map(|p| (p.name.as_str(), p.trainable))
        .collect();
    assert_eq!(
        attention,
        [
            ("transformer.h.0.ln_1.weight", false),
            ("transformer.h.0.ln_1.bias", false),
            ("transformer.h.0.attn.c_attn.weight", false),
            ("transformer.h.0.attn.c_attn.bias", false),
            ("transformer.h.0.attn.c_attn.lora_A.weight", true),
            ("transformer.h.0.attn.c_attn.lora_B.weight", true),
            ("transformer.h.0.attn.c_proj.weight", false),
            ("transformer.h.0.attn.c_proj.bias", false),
            ("transformer.h.0.attn.c_proj.lora_A.weight", true),
            ("transformer.h.0.attn.c_proj.lora_B.weight", true),
        ]
    );
    let mlp: Vec<&str> = desc.blocks[2]
        .param_descs
        .iter()
        .filter(|p| p.trainable)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        mlp,
        [
            "transformer.h.0.mlp.c_proj.lora_A.weight",
            "transformer.h.0.mlp.c_proj.lora_B.weight"
        ]
    );
    let a = &desc.blocks[1].param_descs[4];
    assert_eq!(
        (a.shape.clone(), a.init),
        (vec![8, 2], crate::ParamInit::UniformFanIn { fan_in: 8 })
    );
    let b = &desc.blocks[1].param_descs[5];
    assert_eq!(
        (b.shape.clone(), b.init, b.split),
        (
            vec![2, 24],
            crate::ParamInit::Zeros,
            crate::Split::HeadColumns { parts: 3 }
        )
    );
    let a_row = &desc.blocks[1].param_descs[8];
    assert_eq!(
        (a_row.split, desc.blocks[1].param_descs[9].split),
        (crate::Split::Rows, crate::Split::Replicated)
    );
    // Trained: the adapters alone (2·(8·2 + 2·24) + 2·(8·2 + 2·8) + (32·2 + 2·8)).
    let trained: u64 = desc.blocks.iter().map(|b| b.trained_params()).sum();
    assert_eq!(trained, 2 * 8 + 2 * 24 + 8 * 2 + 2 * 8 + 32 * 2 + 2 * 8);
    let err = ModelSpec::parse("gpt2:vocab=11,ctx=6,d=8,layers=1,heads=2/lora:r=2,targets=q_proj")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`q_proj` matches no module") && err.contains("c_attn, c_fc, c_proj"),
        "{err}"
    );
    let err = ModelSpec::parse("gpt2:vocab=11,ctx=6,d=8,layers=1,heads=2/lora:r=9,targets=c_attn")
        .unwrap_err()
        .to_string();
    assert!(err.contains("above min(d_in, d_out) = 8"), "{err}");
    let err = ModelSpec::parse("mlp:in=3,hidden=4,layers=1,out=2/lora:r=1,targets=0")
        .unwrap_err()
        .to_string();
    assert!(err.contains("takes no LoRA adapters"), "{err}");
}
