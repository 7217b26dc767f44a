//! Loading FLUX.1 weights from a BFL single file or a diffusers folder, one tensor at a time.
//!
//! Files are memory-mapped; each tensor is decoded (bf16, f16, f32, f64, or FP8 with its
//! `scale_weight`), laid out for Burn (Linear weights transposed to `[d_in, d_out]`, split
//! diffusers layers stacked, see [`super::keys`]), uploaded, and its file pages handed back to
//! the OS before the next one. Peak host memory is one tensor, not a second copy of the model.

use burn_kernels::Kernels;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Element, FloatDType, Tensor, TensorData, backend::Backend};
use burn_quant::{Checkpoint, FloatBytes, FloatDtype, Fp8Format, TensorEntry, read_fp8, scale_key};
use half::{bf16, f16};
use rayon::prelude::*;

use burn_lora::RowSlice;

use super::keys::{LinearKeys, VectorKeys, linear_keys, vector_keys};
use super::{Flux, FluxConfig};
use crate::error::{KeyReport, LoadError, ShapeMismatch};
use crate::weights::{PlaceWeight, place_or_upload};

/// Prefix of the transformer's keys in ComfyUI's all-in-one checkpoints.
const COMFY_PREFIX: &str = "model.diffusion_model.";
/// ComfyUI's marker of a scaled-FP8 file (its dtype tells the format).
const COMFY_FP8_MARKER: &str = "scaled_fp8";
/// ComfyUI's per-layer input scales, for FP8 matmuls; unused when weights are dequantized.
const COMFY_INPUT_SCALE: &str = ".scale_input";

/// The key naming scheme of a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Black Forest Labs' single file (`flux1-dev.safetensors`), also ComfyUI's.
    Bfl,
    /// A diffusers `FluxTransformer2DModel` folder.
    Diffusers,
}

/// The files of a FLUX transformer (FLUX.1 or FLUX.2): a BFL single file or a diffusers
/// folder, the prefix of its keys, and how every parameter of a model is read from them
/// through the model's key tables.
pub(crate) struct TransformerFiles {
    /// The file, or the folder holding `config.json`.
    pub path: PathBuf,
    pub layout: Layout,
    prefix: &'static str,
    files: Checkpoint,
}

