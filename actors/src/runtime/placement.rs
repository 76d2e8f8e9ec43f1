//! Placement: which slot (a device of a host) an actor or a mesh goes to when the program names
//! only a kind of device, as Ray's scheduling strategies and placement groups do. Locally
//! `spawn_with(DeviceSpec::Cpu(1), …)` is that very device; on a cluster a device names its kind
//! (CPU or GPU) and the strategy picks the slot. `spawn_at` places on one slot exactly.

use archipelago_dataflow::DeviceSpec;

use super::cluster::Slot;

/// How a single actor is placed on a cluster among the slots of the kind its device names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Across hosts first (Ray's `SPREAD`): the host with the fewest actors this program placed,
    /// then its device with the fewest; ties to the first in slot order. The default.
    #[default]
    Spread,
    /// Fill hosts in slot order (Ray's `PACK`): the first device of that kind with no actor this
    /// program placed; once every one has some, the least loaded in slot order.
    Pack,
}

/// How a mesh's members are laid on the slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MeshPlacement {
    /// Member `r` on slot `r` (what `spawn_mesh` does).
    #[default]
    InOrder,
    /// Every member on one host (Ray's `STRICT_PACK`): the first host with a slot for each.
    OneHost,
    /// Round robin over the hosts (each host's slots in order): neighbours on different hosts.
    Spread,
}

/// Whether `slot` is of the kind `device` names (CPU or GPU).
fn same_kind(slot: DeviceSpec, device: DeviceSpec) -> bool {
    slot.cuda_ordinal().is_some() == device.cuda_ordinal().is_some()
}

/// The slot for one actor on a device of `device`'s kind, given how many actors this program
/// already placed on each slot; `None` when no slot is of that kind.
pub(crate) fn choose_slot(
    slots: &[Slot],
    placed: &[usize],
    device: DeviceSpec,
    placement: Placement,
) -> Option<usize> {
    let load = |i: usize| placed.get(i).copied().unwrap_or(0);
    let host_load = |host: &str| -> usize {
        (slots.iter().enumerate())
            .filter(|(_, s)| s.host == host)
            .map(|(i, _)| load(i))
            .sum()
    };
    let kind = (0..slots.len()).filter(|&i| same_kind(slots[i].device, device));
    match placement {
        Placement::Spread => kind.min_by_key(|&i| (host_load(&slots[i].host), load(i), i)),
        Placement::Pack => kind.min_by_key(|&i| (load(i), i)),
    }
}

/// The slots of a mesh of `size` members under `placement`, or why it cannot be laid out.
pub(crate) fn mesh_slots(
    slots: &[Slot],
    size: usize,
    placement: MeshPlacement,
) -> Result<Vec<usize>, String> {
    let mut hosts: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        match hosts.iter_mut().find(|(h, _)| *h == slot.host) {
            Some((_, own)) => own.push(i),
            None => hosts.push((&slot.host, vec![i])),
        }
    }
    let chosen: Vec<usize> = match placement {
        MeshPlacement::InOrder => (0..slots.len()).take(size).collect(),
        MeshPlacement::OneHost => {
            let fits = hosts.iter().find(|(_, own)| own.len() >= size);
            let Some((_, own)) = fits else {
                let largest = hosts.iter().map(|(_, own)| own.len()).max().unwrap_or(0);
                return Err(format!(
                    "no host has {size} devices for the mesh on one host (the largest has {largest}); \
                     make the mesh smaller, start a host with more devices, or place it with MeshPlacement::Spread"
                ));
            };
            own[..size].to_vec()
        }
        MeshPlacement::Spread => {
            let rounds = hosts.iter().map(|(_, own)| own.len()).max().unwrap_or(0);
            (0..rounds)
                .flat_map(|k| hosts.iter().filter_map(move |(_, own)| own.get(k).copied()))
                .take(size)
                .collect()
        }
    };
    if chosen.len() < size {
        return Err(format!(
            "the mesh needs {size} devices and there are {}; make the mesh smaller or add devices (hosts)",
            slots.len()
        ));
    }
    Ok(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(spec: &[(&str, &str)]) -> Vec<Slot> {
        (spec.iter())
            .map(|(host, device)| Slot {
                host: host.to_string(),
                island: String::new(),
                addr: format!("{host}:1"),
                device: device.parse().unwrap(),
            })
            .collect()
    }

    #[test]
    fn spread_goes_across_hosts_and_pack_fills_the_first() {
        let s = slots(&[
            ("h1", "cpu:0"),
            ("h1", "cpu:1"),
            ("h2", "cpu:0"),
            ("h2", "cuda:0"),
        ]);
        let mut placed = vec![0; s.len()];
        let mut spread = Vec::new();
        for _ in 0..4 {
            let i = choose_slot(&s, &placed, DeviceSpec::Cpu(7), Placement::Spread).unwrap();
            placed[i] += 1;
            spread.push(i);
        }
        assert_eq!(
            spread,
            vec![0, 2, 1, 2],
            "h1, h2, h1's idle device, then h2 (the host with fewer)"
        );
        let mut placed = vec![0; s.len()];
        let mut pack = Vec::new();
        for _ in 0..4 {
            let i = choose_slot(&s, &placed, DeviceSpec::Cpu(0), Placement::Pack).unwrap();
            placed[i] += 1;
            pack.push(i);
        }
        assert_eq!(pack, vec![0, 1, 2, 0]);
        let gpu = choose_slot(&s, &[0; 4], DeviceSpec::Cuda(3), Placement::Spread);
        assert_eq!(gpu, Some(3), "a GPU request goes to the only GPU");
        let none = choose_slot(
            &slots(&[("h1", "cpu:0")]),
            &[0],
            DeviceSpec::Cuda(0),
            Placement::Pack,
        );
        assert_eq!(none, None);
    }

    #[test]
    fn meshes_in_order_on_one_host_or_spread() {
        let s = slots(&[
            ("h1", "cpu:0"),
            ("h1", "cpu:1"),
            ("h2", "cpu:0"),
            ("h2", "cpu:1"),
            ("h2", "cpu:2"),
        ]);
        assert_eq!(mesh_slots(&s, 3, MeshPlacement::InOrder).unwrap(), vec![0, 1, 2]);
        assert_eq!(mesh_slots(&s, 3, MeshPlacement::OneHost).unwrap(), vec![2, 3, 4]);
        assert_eq!(mesh_slots(&s, 2, MeshPlacement::OneHost).unwrap(), vec![0, 1]);
        assert_eq!(
            mesh_slots(&s, 4, MeshPlacement::Spread).unwrap(),
            vec![0, 2, 1, 3]
        );
        let refused = mesh_slots(&s, 4, MeshPlacement::OneHost).unwrap_err();
        assert!(
            refused.contains("no host has 4 devices") && refused.contains("the largest has 3"),
            "{refused}"
        );
        assert!(
            mesh_slots(&s, 6, MeshPlacement::Spread)
                .unwrap_err()
                .contains("needs 6 devices and there are 5")
        );
    }
}
