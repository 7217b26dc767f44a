//! The run folder and its checkpoints: written atomically, checked on the way back, the
//! newest valid one found for resume, the last `k` kept.
//!
//! ```text
//! <output_dir>/<name>/
//!   <name>_000000250.safetensors   LoRA file at step 250 (written by the caller)
//!   state_000000250.safetensors    training state at step 250: optimizer tensors, and in the
//!                                  metadata the step, data position, RNG, config fingerprint,
//!                                  and the size and CRC-32 of the LoRA file and of the tensors
//! ```
//!
//! Each file is written to `<file>.tmp` in the same folder, synced, then renamed over its name,
//! and the folder is synced; the state file goes last, so a checkpoint exists only once both
//! files are complete. A checkpoint is valid when its state file parses, its tensors match their
//! CRC-32, and its LoRA file has the recorded size and CRC-32: a file cut short or damaged is
//! never taken for a checkpoint.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, TensorData};
use safetensors::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};

use crate::dataset::DataPosition;

/// The safetensors metadata key of the training state (JSON).
pub const STATE_KEY: &str = "burnlora.training_state";

/// Version of the training state layout.
const STATE_VERSION: u32 = 1;

/// A problem with the run folder or a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file or folder could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The caller's LoRA writer failed.
    #[error("writing the LoRA file {path}")]
    Lora {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A checkpoint is incomplete or damaged.
    #[error("{path}: not a valid checkpoint: {reason}")]
    Invalid {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Everything needed to continue a run exactly where a checkpoint left it. The learning rate
/// is a function of `step` ([`crate::optim::LrSchedule::lr`]), so the schedule needs nothing
/// more.
#[derive(Debug)]
pub struct TrainingState {
    /// Optimizer steps completed.
    pub step: u64,
    /// The next batch of the data stream.
    pub data: DataPosition,
    /// State of the training loop's random generator ([`crate::rng::Rng::state`]).
    pub rng: [u64; 4],
    /// [`crate::config::TrainPlan::resume_fingerprint`] of the configuration that wrote it.
    pub config_fingerprint: String,
    /// Anything else the loop needs (counters such as consecutive non-finite losses).
    pub extra: serde_json::Value,
    /// Optimizer steps taken ([`crate::optim::AdamW::steps`]).
    pub optimizer_steps: u64,
    /// Optimizer tensors ([`crate::optim::AdamW::state_tensors`]).
    pub optimizer: Vec<StateTensor>,
}

/// A tensor of a training state: values read from a checkpoint, or made (read from where the
/// optimizer keeps them) each time they are needed, so that a save never holds a copy of the
/// whole state.
pub struct StateTensor {
    /// Its key.
    pub name: String,
    /// The values' dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    values: Values,
}

enum Values {
    Data(TensorData),
    Lazy(Box<dyn Fn() -> TensorData + Send + Sync>),
}

impl StateTensor {
    /// A tensor with these values.
    pub fn from_data(name: String, data: TensorData) -> Self {
        Self {
            name,
            dtype: data.dtype,
            shape: data.shape.to_vec(),
            values: Values::Data(data),
        }
    }

    /// A tensor whose values `values` makes when they are needed (of `dtype` and `shape`).
    pub fn lazy(
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        values: impl Fn() -> TensorData + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            dtype,
            shape,
            values: Values::Lazy(Box::new(values)),
        }
    }

    /// The values.
    pub fn values(&self) -> Cow<'_, TensorData> {
        match &self.values {
            Values::Data(data) => Cow::Borrowed(data),
            Values::Lazy(make) => Cow::Owned(make()),
        }
    }

    /// The values' bytes, as a file holds them.
    fn bytes(&self) -> Cow<'_, [u8]> {
        match self.values() {
            Cow::Borrowed(data) => Cow::Borrowed(data.as_bytes()),
            Cow::Owned(data) => Cow::Owned(data.into_bytes().to_vec()),
        }
    }

    /// The name and the values.
    pub fn into_named(self) -> (String, TensorData) {
        let data = match self.values {
            Values::Data(data) => data,
            Values::Lazy(make) => make(),
        };
        (self.name, data)
    }
}