impl TransformerFiles {
    /// Opens a BFL-layout `.safetensors` file (keys possibly under `model.diffusion_model.`),
    /// recognised by its key `marker` (a BFL key every such model has), or a diffusers folder:
    /// a pipeline folder with `transformer/`, or the `transformer` folder itself (`config.json`
    /// and one safetensors file or a shard index). `model` names the model in errors.
    pub fn open(path: &Path, marker: &str, model: &str) -> Result<Self, LoadError> {
        if path.is_dir() {
            let folder = [path.join("transformer"), path.to_path_buf()]
                .into_iter()
                .find(|f| f.join("config.json").is_file())
                .ok_or_else(|| LoadError::UnknownLayout {
                    path: path.to_path_buf(),
                })?;
            let files = Checkpoint::open(&folder)?;
            return Ok(Self {
                path: folder,
                layout: Layout::Diffusers,
                prefix: "",
                files,
            });
        }
        if path.extension().is_none_or(|e| e != "safetensors") {
            return Err(LoadError::UnknownLayout {
                path: path.to_path_buf(),
            });
        }
        let files = Checkpoint::open(path)?;
        let prefix = if files.get(&format!("{COMFY_PREFIX}{marker}")).is_some() {
            COMFY_PREFIX
        } else {
            ""
        };
        if prefix.is_empty() && files.get(marker).is_none() {
            let message = if files.get("x_embedder.weight").is_some() {
                "diffusers-layout weights: open the folder that holds them with config.json"
                    .to_string()
            } else {
                format!("not a {model} transformer: `{marker}` is missing")
            };
            return Err(LoadError::Config {
                file: path.to_path_buf(),
                message,
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            layout: Layout::Bfl,
            prefix,
            files,
        })
    }

    /// The diffusers `config.json` (for the diffusers layout).
    pub fn config_json(&self) -> PathBuf {
        self.path.join("config.json")
    }

    /// The keys of a BFL file without their prefix.
    pub fn bfl_keys(&self) -> impl Iterator<Item = &str> {
        self.files
            .tensors()
            .filter_map(|t| t.name.strip_prefix(self.prefix))
    }

    /// The shape of the BFL key `key` (without prefix), if present.
    pub fn shape(&self, key: &str) -> Option<Vec<usize>> {
        self.files
            .get(&format!("{}{key}", self.prefix))
            .map(|t| t.shape.to_vec())
    }

    /// Fills every parameter of `model` (whose Linears and norm scales `linears` and `vectors`
    /// name) in `dtype` on `device`, weight matrices handed to `place` when given.
    ///
    /// Every missing, unexpected or mis-shaped key is collected and reported in one
    /// [`LoadError::Keys`]. In a ComfyUI all-in-one file, keys outside
    /// `model.diffusion_model.` (VAE, text encoders) are ignored.
    pub fn load<B: Kernels, M: Module<B>>(
        &self,
        model: M,
        linears: &[LinearKeys],
        vectors: &[VectorKeys],
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<M, LoadError> {
        let mut loader = Loader::<B> {
            source: self,
            device: device.clone(),
            dtype,
            place,
            linears: linears.iter().map(|k| (k.module.as_str(), k)).collect(),
            vectors: vectors.iter().map(|k| (k.module.as_str(), k)).collect(),
            path: Vec::new(),
            used: HashSet::new(),
            report: KeyReport::default(),
            failure: None,
        };
        let model = model.map(&mut loader);
        loader.finish()?;
        Ok(model)
    }
}

/// The configuration of a FLUX-family transformer (FLUX.1, FLUX.2), as far as its checkpoints
/// need it to be opened and loaded by [`TransformerCheckpoint`].
pub trait TransformerConfig: Sized + Clone {
    /// The transformer this configures.
    type Model<B: Backend>: Module<B>;
    /// The model's name in errors (`FLUX.1`).
    const MODEL: &'static str;
    /// A BFL key every checkpoint of this model has and no other model's does.
    const MARKER: &'static str;

    /// Reads diffusers' `transformer/config.json`.
    fn from_diffusers_json(file: &Path) -> Result<Self, LoadError>;

    /// Infers the configuration from the keys and shapes of a BFL file.
    fn from_bfl_keys<'a>(
        file: &Path,
        keys: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError>;

    /// The model of this shape, its parameters not yet created.
    fn build<B: Kernels>(&self, device: &B::Device) -> Self::Model<B>;

    /// Every Linear and every norm scale of the model, under each naming scheme.
    fn key_tables(&self) -> (Vec<LinearKeys>, Vec<VectorKeys>);
}

impl TransformerConfig for FluxConfig {
    type Model<B: Backend> = Flux<B>;
    const MODEL: &'static str = "FLUX.1";
    const MARKER: &'static str = "img_in.weight";

    fn from_diffusers_json(file: &Path) -> Result<Self, LoadError> {
        FluxConfig::from_diffusers_json(file)
    }

    fn from_bfl_keys<'a>(
        file: &Path,
        keys: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        FluxConfig::from_bfl_keys(file, keys, shape_of)
    }

    fn build<B: Kernels>(&self, device: &B::Device) -> Flux<B> {
        self.init(device)
    }

    fn key_tables(&self) -> (Vec<LinearKeys>, Vec<VectorKeys>) {
        (linear_keys(self), vector_keys(self))
    }
}

/// An opened checkpoint of a FLUX-family transformer: its files, layout and configuration.
pub struct TransformerCheckpoint<C> {
    files: TransformerFiles,
    config: C,
}

/// An opened FLUX.1 checkpoint.
pub type FluxCheckpoint = TransformerCheckpoint<FluxConfig>;

impl<C: TransformerConfig> TransformerCheckpoint<C> {
    /// Opens a BFL-layout `.safetensors` file (keys possibly under `model.diffusion_model.`),
    /// or a diffusers folder: a pipeline folder with `transformer/`, or the `transformer`
    /// folder itself (`config.json` and one safetensors file or a shard index). FP8 tensors
    /// (from `burnlora quantize` or ComfyUI's scaled FP8) are accepted in both.
    ///
    /// The configuration comes from `config.json`, or is inferred from a BFL file's keys
    /// ([`TransformerConfig::from_bfl_keys`]).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let files = TransformerFiles::open(path, C::MARKER, C::MODEL)?;
        let config = match files.layout {
            Layout::Diffusers => C::from_diffusers_json(&files.config_json())?,
            Layout::Bfl => C::from_bfl_keys(path, files.bfl_keys(), |key| files.shape(key))?,
        };
        Ok(Self { files, config })
    }

