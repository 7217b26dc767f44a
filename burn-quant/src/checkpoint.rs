//! Reading safetensors checkpoints (single files and sharded folders) tensor by tensor, and
//! writing them as a stream, atomically.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use crate::error::QuantError;

/// One memory-mapped safetensors file.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Where tensor data starts in the file.
    data_start: usize,
    metadata: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Self, QuantError> {
        let file = File::open(path).map_err(QuantError::io(path))?;
        // SAFETY: the map is read-only; a file changed underneath would give wrong values, never
        // unsound Rust (we only read bytes).
        let mmap = unsafe { Mmap::map(&file) }.map_err(QuantError::io(path))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| QuantError::corrupt(path, e))?;
        let data_start = 8 + header_len;
        if data_start + metadata.data_len() > mmap.len() {
            return Err(QuantError::corrupt(
                path,
                "the file is shorter than its header says",
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            data_start,
            metadata,
        })
    }
}

/// A tensor of a checkpoint: its name, dtype, shape and bytes (borrowed from the map).
#[derive(Clone, Copy, Debug)]
pub struct TensorEntry<'a> {
    /// The key.
    pub name: &'a str,
    /// The stored dtype.
    pub dtype: Dtype,
    /// The shape.
    pub shape: &'a [usize],
    /// The raw little-endian bytes.
    pub data: &'a [u8],
    /// The file that holds it.
    pub file: &'a Path,
}

/// A safetensors checkpoint: one file, or the shards listed by a `*.safetensors.index.json`.
///
/// Tensors are memory-mapped and read one at a time; [`Checkpoint::release`] hands a tensor's
/// pages back to the OS once it has been used, so a pass over a checkpoint larger than RAM stays
/// within a small resident set.
pub struct Checkpoint {
    shards: Vec<Shard>,
    /// `(shard, name)` in file order (shard by shard, by offset).
    order: Vec<(usize, String)>,
    /// Name to position in `order`.
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens a `.safetensors` file, a `.safetensors.index.json` shard index, or a folder holding
    /// exactly one of either.
    pub fn open(path: &Path) -> Result<Self, QuantError> {
        let path = resolve(path)?;
        let files = if path.to_string_lossy().ends_with(".json") {
            shard_files(&path)?
        } else {
            vec![path]
        };
        let shards = files
            .iter()
            .map(|f| Shard::open(f))
            .collect::<Result<Vec<_>, _>>()?;
        let mut index = HashMap::new();
        let mut order = Vec::new();
        for (s, shard) in shards.iter().enumerate() {
            for name in shard.metadata.offset_keys() {
                if index.insert(name.clone(), order.len()).is_some() {
                    return Err(QuantError::DuplicateKey {
                        file: shard.path.clone(),
                        key: name,
                    });
                }
                order.push((s, name));
            }
        }
        Ok(Self {
            shards,
            order,
            index,
        })
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The string metadata of the first file (`__metadata__`), if any.
    pub fn metadata(&self) -> HashMap<String, String> {
        self.shards
            .first()
            .and_then(|s| s.metadata.metadata().clone())
            .unwrap_or_default()
    }

    /// The files read.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorEntry<'_>> {
        self.order.iter().map(|(s, name)| self.entry(*s, name))
    }

    /// The tensor under `name`, if present.
    pub fn get(&self, name: &str) -> Option<TensorEntry<'_>> {
        let (shard, name) = &self.order[*self.index.get(name)?];
        Some(self.entry(*shard, name))
    }

    fn entry<'a>(&'a self, shard: usize, name: &'a str) -> TensorEntry<'a> {
        let shard = &self.shards[shard];
        let info: &TensorInfo = shard.metadata.info(name).expect("key listed by the header");
        let (start, end) = info.data_offsets;
        TensorEntry {
            name,
            dtype: info.dtype,
            shape: &info.shape,
            data: &shard.mmap[shard.data_start + start..shard.data_start + end],
            file: &shard.path,
        }
    }

    /// Hands the pages of a tensor's bytes back to the OS (they are read again from the file if
    /// the tensor is used once more).
    pub fn release(&self, entry: &TensorEntry<'_>) {
        let Some(shard) = self.shards.iter().find(|s| s.path == entry.file) else {
            return;
        };
        let offset = entry.data.as_ptr() as usize - shard.mmap.as_ptr() as usize;
        // SAFETY: the map is a read-only file mapping, so dropping its pages loses nothing: the
        // next access faults them in again from the file with the same contents.
        let advised = unsafe {
            shard
                .mmap
                .unchecked_advise_range(UncheckedAdvice::DontNeed, offset, entry.data.len())
        };
        if let Err(e) = advised {
            tracing::debug!("madvise on {}: {e}", shard.path.display());
        }
    }
}

