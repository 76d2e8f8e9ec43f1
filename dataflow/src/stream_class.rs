//! Stream classes: the actors of one pipeline device run the same instruction stream in every
//! data-parallel replica and on every tensor-parallel rank, up to who their peers are and which
//! rows of the batch they load. The plan builds, lowers and verifies one representative stream
//! per pipeline device (replica 0, rank 0) and derives every other actor's by translation along
//! `dp` and `tp` — as Pathways' single controller compiles a program once per sharded
//! computation, not once per shard (Barham et al. 2022) — so building and verifying a plan's
//! streams cost what its pipeline costs, not what its replicas multiply it to (the actors'
//! placement and estimates stay per actor).
//!
//! The translation: an actor at `(r, s, t)` runs its representative `(0, s, 0)`'s stream with
//! every peer moved by `(r, ·, t)`, every collective group moved along the axes it does not span
//! (a dp group keeps its replicas and moves to rank `t`; a tp group keeps its ranks and moves to
//! replica `r`; a group over everyone stays), and `LoadBatch` rows moved by `r` replicas. Verifying
//! the representatives with every actor replaced by its class ([`Symmetry::quotient`]) verifies
//! the whole mesh: the classes run in lockstep, so a whole mesh deadlocks exactly when its
//! quotient does, provided the streams are symmetric ([`Symmetry::check`]: every peer a
//! representative, every group whole along the class axes it spans and the same for every member).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::instruction::{ComputeOp, Instruction};
use crate::mesh::Mesh;
use crate::{ActorId, PlanError};

/// The axes the classes translate along, and what a replica's batch rows are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Symmetry {
    /// Per mesh axis (outermost first): stride, size, and whether classes translate along it.
    axes: Vec<Axis>,
    /// Rows of the global batch per data-parallel replica.
    replica_rows: usize,
    /// The mesh axis `dp` (the one that moves `LoadBatch` rows).
    dp: Option<usize>,
    /// One past the representatives' largest tag: an actor's tags are its representative's
    /// moved by a multiple of it, so that every edge of the mesh keeps a tag of its own.
    pub tags: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Axis {
    stride: usize,
    size: usize,
    class: bool,
}

/// The mesh axes the stream classes translate along.
const CLASS_AXES: [&str; 2] = ["dp", "tp"];

impl Symmetry {
    /// The symmetry of `mesh`'s `dp` and `tp` axes, with `replica_rows` batch rows per replica.
    pub fn of(mesh: &Mesh, replica_rows: usize) -> Symmetry {
        let mut stride = 1;
        let mut axes: Vec<Axis> = Vec::new();
        for (name, size) in mesh.axes.iter().rev() {
            axes.push(Axis {
                stride,
                size: *size,
                class: CLASS_AXES.contains(&name.as_str()),
            });
            stride *= size;
        }
        axes.reverse();
        Symmetry {
            axes,
            replica_rows,
            dp: mesh.axes.iter().position(|(n, _)| n == "dp"),
            tags: 0,
        }
    }

    fn coord(&self, actor: ActorId, axis: usize) -> usize {
        let a = self.axes[axis];
        actor / a.stride % a.size
    }

    fn size(&self) -> usize {
        self.axes.first().map_or(1, |a| a.stride * a.size)
    }

    /// The representative of `actor`'s class: its coordinates on `dp` and `tp` set to 0.
    pub fn representative(&self, actor: ActorId) -> ActorId {
        (self.axes.iter().enumerate())
            .filter(|(_, a)| a.class)
            .fold(actor, |x, (i, a)| x - self.coord(actor, i) * a.stride)
    }

    /// Which actors are representatives (indexed by actor).
    pub fn built(&self) -> Vec<bool> {
        (0..self.size()).map(|a| self.representative(a) == a).collect()
    }

    /// Whether `group` spans mesh axis `i` (its members differ there).
    fn spans(&self, group: &[ActorId], i: usize) -> bool {
        let first = group.first().map(|&a| self.coord(a, i));
        group.iter().any(|&a| Some(self.coord(a, i)) != first)
    }

    /// The mesh axes `group` spans, one bit each (none for a single peer: pass `&[]`).
    pub fn spanned(&self, group: &[ActorId]) -> u64 {
        (0..self.axes.len())
            .filter(|&i| self.spans(group, i))
            .fold(0, |mask, i| mask | 1 << i)
    }

