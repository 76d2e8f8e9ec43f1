//! Checkpoint format tests: pieces by name (flat ranges and slices along one dimension) read
//! back across writers, named optimizer state, the block-wise readers, and hostile manifests.

use super::*;

/// Piece of parameter `param` (shape `shape`, at `block_offset` in block `block`) holding
/// `slice`, whose values are `scale ·` the element's flat index, with state `m`, `v` of
/// `+0.25`, `+0.5` when `state`.
fn piece(
    block: usize,
    block_offset: usize,
    param: &str,
    shape: &[usize],
    slice: Slice,
    scale: f32,
    state: bool,
) -> Piece {
    let elements: Vec<usize> = slice
        .runs(shape)
        .into_iter()
        .flat_map(|(at, len)| at..at + len)
        .collect();
    let values = |k: f32| elements.iter().map(|&i| scale * i as f32 + k).collect::<Vec<_>>();
    Piece {
        block,
        block_offset,
        param: param.into(),
        shape: shape.to_vec(),
        slice,
        values: values(0.0),
        state: if state {
            vec![
                ("exp_avg".into(), values(0.25)),
                ("exp_avg_sq".into(), values(0.5)),
            ]
        } else {
            Vec::new()
        },
    }
}

fn manifest(files: Vec<ShardFile>, step: u64) -> Manifest {
    Manifest {
        job: "t".into(),
        step,
        next_step: step + 1,
        model: "m".into(),
        seed: 0,
        layout: serde_json::Value::Null,
        run: None,
        files,
    }
}

fn write(dir: &Path, shards: Vec<ShardState>, step: u64) {
    let files = shards
        .iter()
        .enumerate()
        .map(|(actor, s)| write_shard(dir, actor, s).unwrap())
        .collect();
    write_manifest(dir, &manifest(files, step)).unwrap();
}

/// A manifest is input: a file size it claims (1 PiB here) is checked against the file before
/// anything is allocated or read; so is a piece reaching past its file, and a slice outside its
/// parameter's shape.
#[test]
fn an_absurd_manifest_is_refused_before_reading() {
    let root = tempfile::tempdir().unwrap();
    let dir = step_dir(root.path(), 1);
    let state = ShardState {
        steps: 1,
        schedule_step: 1,
        loss_scale: None,
        pieces: vec![piece(0, 0, "w", &[4], Slice::flat(0..4), 1.0, true)],
    };
    let file = write_shard(&dir, 0, &state).unwrap();
    let real = file.bytes;
    let refused = |edit: &dyn Fn(&mut ShardFile), expect: &str| {
        let mut f = file.clone();
        edit(&mut f);
        write_manifest(&dir, &manifest(vec![f], 1)).unwrap();
        let error = verify(&dir).unwrap_err();
        assert!(error.contains(expect), "{error}");
    };
    refused(
        &|f| f.bytes = 1 << 50,
        &format!("has {real} bytes, the manifest says {}", 1u64 << 50),
    );
    refused(&|f| f.header.pieces[0].offset = 1 << 40, "reaches past the file");
    refused(&|f| f.header.pieces[0].shape = vec![usize::MAX, 3], "overflows");
    refused(
        &|f| {
            f.header.pieces[0].slice = Slice::Dim {
                dim: 1,
                start: 0,
                end: 1,
            }
        },
        "is not a slice of shape",
    );
    refused(&|f| f.header.pieces[0].state = vec!["exp_avg".into(); 2], "twice");
    // An empty slice of an enormous (but not overflowing) shape is nothing to read, not a walk
    // over 2⁶⁰ empty runs.
    let empty = Slice::Dim {
        dim: 1,
        start: 0,
        end: 0,
    };
    assert!(empty.runs(&[1 << 60, 1]).is_empty());
    refused(&|f| f.header.format = 1, "format 1");
    write_manifest(&dir, &manifest(vec![file.clone()], 1)).unwrap();
    verify(&dir).unwrap();
}

