//! Reading a safetensors file as hostile input: the header alone, then only the tensors asked
//! for.
//!
//! The format (Hugging Face's `safetensors`): an 8-byte little-endian header length `n`, `n` bytes
//! of JSON naming each tensor's dtype, shape and byte range, then the data. [`TensorFile::open`]
//! reads and checks the header only (its length is bounded by the format's 100 MB limit, every
//! range lies within the file, every size matches its dtype and shape; the `safetensors` crate
//! parses and validates the JSON), so a controller can check a file's names and shapes without
//! touching tensor bytes; [`TensorFile::read_f32`] and [`TensorFile::read_ints`] then read one
//! tensor's bytes from its place in the file.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

/// The format's limit on the header's size, in bytes.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// A safetensors file whose header has been read and checked.
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    file: File,
    /// Where the data section starts in the file.
    data_start: u64,
    tensors: HashMap<String, TensorInfo>,
    /// The header's `__metadata__` (string to string).
    meta: HashMap<String, String>,
}

impl TensorFile {
    /// Opens `path` and reads its header, refusing a file that is not well-formed safetensors.
    pub fn open(path: &Path) -> Result<TensorFile, String> {
        let shown = path.display();
        let mut file = File::open(path).map_err(|e| format!("cannot open {shown}: {e}"))?;
        let file_len = file
            .metadata()
            .map_err(|e| format!("cannot read {shown}: {e}"))?
            .len();
        let mut len_bytes = [0u8; 8];
        file.read_exact(&mut len_bytes).map_err(|_| {
            format!("{shown} is not a safetensors file: shorter than its 8-byte header length")
        })?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER_BYTES || header_len > file_len - 8 {
            return Err(format!(
                "{shown} is not a safetensors file: it announces a {header_len}-byte header in a {file_len}-byte file"
            ));
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header)
            .map_err(|e| format!("cannot read the header of {shown}: {e}"))?;
        let metadata: Metadata = serde_json::from_slice(&header)
            .map_err(|e| format!("{shown} is not a safetensors file: bad header ({e})"))?;
        let data_start = 8 + header_len;
        let data_len = metadata.data_len() as u64;
        if data_start + data_len != file_len {
            return Err(format!(
                "{shown} is truncated or has trailing bytes: its header describes {data_len} bytes of data, the file holds {}",
                file_len - data_start
            ));
        }
        let tensors = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, info.clone()))
            .collect();
        let meta = metadata.metadata().clone().unwrap_or_default();
        Ok(TensorFile {
            path: path.to_path_buf(),
            file,
            data_start,
            tensors,
            meta,
        })
    }

    /// The header's metadata (`__metadata__`: what wrote it, say, and of which model).
    pub fn meta(&self) -> &HashMap<String, String> {
        &self.meta
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of its tensors, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Dtype and shape of tensor `name`, if the file holds one.
    pub fn info(&self, name: &str) -> Option<(Dtype, &[usize])> {
        self.tensors.get(name).map(|t| (t.dtype, t.shape.as_slice()))
    }

    fn bytes(&self, name: &str) -> Result<Vec<u8>, String> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| format!("{} holds no tensor `{name}`", self.path.display()))?;
        let (start, end) = info.data_offsets;
        let mut out = vec![0u8; end - start];
        self.file
            .read_exact_at(&mut out, self.data_start + start as u64)
            .map_err(|e| format!("cannot read `{name}` from {}: {e}", self.path.display()))?;
        Ok(out)
    }

    /// The values of f32 tensor `name`, row-major.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, String> {
        match self.info(name) {
            Some((Dtype::F32, _)) => {}
            Some((dtype, _)) => {
                return Err(format!(
                    "`{name}` in {} is {dtype:?}; it must be F32",
                    self.path.display()
                ));
            }
            None => return Err(format!("{} holds no tensor `{name}`", self.path.display())),
        }
        let bytes = self.bytes(name)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// The values of integer tensor `name` (I64, I32, U8), row-major, as `i64`.
    pub fn read_ints(&self, name: &str) -> Result<Vec<i64>, String> {
        let Some((dtype, _)) = self.info(name) else {
            return Err(format!("{} holds no tensor `{name}`", self.path.display()));
        };
        let bytes = self.bytes(name)?;
        Ok(match dtype {
            Dtype::I64 => bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            Dtype::I32 => bytes
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
                .collect(),
            Dtype::U8 => bytes.into_iter().map(i64::from).collect(),
            other => {
                return Err(format!(
                    "`{name}` in {} is {other:?}; it must be an integer tensor (I64, I32 or U8)",
                    self.path.display()
                ));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(bytes: &[u8]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), bytes).unwrap();
        f
    }

    /// A well-formed file reads back; lying lengths, truncation and bad JSON are refused with
    /// the file named, and nothing is allocated from an announced length that is not there.
    #[test]
    fn hostile_headers_are_refused() {
        let header = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let mut good = (header.len() as u64).to_le_bytes().to_vec();
        good.extend_from_slice(header);
        good.extend_from_slice(&[0, 0, 128, 63, 0, 0, 0, 64]);
        let f = write(&good);
        let file = TensorFile::open(f.path()).unwrap();
        assert_eq!(file.read_f32("a").unwrap(), [1.0, 2.0]);
        assert!(file.read_ints("a").unwrap_err().contains("integer"));
        let cases: [(&[u8], &str); 4] = [
            (&good[..good.len() - 1], "truncated"),
            (&[1, 2, 3], "shorter"),
            (&u64::MAX.to_le_bytes(), "announces"),
            (&[2, 0, 0, 0, 0, 0, 0, 0, b'{', b'x'], "bad header"),
        ];
        for (bytes, why) in cases {
            let f = write(bytes);
            let err = TensorFile::open(f.path()).unwrap_err();
            assert!(
                err.contains(why) && err.contains(&f.path().display().to_string()),
                "{err}"
            );
        }
    }
}
