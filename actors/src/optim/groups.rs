//! Parameter groups on a flat shard (the AdamW recipes of Loshchilov & Hutter, ICLR 2019, and
//! of BERT/GPT-2: no weight decay for biases and LayerNorm): which elements of the optimizer's
//! flat state belong to which parameter, and whether that parameter takes weight decay.
//!
//! The trainer builds a [`ParamLayout`] from its blocks' parameter shapes (`Block::param_shapes`,
//! checked against the plan's parameter descriptions) and the ZeRO shard it owns: a parameter
//! cut by a shard boundary appears as a part on each replica, under the same parameter index, so
//! LAMB's per-parameter norms add up across the dp group. Any caller with its own knowledge of
//! the parameters can build one directly.

use std::ops::Range;

/// One parameter's part of the flat state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamPart {
    /// Elements of the optimizer's flat state.
    pub range: Range<usize>,
    /// The parameter, numbered over everything the caller's reduction spans (for the trainer:
    /// the parameters of its pipeline stage, the same numbering on every replica).
    pub param: usize,
    /// Whether the parameter takes weight decay.
    pub decay: bool,
}

/// The parameters of a flat state: parts in order, covering it without gaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    parts: Vec<ParamPart>,
    params: usize,
    len: usize,
}

impl ParamLayout {
    /// `len` elements of one parameter that takes weight decay.
    pub fn whole(len: usize) -> ParamLayout {
        let parts = if len == 0 {
            Vec::new()
        } else {
            vec![ParamPart {
                range: 0..len,
                param: 0,
                decay: true,
            }]
        };
        ParamLayout {
            parts,
            params: 1,
            len,
        }
    }

    /// A layout of `parts` (each a contiguous run, in order from element 0, no gaps) over
    /// `params` parameters in all (some may have no part here).
    pub fn new(parts: Vec<ParamPart>, params: usize) -> Result<ParamLayout, String> {
        let mut at = 0;
        for p in &parts {
            if p.range.start != at || p.range.end < p.range.start {
                return Err(format!(
                    "parameter part {:?} does not follow element {at}: parts must cover the state in order",
                    p.range
                ));
            }
            if p.param >= params {
                return Err(format!("parameter {} of {params}", p.param));
            }
            at = p.range.end;
        }
        Ok(ParamLayout {
            parts,
            params,
            len: at,
        })
    }

    /// Elements covered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Parameters numbered (the length of a per-parameter norm vector is twice this).
    pub fn params(&self) -> usize {
        self.params
    }

    /// The parts.
    pub fn parts(&self) -> &[ParamPart] {
        &self.parts
    }

    /// The parts overlapping `range`, each cut to it, in order.
    pub fn pieces(&self, range: Range<usize>) -> impl Iterator<Item = (Range<usize>, &ParamPart)> {
        let first = self.parts.partition_point(|p| p.range.end <= range.start);
        self.parts[first..]
            .iter()
            .take_while(move |p| p.range.start < range.end)
            .map(move |p| (p.range.start.max(range.start)..p.range.end.min(range.end), p))
            .filter(|(r, _)| !r.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_parts_to_a_range() {
        let part = |range: Range<usize>, param, decay| ParamPart { range, param, decay };
        let layout = ParamLayout::new(
            vec![part(0..4, 0, true), part(4..6, 1, false), part(6..10, 2, true)],
            3,
        )
        .unwrap();
        let got: Vec<(Range<usize>, usize)> = layout.pieces(3..7).map(|(r, p)| (r, p.param)).collect();
        assert_eq!(got, vec![(3..4, 0), (4..6, 1), (6..7, 2)]);
        assert_eq!(layout.pieces(10..10).count(), 0);
        assert!(ParamLayout::new(vec![part(1..4, 0, true)], 1).is_err(), "a gap");
        assert!(
            ParamLayout::new(vec![part(0..4, 1, true)], 1).is_err(),
            "an index past params"
        );
    }
}
