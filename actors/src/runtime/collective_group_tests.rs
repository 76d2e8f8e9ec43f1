//! Collective groups of a mesh's actors: the tp groups of a `dp × tp` mesh all-reduce (f32 and
//! bf16), reduce-scatter and all-gather typed tensors inside their handlers and get the sums and
//! shards computed here; the negative controls — a member that never comes, members out of
//! step (an all-reduce meeting an all-gather, or a reduce-scatter of the same type and length),
//! an actor outside the group, an axis the mesh lacks — fail with errors naming them instead of
//! answering.

use std::time::Duration;

use archipelago_dataflow::{DeviceSpec, Mesh};
use half::bf16;

use super::*;
use crate::typed_tensor::TypedTensor;

struct Rank;

impl Actor for Rank {
    type Params = ();
    async fn new(_: (), _ctx: &Context<Self>) -> Result<Self, String> {
        Ok(Rank)
    }
}

/// A collective over a member's values (as f32, or bf16 when `half`).
#[derive(Clone, serde::Serialize, serde::Deserialize)]
enum Collective {
    AllReduce { half: bool },
    ReduceScatter,
    AllGather,
}

#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Run {
    group: CollectiveGroup,
    collective: Collective,
    values: Vec<f32>,
}

/// A collective's result: its shape and values (as f32), or why it failed.
type Answer = Result<(Vec<usize>, Vec<f32>), String>;

impl Message for Run {
    type Reply = Answer;
}

impl Handler<Run> for Rank {
    async fn handle(&mut self, run: Run, ctx: &Context<Self>) -> Answer {
        let len = run.values.len();
        let out = match run.collective {
            Collective::AllReduce { half: true } => {
                let values: Vec<bf16> = run.values.iter().map(|&v| bf16::from_f32(v)).collect();
                ctx.all_reduce(&run.group, TypedTensor::from_values(vec![len], &values))
                    .await
            }
            Collective::AllReduce { half: false } => {
                ctx.all_reduce(&run.group, TypedTensor::new(vec![len], run.values))
                    .await
            }
            Collective::ReduceScatter => {
                ctx.reduce_scatter(&run.group, TypedTensor::new(vec![len], run.values))
                    .await
            }
            Collective::AllGather => {
                let ids: Vec<i32> = run.values.iter().map(|&v| v as i32).collect();
                ctx.all_gather(&run.group, TypedTensor::from_values(vec![len], &ids))
                    .await
            }
        }
        .map_err(|e| e.to_string())?;
        let values = match out.dtype() {
            archipelago_dataflow::DType::BF16 => out.values::<bf16>().iter().map(|v| v.to_f32()).collect(),
            archipelago_dataflow::DType::I32 => out.values::<i32>().iter().map(|&v| v as f32).collect(),
            _ => out.values::<f32>().to_vec(),
        };
        Ok((out.shape().to_vec(), values))
    }
}

/// A `dp=2 × tp=2` mesh of ranks and each member's tp group.
fn mesh(patience: Duration) -> (Runtime, ActorMesh<Rank>, Vec<CollectiveGroup>) {
    let runtime = Runtime::local(DeviceSpec::cpus(4));
    runtime.set_strict_registry(false);
    let mesh = Mesh::new(&[("dp", 2), ("tp", 2)]).unwrap();
    let ranks = runtime.spawn_mesh::<Rank>(mesh, |_| ()).get().unwrap();
    let groups = ranks.collective_groups("tp", patience).unwrap();
    (runtime, ranks, groups)
}

/// Member `r`'s values: `len` small integers (their sums are exact in f32 and bf16).
fn values(r: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7 + r * 3) % 50) as f32).collect()
}

/// Every member of `ranks` runs `collective`; their answers by rank.
fn run_all(
    ranks: &ActorMesh<Rank>,
    groups: &[CollectiveGroup],
    collective: Collective,
    len: usize,
) -> Vec<Answer> {
    let calls: Vec<_> = (ranks.members().iter().enumerate())
        .map(|(r, member)| {
            member.call(Run {
                group: groups[r].clone(),
                collective: collective.clone(),
                values: values(r, len),
            })
        })
        .collect();
    calls.into_iter().map(|c| c.get().unwrap()).collect()
}