/// Turns a folder into the one checkpoint file or index it holds.
fn resolve(path: &Path) -> Result<PathBuf, QuantError> {
    if !path.is_dir() {
        if !path.exists() {
            return Err(QuantError::Io {
                file: path.to_path_buf(),
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        return Ok(path.to_path_buf());
    }
    let names: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(QuantError::io(path))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    let pick = |suffix: &str| -> Vec<&PathBuf> {
        names
            .iter()
            .filter(|p| p.to_string_lossy().ends_with(suffix))
            .collect()
    };
    match (
        pick(".safetensors.index.json").as_slice(),
        pick(".safetensors").as_slice(),
    ) {
        ([index], _) => Ok((*index).clone()),
        ([], [single]) => Ok((*single).clone()),
        _ => Err(QuantError::corrupt(
            path,
            "expected one .safetensors file or one .safetensors.index.json in the folder",
        )),
    }
}

/// The shard files named by an index's `weight_map`, in first-seen order.
fn shard_files(index: &Path) -> Result<Vec<PathBuf>, QuantError> {
    let text = std::fs::read_to_string(index).map_err(QuantError::io(index))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| QuantError::corrupt(index, e))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| QuantError::corrupt(index, "no `weight_map` object"))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (key, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| QuantError::corrupt(index, format!("`{key}` maps to a non-string")))?;
        let file = dir.join(file);
        if !files.contains(&file) {
            files.push(file);
        }
    }
    Ok(files)
}

/// The header of one tensor of a file being written.
#[derive(Clone, Debug)]
pub struct TensorHeader {
    /// The key.
    pub name: String,
    /// The dtype.
    pub dtype: Dtype,
    /// The shape.
    pub shape: Vec<usize>,
}

/// Writes a safetensors file tensor by tensor, without holding it in memory.
///
/// The header (every key, dtype and shape) is written first; the bytes of each tensor follow in
/// header order. Everything goes to a temporary file in the same folder, renamed over the final
/// name by [`StreamingWriter::finish`]; a writer dropped before that removes its temporary file,
/// so a half-written file never appears under the final name.
pub struct StreamingWriter {
    path: PathBuf,
    temp: PathBuf,
    out: Option<BufWriter<File>>,
    pending: std::vec::IntoIter<(String, usize)>,
}

impl StreamingWriter {
    /// Starts the file at `path` with these tensors (written later, in this order) and metadata.
    pub fn create(
        path: &Path,
        tensors: Vec<TensorHeader>,
        metadata: HashMap<String, String>,
    ) -> Result<Self, QuantError> {
        let mut offset = 0;
        let mut infos = Vec::with_capacity(tensors.len());
        let mut pending = Vec::with_capacity(tensors.len());
        for t in tensors {
            let numel: usize = t.shape.iter().product();
            let len = numel * t.dtype.bitsize() / 8;
            pending.push((t.name.clone(), len));
            infos.push((
                t.name,
                TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape,
                    data_offsets: (offset, offset + len),
                },
            ));
            offset += len;
        }
        let metadata = (!metadata.is_empty()).then_some(metadata);
        let header = Metadata::new(metadata, infos).map_err(|e| QuantError::corrupt(path, e))?;
        let mut header =
            serde_json::to_vec(&header).map_err(|e| QuantError::corrupt(path, e.to_string()))?;
        header.resize(header.len().next_multiple_of(8), b' ');

