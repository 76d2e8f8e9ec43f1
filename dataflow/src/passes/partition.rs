//! Partition: cut the model's blocks into contiguous pipeline chunks.
//!
//! By default the chunks are balanced by parameter count (the linear-partition problem: minimise
//! the largest chunk, solved exactly by dynamic programming, as GPipe's and DeepSpeed's
//! `partition_method="parameters"` do). A hand-pinned split (`--stages 0-2,3-8`) is checked to
//! cover every block exactly once, in order, with no empty chunk.

use crate::PlanError;
use crate::model_spec::ModelDesc;

/// A chunk: blocks `start..end`.
pub type Chunk = (usize, usize);

/// Splits the blocks of `model` into `chunks` contiguous chunks of near-equal parameter count.
///
/// Chunks start only where [`crate::sequence_parallel::can_cut_before`] allows; when no cut
/// into `chunks` exists the result has fewer chunks (the caller refuses it).
pub fn balanced(model: &ModelDesc, chunks: usize) -> Vec<Chunk> {
    let n = model.blocks.len();
    let allowed: Vec<bool> = (0..=n)
        .map(|j| crate::sequence_parallel::can_cut_before(model, j))
        .collect();
    let can_cut = |j: usize| allowed[j];
    let weights: Vec<u64> = model.blocks.iter().map(|b| b.params.max(1)).collect();
    let mut prefix = vec![0u64; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + weights[i];
    }
    // best[k][i]: the smallest possible largest chunk when the first i blocks form k chunks.
    let mut best = vec![vec![u64::MAX; n + 1]; chunks + 1];
    let mut cut = vec![vec![0usize; n + 1]; chunks + 1];
    best[0][0] = 0;
    for k in 1..=chunks {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == u64::MAX || !can_cut(j) {
                    continue;
                }
                let cost = best[k - 1][j].max(prefix[i] - prefix[j]);
                // `<` keeps the earliest cut among equals: deterministic.
                if cost < best[k][i] {
                    best[k][i] = cost;
                    cut[k][i] = j;
                }
            }
        }
    }
    if best[chunks][n] == u64::MAX {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(chunks);
    let mut end = n;
    for k in (1..=chunks).rev() {
        let start = cut[k][end];
        out.push((start, end));
        end = start;
    }
    out.reverse();
    out
}

/// Parses `0-2,3-8` (inclusive ranges; a single block may be written `5`) into half-open chunks.
pub fn parse_stages(text: &str, blocks: usize) -> Result<Vec<Chunk>, PlanError> {
    let bad = |why: String| bad_stages(text, why, blocks);
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let parse = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("`{part}` is not a block range like 3-5")))
        };
        let (first, last) = (parse(a)?, parse(b)?);
        if last < first {
            return Err(bad(format!("`{part}` ends before it starts")));
        }
        out.push((first, last + 1));
    }
    Ok(out)
}

/// Checks that `chunks` cover `0..blocks` in order, each non-empty, and that there are `expected`.
pub fn check(chunks: &[Chunk], blocks: usize, expected: usize, given: &str) -> Result<(), PlanError> {
    let bad = |why: String| bad_stages(given, why, blocks);
    if chunks.len() != expected {
        return Err(bad(format!(
            "{} ranges given but pp × virtual-stages = {expected} chunks are needed",
            chunks.len()
        )));
    }
    let mut next = 0;
    for (i, &(start, end)) in chunks.iter().enumerate() {
        if start >= end {
            return Err(bad(format!("chunk {i} is empty")));
        }
        if start < next {
            return Err(bad(format!(
                "chunk {i} starts at block {start}, which chunk {} already holds (ranges overlap)",
                i.saturating_sub(1)
            )));
        }
        if start > next {
            return Err(bad(format!("no chunk holds block {next}")));
        }
        next = end;
    }
    if next != blocks {
        return Err(bad(format!(
            "the last chunk ends at block {} but the model's last block is {}",
            next.saturating_sub(1),
            blocks - 1
        )));
    }
    Ok(())
}

fn bad_stages(given: &str, why: String, blocks: usize) -> PlanError {
    let half = blocks / 2;
    let example = if blocks >= 2 {
        format!("0-{},{}-{}", half - 1, half, blocks - 1)
    } else {
        "0-0".to_string()
    };
    PlanError::BadStages {
        given: given.to_string(),
        why,
        last: blocks.saturating_sub(1),
        example,
    }
}

/// Prints chunks as `0-2,3-8` (the `--stages` syntax).
pub fn format_stages(chunks: &[Chunk]) -> String {
    chunks
        .iter()
        .map(|&(s, e)| {
            if e > s {
                format!("{s}-{}", e - 1)
            } else {
                format!("{s}..{e}(empty)")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelSpec;

    #[test]
    fn balanced_chunks_cover_the_model_and_minimise_the_largest() {
        let model = ModelSpec::mlp_8x1024().desc();
        let c = balanced(&model, 2);
        assert_eq!(c, vec![(0, 4), (4, 9)]);
        let seven = ModelSpec::parse("mlp:in=8,hidden=8,layers=6,out=8")
            .unwrap()
            .desc();
        for k in 1..=7 {
            let c = balanced(&seven, k);
            check(&c, 7, k, "").unwrap();
        }
        assert_eq!(balanced(&seven, 3), vec![(0, 2), (2, 4), (4, 7)]);
    }

    #[test]
    fn hand_splits_are_parsed_and_checked() {
        assert_eq!(parse_stages("0-2,3-8", 9).unwrap(), vec![(0, 3), (3, 9)]);
        assert_eq!(parse_stages("0-7, 8", 9).unwrap(), vec![(0, 8), (8, 9)]);
        let overlap = parse_stages("0-4,3-8", 9).unwrap();
        let err = check(&overlap, 9, 2, "0-4,3-8").unwrap_err().to_string();
        assert!(
            err.contains("overlap") && err.contains("--stages 0-3,4-8"),
            "{err}"
        );
        let gap = parse_stages("0-2,4-8", 9).unwrap();
        assert!(
            check(&gap, 9, 2, "0-2,4-8")
                .unwrap_err()
                .to_string()
                .contains("block 3")
        );
        let short = parse_stages("0-2,3-7", 9).unwrap();
        assert!(
            check(&short, 9, 2, "")
                .unwrap_err()
                .to_string()
                .contains("last block is 8")
        );
        assert!(
            check(&[(0, 9)], 9, 2, "0-8")
                .unwrap_err()
                .to_string()
                .contains("2 chunks")
        );
        assert!(parse_stages("3-1", 9).is_err());
        assert_eq!(format_stages(&[(0, 3), (3, 9)]), "0-2,3-8");
    }
}