    /// The key layout.
    pub fn layout(&self) -> Layout {
        self.files.layout
    }

    /// The model's configuration.
    pub fn config(&self) -> &C {
        &self.config
    }

    /// Builds the model with its weights in `dtype` on `device`.
    ///
    /// Every missing, unexpected or mis-shaped key is collected and reported in one
    /// [`LoadError::Keys`]. In a ComfyUI all-in-one file, keys outside
    /// `model.diffusion_model.` (VAE, text encoders) are ignored.
    pub fn load<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
    ) -> Result<C::Model<B>, LoadError> {
        self.load_placed(device, dtype, None)
    }

    /// As [`TransformerCheckpoint::load`], but every weight matrix (the projections' rank-2
    /// weights, in Burn's layout and in `dtype`) is handed to `place`, by parameter path,
    /// instead of being uploaded to `device`: a model larger than the device's memory loads
    /// this way into host memory (burn-offload's `WeightStream::streamed_tensor`). An error
    /// `place` returns is reported as [`LoadError::Place`] naming the parameter.
    pub fn load_with<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: &mut PlaceWeight<'_, B>,
    ) -> Result<C::Model<B>, LoadError> {
        self.load_placed(device, dtype, Some(place))
    }

    fn load_placed<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<C::Model<B>, LoadError> {
        let (linears, vectors) = self.config.key_tables();
        self.files.load(
            self.config.build::<B>(device),
            &linears,
            &vectors,
            device,
            dtype,
            place,
        )
    }
}

impl<B: Kernels> Flux<B> {
    /// Opens and loads a checkpoint (see [`FluxCheckpoint::open`] and [`FluxCheckpoint::load`]).
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        FluxCheckpoint::open(path)?.load(device, dtype)
    }
}

/// One tensor to read: rows `rows` of `key` (a tensor of `len` rows) go to rows `to..` of the
/// parameter.
struct Piece {
    key: String,
    len: usize,
    rows: Range<usize>,
    to: usize,
}

/// Fills each parameter from the checkpoint as the model's parameters are visited.
struct Loader<'a, 'p, 'q, B: Backend> {
    source: &'a TransformerFiles,
    device: B::Device,
    dtype: FloatDType,
    /// Where weight matrices go instead of the device, if anywhere.
    place: Option<&'p mut PlaceWeight<'q, B>>,
    linears: HashMap<&'a str, &'a LinearKeys>,
    vectors: HashMap<&'a str, &'a VectorKeys>,
    path: Vec<String>,
    used: HashSet<String>,
    report: KeyReport,
    failure: Option<LoadError>,
}

impl<B: Kernels> ModuleMapper<B> for Loader<'_, '_, '_, B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.path.join(".");
        let shape = param.lazy_shape().as_slice().to_vec();
        let Some(data) = self.read(&path, &shape) else {
            return param;
        };
        let place = self.place.as_deref_mut().filter(|_| D == 2);
        let dtype = DType::from(self.dtype);
        let placed = place_or_upload(place, &path, data, &self.device, dtype, &self.source.path);
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