    /// The class axes a group with `spanned` axes moves along.
    fn moving(&self, spanned: u64) -> impl Iterator<Item = (usize, &Axis)> {
        (self.axes.iter().enumerate()).filter(move |(i, a)| a.class && spanned & (1 << i) == 0)
    }

    /// Member `x` of a representative's group spanning `spanned`, as `actor` names it: moved to
    /// `actor`'s place along the class axes the group does not span (all of them for a peer).
    pub fn moved(&self, x: ActorId, actor: ActorId, spanned: u64) -> ActorId {
        self.moving(spanned)
            .fold(x, |x, (i, a)| x + self.coord(actor, i) * a.stride)
    }

    /// The member of a representative's group spanning `spanned` that `actor` is the image of
    /// (the actor's place there: what its position in the group is read from).
    pub fn as_member(&self, actor: ActorId, spanned: u64) -> ActorId {
        self.moving(spanned)
            .fold(actor, |x, (i, a)| x - self.coord(actor, i) * a.stride)
    }

    /// The tag `actor` gives its representative's `tag` on an edge over a group spanning
    /// `spanned` (none for a send or receive): moved by the actor's place along the class axes
    /// the group does not span, which every member of the edge shares.
    fn tag(&self, tag: u64, actor: ActorId, spanned: u64) -> u64 {
        let mut place = 0;
        for (i, a) in self.axes.iter().enumerate().filter(|(_, a)| a.class) {
            let c = if spanned & (1 << i) != 0 {
                0
            } else {
                self.coord(actor, i)
            };
            place = place * a.size as u64 + c as u64;
        }
        tag + place * self.tags
    }

    /// `actor`'s instruction, from its representative's `template`; `started` maps the
    /// representative's collective tags to the actor's, for the waits that follow their starts.
    fn rebase(&self, template: &Instruction, actor: ActorId, started: &mut HashMap<u64, u64>) -> Instruction {
        let mut out = template.clone();
        match &mut out {
            Instruction::Send { to: peer, tag, .. } | Instruction::Recv { from: peer, tag, .. } => {
                *peer = self.moved(*peer, actor, 0);
                *tag = self.tag(*tag, actor, 0);
            }
            Instruction::StartCollective { group, tag, .. } => {
                let spanned = self.spanned(group);
                for m in group.iter_mut() {
                    *m = self.moved(*m, actor, spanned);
                }
                let moved = self.tag(*tag, actor, spanned);
                started.insert(*tag, moved);
                *tag = moved;
            }
            Instruction::WaitCollective { tag, .. } => {
                *tag = started.get(tag).copied().unwrap_or(*tag);
            }
            Instruction::Compute {
                op: ComputeOp::LoadBatch { start, end },
                ..
            } => {
                let rows = self.dp.map_or(0, |d| self.coord(actor, d)) * self.replica_rows;
                *start += rows;
                *end += rows;
            }
            Instruction::Compute { .. } => {}
        }
        out
    }

    /// `actor`'s whole stream, from its representative's.
    pub fn stream(&self, template: &[Instruction], actor: ActorId) -> Vec<Instruction> {
        if self.representative(actor) == actor {
            return template.to_vec();
        }
        let mut started = HashMap::new();
        template
            .iter()
            .map(|i| self.rebase(i, actor, &mut started))
            .collect()
    }