/// State is named: SGD's momentum buffer is one tensor, read back by name and by the
/// block-wise reader asking for one; a reader keeping Adam's two is refused, naming both.
#[test]
fn optimizer_state_is_read_by_name() {
    let root = tempfile::tempdir().unwrap();
    let dir = step_dir(root.path(), 1);
    let mut p = piece(0, 0, "w", &[4], Slice::flat(0..4), 1.0, false);
    p.state = vec![("momentum_buffer".into(), vec![1.25, 2.25, 3.25, 4.25])];
    write(
        &dir,
        vec![ShardState {
            steps: 3,
            schedule_step: 5,
            loss_scale: None,
            pieces: vec![p],
        }],
        1,
    );
    let reader = CheckpointReader::open(&dir).unwrap();
    assert_eq!((reader.steps(), reader.schedule_step()), (3, 5));
    let (values, state) = reader.read_param("w", &[4], 1..3, &["momentum_buffer"]).unwrap();
    assert_eq!((values, state), (vec![1.0, 2.0], vec![vec![2.25, 3.25]]));
    let [params, m, v] = reader.read_values(0, 1..3, 1).unwrap();
    assert_eq!((params, m, v), (vec![1.0, 2.0], vec![2.25, 3.25], vec![]));
    let wrong = reader.read_values(0, 0..4, 2).unwrap_err();
    assert!(
        wrong.contains("momentum_buffer") && wrong.contains("2 state tensors"),
        "{wrong}"
    );
    let wrong = reader
        .read_param("w", &[4], 0..4, &["exp_avg", "exp_avg_sq"])
        .unwrap_err();
    assert!(wrong.contains("exp_avg_sq"), "{wrong}");
    let shape = reader.read_param("w", &[2, 2], 0..4, &[]).unwrap_err();
    assert!(shape.contains("shape [4]"), "{shape}");
    assert_eq!(reader.read(0, 0..4, false).unwrap()[0], vec![0.0, 1.0, 2.0, 3.0]);
}

/// A frozen parameter is written whole without optimizer state beside trained ones with it:
/// block-wise reads of values cover both, and a run that would train it is told it was frozen.
#[test]
fn a_frozen_parameter_reads_back_and_asking_its_state_names_the_freeze() {
    let root = tempfile::tempdir().unwrap();
    let dir = step_dir(root.path(), 1);
    let trained = piece(0, 0, "w", &[4], Slice::flat(0..4), 1.0, true);
    let frozen = piece(0, 4, "b", &[2], Slice::flat(0..2), 10.0, false);
    let pieces = vec![trained, frozen];
    write(
        &dir,
        vec![ShardState {
            steps: 1,
            schedule_step: 1,
            loss_scale: None,
            pieces,
        }],
        1,
    );
    let reader = CheckpointReader::open(&dir).unwrap();
    assert_eq!(reader.read(0, 2..6, false).unwrap()[0], vec![2.0, 3.0, 0.0, 10.0]);
    let (b, _) = reader.read_param("b", &[2], 0..2, &[]).unwrap();
    assert_eq!(b, vec![0.0, 10.0]);
    let refused = reader
        .read_param("b", &[2], 0..2, &["exp_avg", "exp_avg_sq"])
        .unwrap_err();
    assert!(refused.contains("frozen in the run that wrote it"), "{refused}");
    let refused = reader.read(0, 0..6, true).unwrap_err();
    assert!(refused.contains("frozen"), "{refused}");
}