impl std::fmt::Debug for StateTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateTensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish()
    }
}

/// The JSON kept in the state file's metadata.
#[derive(Serialize, Deserialize)]
struct StateMeta {
    version: u32,
    step: u64,
    data: DataPosition,
    rng: [u64; 4],
    config_fingerprint: String,
    extra: serde_json::Value,
    optimizer_steps: u64,
    lora_file: String,
    lora_bytes: u64,
    lora_crc32: u32,
    tensors_crc32: u32,
}

/// A complete checkpoint on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// Optimizer steps completed.
    pub step: u64,
    /// The LoRA file.
    pub lora: PathBuf,
    /// The training state file.
    pub state: PathBuf,
}

/// The folder of one run: `<output_dir>/<name>`.
#[derive(Clone, Debug)]
pub struct RunDir {
    dir: PathBuf,
    name: String,
}

impl RunDir {
    /// Opens (creating if needed) the run folder `dir` of run `name`, and deletes the `.tmp`
    /// files an interrupted write left there.
    pub fn create(dir: impl Into<PathBuf>, name: &str) -> Result<Self, CheckpointError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        let run = Self {
            dir,
            name: name.to_string(),
        };
        for entry in std::fs::read_dir(&run.dir).map_err(io_error(&run.dir))? {
            let path = entry.map_err(io_error(&run.dir))?.path();
            let ours = path.extension().is_some_and(|e| e == "tmp")
                && path
                    .file_stem()
                    .is_some_and(|s| run.step_of(Path::new(s)).is_some());
            if ours {
                std::fs::remove_file(&path).map_err(io_error(&path))?;
            }
        }
        Ok(run)
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The LoRA file of step `step`: `<name>_<step:09>.safetensors`.
    pub fn lora_path(&self, step: u64) -> PathBuf {
        self.dir
            .join(format!("{}_{step:09}.safetensors", self.name))
    }

