//! Loading the models whose fields follow their checkpoint's names (the VAE and the text
//! encoders): every tensor of the files gets a canonical name (the layout the model's fields
//! follow, whatever layout the file uses), and every parameter is read from the name its module
//! path gives, one tensor at a time.
//!
//! Burn's own layer layouts are handled here once: a `Linear` weight is stored `[d_input,
//! d_output]` (the checkpoint's `[d_output, d_input]`, or a 1×1 convolution's
//! `[d_output, d_input, 1, 1]`, transposed), and the `gamma` / `beta` of `GroupNorm` and
//! `LayerNorm` are the checkpoint's `weight` / `bias`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, FloatDType, Tensor, TensorData, backend::Backend};
use burn_quant::Checkpoint;
use half::bf16;
use rayon::prelude::*;
use serde::de::DeserializeOwned;

use crate::error::{KeyReport, LoadError, ShapeMismatch};
use crate::flux::read_f32;

/// Where a loader puts a weight matrix instead of the device: given its parameter path and its
/// values (Burn's layout, the model's dtype), the tensor the model holds, or why not. The
/// trainer passes burn-offload's `WeightStream::streamed_tensor`, so that a model larger than
/// the device loads straight into host memory.
pub type PlaceWeight<'a, B> = dyn FnMut(&str, TensorData) -> Result<Tensor<B, 2>, Box<dyn std::error::Error + Send + Sync>>
    + 'a;

/// `data` as the tensor of parameter `name`: handed to `place` when given (which takes
/// matrices only), else uploaded to `device`; in `dtype` either way. A refusal of the placement
/// is a [`LoadError::Place`] about `file` naming the parameter, with the placement's error as
/// its source.
pub(crate) fn place_or_upload<B: Backend, const D: usize>(
    place: Option<&mut PlaceWeight<'_, B>>,
    name: &str,
    data: TensorData,
    device: &B::Device,
    dtype: DType,
    file: &Path,
) -> Result<Tensor<B, D>, LoadError> {
    match place {
        Some(place) => {
            let matrix =
                place(name, data.convert_dtype(dtype)).map_err(|source| LoadError::Place {
                    file: file.to_path_buf(),
                    key: name.to_string(),
                    source,
                })?;
            Ok(Tensor::from_primitive(matrix.into_primitive()))
        }
        None => Ok(B::memory_persistent_allocations(device, data, |data| {
            Tensor::from_data(data, (device, dtype))
        })),
    }
}

/// How a tensor of the canonical layout is stored in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stored {
    /// As the whole tensor.
    Whole,
    /// As block `index` of `parts` equal blocks of rows of a fused tensor (OpenCLIP's
    /// `in_proj_weight`, the attention's q, k and v stacked).
    Rows { index: usize, parts: usize },
    /// As the transpose of the matrix (OpenCLIP's `text_projection`, applied as `x · W`).
    Transposed,
}

impl Stored {
    /// The canonical shape of a tensor stored as `shape`, or `None` when `shape` cannot hold
    /// it.
    fn canonical_shape(self, shape: &[usize]) -> Option<Vec<usize>> {
        match (self, shape) {
            (Self::Whole, _) => Some(shape.to_vec()),
            (Self::Rows { parts, .. }, [rows, rest @ ..]) if rows.is_multiple_of(parts) => {
                Some([&[rows / parts], rest].concat())
            }
            (Self::Transposed, [rows, cols]) => Some(vec![*cols, *rows]),
            _ => None,
        }
    }

    /// The canonical values of a tensor stored as `values` of `shape` (which
    /// [`canonical_shape`](Self::canonical_shape) accepts).
    fn canonical_values(self, values: Vec<f32>, shape: &[usize]) -> Vec<f32> {
        match self {
            Self::Whole => values,
            Self::Rows { index, parts } => {
                let block = values.len() / parts;
                values[index * block..(index + 1) * block].to_vec()
            }
            Self::Transposed => transpose(&values, shape[0], shape[1]),
        }
    }
}

/// The tensors of a checkpoint under their canonical names.
pub(crate) struct NamedTensors {
    files: Checkpoint,
    path: PathBuf,
    /// Canonical name → key in the files and how the tensor is stored there.
    keys: HashMap<String, (String, Stored)>,
}

