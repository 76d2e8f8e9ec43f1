//! Tests of the tensor-parallel slicing: the per-head qkv cut, exact cover of every element by the
//! ranks for every split kind, padding, and the local model.

use super::*;
use crate::ModelSpec;
use crate::param_desc::ParamInit;

fn param(shape: &[usize], split: Split) -> ParamDesc {
    ParamDesc::new("p", shape.to_vec(), ParamInit::Zeros).with_split(split)
}

/// The fused qkv weight `[8, 24]` at tp=2: rank 0 holds columns 0..4 of q, k and v (global
/// columns 0..4, 8..12, 16..20) in every row, rank 1 the others; the contiguous cut would not.
#[test]
fn qkv_is_cut_per_head_inside_q_k_and_v() {
    let split = Split::HeadColumns { parts: 3 };
    assert_eq!(local_shape(split, &[8, 24], 2), vec![8, 12]);
    let global: Vec<f32> = (0..8 * 24).map(|i| i as f32).collect();
    let rank0 = take_local(&param(&[8, 24], split), &global, 0, 2);
    for row in 0..8 {
        let cols: Vec<usize> = rank0[row * 12..(row + 1) * 12]
            .iter()
            .map(|&v| v as usize - row * 24)
            .collect();
        assert_eq!(cols, [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19], "row {row}");
    }
    let bias = take_local(&param(&[24], split), &global[..24], 1, 2);
    assert_eq!(bias, [4., 5., 6., 7., 12., 13., 14., 15., 20., 21., 22., 23.]);
    let contiguous = take_local(&param(&[24], Split::Columns), &global[..24], 0, 2);
    assert_ne!(contiguous, take_local(&param(&[24], split), &global[..24], 0, 2));
}

/// Over the ranks, every global element is held exactly once, at a local position inside the
/// local shape; padded positions are the only ones left out. Every split kind, tp 1 to 4, shapes
/// tp divides and shapes it does not (padded).
#[test]
fn the_ranks_cover_every_element_exactly_once() {
    let cases: &[(&[usize], Split)] = &[
        (&[6, 12], Split::Rows),
        (&[7, 5], Split::Rows),
        (&[5, 12], Split::Columns),
        (&[3, 13], Split::Columns),
        (&[12], Split::Columns),
        (&[11], Split::Columns),
        (&[4, 36], Split::HeadColumns { parts: 3 }),
        (&[36], Split::HeadColumns { parts: 3 }),
        (&[4, 5], Split::Replicated),
        (&[2, 3, 12], Split::Columns),
        (&[9, 2, 3], Split::Rows),
    ];
    for &(shape, split) in cases {
        for tp in 1..=4 {
            if let Split::HeadColumns { parts } = split
                && !(shape[shape.len() - 1] / parts).is_multiple_of(tp)
            {
                continue;
            }
            let total: usize = shape.iter().product();
            let local: usize = local_shape(split, shape, tp).iter().product();
            let mut seen = vec![0; total];
            for rank in 0..tp {
                let mut locals = vec![false; local];
                for run in global_runs(split, shape, rank, tp) {
                    assert!(run.local + run.len <= local, "{shape:?} {split:?} tp={tp}");
                    for (l, g) in run.local_range().zip(run.global_range()) {
                        assert!(!locals[l], "{shape:?} {split:?} tp={tp}: local {l} twice");
                        locals[l] = true;
                        seen[g] += 1;
                    }
                }
                let held = locals.iter().filter(|h| **h).count();
                if split == Split::Replicated {
                    assert_eq!(held, total);
                }
            }
            let want = if split == Split::Replicated { tp } else { 1 };
            assert!(
                seen.iter().all(|&c| c == want),
                "{shape:?} {split:?} tp={tp}: {seen:?}"
            );
        }
    }
}

/// A vocabulary tp does not divide is padded: 65 rows at tp=2 are 33 per rank, rank 1's last row
/// padding (zero, in no run).
#[test]
fn an_extent_tp_does_not_divide_is_padded_on_the_last_rank() {
    let table = param(&[65, 2], Split::Rows);
    assert_eq!(local_shape(table.split, &table.shape, 2), vec![33, 2]);
    let global: Vec<f32> = (1..=130).map(|i| i as f32).collect();
    let rank1 = take_local(&table, &global, 1, 2);
    assert_eq!(rank1.len(), 66);
    assert_eq!(&rank1[..2], &[67.0, 68.0]);
    assert_eq!(&rank1[64..], &[0.0, 0.0]);
    assert_eq!(
        global_runs(table.split, &table.shape, 1, 2),
        [Run {
            local: 0,
            global: 66,
            len: 64
        }]
    );
}

/// The local gpt at tp=2 holds half of every split parameter (the vocabulary padded) and all of
/// every replicated one; names and blocks are the model's.
#[test]
fn the_local_model_holds_a_slice_of_each_split_parameter() {
    let model = ModelSpec::parse("gpt:vocab=65,ctx=8,d=16,layers=1,heads=4")
        .unwrap()
        .desc();
    let local = local_model(&model, 2);
    assert_eq!(local.blocks.len(), model.blocks.len());
    for (g, l) in model.blocks.iter().zip(&local.blocks) {
        for (gp, lp) in g.param_descs.iter().zip(&l.param_descs) {
            assert_eq!(gp.name, lp.name);
            let (gn, ln) = (gp.len(), lp.len());
            match (gp.name.as_str(), gp.split) {
                ("tok.weight", _) => assert_eq!(lp.shape, vec![33, 16]),
                ("head.weight", _) => assert_eq!(lp.shape, vec![16, 33]),
                (_, Split::Replicated) => assert_eq!(ln, gn, "{}", gp.name),
                _ => assert_eq!(2 * ln, gn, "{}", gp.name),
            }
        }
        assert_eq!(
            l.params,
            l.param_descs.iter().map(|p| p.len() as u64).sum::<u64>()
        );
    }
    assert_eq!(local_model(&model, 1), model);
}

/// The runs of a local range are the whole slice's runs cut to it, for every split, rank and
/// range of small parameters (padded and per-head ones included).
#[test]
fn runs_within_a_local_range_are_the_slices_runs_cut_to_it() {
    let cases = [
        (Split::Rows, vec![5, 3]),
        (Split::Columns, vec![2, 5]),
        (Split::Columns, vec![7]),
        (Split::HeadColumns { parts: 3 }, vec![2, 12]),
        (Split::Replicated, vec![4, 2]),
    ];
    for (split, shape) in cases {
        for tp in [2, 3] {
            if matches!(split, Split::HeadColumns { .. }) && tp == 3 {
                continue;
            }
            for rank in 0..tp {
                let all = global_runs(split, &shape, rank, tp);
                let local: usize = local_shape(split, &shape, tp).iter().product();
                for start in 0..=local {
                    for end in start..=local {
                        let mut expected: Vec<(usize, usize)> = Vec::new();
                        for r in &all {
                            let (a, b) = (r.local.max(start), (r.local + r.len).min(end));
                            if a < b {
                                expected.push((r.global + a - r.local, b - a));
                            }
                        }
                        let got: Vec<(usize, usize)> =
                            global_runs_within(split, &shape, rank, tp, start..end)
                                .iter()
                                .map(|r| (r.global, r.len))
                                .collect();
                        let flatten = |v: &[(usize, usize)]| -> Vec<usize> {
                            v.iter().flat_map(|&(g, n)| g..g + n).collect()
                        };
                        assert_eq!(
                            flatten(&got),
                            flatten(&expected),
                            "{split:?} {shape:?} rank {rank}/{tp} {start}..{end}"
                        );
                    }
                }
            }
        }
    }
}
