//! A server's keys: `u64` keys, each with `width` f32 values and its update rule's state, created
//! on first touch with the rule's initialiser (Li et al., OSDI 2014, §3.1: the model as sparse
//! (key, value) pairs). One flat vector of values and one of state, an index from key to slot:
//! no allocation per key, so millions of logistic-regression weights cost 4 bytes each plus the
//! index.

use std::collections::HashMap;

use super::update::ServerUpdate;

/// The keys one server holds.
#[derive(Debug, Clone)]
pub struct KeyStore {
    width: usize,
    state_len: usize,
    index: HashMap<u64, usize>,
    keys: Vec<u64>,
    values: Vec<f32>,
    state: Vec<f32>,
}

impl KeyStore {
    /// An empty store of keys with `width` values and `state_len` state floats each.
    pub fn new(width: usize, state_len: usize) -> KeyStore {
        KeyStore {
            width,
            state_len,
            index: HashMap::new(),
            keys: Vec::new(),
            values: Vec::new(),
            state: Vec::new(),
        }
    }

    /// Values per key.
    pub fn width(&self) -> usize {
        self.width
    }

    /// State floats per key.
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The slot of `key`, created with `rule`'s initial values on first touch.
    fn slot<U: ServerUpdate>(&mut self, key: u64, rule: &U) -> usize {
        if let Some(&slot) = self.index.get(&key) {
            return slot;
        }
        let slot = self.keys.len();
        self.keys.push(key);
        self.index.insert(key, slot);
        let at = self.values.len();
        self.values.resize(at + self.width, 0.0);
        rule.initial(key, &mut self.values[at..]);
        self.state.resize(self.state.len() + self.state_len, 0.0);
        slot
    }

    /// Appends the values of `keys` (created on first touch) to `out`.
    pub fn read<U: ServerUpdate>(&mut self, keys: &[u64], rule: &U, out: &mut Vec<f32>) {
        out.reserve(keys.len() * self.width);
        for &key in keys {
            let slot = self.slot(key, rule);
            out.extend_from_slice(&self.values[slot * self.width..(slot + 1) * self.width]);
        }
    }

    /// Applies `grad` (`width` values) to `key` with `rule`.
    pub fn update<U: ServerUpdate>(&mut self, key: u64, grad: &[f32], rule: &U) {
        let slot = self.slot(key, rule);
        let (w, s) = (self.width, self.state_len);
        rule.update(
            &mut self.values[slot * w..(slot + 1) * w],
            &mut self.state[slot * s..(slot + 1) * s],
            grad,
        );
    }

    /// Sets `key`'s values (and, when given, its state), creating it if new.
    pub fn assign<U: ServerUpdate>(&mut self, key: u64, values: &[f32], state: Option<&[f32]>, rule: &U) {
        let slot = self.slot(key, rule);
        let (w, s) = (self.width, self.state_len);
        self.values[slot * w..(slot + 1) * w].copy_from_slice(values);
        if let Some(state) = state {
            self.state[slot * s..(slot + 1) * s].copy_from_slice(state);
        }
    }

    /// Every key with its values and state, ascending by key.
    pub fn entries(&self) -> Vec<(u64, &[f32], &[f32])> {
        let mut slots: Vec<usize> = (0..self.keys.len()).collect();
        slots.sort_unstable_by_key(|&s| self.keys[s]);
        let (w, s) = (self.width, self.state_len);
        slots
            .into_iter()
            .map(|slot| {
                (
                    self.keys[slot],
                    &self.values[slot * w..(slot + 1) * w],
                    &self.state[slot * s..(slot + 1) * s],
                )
            })
            .collect()
    }

    /// Bytes of values and state held.
    pub fn bytes(&self) -> u64 {
        4 * (self.values.len() + self.state.len()) as u64 + 8 * self.keys.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::update::{Adam, BuiltinUpdate, Initializer, Rule};

    #[test]
    fn keys_are_created_on_first_touch_with_the_initialiser_and_updated_in_place() {
        let rule = BuiltinUpdate {
            rule: Rule::Adam(Adam {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            }),
            init: Initializer::Uniform { scale: 0.5, seed: 1 },
        };
        let mut store = KeyStore::new(3, rule.state_len(3));
        let mut out = Vec::new();
        store.read(&[7, 1_000_000_007], &rule, &mut out);
        assert_eq!(out.len(), 6);
        assert_eq!(store.len(), 2);
        let mut expected = [0.0; 3];
        rule.init.fill(7, &mut expected);
        assert_eq!(&out[..3], &expected);
        store.update(7, &[1.0, 1.0, 1.0], &rule);
        let entries = store.entries();
        assert_eq!(entries[0].0, 7);
        assert!((entries[0].1[0] - (expected[0] - 0.1)).abs() < 1e-6);
        assert_eq!(entries[0].2[6], 1.0);
        assert_eq!(store.bytes(), 4 * (6 + 14) + 16);
    }
}
