//! The mesh: a named n-dimensional arrangement of actors, the one source of truth for groups.
//!
//! Like picotron's `arange(world).view(dp, pp, tp)`: ranks are laid out row-major over the axes
//! in declaration order, and every communication group is a slice of that grid along one axis.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{ActorId, PlanError};

/// Named axes and their sizes, e.g. `[("dp", 2)]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mesh {
    /// Axes outermost first.
    pub axes: Vec<(String, usize)>,
}

impl Mesh {
    /// A mesh from `(name, size)` pairs, outermost first. Every size must be at least 1.
    pub fn new(axes: &[(&str, usize)]) -> Result<Mesh, PlanError> {
        for (name, size) in axes {
            if *size == 0 {
                return Err(PlanError::Zero {
                    what: axis_flag(name),
                });
            }
        }
        Ok(Mesh {
            axes: axes.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
        })
    }

    /// Number of actors in the mesh (the product of the axis sizes).
    pub fn size(&self) -> usize {
        self.axes.iter().map(|(_, s)| s).product()
    }

    /// Size of the named axis (1 when the mesh does not have it).
    pub fn axis_size(&self, axis: &str) -> usize {
        self.axes.iter().find(|(n, _)| n == axis).map_or(1, |(_, s)| *s)
    }

    /// Coordinates of `rank`, one per axis.
    pub fn coords(&self, rank: ActorId) -> Vec<usize> {
        let mut rest = rank;
        let mut coords = vec![0; self.axes.len()];
        for (i, (_, size)) in self.axes.iter().enumerate().rev() {
            coords[i] = rest % size;
            rest /= size;
        }
        coords
    }

    /// Rank of the given coordinates.
    pub fn rank(&self, coords: &[usize]) -> ActorId {
        self.axes
            .iter()
            .zip(coords)
            .fold(0, |acc, ((_, size), c)| acc * size + c)
    }

    /// The rank at the named coordinates; an axis not named is at 0, and a named axis the mesh
    /// does not have must be at 0 (the mesh is then that slice of a larger one).
    pub fn rank_of(&self, coords: &[(&str, usize)]) -> ActorId {
        debug_assert!(
            coords
                .iter()
                .all(|(n, c)| *c == 0 || self.axes.iter().any(|(a, _)| a == n)),
            "coordinates {coords:?} off the mesh {self}"
        );
        self.axes.iter().fold(0, |acc, (name, size)| {
            let c = coords.iter().find(|(n, _)| n == name).map_or(0, |(_, c)| *c);
            acc * size + c
        })
    }

    /// The coordinate of `rank` along `axis` (0 when the mesh does not have it).
    pub fn coord(&self, rank: ActorId, axis: &str) -> usize {
        match self.axes.iter().position(|(n, _)| n == axis) {
            Some(i) => self.coords(rank)[i],
            None => 0,
        }
    }

    /// The members of `rank`'s group along `axis`, in axis order (`rank` itself included).
    pub fn group(&self, rank: ActorId, axis: &str) -> Vec<ActorId> {
        let Some(i) = self.axes.iter().position(|(n, _)| n == axis) else {
            return vec![rank];
        };
        let mut coords = self.coords(rank);
        (0..self.axes[i].1)
            .map(|c| {
                coords[i] = c;
                self.rank(&coords)
            })
            .collect()
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
        write!(f, "{}", parts.join(" × "))
    }
}

fn axis_flag(name: &str) -> &'static str {
    match name {
        "dp" => "--dp",
        "pp" => "--pp",
        "tp" => "--tp",
        _ => "every mesh axis",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_slices_of_the_grid() {
        let mesh = Mesh::new(&[("dp", 2), ("pp", 3)]).unwrap();
        assert_eq!(mesh.size(), 6);
        assert_eq!(mesh.coords(4), vec![1, 1]);
        assert_eq!(mesh.rank(&[1, 1]), 4);
        assert_eq!(mesh.group(4, "dp"), vec![1, 4]);
        assert_eq!(mesh.group(4, "pp"), vec![3, 4, 5]);
        assert_eq!(mesh.group(4, "tp"), vec![4]);
        assert_eq!(mesh.to_string(), "dp=2 × pp=3");
        assert!(Mesh::new(&[("dp", 0)]).is_err());
        assert_eq!(mesh.rank_of(&[("pp", 1), ("dp", 1), ("tp", 0)]), 4);
    }

    /// tp is the innermost axis: a tp group is consecutive ranks, a dp group strided by pp·tp,
    /// a pp group by tp.
    #[test]
    fn tp_groups_are_consecutive_ranks() {
        let mesh = Mesh::new(&[("dp", 2), ("pp", 2), ("tp", 2)]).unwrap();
        assert_eq!(mesh.group(5, "tp"), vec![4, 5]);
        assert_eq!(mesh.group(5, "dp"), vec![1, 5]);
        assert_eq!(mesh.group(5, "pp"), vec![5, 7]);
        assert_eq!(mesh.rank_of(&[("dp", 1), ("pp", 0), ("tp", 1)]), 5);
        assert_eq!(mesh.coords(6), vec![1, 1, 0]);
    }
}