impl NamedTensors {
    /// Names the tensors of `files` (opened from `path`) with `canonical`, which returns `None`
    /// for a tensor that is not part of the model (another component of an all-in-one file, a
    /// buffer); those are ignored. The scales of FP8 weights are read with their weight and get
    /// no name of their own.
    pub fn new(
        files: Checkpoint,
        path: &Path,
        canonical: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, LoadError> {
        Self::with_parts(files, path, |key| {
            canonical(key)
                .map(|name| (name, Stored::Whole))
                .into_iter()
                .collect()
        })
    }

    /// Names the tensors of `files` as [`new`](Self::new) does, where a tensor of the files
    /// may hold several canonical tensors, or hold one in another orientation: `canonical`
    /// gives each canonical name a tensor holds and how (none for a tensor that is not the
    /// model's).
    pub fn with_parts(
        files: Checkpoint,
        path: &Path,
        canonical: impl Fn(&str) -> Vec<(String, Stored)>,
    ) -> Result<Self, LoadError> {
        let mut keys = HashMap::new();
        for entry in files.tensors() {
            if is_fp8_companion(entry.name) {
                continue;
            }
            for (name, stored) in canonical(entry.name) {
                let held = (entry.name.to_string(), stored);
                if let Some((previous, _)) = keys.insert(name.clone(), held) {
                    return Err(LoadError::Config {
                        file: path.to_path_buf(),
                        message: format!("`{previous}` and `{}` both hold `{name}`", entry.name),
                    });
                }
            }
        }
        Ok(Self {
            files,
            path: path.to_path_buf(),
            keys,
        })
    }

    /// The canonical names present.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// The shape of the tensor named `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let (key, stored) = self.keys.get(name)?;
        stored.canonical_shape(self.files.get(key)?.shape)
    }

    /// Fills every parameter of `model` from the tensor named by `name_of` (applied to the
    /// parameter's module path, after the `gamma` / `beta` renaming), in `dtype` on `device`.
    ///
    /// Every missing, mis-shaped or unused tensor is collected and reported at once as
    /// [`LoadError::Keys`] (missing ones under their canonical names). With `place`, every
    /// `Linear` weight goes there instead of to the device.
    pub fn load<B: Backend, M: Module<B>>(
        &self,
        model: M,
        name_of: impl Fn(&str) -> String,
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<M, LoadError> {
        let mut filler = Filler {
            source: self,
            name_of,
            device: device.clone(),
            dtype,
            place,
            stack: Vec::new(),
            used: HashSet::new(),
            report: KeyReport::default(),
            failure: None,
        };
        let model = model.map(&mut filler);
        filler.finish()?;
        Ok(model)
    }
}

/// The tensor shapes of a single file, from which a loader infers the model's configuration
/// (`model` names the model in errors).
pub(crate) struct KeyShapes<'a, F> {
    pub file: &'a Path,
    pub model: &'static str,
    pub shape_of: F,
}

impl<F: Fn(&str) -> Option<Vec<usize>>> KeyShapes<'_, F> {
    /// A configuration error about the file.
    pub fn error(&self, message: String) -> LoadError {
        LoadError::Config {
            file: self.file.to_path_buf(),
            message,
        }
    }

    /// The shape of `name`, which must have `rank` dimensions.
    pub fn shape(&self, name: &str, rank: usize) -> Result<Vec<usize>, LoadError> {
        match (self.shape_of)(name) {
            Some(shape) if shape.len() == rank => Ok(shape),
            Some(shape) => Err(self.error(format!("`{name}` is {shape:?}, expected rank {rank}"))),
            None => Err(self.error(format!(
                "cannot infer the {} config: `{name}` is missing",
                self.model
            ))),
        }
    }

    /// `[rows, columns]` of the matrix `name`.
    pub fn matrix(&self, name: &str) -> Result<[usize; 2], LoadError> {
        self.shape(name, 2).map(|s| [s[0], s[1]])
    }
}

/// How many numbered children `<prefix><n>.` the names hold: one more than the largest `n`.
pub(crate) fn numbered<'a>(names: impl Iterator<Item = &'a str>, prefix: &str) -> usize {
    names
        .filter_map(|name| name.strip_prefix(prefix))
        .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
        .max()
        .map_or(0, |last| last + 1)
}