    /// Refuses representative streams (indexed by actor, empty for the others) that the
    /// translation cannot carry to every actor: a peer off the representatives, a group not whole
    /// along a class axis it spans or off the representatives' place on one it does not, or a
    /// collective whose members list different groups.
    pub fn check(&self, streams: &[Vec<Instruction>]) -> Result<(), PlanError> {
        let places: u64 = (self.axes.iter())
            .filter(|a| a.class)
            .map(|a| a.size as u64)
            .product();
        if self.tags.saturating_mul(places) >= 1 << 32 {
            return Err(PlanError::Malformed(format!(
                "{} edges per class × {places} places need tags past 2³², which a step's edge ids do not hold",
                self.tags
            )));
        }
        let mut groups: HashMap<u64, &[ActorId]> = HashMap::new();
        for (actor, stream) in streams.iter().enumerate() {
            let mut started = std::collections::HashSet::new();
            for (pc, instruction) in stream.iter().enumerate() {
                let fault = |why: String| {
                    PlanError::Malformed(format!(
                        "actor {actor}, instruction {pc} `{instruction}`: {why}; the stream classes \
                         (one stream per pipeline device, translated along dp and tp) cannot carry it"
                    ))
                };
                match instruction {
                    Instruction::Send { to: peer, .. } | Instruction::Recv { from: peer, .. }
                        if self.representative(*peer) != *peer =>
                    {
                        return Err(fault(format!("its peer {peer} is not at replica 0, rank 0")));
                    }
                    Instruction::WaitCollective { tag, .. } if !started.contains(tag) => {
                        return Err(fault(format!(
                            "it waits for collective tag {tag} before starting it"
                        )));
                    }
                    Instruction::StartCollective { group, tag, .. } => {
                        started.insert(*tag);
                        if *groups.entry(*tag).or_insert(group) != group.as_slice() {
                            return Err(fault(format!("members list different groups for tag {tag}")));
                        }
                        self.check_group(group).map_err(fault)?;
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn check_group(&self, group: &[ActorId]) -> Result<(), String> {
        for (i, axis) in self.axes.iter().enumerate().filter(|(_, a)| a.class) {
            if self.spans(group, i) {
                let mut seen = vec![false; axis.size];
                for &m in group {
                    seen[self.coord(m, i)] = true;
                }
                if seen.contains(&false) {
                    return Err(format!("group {group:?} spans mesh axis {i} but not all of it"));
                }
            } else if group.first().is_some_and(|&m| self.coord(m, i) != 0) {
                return Err(format!("group {group:?} sits off coordinate 0 of mesh axis {i}"));
            }
        }
        // Whole along what it spans: every member's line along each spanned class axis is in
        // the group (its places there × its distinct other coordinates, each once).
        let spanned = self.spanned(group);
        let members: std::collections::HashSet<ActorId> = group.iter().copied().collect();
        let others: std::collections::HashSet<ActorId> =
            group.iter().map(|&m| self.as_member(m, !spanned)).collect();
        let lines: usize = (self.axes.iter().enumerate())
            .filter(|(i, a)| a.class && spanned & (1 << i) != 0)
            .map(|(_, a)| a.size)
            .product();
        if members.len() != group.len() || group.len() != others.len() * lines {
            return Err(format!(
                "group {group:?} is not whole along the class axes it spans (each member's line along them)"
            ));
        }
        Ok(())
    }

    /// The representatives' streams with every actor named by its class's representative and
    /// every group cut to its distinct classes: what [`crate::verify::verify`] checks for the
    /// whole mesh (see the module's note).
    pub fn quotient(&self, streams: &[Vec<Instruction>]) -> Vec<Vec<Instruction>> {
        let class = |a: ActorId| self.representative(a);
        let named_by_class = |i: &Instruction| {
            let mut i = i.clone();
            match &mut i {
                Instruction::Send { to: peer, .. } | Instruction::Recv { from: peer, .. } => {
                    *peer = class(*peer)
                }
                Instruction::StartCollective { group, .. } => {
                    let mut classes: Vec<ActorId> = Vec::new();
                    for c in group.iter().map(|&m| class(m)) {
                        if !classes.contains(&c) {
                            classes.push(c);
                        }
                    }
                    *group = classes;
                }
                Instruction::Compute { .. } | Instruction::WaitCollective { .. } => {}
            }
            i
        };
        (streams.iter())
            .map(|stream| stream.iter().map(named_by_class).collect())
            .collect()
    }
}

/// A plan's streams: one per class, kept by its representative, and the symmetry that carries
/// it to the class's other actors.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamClasses {
    /// The translation from representatives to actors (`None`: every actor keeps its own).
    pub symmetry: Option<Symmetry>,
    /// The representatives' streams, indexed by actor (empty for every other actor, and for
    /// actors whose stream a host part leaves out).
    pub templates: Vec<Vec<Instruction>>,
}

impl StreamClasses {
    /// The lowered `streams` (indexed by actor; those of `symmetry`'s representatives only, when
    /// given, with `tags` edges), verified: whole, or through the symmetry's check and quotient.
    pub fn verified(
        symmetry: Option<Symmetry>,
        streams: Vec<Vec<Instruction>>,
        tags: u64,
    ) -> Result<StreamClasses, PlanError> {
        let symmetry = match symmetry {
            Some(mut s) => {
                s.tags = tags;
                s.check(&streams)?;
                crate::verify::verify(&s.quotient(&streams))?;
                Some(s)
            }
            None => {
                crate::verify::verify(&streams)?;
                None
            }
        };
        Ok(StreamClasses {
            symmetry,
            templates: streams,
        })
    }

    /// The representative whose stream `actor` runs.
    pub fn representative(&self, actor: ActorId) -> ActorId {
        self.symmetry.as_ref().map_or(actor, |s| s.representative(actor))
    }

    /// The stream of `actor`'s class as its representative runs it: the computes, tensors and
    /// collective kinds every actor of the class runs; peers, groups and tags the representative's.
    pub fn template(&self, actor: ActorId) -> &[Instruction] {
        self.templates
            .get(self.representative(actor))
            .map_or(&[], Vec::as_slice)
    }

    /// The mesh axes a template's `group` spans ([`Symmetry::spanned`]; none without classes).
    pub fn spanned(&self, group: &[ActorId]) -> u64 {
        self.symmetry.as_ref().map_or(0, |s| s.spanned(group))
    }

    /// Who `actor` is in a group of its class's template spanning `spanned` (see
    /// [`Symmetry::as_member`]): its position there is its position in its own stream's group.
    pub fn as_member(&self, actor: ActorId, spanned: u64) -> ActorId {
        self.symmetry
            .as_ref()
            .map_or(actor, |s| s.as_member(actor, spanned))
    }

    /// `actor`'s own stream.
    pub fn stream(&self, actor: ActorId) -> Vec<Instruction> {
        match &self.symmetry {
            Some(s) => s.stream(self.template(actor), actor),
            None => self.template(actor).to_vec(),
        }
    }

    /// Instruction `index` of `actor`'s own stream (one translated, not the whole stream: what a
    /// hang report names).
    pub fn instruction(&self, actor: ActorId, index: usize) -> Option<Instruction> {
        let template = self.template(actor);
        let at = template.get(index)?;
        let Some(symmetry) = &self.symmetry else {
            return Some(at.clone());
        };
        let mut started = HashMap::new();
        if let Instruction::WaitCollective { tag, .. } = at
            && let Some(start) = (template[..index].iter())
                .rfind(|i| matches!(i, Instruction::StartCollective { tag: t, .. } if t == tag))
        {
            symmetry.rebase(start, actor, &mut started);
        }
        Some(symmetry.rebase(at, actor, &mut started))
    }

    /// Refuses classes that do not fit a plan of `actors` actors (a plan from the network is
    /// hostile): one template per actor, and a symmetry over exactly that many.
    pub fn check_shape(&self, actors: usize) -> Result<(), String> {
        if self.templates.len() != actors {
            return Err(format!("{} streams for {actors} actors", self.templates.len()));
        }
        let Some(s) = &self.symmetry else {
            return Ok(());
        };
        // Row-major strides over sizes of at least 1 whose product is the actor count.
        let mut stride = Some(1usize);
        for a in s.axes.iter().rev() {
            if a.size == 0 || stride != Some(a.stride) {
                stride = None;
                break;
            }
            stride = stride.and_then(|x| x.checked_mul(a.size));
        }
        if stride != Some(actors) || s.dp.is_some_and(|d| d >= s.axes.len()) {
            return Err(format!(
                "a symmetry over axis sizes {:?} for {actors} actors",
                s.axes.iter().map(|a| a.size).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }

    /// The instructions of every actor's stream, summed.
    pub fn instructions(&self) -> usize {
        (0..self.templates.len()).map(|a| self.template(a).len()).sum()
    }

    /// The instructions built: the representatives' streams, summed (what compiling and
    /// verifying cost grows with).
    pub fn built_instructions(&self) -> usize {
        self.templates.iter().map(Vec::len).sum()
    }

    /// The classes as a host of `actors` needs them: their representatives' streams only.
    pub fn for_actors(&self, actors: &[ActorId]) -> StreamClasses {
        let mut keep = vec![false; self.templates.len()];
        for &a in actors {
            if let Some(k) = keep.get_mut(self.representative(a)) {
                *k = true;
            }
        }
        StreamClasses {
            symmetry: self.symmetry.clone(),
            templates: (self.templates.iter().zip(keep))
                .map(|(t, keep)| if keep { t.clone() } else { Vec::new() })
                .collect(),
        }
    }
}

#[cfg(test)]
#[path = "stream_class_tests.rs"]
mod tests;