#[test]
fn a_meshs_tp_groups_all_reduce_scatter_and_gather_typed_tensors() {
    let (_runtime, ranks, groups) = mesh(DEFAULT_PATIENCE);
    assert_eq!(groups[0], groups[1]);
    assert_eq!(groups[2], groups[3]);
    assert_ne!(groups[0], groups[2]);
    let len = 10_001;
    for half in [false, true] {
        for (r, answer) in run_all(&ranks, &groups, Collective::AllReduce { half }, len)
            .into_iter()
            .enumerate()
        {
            let (shape, sum) = answer.unwrap();
            let pair = r / 2 * 2;
            let want: Vec<f32> = (values(pair, len).iter().zip(values(pair + 1, len)))
                .map(|(a, b)| a + b)
                .collect();
            assert_eq!(shape, [len]);
            assert_eq!(sum, want, "member {r}'s all-reduce (bf16: {half})");
        }
    }
    for (r, answer) in run_all(&ranks, &groups, Collective::ReduceScatter, len)
        .into_iter()
        .enumerate()
    {
        let (_, shard) = answer.unwrap();
        let pair = r / 2 * 2;
        let own = archipelago_dataflow::actor_training::shard_range(len, 2, r % 2);
        let want: Vec<f32> = own
            .map(|i| values(pair, len)[i] + values(pair + 1, len)[i])
            .collect();
        assert_eq!(shard, want, "member {r}'s reduce-scatter");
    }
    for (r, answer) in run_all(&ranks, &groups, Collective::AllGather, 33)
        .into_iter()
        .enumerate()
    {
        let (shape, gathered) = answer.unwrap();
        let pair = r / 2 * 2;
        assert_eq!(shape, [2, 33]);
        assert_eq!(
            gathered,
            [values(pair, 33), values(pair + 1, 33)].concat(),
            "member {r}'s all-gather"
        );
    }
}

/// The negative controls: none of these answers; each error names the group and the member.
#[test]
fn a_missing_member_members_out_of_step_and_outsiders_fail_naming_them() {
    let (_runtime, ranks, groups) = mesh(Duration::from_millis(300));
    // Member 1 never comes to member 0's all-reduce.
    let alone = ranks.members()[0]
        .call(Run {
            group: groups[0].clone(),
            collective: Collective::AllReduce { half: false },
            values: values(0, 8),
        })
        .get()
        .unwrap()
        .unwrap_err();
    eprintln!("a member that never comes: {alone}");
    assert!(alone.contains("member 0 (`Rank[dp=0,tp=0]`)"), "{alone}");
    assert!(alone.contains("Rank[dp=0,tp=1]"), "{alone}");
    // Members 2 and 3 out of step: an all-reduce meets an all-gather.
    let calls = [
        (2, Collective::AllReduce { half: false }),
        (3, Collective::AllGather),
    ]
    .map(|(r, collective)| {
        ranks.members()[r].call(Run {
            group: groups[r].clone(),
            collective,
            values: values(r, 8),
        })
    });
    let answers: Vec<_> = calls.into_iter().map(|c| c.get().unwrap()).collect();
    eprintln!("members out of step: {answers:?}");
    assert!(answers.iter().all(Result::is_err), "{answers:?}");
    // An actor outside the group.
    let outsider = ranks.members()[2]
        .call(Run {
            group: groups[0].clone(),
            collective: Collective::AllReduce { half: false },
            values: values(2, 8),
        })
        .get()
        .unwrap()
        .unwrap_err();
    assert!(outsider.contains("is not a member"), "{outsider}");
    // Out of step with buffers of one type and length: an all-reduce meets a reduce-scatter.
    let (_runtime, ranks, groups) = mesh(Duration::from_millis(300));
    let calls = [
        (0, Collective::AllReduce { half: false }),
        (1, Collective::ReduceScatter),
    ]
    .map(|(r, collective)| {
        ranks.members()[r].call(Run {
            group: groups[r].clone(),
            collective,
            values: values(r, 16),
        })
    });
    let answers: Vec<_> = calls.into_iter().map(|c| c.get().unwrap()).collect();
    eprintln!("an all-reduce meets a reduce-scatter: {answers:?}");
    assert!(
        answers.iter().all(|a| a
            .as_ref()
            .is_err_and(|e| e.contains("all-reduce and reduce-scatter")
                || e.contains("reduce-scatter and all-reduce"))),
        "{answers:?}"
    );
    let no_axis = ranks.collective_groups("pp", DEFAULT_PATIENCE).unwrap_err();
    assert!(no_axis.to_string().contains("no axis `pp`"), "{no_axis}");
}