/// A `[4, 6]` matrix written as two column slices (a tensor-parallel layout) by two actors and a
/// vector written as two flat ranges: any flat range of either, and any block range across
/// both, reads back the same values as one writer holding everything.
#[test]
fn slices_along_a_dimension_and_flat_ranges_read_back_as_one_parameter() {
    let root = tempfile::tempdir().unwrap();
    let shape = [4, 6];
    let cols = |start, end| Slice::Dim { dim: 1, start, end };
    let a = ShardState {
        steps: 2,
        schedule_step: 2,
        loss_scale: None,
        pieces: vec![
            piece(0, 0, "w", &shape, cols(0, 4), 1.0, true),
            piece(0, 24, "b", &[6], Slice::flat(0..2), 1.0, true),
        ],
    };
    let b = ShardState {
        steps: 2,
        schedule_step: 2,
        loss_scale: None,
        pieces: vec![
            piece(0, 0, "w", &shape, cols(4, 6), 1.0, true),
            piece(0, 24, "b", &[6], Slice::flat(2..6), 1.0, true),
        ],
    };
    let split = step_dir(root.path(), 2);
    write(&split, vec![a, b], 2);
    let whole = step_dir(root.path(), 3);
    let one = ShardState {
        steps: 2,
        schedule_step: 2,
        loss_scale: None,
        pieces: vec![
            piece(0, 0, "w", &shape, Slice::flat(0..24), 1.0, true),
            piece(0, 24, "b", &[6], Slice::flat(0..6), 1.0, true),
        ],
    };
    write(&whole, vec![one], 3);
    let (split, whole) = (
        CheckpointReader::open(&split).unwrap(),
        CheckpointReader::open(&whole).unwrap(),
    );
    let names = ["exp_avg", "exp_avg_sq"];
    for range in [0..24, 3..17, 5..6, 22..24] {
        let got = split.read_param("w", &shape, range.clone(), &names).unwrap();
        assert_eq!(
            got,
            whole.read_param("w", &shape, range.clone(), &names).unwrap(),
            "{range:?}"
        );
        assert_eq!(got.0, range.clone().map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(got.1[1][0], range.start as f32 + 0.5);
    }
    for range in [0..30, 20..27, 24..30] {
        assert_eq!(
            split.read(0, range.clone(), true).unwrap(),
            whole.read(0, range.clone(), true).unwrap(),
            "{range:?}"
        );
    }
    assert!(
        split
            .read(0, 28..31, false)
            .unwrap_err()
            .contains("covers 2 of the 3")
    );
    let stored = split.params();
    assert_eq!(stored["b"].block_offset, 24);
    assert_eq!(stored["w"].shape, vec![4, 6]);
}

/// A corrupted shard makes the checkpoint skipped for the previous one; so does a missing
/// manifest (the writer died before it).
#[test]
fn a_corrupt_or_partial_checkpoint_is_skipped() {
    let root = tempfile::tempdir().unwrap();
    for step in [2, 4] {
        let a = ShardState {
            steps: step as i32,
            schedule_step: step,
            loss_scale: None,
            pieces: vec![piece(0, 0, "w", &[12], Slice::flat(0..7), 1.0, true)],
        };
        let b = ShardState {
            steps: step as i32,
            schedule_step: step,
            loss_scale: None,
            pieces: vec![piece(0, 0, "w", &[12], Slice::flat(7..12), 1.0, true)],
        };
        write(&step_dir(root.path(), step), vec![a, b], step);
    }
    let (latest, skipped) = latest_complete(root.path());
    assert_eq!(latest.unwrap().1.step, 4);
    assert!(skipped.is_empty());
    let shard = step_dir(root.path(), 4).join("actor-00001.shard");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let (latest, skipped) = latest_complete(root.path());
    assert_eq!(latest.unwrap().1.step, 2);
    assert!(skipped[0].contains("CRC-32C"), "{skipped:?}");
    std::fs::create_dir_all(step_dir(root.path(), 6)).unwrap();
    let (latest, skipped) = latest_complete(root.path());
    assert_eq!(latest.unwrap().1.step, 2);
    assert!(skipped[0].contains("no manifest"), "{skipped:?}");
}

/// f16's loss scale is written into each shard's header (present or not, so that the header
/// crosses processes in the name-less codec as well as in JSON) and read back; shards that
/// disagree are refused, naming the file.
#[test]
fn the_loss_scale_crosses_processes_and_reads_back() {
    let root = tempfile::tempdir().unwrap();
    let scaler = crate::precision::LossScaler {
        scale: 32768.0,
        clean_steps: 7,
        growth_interval: 2000,
    };
    for loss_scale in [Some(scaler), None] {
        let state = ShardState {
            steps: 2,
            schedule_step: 2,
            loss_scale,
            pieces: vec![piece(0, 0, "w", &[4], Slice::flat(0..4), 1.0, false)],
        };
        let file = write_shard(root.path(), 0, &state).unwrap();
        let crossed: ShardFile = crate::codec::decode(&crate::codec::encode(&file).unwrap()).unwrap();
        assert_eq!(crossed, file);
        let json: ShardFile = serde_json::from_slice(&serde_json::to_vec(&file).unwrap()).unwrap();
        assert_eq!(json.header.loss_scale, loss_scale);
    }
    let dir = step_dir(root.path(), 1);
    let shard = |loss_scale| ShardState {
        steps: 2,
        schedule_step: 2,
        loss_scale,
        pieces: vec![piece(0, 0, "w", &[4], Slice::flat(0..4), 1.0, false)],
    };
    write(&dir, vec![shard(Some(scaler))], 1);
    assert_eq!(
        CheckpointReader::open(&dir).unwrap().loss_scale(),
        Ok(Some(scaler))
    );
    let other = step_dir(root.path(), 2);
    let halved = crate::precision::LossScaler {
        scale: 16384.0,
        ..scaler
    };
    write(&other, vec![shard(Some(scaler)), shard(Some(halved))], 2);
    let refused = CheckpointReader::open(&other).unwrap().loss_scale().unwrap_err();
    assert!(refused.contains("disagree on the loss scale"), "{refused}");
}

/// A tensor-parallel rank's slice: a per-head qkv split stores each head's columns at their
/// global places; a vocabulary tp does not divide stores no padding; a ZeRO range inside a
/// rank's slice; a manifest's impossible tp slice is refused before anything is read.
#[test]
fn tp_slices_map_to_global_places_without_padding() {
    use archipelago_dataflow::Split;
    let tp = |split, rank, size, start, end| Slice::Tp {
        split,
        rank,
        size,
        start,
        end,
    };
    // qkv `[2, 12]` (2 rows, q|k|v of 4 columns), rank 1 of 2: columns 2..4, 6..8, 10..12.
    let qkv = tp(Split::HeadColumns { parts: 3 }, 1, 2, 0, 12);
    assert_eq!(qkv.len_in(&[2, 12]).unwrap(), 12);
    assert_eq!(
        qkv.runs(&[2, 12]),
        vec![(2, 2), (6, 2), (10, 2), (14, 2), (18, 2), (22, 2)]
    );
    // A vocabulary of 5 rows over 2 ranks: rank 1 holds rows 3..5 and one padding row.
    let vocab = tp(Split::Rows, 1, 2, 0, 3 * 4);
    assert_eq!(vocab.len_in(&[5, 4]).unwrap(), 8);
    assert_eq!(vocab.runs(&[5, 4]), vec![(12, 8)]);
    // Columns `[2, 5]` over 2 ranks (3 local, the last padding on rank 1), a ZeRO range 2..5.
    let cols = tp(Split::Columns, 1, 2, 2, 5);
    assert_eq!(cols.len_in(&[2, 5]).unwrap(), 2);
    assert_eq!(cols.runs(&[2, 5]), vec![(8, 2)]);
    for (bad, why) in [
        (tp(Split::Rows, 2, 2, 0, 1), "outside its group"),
        (tp(Split::Rows, 0, 0, 0, 1), "outside its group"),
        (tp(Split::HeadColumns { parts: 0 }, 0, 2, 0, 1), "per-head"),
        (tp(Split::HeadColumns { parts: 3 }, 0, 2, 0, 1), "per-head"),
        (tp(Split::Rows, 0, 2, 0, 13), "past the rank's slice"),
    ] {
        let error = bad.len_in(&[5, 4]);
        assert!(
            error.as_ref().is_err_and(|e| e.contains(why)),
            "{bad:?}: {error:?}"
        );
    }
    // Hostile sizes are refused, never an overflow or a panic.
    let huge = usize::MAX;
    let saturating = tp(Split::HeadColumns { parts: huge }, 0, 2, 0, 1);
    assert!(saturating.len_in(&[huge]).is_err());
    let overflowing = tp(Split::Rows, 1 << 63, (1 << 63) + 1, 0, 1);
    assert!(overflowing.len_in(&[huge]).is_err());
    // A slice of one element of an enormous parameter walks one row, not 2⁴⁰.
    let one = tp(Split::Columns, 1, 2, 5, 6);
    assert_eq!(one.len_in(&[1 << 40, 4]).unwrap(), 1);
    assert_eq!(one.runs(&[1 << 40, 4]), vec![(11, 1)]);
    assert!(tp(Split::Columns, 1, 2, 6, 6).runs(&[1 << 40, 4]).is_empty());
}