/// The model folder of a pipeline component: `path/component` when it holds a
/// `config.json`, else `path` itself when it does.
pub(crate) fn component_folder(path: &Path, component: &str) -> Option<PathBuf> {
    [path.join(component), path.to_path_buf()]
        .into_iter()
        .find(|folder| folder.join("config.json").is_file())
}

/// The weights of a diffusers model folder: its shard index or its
/// `diffusion_pytorch_model.safetensors`, else the folder itself (for [`Checkpoint::open`] to
/// find one other `.safetensors` file there, such as the `.fp16` variant).
pub(crate) fn diffusers_weights(folder: PathBuf) -> PathBuf {
    [
        "diffusion_pytorch_model.safetensors.index.json",
        "diffusion_pytorch_model.safetensors",
    ]
    .iter()
    .map(|name| folder.join(name))
    .find(|file| file.is_file())
    .unwrap_or(folder)
}

/// Reads and parses a json file.
pub(crate) fn read_json<T: DeserializeOwned>(file: &Path) -> Result<T, LoadError> {
    let text = std::fs::read_to_string(file).map_err(|source| LoadError::Io {
        file: file.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json {
        file: file.to_path_buf(),
        source,
    })
}

/// Fills each parameter from the checkpoint as the model's parameters are visited.
struct Filler<'a, 'p, 'q, B: Backend, F> {
    source: &'a NamedTensors,
    name_of: F,
    device: B::Device,
    dtype: FloatDType,
    place: Option<&'p mut PlaceWeight<'q, B>>,
    /// `(field, type of the struct that holds it)` from the root to the current parameter.
    stack: Vec<(String, String)>,
    used: HashSet<String>,
    report: KeyReport,
    failure: Option<LoadError>,
}

impl<B: Backend, F: Fn(&str) -> String> ModuleMapper<B> for Filler<'_, '_, '_, B, F> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.stack
            .push((name.to_string(), container_type.to_string()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some((field, container)) = self.stack.last() else {
            return param;
        };
        let norm = matches!(container.as_str(), "Struct:GroupNorm" | "Struct:LayerNorm");
        let field = match field.as_str() {
            "gamma" if norm => "weight",
            "beta" if norm => "bias",
            other => other,
        };
        let linear_weight = container == "Struct:Linear" && field == "weight";
        let parents: Vec<&str> = self.stack[..self.stack.len() - 1]
            .iter()
            .map(|(name, _)| name.as_str())
            .collect();
        let path = if parents.is_empty() {
            field.to_string()
        } else {
            format!("{}.{field}", parents.join("."))
        };
        let name = (self.name_of)(&path);
        let shape = param.lazy_shape().as_slice().to_vec();
        let Some(data) = self.read(&name, &shape, linear_weight) else {
            return param;
        };
        let place = self
            .place
            .as_deref_mut()
            .filter(|_| linear_weight && D == 2);
        let dtype = DType::from(self.dtype);
        let placed = place_or_upload(place, &name, data, &self.device, dtype, &self.source.path);
        let tensor = match placed {
            Ok(tensor) => tensor,
            Err(error) => {
                self.failure.get_or_insert(error);
                return param;
            }
        };
        let id = param.id;
        param.transform_for_load(tensor, id)
    }
}