        let temp = temp_path(path);
        let file = File::create(&temp).map_err(QuantError::io(&temp))?;
        let mut writer = Self {
            path: path.to_path_buf(),
            temp,
            out: Some(BufWriter::with_capacity(1 << 22, file)),
            pending: pending.into_iter(),
        };
        writer.write_raw(&(header.len() as u64).to_le_bytes())?;
        writer.write_raw(&header)?;
        Ok(writer)
    }

    /// Writes the bytes of the next tensor; `name` must be the next one in header order.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<(), QuantError> {
        match self.pending.next() {
            Some((expected, len)) if expected == name && len == bytes.len() => {
                self.write_raw(bytes)
            }
            Some((expected, len)) => Err(QuantError::corrupt(
                &self.path,
                format!(
                    "writing `{name}` ({} bytes) where `{expected}` ({len} bytes) comes next",
                    bytes.len()
                ),
            )),
            None => Err(QuantError::corrupt(
                &self.path,
                format!("`{name}` is not in the header"),
            )),
        }
    }

    fn write_raw(&mut self, bytes: &[u8]) -> Result<(), QuantError> {
        let out = self.out.as_mut().expect("open until finish");
        out.write_all(bytes).map_err(QuantError::io(&self.temp))
    }

    /// Flushes, syncs and renames the file to its final name.
    pub fn finish(mut self) -> Result<(), QuantError> {
        if let Some((name, _)) = self.pending.next() {
            return Err(QuantError::corrupt(
                &self.path,
                format!("`{name}` was never written"),
            ));
        }
        let out = self.out.take().expect("open until finish");
        let file = out
            .into_inner()
            .map_err(|e| QuantError::io(&self.temp)(e.into_error()))?;
        file.sync_all().map_err(QuantError::io(&self.temp))?;
        std::fs::rename(&self.temp, &self.path).map_err(QuantError::io(&self.path))
    }
}

impl Drop for StreamingWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// A hidden sibling of `path`, unique to this process.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_file(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let headers = tensors
            .iter()
            .map(|(n, d, s, _)| TensorHeader {
                name: n.to_string(),
                dtype: *d,
                shape: s.clone(),
            })
            .collect();
        let mut w = StreamingWriter::create(path, headers, HashMap::new()).unwrap();
        for (n, _, _, b) in tensors {
            w.write(n, b).unwrap();
        }
        w.finish().unwrap();
    }

    #[test]
    fn streamed_file_reads_back_with_the_reference_parser() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        let b: Vec<u8> = (0..24u8).collect();
        write_file(
            &path,
            &[
                ("x", Dtype::F32, vec![2, 3], b.clone()),
                ("y", Dtype::U8, vec![3], vec![7, 8, 9]),
            ],
        );
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("x").unwrap().data(), &b[..]);
        assert_eq!(st.tensor("y").unwrap().shape(), &[3]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn abandoned_writer_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        let header = TensorHeader {
            name: "x".into(),
            dtype: Dtype::U8,
            shape: vec![2],
        };
        let mut w = StreamingWriter::create(&path, vec![header], HashMap::new()).unwrap();
        assert!(w.write("y", &[1, 2]).is_err());
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn sharded_index_is_read_in_order() {
        let dir = tempfile::tempdir().unwrap();
        write_file(
            &dir.path().join("m-1.safetensors"),
            &[("a", Dtype::U8, vec![1], vec![1])],
        );
        write_file(
            &dir.path().join("m-2.safetensors"),
            &[("b", Dtype::U8, vec![1], vec![2])],
        );
        std::fs::write(
            dir.path().join("m.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}"#,
        )
        .unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let names: Vec<_> = ckpt.tensors().map(|t| (t.name, t.data[0])).collect();
        assert_eq!(names, vec![("a", 1), ("b", 2)]);
    }

    #[test]
    fn truncated_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        write_file(&path, &[("x", Dtype::U8, vec![64], vec![0; 64])]);
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
        let err = Checkpoint::open(&path).err().unwrap().to_string();
        assert!(err.contains("t.safetensors"), "{err}");
    }
}