    /// The training state file of step `step`: `state_<step:09>.safetensors`.
    pub fn state_path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("state_{step:09}.safetensors"))
    }

    /// The step of a checkpoint file name of this run, if it is one.
    fn step_of(&self, file: &Path) -> Option<u64> {
        let name = file.file_name()?.to_str()?.strip_suffix(".safetensors")?;
        let digits = name
            .strip_prefix("state_")
            .or_else(|| name.strip_prefix(&format!("{}_", self.name)))?;
        (digits.len() == 9 && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| digits.parse().ok())?
    }

    /// Writes the checkpoint of `state.step`: first the LoRA file, through `write_lora` (which
    /// gets a temporary path in the run folder to write to), then the training state; then
    /// deletes all but the newest `keep` checkpoints.
    pub fn save<E>(
        &self,
        state: &TrainingState,
        keep: usize,
        write_lora: impl FnOnce(&Path) -> Result<(), E>,
    ) -> Result<Checkpoint, CheckpointError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let lora = self.lora_path(state.step);
        write_atomically(&lora, |tmp| {
            write_lora(tmp).map_err(|e| CheckpointError::Lora {
                path: lora.clone(),
                source: Box::new(e),
            })
        })?;
        let (lora_bytes, lora_crc32) = file_crc(&lora)?;

        let mut tensors: Vec<&StateTensor> = state.optimizer.iter().collect();
        tensors.sort_by_key(|t| t.name.as_str());
        let meta = StateMeta {
            version: STATE_VERSION,
            step: state.step,
            data: state.data,
            rng: state.rng,
            config_fingerprint: state.config_fingerprint.clone(),
            extra: state.extra.clone(),
            optimizer_steps: state.optimizer_steps,
            lora_file: file_name(&lora),
            lora_bytes,
            lora_crc32,
            // One tensor's values at a time: once for the CRC, once more for the file.
            tensors_crc32: tensors_crc(tensors.iter().map(|t| (t.name.as_str(), t.bytes()))),
        };
        let metadata = HashMap::from([(
            STATE_KEY.to_string(),
            serde_json::to_string(&meta).expect("the state serializes to JSON"),
        )]);
        let state_path = self.state_path(state.step);
        let views = tensors
            .iter()
            .map(|t| {
                let view = LazyView::new(t.dtype, t.shape.clone(), move || t.bytes());
                (t.name.as_str(), view)
            })
            .collect();
        write_views(&state_path, views, metadata)?;
        self.prune(keep)?;
        Ok(Checkpoint {
            step: state.step,
            lora,
            state: state_path,
        })
    }

    /// Steps that have a state file, newest first (valid or not).
    fn saved_steps(&self) -> Result<Vec<u64>, CheckpointError> {
        let mut steps: Vec<u64> = std::fs::read_dir(&self.dir)
            .map_err(io_error(&self.dir))?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("state_"))
            .filter_map(|e| self.step_of(&e.path()))
            .collect();
        steps.sort_unstable_by(|a, b| b.cmp(a));
        Ok(steps)
    }

    /// Deletes the checkpoint files (state and LoRA) older than the newest `keep` saved steps.
    fn prune(&self, keep: usize) -> Result<(), CheckpointError> {
        let kept: Vec<u64> = self.saved_steps()?.into_iter().take(keep).collect();
        let Some(&oldest_kept) = kept.last() else {
            return Ok(());
        };
        for entry in std::fs::read_dir(&self.dir).map_err(io_error(&self.dir))? {
            let path = entry.map_err(io_error(&self.dir))?.path();
            if self.step_of(&path).is_some_and(|s| s < oldest_kept) {
                std::fs::remove_file(&path).map_err(io_error(&path))?;
            }
        }
        Ok(())
    }

    /// The newest valid checkpoint with its state, for auto-resume; invalid newer ones are
    /// skipped with a warning. `None` when the folder has no valid checkpoint.
    pub fn resume(&self) -> Result<Option<(Checkpoint, TrainingState)>, CheckpointError> {
        for step in self.saved_steps()? {
            match self.load(step) {
                Ok(found) => return Ok(Some(found)),
                Err(CheckpointError::Invalid { path, reason }) => {
                    tracing::warn!("skipping {}: {reason}", path.display());
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// The checkpoint of step `step`, checked: [`CheckpointError::Invalid`] when it is
    /// incomplete or damaged.
    pub fn load(&self, step: u64) -> Result<(Checkpoint, TrainingState), CheckpointError> {
        let path = self.state_path(step);
        let invalid = |reason: String| CheckpointError::Invalid {
            path: path.clone(),
            reason,
        };
        let (optimizer, metadata) = read_tensors(&path)?;
        let json = metadata
            .get(STATE_KEY)
            .ok_or_else(|| invalid(format!("no `{STATE_KEY}` metadata")))?;
        let meta: StateMeta =
            serde_json::from_str(json).map_err(|e| invalid(format!("state metadata: {e}")))?;
        if meta.version != STATE_VERSION || meta.step != step {
            return Err(invalid(format!(
                "version {} at step {}, expected version {STATE_VERSION} at step {step}",
                meta.version, meta.step
            )));
        }
        if tensors_crc(
            optimizer
                .iter()
                .map(|(k, v)| (k.as_str(), Cow::Borrowed(v.as_bytes()))),
        ) != meta.tensors_crc32
        {
            return Err(invalid(
                "optimizer tensors do not match their CRC-32".into(),
            ));
        }
        let lora = self.dir.join(&meta.lora_file);
        if lora != self.lora_path(step) {
            return Err(invalid(format!("names LoRA file {}", meta.lora_file)));
        }
        match file_crc(&lora) {
            Ok(found) if found == (meta.lora_bytes, meta.lora_crc32) => {}
            Ok((bytes, _)) => {
                return Err(invalid(format!(
                    "LoRA file {} has {bytes} bytes or a CRC-32 other than recorded ({} bytes)",
                    lora.display(),
                    meta.lora_bytes
                )));
            }
            Err(e) => return Err(invalid(e.to_string())),
        }
        Ok((
            Checkpoint {
                step,
                lora,
                state: path.clone(),
            },
            TrainingState {
                step,
                data: meta.data,
                rng: meta.rng,
                config_fingerprint: meta.config_fingerprint,
                extra: meta.extra,
                optimizer_steps: meta.optimizer_steps,
                optimizer: optimizer
                    .into_iter()
                    .map(|(name, data)| StateTensor::from_data(name, data))
                    .collect(),
            },
        ))
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .expect("checkpoint paths name a file")
        .to_string_lossy()
        .into_owned()
}

/// Writes `target` through `write` (given `<target>.tmp`), syncs it, renames it over `target`
/// and syncs the folder. On error the temporary file is removed and `target` is untouched.
pub fn write_atomically<E>(
    target: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E>
where
    E: From<CheckpointError>,
{
    let tmp = target.with_file_name(format!("{}.tmp", file_name(target)));
    let result = write(&tmp).and_then(|()| {
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .and_then(|()| std::fs::rename(&tmp, target))
            .map_err(|e| E::from(io_error(target)(e)))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    let dir = target.parent().unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| E::from(io_error(dir)(e)))
}

/// Writes `tensors` (in the given order) and `metadata` to the safetensors file `path`,
/// atomically.
pub(crate) fn write_tensors(
    path: &Path,
    tensors: &[(&str, &TensorData)],
    metadata: HashMap<String, String>,
) -> Result<(), CheckpointError> {
    let views = tensors
        .iter()
        .map(|&(name, data)| {
            let bytes = move || Cow::Borrowed(data.as_bytes());
            (name, LazyView::new(data.dtype, data.shape.to_vec(), bytes))
        })
        .collect();
    write_views(path, views, metadata)
}

/// [`write_tensors`] of views whose bytes are taken as the file is written, one at a time.
fn write_views(
    path: &Path,
    views: Vec<(&str, LazyView<'_>)>,
    metadata: HashMap<String, String>,
) -> Result<(), CheckpointError> {
    if let Some((name, view)) = views.iter().find(|(_, view)| view.dtype.is_none()) {
        return Err(CheckpointError::Invalid {
            path: path.to_path_buf(),
            reason: format!("tensor `{name}`: dtype {:?} cannot be saved", view.source),
        });
    }
    write_atomically(path, |tmp| {
        safetensors::serialize_to_file(views, Some(metadata), tmp).map_err(|e| {
            CheckpointError::Io {
                path: tmp.to_path_buf(),
                source: std::io::Error::other(e),
            }
        })
    })
}

/// A tensor as safetensors writes it: its bytes taken when they are written.
struct LazyView<'a> {
    /// The dtype in the file, `None` where it has none for `source`.
    dtype: Option<Dtype>,
    source: DType,
    shape: Vec<usize>,
    bytes: Box<dyn Fn() -> Cow<'a, [u8]> + 'a>,
}

impl<'a> LazyView<'a> {
    fn new(dtype: DType, shape: Vec<usize>, bytes: impl Fn() -> Cow<'a, [u8]> + 'a) -> Self {
        Self {
            dtype: to_safetensors_dtype(dtype),
            source: dtype,
            shape,
            bytes: Box::new(bytes),
        }
    }
}

impl View for LazyView<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
            .expect("write_views refuses dtypes a file cannot hold")
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        (self.bytes)()
    }

    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.source.size()
    }
}

/// Named tensors, as a safetensors file holds them.
pub(crate) type NamedData = Vec<(String, TensorData)>;

/// The tensors of the safetensors file `path`, sorted by name, and its metadata;
/// [`CheckpointError::Invalid`] when the file cannot be parsed.
pub(crate) fn read_tensors(
    path: &Path,
) -> Result<(NamedData, HashMap<String, String>), CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    // Mapped, not read: each tensor is then copied once, from the page cache.
    let file = File::open(path).map_err(io_error(path))?;
    if file.metadata().map_err(io_error(path))?.len() == 0 {
        return Err(invalid("the file is empty".into()));
    }
    // SAFETY: the map is read-only and dropped before returning; checkpoint and cache files are
    // replaced by rename, never modified in place.
    let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(io_error(path))?;
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| invalid(e.to_string()))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| invalid(e.to_string()))?;
    let mut views = tensors.tensors();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    let tensors = views
        .into_iter()
        .map(|(k, v)| {
            let dtype = from_safetensors_dtype(v.dtype())
                .ok_or_else(|| invalid(format!("tensor `{k}` has dtype {:?}", v.dtype())))?;
            let data = TensorData::from_bytes_vec(v.data().to_vec(), v.shape().to_vec(), dtype);
            Ok((k, data))
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    Ok((tensors, header.metadata().clone().unwrap_or_default()))
}

/// Size and CRC-32 of a file.
fn file_crc(path: &Path) -> Result<(u64, u32), CheckpointError> {
    let file = File::open(path).map_err(io_error(path))?;
    let len = file.metadata().map_err(io_error(path))?.len();
    let mut hasher = crc32fast::Hasher::new();
    if len > 0 {
        // SAFETY: the map is read-only and dropped before returning; checkpoint files are
        // replaced by rename, never modified in place.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_error(path))?;
        hasher.update(&map);
    }
    Ok((len, hasher.finalize()))
}

/// CRC-32 over the names and bytes of tensors given in name order.
fn tensors_crc<'a>(tensors: impl Iterator<Item = (&'a str, Cow<'a, [u8]>)>) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    for (name, bytes) in tensors {
        hasher.update(name.as_bytes());
        hasher.update(&bytes);
    }
    hasher.finalize()
}