impl<B: Backend, F> Filler<'_, '_, '_, B, F> {
    /// The value of the tensor `name` in Burn's layout (`shape`), or `None` after recording
    /// why it cannot be read.
    fn read(&mut self, name: &str, shape: &[usize], linear_weight: bool) -> Option<TensorData> {
        let Some((key, stored)) = self.source.keys.get(name) else {
            self.report.missing.push(name.to_string());
            return None;
        };
        let files = &self.source.files;
        let entry = files.get(key).expect("named keys come from the files");
        self.used.insert(name.to_string());
        let found = stored.canonical_shape(entry.shape);
        let fits = match &found {
            Some(found) if linear_weight => {
                let [d_input, d_output] = [shape[0], shape[1]];
                found.len() >= 2
                    && found[..2] == [d_output, d_input]
                    && found[2..].iter().all(|&s| s == 1)
            }
            Some(found) => found == shape,
            None => false,
        };
        if !fits {
            let expected = if linear_weight {
                vec![shape[1], shape[0]]
            } else {
                shape.to_vec()
            };
            self.report.mismatched.push(ShapeMismatch {
                key: key.clone(),
                expected,
                found: found.unwrap_or_else(|| entry.shape.to_vec()),
            });
            return None;
        }
        let values = match read_f32(files, &entry) {
            Ok(values) => stored.canonical_values(values, entry.shape),
            Err(error) => {
                self.failure.get_or_insert(error);
                return None;
            }
        };
        files.release(&entry);
        let values = if linear_weight {
            transpose(&values, shape[1], shape[0])
        } else {
            values
        };
        Some(TensorData::new(values, shape.to_vec()))
    }

    /// Fails with everything collected, including the tensors no parameter used.
    fn finish(mut self) -> Result<(), LoadError> {
        if let Some(error) = self.failure {
            return Err(error);
        }
        self.report.unexpected = self
            .source
            .keys
            .iter()
            .filter(|(name, _)| !self.used.contains(*name))
            .map(|(_, (key, _))| key.clone())
            .collect();
        self.report.missing.sort();
        self.report.unexpected.sort();
        self.report.unexpected.dedup();
        if self.report.is_empty() {
            Ok(())
        } else {
            Err(LoadError::Keys {
                file: self.source.path.clone(),
                report: self.report,
            })
        }
    }
}

/// Whether `key` is the scale of an FP8 weight (`burnlora quantize`'s and ComfyUI's
/// `.scale_weight`), one of ComfyUI's FP8 input scales, or its scaled-FP8 marker.
fn is_fp8_companion(key: &str) -> bool {
    key.ends_with(".scale_weight") || key.ends_with(".scale_input") || key == "scaled_fp8"
}

/// The transpose of a row-major `[rows, cols]` matrix.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for (r, row) in values.chunks_exact(cols).enumerate() {
        for (c, v) in row.iter().enumerate() {
            out[c * rows + r] = *v;
        }
    }
    out
}

/// Creates every lazily initialized parameter of `module` now, in `dtype`, so that the values
/// do not depend on when the device's random generator is next reseeded.
pub fn materialize<B: Backend, M: Module<B>>(module: M, dtype: FloatDType) -> M {
    struct Cast(FloatDType);
    impl<B: Backend> ModuleMapper<B> for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let dtype = self.0;
            param.map(|tensor| {
                if tensor.dtype() == DType::from(dtype) {
                    tensor
                } else {
                    tensor.cast(dtype)
                }
            })
        }
    }
    module.map(&mut Cast(dtype))
}

/// `module` (lazily initialized) with every parameter created now in `dtype`: each `Linear`
/// weight from random values made on the host and handed to `place` (into host memory for
/// streaming, never through the device), uniform in `±1/√d_input` as Burn's default `Linear`
/// initialization, drawn from `seed` and the parameter's position; every other parameter on
/// the device. This is how a model with random weights larger than the device is built.
pub fn random_placed<B: Backend, M: Module<B>>(
    module: M,
    dtype: FloatDType,
    seed: u64,
    place: &mut PlaceWeight<'_, B>,
) -> Result<M, Box<dyn std::error::Error + Send + Sync>> {
    struct Random<'p, 'q, B: Backend> {
        dtype: FloatDType,
        seed: u64,
        index: u64,
        path: Vec<(String, String)>,
        place: &'p mut PlaceWeight<'q, B>,
        error: Option<Box<dyn std::error::Error + Send + Sync>>,
    }
    impl<B: Backend> ModuleMapper<B> for Random<'_, '_, B> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.push((name.to_string(), container.to_string()));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let shape = param.lazy_shape().as_slice().to_vec();
            self.index += 1;
            let linear_weight = matches!(
                self.path.as_slice(),
                [.., (field, container)] if container == "Struct:Linear" && field == "weight"
            );
            if !linear_weight || self.error.is_some() {
                let dtype = self.dtype;
                return param.map(|tensor| tensor.cast(dtype));
            }
            let data = uniform_matrix(
                &shape,
                self.dtype,
                self.seed ^ self.index.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            let name: Vec<&str> = self.path.iter().map(|(n, _)| n.as_str()).collect();
            match (self.place)(&name.join("."), data) {
                Ok(matrix) => {
                    let id = param.id;
                    param.transform_for_load(Tensor::from_primitive(matrix.into_primitive()), id)
                }
                Err(error) => {
                    self.error = Some(error);
                    param
                }
            }
        }
    }
    let mut random = Random {
        dtype,
        seed,
        index: 0,
        path: Vec::new(),
        place,
        error: None,
    };
    let module = module.map(&mut random);
    match random.error {
        Some(error) => Err(error),
        None => Ok(module),
    }
}

