//! Top-k's error-feedback residuals in a checkpoint (issue 43): each replica's leftover per bucket
//! ([`super::sparse::Residuals`]) is its own state, not a piece of the model, so every actor
//! that keeps any writes them beside its shard as `actor-NNNNN.residuals`, and a resume of the
//! same layout reads them back, bit for bit (at another layout the buckets differ and they
//! start at zero; the controller says so).
//!
//! The file: the magic `ARCHRES1`, the bucket count (u32), then per bucket its tag (u64), its
//! length (u64) and its f32 values, all little-endian, and last the CRC-32C of everything before
//! it. A file read back is checked whole — magic, every length against the bytes left, the CRC —
//! before anything is taken from it.

use std::path::{Path, PathBuf};

use archipelago_dataflow::ActorId;

use super::sparse::Residuals;

const MAGIC: &[u8; 8] = b"ARCHRES1";

/// The residual file of `actor` in checkpoint directory `dir`.
pub fn path(dir: &Path, actor: ActorId) -> PathBuf {
    dir.join(format!("actor-{actor:05}.residuals"))
}

/// The bytes of `residuals`, buckets in tag order.
fn encode(residuals: &Residuals) -> Vec<u8> {
    let mut tags: Vec<&u64> = residuals.keys().collect();
    tags.sort();
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&(tags.len() as u32).to_le_bytes());
    for tag in tags {
        let values = &residuals[tag];
        bytes.extend_from_slice(&tag.to_le_bytes());
        bytes.extend_from_slice(&(values.len() as u64).to_le_bytes());
        bytes.extend_from_slice(bytemuck::cast_slice(values));
    }
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    bytes
}

/// Takes `n` bytes from the front of `rest`, or says what was cut short.
fn take<'b>(rest: &mut &'b [u8], n: usize, what: &str) -> Result<&'b [u8], String> {
    if rest.len() < n {
        return Err(format!("it ends inside {what}"));
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Ok(head)
}

/// The residuals in `bytes`, or what is wrong with them.
fn decode(bytes: &[u8]) -> Result<Residuals, String> {
    let Some((body, crc)) = bytes.split_last_chunk::<4>() else {
        return Err("it is shorter than its checksum".into());
    };
    if crc32c::crc32c(body) != u32::from_le_bytes(*crc) {
        return Err("its CRC-32C does not match its contents".into());
    }
    let mut rest = body;
    if take(&mut rest, MAGIC.len(), "the magic")? != MAGIC {
        return Err("it is not a residual file (no ARCHRES1 magic)".into());
    }
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(take(&mut rest, 4, "the count")?.try_into().expect("4 bytes"));
    let mut residuals = Residuals::new();
    for _ in 0..count {
        let tag = word(take(&mut rest, 8, "a bucket's tag")?);
        let len = word(take(&mut rest, 8, "a bucket's length")?);
        let byte_len = usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_mul(4))
            .ok_or_else(|| format!("bucket {tag} claims {len} values"))?;
        let values = take(&mut rest, byte_len, "a bucket's values")?;
        let values = values
            .chunks_exact(4)
            .map(|v| f32::from_le_bytes(v.try_into().expect("4 bytes")));
        residuals.insert(tag, values.collect());
    }
    if !rest.is_empty() {
        return Err(format!("{} bytes follow its last bucket", rest.len()));
    }
    Ok(residuals)
}

/// Writes `actor`'s `residuals` into checkpoint directory `dir` (nothing when it keeps none).
pub fn write(dir: &Path, actor: ActorId, residuals: &Residuals) -> Result<(), String> {
    if residuals.is_empty() {
        return Ok(());
    }
    let path = path(dir, actor);
    crate::checkpoint::write_atomically(&path, &encode(residuals))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// `actor`'s residuals from checkpoint directory `dir`: none when it wrote no file; an error
/// naming the file when it is unreadable or damaged.
pub fn read(dir: &Path, actor: ActorId) -> Result<Residuals, String> {
    let path = path(dir, actor);
    match std::fs::read(&path) {
        Ok(bytes) => {
            decode(&bytes).map_err(|why| format!("the residual file {} is damaged: {why}", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Residuals::new()),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residuals_round_trip_bit_for_bit_and_damage_is_named() {
        let mut residuals = Residuals::new();
        residuals.insert(7, vec![1.5, -0.0, f32::MIN_POSITIVE, 3.25e-9]);
        residuals.insert(2, vec![]);
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 3, &residuals).unwrap();
        let back = read(dir.path(), 3).unwrap();
        assert_eq!(back.len(), 2);
        for (tag, values) in &residuals {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&back[tag]), bits(values), "bucket {tag}");
        }
        assert!(read(dir.path(), 4).unwrap().is_empty(), "no file: no residuals");
        let bytes = std::fs::read(path(dir.path(), 3)).unwrap();
        let mut flipped = bytes.clone();
        flipped[20] ^= 1;
        for (damaged, says) in [
            (flipped, "CRC-32C"),
            (bytes[..2].to_vec(), "shorter than its checksum"),
            (vec![0; 12], "CRC-32C"),
        ] {
            std::fs::write(path(dir.path(), 3), &damaged).unwrap();
            let refused = read(dir.path(), 3).unwrap_err();
            assert!(
                refused.contains("actor-00003.residuals is damaged") && refused.contains(says),
                "{refused}"
            );
        }
        // A length that claims more than the file holds, under a valid checksum.
        let mut lying = MAGIC.to_vec();
        lying.extend_from_slice(&1u32.to_le_bytes());
        lying.extend_from_slice(&9u64.to_le_bytes());
        lying.extend_from_slice(&u64::MAX.to_le_bytes());
        let crc = crc32c::crc32c(&lying);
        lying.extend_from_slice(&crc.to_le_bytes());
        let refused = decode(&lying).unwrap_err();
        assert!(refused.contains("bucket 9 claims"), "{refused}");
        write(dir.path(), 5, &Residuals::new()).unwrap();
        assert!(!path(dir.path(), 5).exists(), "nothing kept: nothing written");
    }
}