impl<B: Kernels> Loader<'_, '_, '_, B> {
    /// The value of the parameter at `path` (Burn's shape `shape`), or `None` after recording
    /// why it cannot be read.
    fn read(&mut self, path: &str, shape: &[usize]) -> Option<TensorData> {
        let (module, field) = path.rsplit_once('.').unwrap_or(("", path));
        let diffusers = self.source.layout == Layout::Diffusers;
        let (pieces, d_input) = if let Some(keys) = self.linears.get(module).copied() {
            let pieces = if diffusers {
                keys.diffusers
                    .iter()
                    .map(|r: &RowSlice| Piece {
                        key: format!("{}.{field}", r.target),
                        len: r.len,
                        rows: r.rows.clone(),
                        to: r.to,
                    })
                    .collect()
            } else {
                vec![Piece {
                    key: format!("{}.{field}", keys.bfl),
                    len: keys.d_output,
                    rows: 0..keys.d_output,
                    to: 0,
                }]
            };
            (pieces, (field == "weight").then_some(keys.d_input))
        } else if let Some(keys) = self.vectors.get(path).copied() {
            let key = if diffusers {
                &keys.diffusers
            } else {
                &keys.module
            };
            let piece = Piece {
                key: key.clone(),
                len: keys.len,
                rows: 0..keys.len,
                to: 0,
            };
            (vec![piece], None)
        } else {
            self.report
                .missing
                .push(format!("{path} (no checkpoint key for this parameter)"));
            return None;
        };
        match self.dtype {
            FloatDType::F64 => self.assemble::<f64>(pieces, d_input, shape),
            FloatDType::F32 | FloatDType::Flex32 => self.assemble::<f32>(pieces, d_input, shape),
            FloatDType::F16 => self.assemble::<f16>(pieces, d_input, shape),
            FloatDType::BF16 => self.assemble::<bf16>(pieces, d_input, shape),
        }
    }

    /// Reads the pieces into one buffer of Burn's layout: a Linear weight (`d_input` given) is
    /// stored `[d_input, d_output]`, the checkpoint's `[rows, d_input]` transposed.
    fn assemble<T: FromF32>(
        &mut self,
        pieces: Vec<Piece>,
        d_input: Option<usize>,
        shape: &[usize],
    ) -> Option<TensorData> {
        let numel: usize = shape.iter().product();
        let d_output = *shape.last().unwrap_or(&1);
        let mut out = vec![T::from_f32(0.0); numel];
        let mut complete = true;
        for piece in pieces {
            let expected = match d_input {
                Some(d_input) => vec![piece.len, d_input],
                None => vec![piece.len],
            };
            let Some(values) = self.values(&piece.key, &expected) else {
                complete = false;
                continue;
            };
            match d_input {
                Some(d_input) => place_transposed(&mut out, d_input, d_output, &values, &piece),
                None => {
                    for (o, v) in out[piece.to..piece.to + piece.rows.len()]
                        .iter_mut()
                        .zip(&values[piece.rows.clone()])
                    {
                        *o = T::from_f32(*v);
                    }
                }
            }
        }
        complete.then(|| TensorData::new(out, shape.to_vec()))
    }

    /// The values of checkpoint tensor `key` as f32, after checking its shape.
    fn values(&mut self, key: &str, expected: &[usize]) -> Option<Vec<f32>> {
        let full = format!("{}{key}", self.source.prefix);
        let files = &self.source.files;
        let Some(entry) = files.get(&full) else {
            self.report.missing.push(full);
            return None;
        };
        if entry.shape != expected {
            self.used.insert(full.clone());
            self.report.mismatched.push(ShapeMismatch {
                key: full,
                expected: expected.to_vec(),
                found: entry.shape.to_vec(),
            });
            return None;
        }
        let values = read_f32(files, &entry);
        files.release(&entry);
        if Fp8Format::from_safetensors_dtype(entry.dtype).is_some() {
            let scale = scale_key(&full);
            if files.get(&scale).is_some() {
                self.used.insert(scale);
            }
        }
        self.used.insert(full);
        match values {
            Ok(values) => Some(values),
            Err(error) => {
                self.failure.get_or_insert(error);
                None
            }
        }
    }

    /// Fails with everything collected, or checks that every key of the file was used.
    fn finish(mut self) -> Result<(), LoadError> {
        if let Some(error) = self.failure {
            return Err(error);
        }
        let prefix = self.source.prefix;
        self.report.unexpected = self
            .source
            .files
            .tensors()
            .map(|t| t.name)
            .filter(|name| name.starts_with(prefix) && !self.used.contains(*name))
            .filter(|name| {
                let key = &name[prefix.len()..];
                key != COMFY_FP8_MARKER && !key.ends_with(COMFY_INPUT_SCALE)
            })
            .map(str::to_string)
            .collect();
        self.report.missing.sort();
        self.report.unexpected.sort();
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

/// Writes rows `piece.rows` of a `[piece.len, d_input]` weight into columns `piece.to..` of the
/// `[d_input, d_output]` buffer `out`, in parallel over bands of `out`'s rows.
fn place_transposed<T: FromF32>(
    out: &mut [T],
    d_input: usize,
    d_output: usize,
    values: &[f32],
    piece: &Piece,
) {
    const BAND: usize = 16;
    out.par_chunks_mut(BAND * d_output)
        .enumerate()
        .for_each(|(band, chunk)| {
            let first = band * BAND;
            let width = chunk.len() / d_output;
            for (col, row) in (piece.to..).zip(piece.rows.clone()) {
                let src = &values[row * d_input + first..][..width];
                for (i, v) in src.iter().enumerate() {
                    chunk[i * d_output + col] = T::from_f32(*v);
                }
            }
        });
}

/// Decodes a checkpoint tensor to f32: bf16, f16, f32, f64, or FP8 times its scales.
pub(crate) fn read_f32(files: &Checkpoint, entry: &TensorEntry<'_>) -> Result<Vec<f32>, LoadError> {
    let dtype_error = || LoadError::Dtype {
        file: entry.file.to_path_buf(),
        key: entry.name.to_string(),
        dtype: format!("{:?}", entry.dtype),
    };
    if let Some(dtype) = FloatDtype::from_safetensors(entry.dtype) {
        return FloatBytes::new(dtype, entry.data)
            .map(|b| b.to_f32_vec())
            .ok_or_else(dtype_error);
    }
    if entry.dtype == safetensors::Dtype::F64 {
        return Ok(entry
            .data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
            .collect());
    }
    match read_fp8(files, entry.name)? {
        Some(fp8) => Ok(fp8.dequantize()),
        None => Err(dtype_error()),
    }
}

/// The element types a model can be loaded in.
trait FromF32: Element + Copy + Send + Sync {
    fn from_f32(value: f32) -> Self;
}

impl FromF32 for f32 {
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl FromF32 for f64 {
    fn from_f32(value: f32) -> Self {
        value as f64
    }
}

impl FromF32 for f16 {
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

impl FromF32 for bf16 {
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposed_placement_fills_the_right_columns() {
        // A [3, 2] weight (rows 1..3 used) into columns 1..3 of a [2, 4] buffer.
        let values = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let piece = Piece {
            key: String::new(),
            len: 3,
            rows: 1..3,
            to: 1,
        };
        let mut out = vec![0f32; 8];
        place_transposed(&mut out, 2, 4, &values, &piece);
        assert_eq!(out, [0.0, 3.0, 5.0, 0.0, 0.0, 4.0, 6.0, 0.0]);
    }

    #[test]
    fn transposed_placement_spans_several_bands() {
        let (d_input, d_output) = (37, 5);
        let values: Vec<f32> = (0..d_output * d_input).map(|v| v as f32).collect();
        let piece = Piece {
            key: String::new(),
            len: d_output,
            rows: 0..d_output,
            to: 0,
        };
        let mut out = vec![0f32; d_input * d_output];
        place_transposed(&mut out, d_input, d_output, &values, &piece);
        for i in 0..d_input {
            for o in 0..d_output {
                assert_eq!(out[i * d_output + o], values[o * d_input + i]);
            }
        }
    }
}