/// A `[d_input, d_output]` matrix uniform in `±1/√d_input`, in `dtype` (bf16 or f32), from
/// `seed`: rows of 4096 values each from their own SplitMix64 stream, in parallel.
fn uniform_matrix(shape: &[usize], dtype: FloatDType, seed: u64) -> TensorData {
    const CHUNK: usize = 4096;
    let numel: usize = shape.iter().product();
    let bound = (shape[0] as f32).sqrt().recip();
    let fill = |chunk: usize, out: &mut dyn FnMut(usize, f32)| {
        let mut state = seed ^ (chunk as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        for i in 0..CHUNK.min(numel - chunk * CHUNK) {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let unit = (z >> 40) as f32 / (1u64 << 24) as f32;
            out(i, (2.0 * unit - 1.0) * bound);
        }
    };
    match dtype {
        FloatDType::BF16 => {
            let mut values = vec![bf16::ZERO; numel];
            values
                .par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, out)| fill(c, &mut |i, v| out[i] = bf16::from_f32(v)));
            TensorData::new(values, shape.to_vec())
        }
        _ => {
            let mut values = vec![0f32; numel];
            values
                .par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, out)| fill(c, &mut |i, v| out[i] = v));
            TensorData::new(values, shape.to_vec())
        }
    }
}