fn to_safetensors_dtype(dtype: DType) -> Option<Dtype> {
    Some(match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U64 => Dtype::U64,
        DType::U32 => Dtype::U32,
        DType::U16 => Dtype::U16,
        DType::U8 => Dtype::U8,
        _ => return None,
    })
}

fn from_safetensors_dtype(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U64 => DType::U64,
        Dtype::U32 => DType::U32,
        Dtype::U16 => DType::U16,
        Dtype::U8 => DType::U8,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> TrainingState {
        TrainingState {
            step,
            data: DataPosition {
                epoch: step / 3,
                batch: (step % 3) as usize,
            },
            rng: [step, 2, 3, 4],
            config_fingerprint: "00ff".into(),
            extra: serde_json::json!({ "nan_streak": 1 }),
            optimizer_steps: step,
            // One tensor given, one made when written.
            optimizer: vec![
                StateTensor::from_data(
                    "layer.m".into(),
                    TensorData::new(vec![step as f32, -0.5, 1e-30], [3]),
                ),
                StateTensor::lazy("layer.m.codes".into(), DType::I8, vec![4], || {
                    TensorData::new(vec![-127i8, 0, 5, 127], [4])
                }),
            ],
        }
    }

    /// A stand-in LoRA writer: bytes that depend on the step.
    fn lora_bytes(step: u64) -> impl FnOnce(&Path) -> Result<(), std::io::Error> {
        move |path| std::fs::write(path, format!("lora weights at step {step}").repeat(100))
    }

    fn save(run: &RunDir, step: u64, keep: usize) -> Checkpoint {
        run.save(&state(step), keep, lora_bytes(step)).unwrap()
    }

    #[test]
    fn a_saved_checkpoint_loads_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(dir.path().join("run"), "demo").unwrap();
        let saved = save(&run, 250, 3);
        assert_eq!(
            saved.lora,
            dir.path().join("run/demo_000000250.safetensors")
        );
        assert_eq!(
            saved.state,
            dir.path().join("run/state_000000250.safetensors")
        );
        let (found, loaded) = run.resume().unwrap().unwrap();
        assert_eq!(found, saved);
        let expected = state(250);
        assert_eq!(loaded.data, expected.data);
        assert_eq!(loaded.rng, expected.rng);
        assert_eq!(loaded.extra, expected.extra);
        assert_eq!(loaded.config_fingerprint, expected.config_fingerprint);
        assert_eq!(loaded.optimizer_steps, 250);
        assert_eq!(loaded.optimizer.len(), expected.optimizer.len());
        for (a, b) in loaded.optimizer.iter().zip(&expected.optimizer) {
            assert_eq!((&a.name, a.dtype, &a.shape), (&b.name, b.dtype, &b.shape));
            let (a, b) = (a.values(), b.values());
            assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape));
            assert_eq!(a.as_bytes(), b.as_bytes());
        }
        // Nothing temporary is left behind.
        let names: Vec<String> = std::fs::read_dir(run.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }

    #[test]
    fn only_the_last_k_checkpoints_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(dir.path(), "demo").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "user file").unwrap();
        for step in [10, 20, 30, 40] {
            save(&run, step, 2);
        }
        let mut names: Vec<String> = std::fs::read_dir(run.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "demo_000000030.safetensors",
                "demo_000000040.safetensors",
                "notes.txt",
                "state_000000030.safetensors",
                "state_000000040.safetensors",
            ]
        );
    }

    #[test]
    fn damaged_newest_checkpoints_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(dir.path(), "demo").unwrap();
        for step in [10, 20, 30, 40, 50] {
            save(&run, step, 10);
        }
        // 50: state file cut short (killed during a write that bypassed the rename).
        let state50 = run.state_path(50);
        let bytes = std::fs::read(&state50).unwrap();
        std::fs::write(&state50, &bytes[..bytes.len() - 7]).unwrap();
        // 40: one flipped bit in the optimizer tensors.
        let state40 = run.state_path(40);
        let mut bytes = std::fs::read(&state40).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&state40, &bytes).unwrap();
        // 30: LoRA file truncated.
        let lora30 = run.lora_path(30);
        let bytes = std::fs::read(&lora30).unwrap();
        std::fs::write(&lora30, &bytes[..10]).unwrap();
        // 20: LoRA file missing.
        std::fs::remove_file(run.lora_path(20)).unwrap();
        let (found, state) = run.resume().unwrap().unwrap();
        assert_eq!(found.step, 10);
        assert_eq!(state.rng[0], 10);
        for step in [20, 30, 40, 50] {
            assert!(
                matches!(run.load(step), Err(CheckpointError::Invalid { .. })),
                "step {step}"
            );
        }
    }

    #[test]
    fn an_interrupted_write_leaves_no_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(dir.path(), "demo").unwrap();
        save(&run, 10, 5);
        // The LoRA writer fails half-way: no file of step 20 may appear.
        let failed = run.save(&state(20), 5, |path: &Path| {
            std::fs::write(path, b"partial").unwrap();
            Err(std::io::Error::other("disk full"))
        });
        assert!(matches!(failed, Err(CheckpointError::Lora { .. })));
        assert!(!run.lora_path(20).exists() && !run.state_path(20).exists());
        // What a kill between write and rename leaves: temporary files, cleaned on open.
        std::fs::write(dir.path().join("state_000000020.safetensors.tmp"), b"x").unwrap();
        std::fs::write(dir.path().join("demo_000000020.safetensors.tmp"), b"x").unwrap();
        let run = RunDir::create(dir.path(), "demo").unwrap();
        assert_eq!(run.resume().unwrap().unwrap().0.step, 10);
        assert!(!dir.path().join("state_000000020.safetensors.tmp").exists());
        assert!(!dir.path().join("demo_000000020.safetensors.tmp").exists());
    }

    #[test]
    fn an_empty_run_folder_has_nothing_to_resume() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(dir.path(), "demo").unwrap();
        assert!(run.resume().unwrap().is_none());
    }
}
