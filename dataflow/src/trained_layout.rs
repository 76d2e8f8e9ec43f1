//! Where a block's trained elements lie among all its elements.
//!
//! A block's parameters, flattened in declaration order, are its *full* vector; the trainer
//! keeps, reduces, shards and updates only the trainable ones, concatenated in the same order:
//! the *trained* vector. Frozen parameters have no place in it (no gradient, no optimizer state,
//! no ZeRO shard): each actor that holds the block keeps them whole, as they were initialised.
//! This file maps between the two vectors; with no frozen parameter they are the same vector.

use std::ops::Range;

use crate::param_desc::ParamDesc;

/// One parameter's run of elements in the full vector, and where it lies in the trained vector
/// (or in the frozen values, for a frozen parameter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// Its elements in the block's full vector.
    pub full: Range<usize>,
    /// Whether it trains.
    pub trained: bool,
    /// Its first element in the trained vector (trainable) or in the frozen values (frozen).
    pub at: usize,
}

/// The map from a block's full parameter vector to its trained vector and its frozen values.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrainedLayout {
    runs: Vec<Run>,
    trained_len: usize,
    frozen_len: usize,
}

impl TrainedLayout {
    /// The layout of a block whose parameters are `params`, in flattening order.
    pub fn of(params: &[ParamDesc]) -> TrainedLayout {
        let mut layout = TrainedLayout::default();
        let mut full = 0;
        for p in params {
            let len = p.len();
            let at = if p.trainable {
                &mut layout.trained_len
            } else {
                &mut layout.frozen_len
            };
            layout.runs.push(Run {
                full: full..full + len,
                trained: p.trainable,
                at: *at,
            });
            *at += len;
            full += len;
        }
        layout
    }

    /// Elements the trainer keeps, reduces and updates.
    pub fn trained_len(&self) -> usize {
        self.trained_len
    }

    /// Elements of the frozen parameters.
    pub fn frozen_len(&self) -> usize {
        self.frozen_len
    }

    /// Elements of all the parameters.
    pub fn full_len(&self) -> usize {
        self.trained_len + self.frozen_len
    }

    /// Whether any parameter is frozen (else the trained vector is the full vector).
    pub fn has_frozen(&self) -> bool {
        self.frozen_len > 0
    }

    /// Each parameter's run.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Splits a full vector into its trained vector and its frozen values.
    ///
    /// # Panics
    /// When `full` is not [`TrainedLayout::full_len`] long.
    pub fn split<T: Copy>(&self, full: &[T]) -> (Vec<T>, Vec<T>) {
        assert_eq!(full.len(), self.full_len(), "a block's full parameter vector");
        let mut trained = Vec::with_capacity(self.trained_len);
        let mut frozen = Vec::with_capacity(self.frozen_len);
        for run in &self.runs {
            let to = if run.trained { &mut trained } else { &mut frozen };
            to.extend_from_slice(&full[run.full.clone()]);
        }
        (trained, frozen)
    }

    /// Where the elements `trained` of the trained vector lie in the full vector: pairs of
    /// (range in the trained vector, range in the full vector), in order.
    pub fn trained_in_full(&self, trained: Range<usize>) -> Vec<(Range<usize>, Range<usize>)> {
        self.runs
            .iter()
            .filter(|run| run.trained)
            .filter_map(|run| {
                let start = trained.start.max(run.at);
                let end = trained.end.min(run.at + run.full.len());
                (start < end).then(|| {
                    let full = run.full.start + (start - run.at)..run.full.start + (end - run.at);
                    (start..end, full)
                })
            })
            .collect()
    }

    /// Where the frozen values lie in the full vector: pairs of (range in the frozen values,
    /// range in the full vector), one per frozen parameter.
    pub fn frozen_in_full(&self) -> Vec<(Range<usize>, Range<usize>)> {
        self.runs
            .iter()
            .filter(|run| !run.trained)
            .map(|run| (run.at..run.at + run.full.len(), run.full.clone()))
            .collect()
    }

    /// Which parameters train, in flattening order.
    pub fn trainable_mask(&self) -> Vec<bool> {
        self.runs.iter().map(|run| run.trained).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ParamInit;

    fn params() -> Vec<ParamDesc> {
        vec![
            ParamDesc::new("a", vec![2, 2], ParamInit::Zeros),
            ParamDesc::new("b", vec![3], ParamInit::Zeros).frozen(),
            ParamDesc::new("c", vec![2], ParamInit::Zeros),
            ParamDesc::new("d", vec![1], ParamInit::Zeros).frozen(),
        ]
    }

    /// The trained vector skips the frozen parameters, and the frozen values are the rest.
    #[test]
    fn split_skips_frozen_parameters_into_the_frozen_values() {
        let layout = TrainedLayout::of(&params());
        assert_eq!((layout.trained_len(), layout.frozen_len()), (6, 4));
        let full: Vec<u32> = (0..10).collect();
        let (trained, frozen) = layout.split(&full);
        assert_eq!(trained, vec![0, 1, 2, 3, 7, 8]);
        assert_eq!(frozen, vec![4, 5, 6, 9]);
        assert_eq!(layout.trainable_mask(), vec![true, false, true, false]);
    }

    /// A range of the trained vector maps to the full vector's runs around the frozen ones.
    #[test]
    fn a_trained_range_maps_around_the_frozen_runs() {
        let layout = TrainedLayout::of(&params());
        assert_eq!(layout.trained_in_full(2..5), vec![(2..4, 2..4), (4..5, 7..8)]);
        assert_eq!(layout.trained_in_full(0..6).len(), 2);
        assert_eq!(layout.trained_in_full(3..3), vec![]);
        assert_eq!(layout.frozen_in_full(), vec![(0..3, 4..7), (3..4, 9..10)]);
    }

    /// Without frozen parameters the trained vector is the full vector.
    #[test]
    fn without_frozen_parameters_the_vectors_are_one() {
        let all: Vec<ParamDesc> = params()
            .into_iter()
            .map(|mut p| {
                p.trainable = true;
                p
            })
            .collect();
        let layout = TrainedLayout::of(&all);
        assert!(!layout.has_frozen());
        let expected = vec![(1..4, 1..4), (4..7, 4..7), (7..9, 7..9)];
        assert_eq!(layout.trained_in_full(1..9), expected);
    }
}