/// Every float parameter of `module`, by path, with its shape (without creating it).
#[cfg(test)]
pub(crate) fn param_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<usize>)> {
    use burn::module::ModuleVisitor;
    struct Paths(Vec<String>, Vec<(String, Vec<usize>)>);
    impl<B: Backend> ModuleVisitor<B> for Paths {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.1
                .push((self.0.join("."), param.lazy_shape().as_slice().to_vec()));
        }
    }
    let mut paths = Paths(Vec::new(), Vec::new());
    module.visit(&mut paths);
    paths.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::nn::{GroupNorm, GroupNormConfig, Linear, LinearConfig};
    use safetensors::tensor::TensorView;

    #[derive(Module, Debug)]
    struct Tiny<B: Backend> {
        proj: Linear<B>,
        norm: GroupNorm<B>,
    }

    /// `tensors` loaded into a fresh [`Tiny`] on the CPU in f32, names unchanged.
    fn load_tiny(tensors: &NamedTensors) -> Result<Tiny<Flex>, LoadError> {
        tensors.load(
            tiny(),
            str::to_string,
            &Default::default(),
            FloatDType::F32,
            None,
        )
    }

    fn tiny() -> Tiny<Flex> {
        let device = Default::default();
        Tiny {
            proj: LinearConfig::new(3, 2).init(&device),
            norm: GroupNormConfig::new(1, 2).init(&device),
        }
    }

    fn write(dir: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) -> PathBuf {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(&str, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((name, shape, _), b)| {
                (
                    *name,
                    TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap(),
                )
            })
            .collect();
        let file = dir.join("model.safetensors");
        safetensors::serialize_to_file(views, None, &file).unwrap();
        file
    }

    #[test]
    fn transposes_linear_weights_and_renames_norm_parameters() {
        let dir = tempfile::tempdir().unwrap();
        let weight: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let file = write(
            dir.path(),
            &[
                ("m.proj.weight", vec![2, 3, 1, 1], weight),
                ("m.proj.bias", vec![2], vec![7.0, 8.0]),
                ("m.norm.weight", vec![2], vec![0.5, 1.5]),
                ("m.norm.bias", vec![2], vec![-1.0, 1.0]),
                ("other.weight", vec![1], vec![0.0]),
            ],
        );
        let files = Checkpoint::open(&file).unwrap();
        let tensors = NamedTensors::new(files, &file, |key| {
            key.strip_prefix("m.").map(str::to_string)
        })
        .unwrap();
        let model = load_tiny(&tensors).unwrap();
        let values = |t: Tensor<Flex, 2>| t.into_data().to_vec::<f32>().unwrap();
        // Burn's [d_input, d_output] is the checkpoint's [d_output, d_input] transposed.
        assert_eq!(
            values(model.proj.weight.val()),
            [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        let gamma = model
            .norm
            .gamma
            .unwrap()
            .val()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(gamma, [0.5, 1.5]);
    }

    #[test]
    fn fp8_weights_load_with_their_scales() {
        use burn_quant::{Fp8Format, Granularity, QuantizeOptions, quantize_checkpoint, read_fp8};
        let dir = tempfile::tempdir().unwrap();
        let weight: Vec<f32> = (0..6).map(|v| v as f32 * 0.37 - 1.0).collect();
        let source = write(
            dir.path(),
            &[
                ("proj.weight", vec![2, 3], weight),
                ("proj.bias", vec![2], vec![7.0, 8.0]),
                ("norm.weight", vec![2], vec![0.5, 1.5]),
                ("norm.bias", vec![2], vec![-1.0, 1.0]),
            ],
        );
        let file = dir.path().join("fp8.safetensors");
        let options = QuantizeOptions {
            format: Fp8Format::E4M3,
            granularity: Granularity::Row,
            include: None,
            exclude: None,
        };
        quantize_checkpoint(&source, &file, &options).unwrap();
        let files = Checkpoint::open(&file).unwrap();
        assert!(files.get("proj.scale_weight").is_some());
        let expected = read_fp8(&files, "proj.weight")
            .unwrap()
            .unwrap()
            .dequantize();
        let tensors = NamedTensors::new(files, &file, |key| Some(key.to_string())).unwrap();
        let model = load_tiny(&tensors).unwrap();
        let loaded = model.proj.weight.val().into_data().to_vec::<f32>().unwrap();
        assert_eq!(loaded, transpose(&expected, 2, 3));
    }

    #[test]
    fn reports_missing_mismatched_and_unused_tensors_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(
            dir.path(),
            &[
                ("proj.weight", vec![3, 2], vec![0.0; 6]),
                ("norm.weight", vec![2], vec![1.0; 2]),
                ("norm.bias", vec![2], vec![0.0; 2]),
                ("extra", vec![1], vec![0.0]),
            ],
        );
        let files = Checkpoint::open(&file).unwrap();
        let tensors = NamedTensors::new(files, &file, |key| Some(key.to_string())).unwrap();
        let error = load_tiny(&tensors).unwrap_err();
        let LoadError::Keys { report, .. } = error else {
            panic!("expected a key report, got {error}");
        };
        assert_eq!(report.missing, ["proj.bias"]);
        assert_eq!(report.unexpected, ["extra"]);
        assert_eq!(
            report.mismatched,
            [ShapeMismatch {
                key: "proj.weight".into(),
                expected: vec![2, 3],
                found: vec![3, 2],
            }]
        );
    }

    #[test]
    fn fused_rows_and_transposed_matrices_load_as_their_canonical_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let fused: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let file = write(
            dir.path(),
            &[
                ("fused.weight", vec![4, 3], fused),
                ("fused.bias", vec![4], vec![1.0, 2.0, 3.0, 4.0]),
                ("norm.weight", vec![2], vec![0.5, 1.5]),
                ("norm.bias", vec![2], vec![-1.0, 1.0]),
            ],
        );
        let files = Checkpoint::open(&file).unwrap();
        let second_half = Stored::Rows { index: 1, parts: 2 };
        let tensors = NamedTensors::with_parts(files, &file, |key| match key {
            "fused.weight" => vec![("proj.weight".into(), second_half)],
            "fused.bias" => vec![("proj.bias".into(), second_half)],
            other => vec![(other.to_string(), Stored::Whole)],
        })
        .unwrap();
        assert_eq!(tensors.shape("proj.weight"), Some(vec![2, 3]));
        let model = load_tiny(&tensors).unwrap();
        let values = |t: Tensor<Flex, 2>| t.into_data().to_vec::<f32>().unwrap();
        // Rows 2 and 3 of the fused [4, 3] matrix, as Burn's [d_input, d_output].
        assert_eq!(
            values(model.proj.weight.val()),
            [6.0, 9.0, 7.0, 10.0, 8.0, 11.0]
        );
        let bias = model.proj.bias.unwrap().val().into_data();
        assert_eq!(bias.to_vec::<f32>().unwrap(), [3.0, 4.0]);

        // A matrix applied as x · W is stored [d_input, d_output], Burn's own layout.
        let projection: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let dir = tempfile::tempdir().unwrap();
        let file = write(
            dir.path(),
            &[
                ("projection", vec![3, 2], projection.clone()),
                ("proj.bias", vec![2], vec![0.0; 2]),
                ("norm.weight", vec![2], vec![1.0; 2]),
                ("norm.bias", vec![2], vec![0.0; 2]),
            ],
        );
        let files = Checkpoint::open(&file).unwrap();
        let tensors = NamedTensors::with_parts(files, &file, |key| match key {
            "projection" => vec![("proj.weight".into(), Stored::Transposed)],
            other => vec![(other.to_string(), Stored::Whole)],
        })
        .unwrap();
        assert_eq!(tensors.shape("proj.weight"), Some(vec![2, 3]));
        let model = load_tiny(&tensors).unwrap();
        assert_eq!(values(model.proj.weight.val()), projection);
    }

    #[test]
    fn rows_that_do_not_split_evenly_are_a_shape_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(
            dir.path(),
            &[
                ("fused.weight", vec![5, 3], vec![0.0; 15]),
                ("proj.bias", vec![2], vec![0.0; 2]),
                ("norm.weight", vec![2], vec![1.0; 2]),
                ("norm.bias", vec![2], vec![0.0; 2]),
            ],
        );
        let files = Checkpoint::open(&file).unwrap();
        let tensors = NamedTensors::with_parts(files, &file, |key| match key {
            "fused.weight" => vec![
                ("proj.weight".into(), Stored::Rows { index: 0, parts: 2 }),
                ("unused.weight".into(), Stored::Rows { index: 1, parts: 2 }),
            ],
            other => vec![(other.to_string(), Stored::Whole)],
        })
        .unwrap();
        let error = load_tiny(&tensors).unwrap_err();
        let LoadError::Keys { report, .. } = error else {
            panic!("expected a key report, got {error}");
        };
        assert_eq!(report.unexpected, ["fused.weight"]);
        assert_eq!(
            report.mismatched,
            [ShapeMismatch {
                key: "fused.weight".into(),
                expected: vec![2, 3],
                found: vec![5, 3],
            }]
        );
    }

    #[test]
    fn two_keys_with_one_name_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = write(
            dir.path(),
            &[("a.w", vec![1], vec![0.0]), ("b.w", vec![1], vec![0.0])],
        );
        let files = Checkpoint::open(&file).unwrap();
        let error = NamedTensors::new(files, &file, |_| Some("w".into()))
            .err()
            .unwrap();
        assert!(error.to_string().contains("both hold `w`"), "{error}");
    }

    #[test]
    fn random_placed_hands_over_linear_weights_only_within_their_bound() {
        let run = || {
            let mut placed = Vec::new();
            let mut place = |name: &str, data: TensorData| {
                placed.push((name.to_string(), data.clone()));
                Ok(Tensor::<Flex, 2>::from_data(data, &Default::default()))
            };
            let model = random_placed(tiny(), FloatDType::F32, 5, &mut place).unwrap();
            (placed, model)
        };
        let (placed, model) = run();
        assert_eq!(placed.len(), 1);
        let (name, data) = &placed[0];
        assert_eq!(name, "proj.weight");
        assert_eq!(data.shape.to_vec(), vec![3, 2]);
        let values = data.to_vec::<f32>().unwrap();
        let bound = 1.0 / 3f32.sqrt();
        assert!(values.iter().all(|v| v.abs() <= bound), "{values:?}");
        assert!(values.windows(2).any(|w| w[0] != w[1]));
        assert_eq!(
            model.proj.weight.val().into_data().to_vec::<f32>().unwrap(),
            values
        );
        assert_eq!(run().0[0].1, *data, "the same seed gives the same values");
    }
}
