//! Wan's causal video VAE, block by block as diffusers writes it: an encoder of causal 3-D
//! convolutions from RGB clips to a diagonal Gaussian over latents (8× smaller in space for
//! Wan 2.1, 16× for Wan 2.2, 4× in time, the first frame alone), and a decoder back.
//!
//! Wan 2.2's variant (TI2V-5B) folds each 2×2 square of pixels into channels before the encoder
//! and unfolds them after the decoder, and makes each level one residual block: its blocks and
//! resample, plus a parameter-free shortcut that averages the level's input into the
//! downsampled shape ([`AvgDown3d`]) or duplicates it into the upsampled one ([`DupUp3d`]).
//!
//! Clips go through chunk by chunk, as the reference runs them: the encoder takes the first
//! frame, then 4 frames at a time; the decoder takes one latent frame at a time. Each causal
//! convolution keeps the last 2 frames of its input from one chunk to the next (a
//! [`FrameCache`]), so a chunk sees exactly what it would see in one pass over the whole clip,
//! and a long clip needs the memory of one chunk. A causal convolution is a sum over its time
//! taps of 2-D convolutions ([`burn_kernels::products::conv2d`], the device's DNN library where
//! it has one) on frames folded into the batch. Inside, activations are frame-major
//! (`[batch, frames, channels, height, width]`), so that folding frames is a reshape.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/autoencoders/autoencoder_kl_wan.py (AvgDown3D, DupUp3D, WanCausalConv3d, WanRMS_norm, WanUpsample, WanResample, WanResidualBlock, WanAttentionBlock, WanMidBlock, WanResidualDownBlock, WanEncoder3d, WanResidualUpBlock, WanUpBlock, WanDecoder3d, patchify, unpatchify, AutoencoderKLWan)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/wan/pipeline_wan.py (latents_mean, latents_std)

use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::activation::silu;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData, TensorPrimitive, backend::Backend};
use burn_kernels::{FusedOps, KernelOptions, products};
use burn_quant::Checkpoint;

use super::{WanVaeConfig, vae_diffusers_name};
use crate::blocks::sdpa;
use crate::error::LoadError;
use crate::vae::{nearest_2x, pad_bottom_right};
use crate::weights::{NamedTensors, component_folder, diffusers_weights};

/// Input frames each causal convolution keeps for the next chunk (its time kernel less one).
const CACHE_FRAMES: usize = 2;
/// Frames the encoder takes at a time after the first.
const CHUNK_FRAMES: usize = 4;
/// The smallest norm [`WanRmsNorm`] divides by (PyTorch's `F.normalize`).
const NORM_EPS: f64 = 1e-12;

/// Wan's video VAE (diffusers' `AutoencoderKLWan`, Wan 2.1's or Wan 2.2's): RGB clips of
/// `4k + 1` frames in `[-1, 1]` to latents of `k + 1` frames,
/// [`spatial_compression`](WanVaeConfig::spatial_compression)× smaller in space, and back.
///
/// Fields follow diffusers' keys, so a diffusers `vae` folder loads without renaming; Wan
/// 2.1's original layout is renamed by [`vae_diffusers_name`]. Its convolutions take the backend's
/// own tensors ([`FusedOps`]): it runs without autodiff (under `Autodiff<B>`, on `B`).
#[derive(Module, Debug)]
pub struct WanVae<B: Backend> {
    /// Clip to latent moments.
    pub encoder: WanEncoder3d<B>,
    /// 1×1×1 convolution over the moments.
    pub quant_conv: WanCausalConv3d<B>,
    /// 1×1×1 convolution over a latent before decoding.
    pub post_quant_conv: WanCausalConv3d<B>,
    /// Latent to clip.
    pub decoder: WanDecoder3d<B>,
    config: WanVaeConfig,
}

impl WanVaeConfig {
    /// The shape of the VAE at `path` without loading it: a folder's `config.json`, or, for a
    /// single file, Wan 2.2's ([`wan22`](Self::wan22)) where the encoder's first convolution
    /// reads 2 × 2 patches of RGB (12 channels), else Wan 2.1's ([`wan21`](Self::wan21)).
    pub fn of(path: &Path) -> Result<Self, LoadError> {
        if path.is_file() {
            let checkpoint = Checkpoint::open(path)?;
            let patches = ["encoder.conv1.weight", "encoder.conv_in.weight"]
                .iter()
                .find_map(|key| checkpoint.get(key))
                .is_some_and(|conv| conv.shape.get(1) == Some(&12));
            return Ok(if patches {
                Self::wan22()
            } else {
                Self::wan21()
            });
        }
        let folder = component_folder(path, "vae").ok_or_else(|| LoadError::Config {
            file: path.to_path_buf(),
            message: "no vae/config.json here: expected a diffusers Wan folder or its vae folder"
                .into(),
        })?;
        Self::from_json(&folder.join("config.json"))
    }

    /// A VAE of this shape with Burn's default initialization (the norms' scales at one),
    /// created lazily, on first use, in the device's default float dtype.
    ///
    /// # Panics
    /// With residual levels whose shortcut cannot split the pixels one resample merges or
    /// splits evenly into channels, as diffusers refuses them (never with `dim_mult`
    /// `[1, 2, 4, 4]`).
    pub fn init<B: FusedOps>(&self, device: &B::Device) -> WanVae<B> {
        let z = self.z_dim;
        WanVae {
            encoder: WanEncoder3d::new(self, device),
            quant_conv: WanCausalConv3d::new(2 * z, 2 * z, [1, 1, 1], 1, [0, 0, 0], device),
            post_quant_conv: WanCausalConv3d::new(z, z, [1, 1, 1], 1, [0, 0, 0], device),
            decoder: WanDecoder3d::new(self, device),
            config: self.clone(),
        }
    }
}

impl<B: FusedOps> WanVae<B> {
    /// Loads diffusers' layout, a pipeline folder with `vae/` or the `vae` folder itself
    /// (`config.json`, Wan 2.1's or Wan 2.2's, and `diffusion_pytorch_model.safetensors`), or a
    /// single file of the shape [`WanVaeConfig::of`] finds: Wan 2.1's in its original
    /// layout (`Wan2.1_VAE.pth` as safetensors, ComfyUI's `wan_2.1_vae.safetensors`) or
    /// diffusers', Wan 2.2's under diffusers' names. The weights go to `device` in `dtype`, the
    /// dtype the VAE then computes in.
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        let config = WanVaeConfig::of(path)?;
        if path.is_file() {
            return Self::load_original(path, config, device, dtype);
        }
        let folder = component_folder(path, "vae").expect("WanVaeConfig::of found it");
        let weights = diffusers_weights(folder);
        let tensors = NamedTensors::new(Checkpoint::open(&weights)?, &weights, |key| {
            Some(key.to_string())
        })?;
        tensors.load(config.init(device), checkpoint_name, device, dtype, None)
    }

    /// Loads a single file in Wan 2.1's original layout (or under diffusers' names, which Wan
    /// 2.2's VAE needs) as a VAE of shape `config`; every missing, unused or mis-shaped tensor
    /// is reported at once.
    pub fn load_original(
        file: &Path,
        config: WanVaeConfig,
        device: &B::Device,
        dtype: FloatDType,
    ) -> Result<Self, LoadError> {
        let blocks = config.num_res_blocks;
        let tensors = NamedTensors::new(Checkpoint::open(file)?, file, |key| {
            Some(vae_diffusers_name(key, blocks))
        })?;
        tensors.load(config.init(device), checkpoint_name, device, dtype, None)
    }

    /// The VAE's configuration.
    pub fn config(&self) -> &WanVaeConfig {
        &self.config
    }

    /// The mean of the latent distribution of `video`, computed in the weights' dtype: the
    /// first frame alone, then 4 frames at a time, the backend's unused memory freed after
    /// each chunk so that one chunk's activations are not held beside the next's.
    ///
    /// # Shapes
    /// - `video`: `[batch, 3, frames, height, width]`; output:
    ///   `[batch, z_dim, 1 + (frames - 1) / 4, height / s, width / s]`, `s` the
    ///   [`spatial_compression`](WanVaeConfig::spatial_compression)
    ///
    /// # Panics
    /// When `frames` is not `4k + 1` (an image is a clip of one frame), or the height or width
    /// is not a multiple of the patch side (of `s` with residual levels, whose shortcuts fold
    /// whole 2×2 squares of every level into channels).
    pub fn encode(&self, video: Tensor<B, 5>) -> Tensor<B, 5> {
        let [_, _, frames, height, width] = video.dims();
        assert!(
            frames % CHUNK_FRAMES == 1,
            "Wan's VAE encodes 4k + 1 frames, got {frames}"
        );
        let multiple = match self.config.is_residual {
            true => self.config.spatial_compression(),
            false => self.config.patch(),
        };
        assert!(
            height.is_multiple_of(multiple) && width.is_multiple_of(multiple),
            "this Wan VAE encodes heights and widths divisible by {multiple}, got {height}×{width}"
        );
        let x = patchify(
            video.cast(self.dtype()).swap_dims(1, 2),
            self.config.patch(),
        );
        let mut cache = FrameCache::default();
        let chunks = (0..1 + frames / CHUNK_FRAMES)
            .map(|i| {
                let (start, length) = match i {
                    0 => (0, 1),
                    _ => (1 + CHUNK_FRAMES * (i - 1), CHUNK_FRAMES),
                };
                let latent = self
                    .encoder
                    .forward(x.clone().narrow(1, start, length), &mut cache);
                B::memory_cleanup(&latent.device());
                latent
            })
            .collect();
        let moments = self.quant_conv.forward(Tensor::cat(chunks, 1), None);
        moments.narrow(2, 0, self.config.z_dim).swap_dims(1, 2)
    }

    /// The latents the transformer sees of `video`: [`encode`](Self::encode), then
    /// [`normalize`](Self::normalize).
    ///
    /// # Shapes
    /// - as [`encode`](Self::encode)
    ///
    /// # Panics
    /// As [`encode`](Self::encode).
    pub fn encode_latents(&self, video: Tensor<B, 5>) -> Tensor<B, 5> {
        self.normalize(self.encode(video))
    }

    /// `(z - latents_mean) · (1 / latents_std)` per channel, as the Wan pipeline writes it.
    ///
    /// # Shapes
    /// - `z`: `[batch, z_dim, frames, height, width]`; output: same
    pub fn normalize(&self, z: Tensor<B, 5>) -> Tensor<B, 5> {
        let [mean, inverse_std] = self.statistics(&z);
        (z - mean) * inverse_std
    }

    /// The inverse of [`normalize`](Self::normalize): `latents / (1 / latents_std) +
    /// latents_mean`.
    ///
    /// # Shapes
    /// - `latents`: `[batch, z_dim, frames, height, width]`; output: same
    pub fn denormalize(&self, latents: Tensor<B, 5>) -> Tensor<B, 5> {
        let [mean, inverse_std] = self.statistics(&latents);
        latents / inverse_std + mean
    }

    /// The clip of latents `z`, one latent frame at a time, clamped to `[-1, 1]`, in the
    /// weights' dtype: the first latent frame gives one frame, each later one four.
    ///
    /// # Shapes
    /// - `z`: `[batch, z_dim, frames, height, width]`; output:
    ///   `[batch, 3, 4 · (frames - 1) + 1, s · height, s · width]`, `s` the
    ///   [`spatial_compression`](WanVaeConfig::spatial_compression)
    pub fn decode(&self, z: Tensor<B, 5>) -> Tensor<B, 5> {
        let frames = z.dims()[2];
        let x = self
            .post_quant_conv
            .forward(z.cast(self.dtype()).swap_dims(1, 2), None);
        let mut cache = FrameCache::default();
        let clips = (0..frames)
            .map(|i| {
                cache.restart();
                self.decoder
                    .forward(x.clone().narrow(1, i, 1), &mut cache, i == 0)
            })
            .collect();
        unpatchify(Tensor::cat(clips, 1), self.config.patch())
            .clamp(-1.0, 1.0)
            .swap_dims(1, 2)
    }

    /// The clip of the transformer's latents: [`denormalize`](Self::denormalize), then
    /// [`decode`](Self::decode).
    ///
    /// # Shapes
    /// - as [`decode`](Self::decode)
    pub fn decode_latents(&self, latents: Tensor<B, 5>) -> Tensor<B, 5> {
        self.decode(self.denormalize(latents))
    }

    /// The dtype of the weights.
    fn dtype(&self) -> DType {
        self.quant_conv.weight.val().dtype()
    }

    /// `latents_mean` and `1 / latents_std` (in f32, as the pipeline's tensors), shaped to
    /// broadcast over `like`'s channels, in its dtype.
    fn statistics(&self, like: &Tensor<B, 5>) -> [Tensor<B, 5>; 2] {
        let channels = self.config.z_dim;
        let tensor = |values: Vec<f32>| {
            Tensor::<B, 1>::from_data(
                TensorData::new(values, [channels]),
                (&like.device(), like.dtype()),
            )
            .reshape([1, channels, 1, 1, 1])
        };
        let mean = self.config.latents_mean.iter().map(|&v| v as f32).collect();
        let inverse = self.config.latents_std.iter().map(|&v| 1.0 / v as f32);
        [tensor(mean), tensor(inverse.collect())]
    }
}

/// The checkpoint name of a parameter's module path: the path without the variants of
/// [`WanDownLayer`] and [`WanUpLayer`] (capitalized; the checkpoints' names are lower-case).
fn checkpoint_name(path: &str) -> String {
    path.split('.')
        .filter(|segment| !segment.starts_with(|c: char| c.is_ascii_uppercase()))
        .collect::<Vec<_>>()
        .join(".")
}

/// The frames each causal convolution of an encoder or decoder keeps from one chunk for the
/// next, in the order the convolutions run (diffusers' `feat_cache` and `feat_idx`); empty
/// for a new clip.
pub struct FrameCache<B: Backend> {
    slots: Vec<Option<Tensor<B, 5>>>,
    next: usize,
}

impl<B: Backend> Default for FrameCache<B> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            next: 0,
        }
    }
}

impl<B: Backend> FrameCache<B> {
    /// Goes back to the first convolution, for the next chunk.
    pub fn restart(&mut self) {
        self.next = 0;
    }

    /// The next convolution's slot: empty in the first chunk.
    fn slot(&mut self) -> &mut Option<Tensor<B, 5>> {
        if self.next == self.slots.len() {
            self.slots.push(None);
        }
        self.next += 1;
        &mut self.slots[self.next - 1]
    }
}

/// `conv2d` of `x` with `weight` (stride and padding on both sides), plus `bias`, through
/// [`products::conv2d`] under the installed kernel options.
fn conv2d<B: FusedOps>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    stride: usize,
    padding: [usize; 2],
) -> Tensor<B, 4> {
    let out = products::conv2d::<B>(
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|bias| bias.into_primitive().tensor()),
        ConvOptions::new([stride, stride], padding, [1, 1], 1),
        &KernelOptions::current(),
    );
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

/// Each `patch`×`patch` square of pixels folded into channels in diffusers' order (its
/// `patchify`): channel `c · patch² + j · patch + i` holds the pixel of column `j` and row `i`
/// of each square of channel `c`; `x` itself when `patch` is 1.
///
/// # Shapes
/// - `x`: `[batch, frames, channels, height, width]`; output: `[batch, frames, channels ·
///   patch², height / patch, width / patch]`
fn patchify<B: Backend>(x: Tensor<B, 5>, patch: usize) -> Tensor<B, 5> {
    if patch == 1 {
        return x;
    }
    let [b, t, c, h, w] = x.dims();
    let (h, w) = (h / patch, w / patch);
    x.reshape([b * t, c, h, patch, w, patch])
        .permute([0, 1, 5, 3, 2, 4])
        .reshape([b, t, c * patch * patch, h, w])
}

/// The inverse of [`patchify`] (diffusers' `unpatchify`).
///
/// # Shapes
/// - `x`: `[batch, frames, channels · patch², height, width]`; output: `[batch, frames,
///   channels, height · patch, width · patch]`
fn unpatchify<B: Backend>(x: Tensor<B, 5>, patch: usize) -> Tensor<B, 5> {
    if patch == 1 {
        return x;
    }
    let [b, t, c, h, w] = x.dims();
    let c = c / (patch * patch);
    x.reshape([b * t, c, patch, patch, h, w])
        .permute([0, 1, 4, 3, 5, 2])
        .reshape([b, t, c, h * patch, w * patch])
}

/// A 3-D convolution, causal in time: `2 · padding[0]` frames before the input, from the
/// previous chunk's frames or zeros, none after; symmetric zero padding in space (diffusers'
/// `WanCausalConv3d`).
#[derive(Module, Debug)]
pub struct WanCausalConv3d<B: Backend> {
    /// `[out, in, kt, kh, kw]`.
    pub weight: Param<Tensor<B, 5>>,
    /// `[out]`.
    pub bias: Param<Tensor<B, 1>>,
    stride: usize,
    padding: [usize; 3],
}

impl<B: FusedOps> WanCausalConv3d<B> {
    /// A convolution of kernel `[kt, kh, kw]`, time stride `stride` (spatial stride 1) and
    /// padding `[pt, ph, pw]`, with Burn's default initialization.
    fn new(
        input: usize,
        output: usize,
        kernel: [usize; 3],
        stride: usize,
        padding: [usize; 3],
        device: &B::Device,
    ) -> Self {
        let [kt, kh, kw] = kernel;
        let (weight, bias) = conv_params([output, input, kt, kh, kw], device);
        Self {
            weight,
            bias,
            stride,
            padding,
        }
    }

    /// The convolution of `x` after `history`, the frames that precede it (at most
    /// `2 · padding[0]`; zeros stand for the rest).
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, frames', out, height',
    ///   width']`
    pub fn forward(&self, x: Tensor<B, 5>, history: Option<Tensor<B, 5>>) -> Tensor<B, 5> {
        let causal = 2 * self.padding[0];
        let (x, missing) = match history {
            Some(history) if causal > 0 => {
                let held = history.dims()[1];
                (
                    Tensor::cat(vec![history, x], 1),
                    causal.saturating_sub(held),
                )
            }
            _ => (x, causal),
        };
        let [b, frames, c, h, w] = x.dims();
        let x = match missing {
            0 => x,
            _ => {
                let zeros = Tensor::zeros([b, missing, c, h, w], (&x.device(), x.dtype()));
                Tensor::cat(vec![zeros, x], 1)
            }
        };
        let frames = frames + missing;
        let [output, _, kt, kh, kw] = self.weight.dims();
        let out_frames = (frames - kt) / self.stride + 1;
        let weight = self.weight.val();
        let spatial = [self.padding[1], self.padding[2]];
        let mut sum: Option<Tensor<B, 4>> = None;
        for tap in 0..kt {
            let taken = match self.stride {
                1 => x.clone().narrow(1, tap, out_frames),
                stride => {
                    let last = tap + stride * (out_frames - 1);
                    let indices = Tensor::<B, 1, Int>::arange_step(
                        tap as i64..last as i64 + 1,
                        stride,
                        &x.device(),
                    );
                    x.clone().select(1, indices)
                }
            };
            let folded = taken.reshape([b * out_frames, c, h, w]);
            let kernel = weight
                .clone()
                .narrow(2, tap, 1)
                .reshape([output, c, kh, kw]);
            let bias = (tap == 0).then(|| self.bias.val());
            let y = conv2d(folded, kernel, bias, 1, spatial);
            sum = Some(match sum {
                Some(sum) => sum + y,
                None => y,
            });
        }
        let y = sum.expect("a kernel has at least one tap");
        let [_, _, h_out, w_out] = y.dims();
        y.reshape([b, out_frames, output, h_out, w_out])
    }

    /// [`forward`](Self::forward) after the frames `slot` kept from the previous chunk, keeping
    /// the last 2 frames of the input seen so far in `slot` for the next.
    pub fn forward_cached(&self, x: Tensor<B, 5>, slot: &mut Option<Tensor<B, 5>>) -> Tensor<B, 5> {
        let history = slot.take();
        let frames = x.dims()[1];
        let kept = match &history {
            _ if frames >= CACHE_FRAMES => x.clone().narrow(1, frames - CACHE_FRAMES, CACHE_FRAMES),
            Some(history) => {
                let last = history.dims()[1] - 1;
                Tensor::cat(vec![history.clone().narrow(1, last, 1), x.clone()], 1)
            }
            None => x.clone(),
        };
        *slot = Some(kept);
        self.forward(x, history)
    }
}

/// A 2-D convolution with bias (diffusers' `nn.Conv2d` in the resamples and the attention).
#[derive(Module, Debug)]
pub struct WanConv2d<B: Backend> {
    /// `[out, in, kh, kw]`.
    pub weight: Param<Tensor<B, 4>>,
    /// `[out]`.
    pub bias: Param<Tensor<B, 1>>,
    stride: usize,
    padding: usize,
}

impl<B: FusedOps> WanConv2d<B> {
    fn new(
        input: usize,
        output: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        device: &B::Device,
    ) -> Self {
        let (weight, bias) = conv_params([output, input, kernel, kernel], device);
        Self {
            weight,
            bias,
            stride,
            padding,
        }
    }

    /// # Shapes
    /// - `x`: `[batch, in, height, width]`; output: `[batch, out, height', width']`
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let padding = [self.padding; 2];
        conv2d(
            x,
            self.weight.val(),
            Some(self.bias.val()),
            self.stride,
            padding,
        )
    }
}

/// A convolution's weight of `shape` (`[out, in, kernel…]`) and its bias, with `nn.Conv2d`'s
/// default initialization.
fn conv_params<B: Backend, const D: usize>(
    shape: [usize; D],
    device: &B::Device,
) -> (Param<Tensor<B, D>>, Param<Tensor<B, 1>>) {
    let init = Initializer::KaimingUniform {
        gain: 1.0 / 3f64.sqrt(),
        fan_out_only: false,
    };
    let taps: usize = shape[2..].iter().product();
    let (fan_in, fan_out) = (Some(shape[1] * taps), Some(shape[0] * taps));
    (
        init.init_with(shape, fan_in, fan_out, device),
        init.init_with([shape[0]], fan_in, fan_out, device),
    )
}

/// `x / ‖x‖ · √channels · gamma` over the channels, the norm computed in f32 and at least
/// 1e-12 (diffusers' `WanRMS_norm`, without bias). `D` is the rank of `gamma` in the
/// checkpoint: 4 (`[c, 1, 1, 1]`) in the residual blocks and heads, 3 in the attention.
#[derive(Module, Debug)]
pub struct WanRmsNorm<B: Backend, const D: usize> {
    /// `[channels, 1, …]`.
    pub gamma: Param<Tensor<B, D>>,
}

impl<B: FusedOps, const D: usize> WanRmsNorm<B, D> {
    fn new(channels: usize, device: &B::Device) -> Self {
        let mut shape = [1; D];
        shape[0] = channels;
        Self {
            gamma: Initializer::Ones.init(shape, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, frames, channels, height, width]`; output: same
    pub fn forward(&self, x: Tensor<B, 5>) -> Tensor<B, 5> {
        let dtype = x.dtype();
        let channels = x.dims()[2];
        let x = x.cast(DType::F32);
        let norm = x.clone().square().sum_dim(2).sqrt().clamp_min(NORM_EPS);
        let gamma = self.gamma.val().reshape([1, 1, channels, 1, 1]);
        (x / norm).cast(dtype) * (channels as f64).sqrt() * gamma
    }
}

/// `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))`, the shortcut a 1×1×1
/// convolution when the width changes (diffusers' `WanResidualBlock`; its dropout holds
/// nothing).
#[derive(Module, Debug)]
pub struct WanResidualBlock<B: Backend> {
    /// First norm.
    pub norm1: WanRmsNorm<B, 4>,
    /// First 3×3×3 causal convolution.
    pub conv1: WanCausalConv3d<B>,
    /// Second norm.
    pub norm2: WanRmsNorm<B, 4>,
    /// Second 3×3×3 causal convolution.
    pub conv2: WanCausalConv3d<B>,
    /// 1×1×1 projection of the input when the width changes.
    pub conv_shortcut: Option<WanCausalConv3d<B>>,
}

impl<B: FusedOps> WanResidualBlock<B> {
    fn new(input: usize, output: usize, device: &B::Device) -> Self {
        let conv = |input| WanCausalConv3d::new(input, output, [3; 3], 1, [1; 3], device);
        Self {
            norm1: WanRmsNorm::new(input, device),
            conv1: conv(input),
            norm2: WanRmsNorm::new(output, device),
            conv2: conv(output),
            conv_shortcut: (input != output)
                .then(|| WanCausalConv3d::new(input, output, [1; 3], 1, [0; 3], device)),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, frames, out, height,
    ///   width]`
    pub fn forward(&self, x: Tensor<B, 5>, cache: &mut FrameCache<B>) -> Tensor<B, 5> {
        let shortcut = match &self.conv_shortcut {
            Some(conv) => conv.forward(x.clone(), None),
            None => x.clone(),
        };
        let h = self
            .conv1
            .forward_cached(silu(self.norm1.forward(x)), cache.slot());
        let h = self
            .conv2
            .forward_cached(silu(self.norm2.forward(h)), cache.slot());
        h + shortcut
    }
}

/// `count` residual blocks from `input` channels to `output`, the first changing the width.
fn residual_blocks<B: FusedOps>(
    input: usize,
    output: usize,
    count: usize,
    device: &B::Device,
) -> Vec<WanResidualBlock<B>> {
    (0..count)
        .map(|i| WanResidualBlock::new(if i == 0 { input } else { output }, output, device))
        .collect()
}

/// `x` through `blocks` in order.
fn chain<B: FusedOps>(
    blocks: &[WanResidualBlock<B>],
    x: Tensor<B, 5>,
    cache: &mut FrameCache<B>,
) -> Tensor<B, 5> {
    blocks.iter().fold(x, |x, block| block.forward(x, cache))
}

/// Single-head self-attention over the pixels of each frame, with its own norm and a residual
/// connection (diffusers' `WanAttentionBlock`).
#[derive(Module, Debug)]
pub struct WanAttentionBlock<B: Backend> {
    /// Norm of the input.
    pub norm: WanRmsNorm<B, 3>,
    /// 1×1 projection to queries, keys and values, stacked.
    pub to_qkv: WanConv2d<B>,
    /// 1×1 output projection.
    pub proj: WanConv2d<B>,
}

impl<B: FusedOps> WanAttentionBlock<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        Self {
            norm: WanRmsNorm::new(width, device),
            to_qkv: WanConv2d::new(width, 3 * width, 1, 1, 0, device),
            proj: WanConv2d::new(width, width, 1, 1, 0, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, frames, channels, height, width]`; output: same
    pub fn forward(&self, x: Tensor<B, 5>) -> Tensor<B, 5> {
        let [b, t, c, h, w] = x.dims();
        let normed = self.norm.forward(x.clone()).reshape([b * t, c, h, w]);
        let qkv = self
            .to_qkv
            .forward(normed)
            .reshape([b * t, 3 * c, h * w])
            .swap_dims(1, 2);
        let head = |i: usize| qkv.clone().narrow(2, i * c, c).unsqueeze_dim::<4>(1);
        let attended = sdpa(head(0), head(1), head(2))
            .squeeze_dim::<3>(1)
            .swap_dims(1, 2)
            .reshape([b * t, c, h, w]);
        self.proj.forward(attended).reshape([b, t, c, h, w]) + x
    }
}

/// A residual block, attention, and a second residual block (diffusers' `WanMidBlock`).
#[derive(Module, Debug)]
pub struct WanMidBlock<B: Backend> {
    /// The two residual blocks.
    pub resnets: Vec<WanResidualBlock<B>>,
    /// The attention between them.
    pub attentions: Vec<WanAttentionBlock<B>>,
}

impl<B: FusedOps> WanMidBlock<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        Self {
            resnets: (0..2)
                .map(|_| WanResidualBlock::new(width, width, device))
                .collect(),
            attentions: vec![WanAttentionBlock::new(width, device)],
        }
    }

    /// # Shapes
    /// - `x`: `[batch, frames, channels, height, width]`; output: same
    pub fn forward(&self, x: Tensor<B, 5>, cache: &mut FrameCache<B>) -> Tensor<B, 5> {
        let mut x = self.resnets[0].forward(x, cache);
        for (attention, resnet) in self.attentions.iter().zip(&self.resnets[1..]) {
            x = resnet.forward(attention.forward(x), cache);
        }
        x
    }
}

/// What a resample does in space, and whether it also resamples time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResampleMode {
    /// Nearest-neighbour 2× upsampling, then a 3×3 convolution (halving the channels in
    /// Wan 2.1's decoder).
    Upsample2d,
    /// [`Upsample2d`](Self::Upsample2d) after doubling the frames (from the second chunk on).
    Upsample3d,
    /// A stride-2 3×3 convolution after one row and column of zeros below and right.
    Downsample2d,
    /// [`Downsample2d`](Self::Downsample2d), then halving the frames (from the second chunk
    /// on).
    Downsample3d,
}

/// The resize before a resample's spatial convolution (entry `0` of diffusers' `resample`
/// sequence: `WanUpsample` or `ZeroPad2d`); it holds no weights.
#[derive(Module, Clone, Debug)]
pub struct Resize {
    /// The resample's mode.
    #[module(skip)]
    pub mode: ResampleMode,
}

/// Resampling of each frame in space, and of time in the `3d` modes by a causal convolution
/// (diffusers' `WanResample`).
#[derive(Module, Debug)]
pub struct WanResample<B: Backend> {
    /// The resize, then the spatial convolution.
    pub resample: (Resize, WanConv2d<B>),
    /// The convolution over time (the `3d` modes): to twice the channels, interleaved into
    /// twice the frames, when upsampling; kernel 3 at stride 2 when downsampling.
    pub time_conv: Option<WanCausalConv3d<B>>,
}

impl<B: FusedOps> WanResample<B> {
    /// A resample of `width` channels; an upsampler's spatial convolution gives
    /// `upsample_out` channels, half the width without it.
    fn new(
        width: usize,
        mode: ResampleMode,
        upsample_out: Option<usize>,
        device: &B::Device,
    ) -> Self {
        let (conv, time_conv) = match mode {
            ResampleMode::Upsample2d | ResampleMode::Upsample3d => (
                WanConv2d::new(width, upsample_out.unwrap_or(width / 2), 3, 1, 1, device),
                (mode == ResampleMode::Upsample3d).then(|| {
                    WanCausalConv3d::new(width, 2 * width, [3, 1, 1], 1, [1, 0, 0], device)
                }),
            ),
            ResampleMode::Downsample2d | ResampleMode::Downsample3d => (
                WanConv2d::new(width, width, 3, 2, 0, device),
                (mode == ResampleMode::Downsample3d)
                    .then(|| WanCausalConv3d::new(width, width, [3, 1, 1], 2, [0; 3], device)),
            ),
        };
        Self {
            resample: (Resize { mode }, conv),
            time_conv,
        }
    }

    /// `first_chunk` says whether `x` is the clip's first chunk, which an upsampler leaves one
    /// frame and a downsampler keeps whole.
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, channels, height, width]`; output: `[batch, frames', channels',
    ///   height', width']`
    pub fn forward(
        &self,
        x: Tensor<B, 5>,
        cache: &mut FrameCache<B>,
        first_chunk: bool,
    ) -> Tensor<B, 5> {
        let mode = self.resample.0.mode;
        let x = match (&self.time_conv, mode) {
            (Some(time_conv), ResampleMode::Upsample3d) => {
                let slot = cache.slot();
                if first_chunk {
                    x
                } else {
                    let [b, t, c, h, w] = x.dims();
                    time_conv
                        .forward_cached(x, slot)
                        .reshape([b, t, 2, c, h, w])
                        .reshape([b, 2 * t, c, h, w])
                }
            }
            _ => x,
        };
        let [b, t, c, h, w] = x.dims();
        let frames = x.reshape([b * t, c, h, w]);
        let resized = match mode {
            ResampleMode::Upsample2d | ResampleMode::Upsample3d => nearest_2x(frames),
            ResampleMode::Downsample2d | ResampleMode::Downsample3d => pad_bottom_right(frames),
        };
        let y = self.resample.1.forward(resized);
        let [_, c, h, w] = y.dims();
        let y = y.reshape([b, t, c, h, w]);
        match (&self.time_conv, mode) {
            (Some(time_conv), ResampleMode::Downsample3d) => {
                let slot = cache.slot();
                let history = slot.replace(y.clone().narrow(1, t - 1, 1));
                match history {
                    Some(history) => time_conv.forward(Tensor::cat(vec![history, y], 1), None),
                    None => y,
                }
            }
            _ => y,
        }
    }
}

/// The shortcut of Wan 2.2's encoder levels: each `factor_t`-frame, `factor_s`×`factor_s`-pixel
/// block folded into channels (zero frames first where the frames do not divide), then the
/// mean of each consecutive group of those channels, one group per output channel (diffusers'
/// `AvgDown3D`). It holds no weights.
#[derive(Module, Clone, Debug)]
pub struct AvgDown3d {
    /// Frames merged.
    pub factor_t: usize,
    /// Pixels merged along each side.
    pub factor_s: usize,
    /// Channels out.
    pub out_channels: usize,
    /// Folded channels averaged into each output channel.
    pub group_size: usize,
}

impl AvgDown3d {
    /// The shortcut from `input` channels to `output`.
    ///
    /// # Panics
    /// When `output` does not divide the folded channels.
    fn new(input: usize, output: usize, factor_t: usize, factor_s: usize) -> Self {
        let folded = input * factor_t * factor_s * factor_s;
        assert!(
            folded.is_multiple_of(output),
            "{input} channels times the downsampling factor do not divide into {output}"
        );
        Self {
            factor_t,
            factor_s,
            out_channels: output,
            group_size: folded / output,
        }
    }

    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, ⌈frames / factor_t⌉,
    ///   out, height / factor_s, width / factor_s]`
    pub fn forward<B: Backend>(&self, x: Tensor<B, 5>) -> Tensor<B, 5> {
        let (ft, fs) = (self.factor_t, self.factor_s);
        let [b, t, c, h, w] = x.dims();
        let x = match (ft - t % ft) % ft {
            0 => x,
            missing => {
                let zeros = Tensor::zeros([b, missing, c, h, w], (&x.device(), x.dtype()));
                Tensor::cat(vec![zeros, x], 1)
            }
        };
        let (t, h, w) = (x.dims()[1] / ft, h / fs, w / fs);
        x.reshape([b * t, ft, c, h, fs, w, fs])
            .permute([0, 2, 1, 4, 6, 3, 5])
            .reshape([b * t, self.out_channels, self.group_size, h, w])
            .mean_dim(2)
            .reshape([b, t, self.out_channels, h, w])
    }
}

/// The shortcut of Wan 2.2's decoder levels: each channel repeated, and the repeats unfolded
/// into `factor_t` frames and `factor_s`×`factor_s` pixels, the inverse arrangement of
/// [`AvgDown3d`] (diffusers' `DupUp3D`). It holds no weights.
#[derive(Module, Clone, Debug)]
pub struct DupUp3d {
    /// Frames each frame becomes.
    pub factor_t: usize,
    /// Pixels each pixel becomes along each side.
    pub factor_s: usize,
    /// Channels out.
    pub out_channels: usize,
    /// Copies of each input channel.
    pub repeats: usize,
}

impl DupUp3d {
    /// The shortcut from `input` channels to `output`.
    ///
    /// # Panics
    /// When `input` does not divide the unfolded channels.
    fn new(input: usize, output: usize, factor_t: usize, factor_s: usize) -> Self {
        let unfolded = output * factor_t * factor_s * factor_s;
        assert!(
            unfolded.is_multiple_of(input),
            "{output} channels times the upsampling factor do not divide by {input}"
        );
        Self {
            factor_t,
            factor_s,
            out_channels: output,
            repeats: unfolded / input,
        }
    }

    /// `first_chunk` says whether `x` is the clip's first chunk, of which only the last of the
    /// `factor_t` frames is kept (as the upsampler keeps one frame there).
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, factor_t · frames, out,
    ///   factor_s · height, factor_s · width]`, `factor_t - 1` frames fewer for the first chunk
    pub fn forward<B: Backend>(&self, x: Tensor<B, 5>, first_chunk: bool) -> Tensor<B, 5> {
        let (ft, fs) = (self.factor_t, self.factor_s);
        let [b, t, c, h, w] = x.dims();
        let y = x
            .reshape([b * t, c, 1, h, w])
            .repeat_dim(2, self.repeats)
            .reshape([b * t, self.out_channels, ft, fs, fs, h, w])
            .permute([0, 2, 1, 5, 3, 6, 4])
            .reshape([b, t * ft, self.out_channels, h * fs, w * fs]);
        match first_chunk {
            true => y.narrow(1, ft - 1, t * ft - (ft - 1)),
            false => y,
        }
    }
}

/// A layer of the encoder's `down_blocks` sequence.
// Built once per model and held in a `Vec`: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum WanDownLayer<B: Backend> {
    /// A residual block (Wan 2.1).
    Residual(WanResidualBlock<B>),
    /// The downsampler after a level's residual blocks (Wan 2.1).
    Resample(WanResample<B>),
    /// A whole level (Wan 2.2).
    Level(WanResidualDownBlock<B>),
}

impl<B: FusedOps> WanDownLayer<B> {
    /// The layer applied to `x`, its causal convolutions after the frames `cache` holds.
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, channels, height, width]`; output: `[batch, frames',
    ///   channels', height', width']`
    pub fn forward(&self, x: Tensor<B, 5>, cache: &mut FrameCache<B>) -> Tensor<B, 5> {
        match self {
            Self::Residual(block) => block.forward(x, cache),
            Self::Resample(resample) => resample.forward(x, cache, false),
            Self::Level(level) => level.forward(x, cache),
        }
    }

    /// Whether the layer halves the frames, and so mixes frames other than through causal
    /// convolutions.
    fn downsamples_time(&self) -> bool {
        let resample = match self {
            Self::Residual(_) => None,
            Self::Resample(resample) => Some(resample),
            Self::Level(level) => level.downsampler.as_ref(),
        };
        resample.is_some_and(|r| r.resample.0.mode == ResampleMode::Downsample3d)
    }
}

/// A level of Wan 2.2's encoder: residual blocks and a downsampler (none at the coarsest
/// level), plus the level's input averaged into their output's shape (diffusers'
/// `WanResidualDownBlock`).
#[derive(Module, Debug)]
pub struct WanResidualDownBlock<B: Backend> {
    /// The shortcut.
    pub avg_shortcut: AvgDown3d,
    /// The residual blocks.
    pub resnets: Vec<WanResidualBlock<B>>,
    /// The downsampler (none at the coarsest level).
    pub downsampler: Option<WanResample<B>>,
}

impl<B: FusedOps> WanResidualDownBlock<B> {
    fn new(
        input: usize,
        output: usize,
        blocks: usize,
        downsample: Option<ResampleMode>,
        device: &B::Device,
    ) -> Self {
        let factor_t = match downsample {
            Some(ResampleMode::Downsample3d) => 2,
            _ => 1,
        };
        let factor_s = if downsample.is_some() { 2 } else { 1 };
        Self {
            avg_shortcut: AvgDown3d::new(input, output, factor_t, factor_s),
            resnets: residual_blocks(input, output, blocks, device),
            downsampler: downsample.map(|mode| WanResample::new(output, mode, None, device)),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, frames', out, height',
    ///   width']`
    pub fn forward(&self, x: Tensor<B, 5>, cache: &mut FrameCache<B>) -> Tensor<B, 5> {
        let shortcut = self.avg_shortcut.forward(x.clone());
        let x = chain(&self.resnets, x, cache);
        let x = match &self.downsampler {
            Some(downsampler) => downsampler.forward(x, cache, false),
            None => x,
        };
        x + shortcut
    }
}

/// Clip to latent moments: a causal convolution in, per level residual blocks and a
/// downsampler (space, and time where configured; Wan 2.2 wraps each level in a residual
/// block), the middle block, and a norm and causal convolution out (diffusers'
/// `WanEncoder3d`).
#[derive(Module, Debug)]
pub struct WanEncoder3d<B: Backend> {
    /// RGB (its patches' channels in Wan 2.2) to the first level's channels.
    pub conv_in: WanCausalConv3d<B>,
    /// The levels' residual blocks and downsamplers, in order (Wan 2.2: the levels).
    pub down_blocks: Vec<WanDownLayer<B>>,
    /// The middle block.
    pub mid_block: WanMidBlock<B>,
    /// Norm before the output.
    pub norm_out: WanRmsNorm<B, 4>,
    /// To the moments: `2 · z_dim` channels.
    pub conv_out: WanCausalConv3d<B>,
}

impl<B: FusedOps> WanEncoder3d<B> {
    fn new(config: &WanVaeConfig, device: &B::Device) -> Self {
        let dims: Vec<usize> = [1]
            .iter()
            .chain(&config.dim_mult)
            .map(|m| m * config.base_dim)
            .collect();
        let levels = config.dim_mult.len();
        let mut down_blocks = Vec::new();
        for (level, pair) in dims.windows(2).enumerate() {
            let (input, output) = (pair[0], pair[1]);
            let downsample =
                (level + 1 < levels).then(|| match config.temperal_downsample[level] {
                    true => ResampleMode::Downsample3d,
                    false => ResampleMode::Downsample2d,
                });
            let blocks = config.num_res_blocks;
            if config.is_residual {
                let level = WanResidualDownBlock::new(input, output, blocks, downsample, device);
                down_blocks.push(WanDownLayer::Level(level));
                continue;
            }
            let resnets = residual_blocks(input, output, blocks, device);
            down_blocks.extend(resnets.into_iter().map(WanDownLayer::Residual));
            if let Some(mode) = downsample {
                let resample = WanResample::new(output, mode, None, device);
                down_blocks.push(WanDownLayer::Resample(resample));
            }
        }
        let width = dims[levels];
        let rgb = 3 * config.patch() * config.patch();
        Self {
            conv_in: WanCausalConv3d::new(rgb, dims[0], [3; 3], 1, [1; 3], device),
            down_blocks,
            mid_block: WanMidBlock::new(width, device),
            norm_out: WanRmsNorm::new(width, device),
            conv_out: WanCausalConv3d::new(width, 2 * config.z_dim, [3; 3], 1, [1; 3], device),
        }
    }

    /// One chunk of the clip, after the chunks `cache` has seen.
    ///
    /// The layers before the first that downsamples in time treat each frame on its own but
    /// for their causal convolutions, which take earlier frames from `cache`; they run one
    /// frame at a time, so the largest activations, those at full resolution, are a frame's
    /// rather than a chunk's. The result is the same.
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, 3 · patch², height, width]`; output: `[batch, frames',
    ///   2 · z_dim, height / 8, width / 8]`
    pub fn forward(&self, x: Tensor<B, 5>, cache: &mut FrameCache<B>) -> Tensor<B, 5> {
        let by_frame = self
            .down_blocks
            .iter()
            .position(WanDownLayer::downsamples_time)
            .unwrap_or(self.down_blocks.len());
        let (by_frame, by_chunk) = self.down_blocks.split_at(by_frame);
        let frames = (0..x.dims()[1])
            .map(|frame| {
                cache.restart();
                let x = self
                    .conv_in
                    .forward_cached(x.clone().narrow(1, frame, 1), cache.slot());
                by_frame.iter().fold(x, |x, layer| layer.forward(x, cache))
            })
            .collect();
        let x = by_chunk
            .iter()
            .fold(Tensor::cat(frames, 1), |x, layer| layer.forward(x, cache));
        let x = self.mid_block.forward(x, cache);
        self.conv_out
            .forward_cached(silu(self.norm_out.forward(x)), cache.slot())
    }
}

/// A level of Wan 2.1's decoder: residual blocks, then an upsampler except at the finest level
/// (diffusers' `WanUpBlock`).
#[derive(Module, Debug)]
pub struct WanUpBlock<B: Backend> {
    /// The residual blocks.
    pub resnets: Vec<WanResidualBlock<B>>,
    /// The upsampler (none at the finest level).
    pub upsamplers: Vec<WanResample<B>>,
}

impl<B: FusedOps> WanUpBlock<B> {
    /// `first_chunk` for the clip's first latent frame.
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, frames', out, height',
    ///   width']`
    pub fn forward(
        &self,
        x: Tensor<B, 5>,
        cache: &mut FrameCache<B>,
        first_chunk: bool,
    ) -> Tensor<B, 5> {
        let x = chain(&self.resnets, x, cache);
        self.upsamplers
            .iter()
            .fold(x, |x, upsampler| upsampler.forward(x, cache, first_chunk))
    }
}

/// A level of Wan 2.2's decoder: residual blocks and an upsampler keeping the channels (none
/// at the finest level), plus the level's input duplicated into their output's shape
/// (diffusers' `WanResidualUpBlock`).
#[derive(Module, Debug)]
pub struct WanResidualUpBlock<B: Backend> {
    /// The shortcut (none at the finest level).
    pub avg_shortcut: Option<DupUp3d>,
    /// The residual blocks.
    pub resnets: Vec<WanResidualBlock<B>>,
    /// The upsampler (none at the finest level).
    pub upsampler: Option<WanResample<B>>,
}

impl<B: FusedOps> WanResidualUpBlock<B> {
    fn new(
        input: usize,
        output: usize,
        blocks: usize,
        upsample: Option<ResampleMode>,
        device: &B::Device,
    ) -> Self {
        let factor_t = match upsample {
            Some(ResampleMode::Upsample3d) => 2,
            _ => 1,
        };
        Self {
            avg_shortcut: upsample.map(|_| DupUp3d::new(input, output, factor_t, 2)),
            resnets: residual_blocks(input, output, blocks, device),
            upsampler: upsample.map(|mode| WanResample::new(output, mode, Some(output), device)),
        }
    }

    /// `first_chunk` for the clip's first latent frame.
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, frames', out, height',
    ///   width']`
    pub fn forward(
        &self,
        x: Tensor<B, 5>,
        cache: &mut FrameCache<B>,
        first_chunk: bool,
    ) -> Tensor<B, 5> {
        let shortcut = self
            .avg_shortcut
            .as_ref()
            .map(|shortcut| shortcut.forward(x.clone(), first_chunk));
        let x = chain(&self.resnets, x, cache);
        let x = match &self.upsampler {
            Some(upsampler) => upsampler.forward(x, cache, first_chunk),
            None => x,
        };
        match shortcut {
            Some(shortcut) => x + shortcut,
            None => x,
        }
    }
}

/// A level of the decoder's `up_blocks`.
// Built once per model and held in a `Vec`: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum WanUpLayer<B: Backend> {
    /// Wan 2.1's level.
    Block(WanUpBlock<B>),
    /// Wan 2.2's level.
    Residual(WanResidualUpBlock<B>),
}

impl<B: FusedOps> WanUpLayer<B> {
    /// `first_chunk` for the clip's first latent frame.
    ///
    /// # Shapes
    /// - `x`: `[batch, frames, in, height, width]`; output: `[batch, frames', out, height',
    ///   width']`
    pub fn forward(
        &self,
        x: Tensor<B, 5>,
        cache: &mut FrameCache<B>,
        first_chunk: bool,
    ) -> Tensor<B, 5> {
        match self {
            Self::Block(block) => block.forward(x, cache, first_chunk),
            Self::Residual(block) => block.forward(x, cache, first_chunk),
        }
    }
}

/// Latent to clip: a causal convolution in, the middle block, the levels coarsest first, and a
/// norm and causal convolution out (diffusers' `WanDecoder3d`).
#[derive(Module, Debug)]
pub struct WanDecoder3d<B: Backend> {
    /// Latent to the coarsest level's channels.
    pub conv_in: WanCausalConv3d<B>,
    /// The middle block.
    pub mid_block: WanMidBlock<B>,
    /// The levels, coarsest first.
    pub up_blocks: Vec<WanUpLayer<B>>,
    /// Norm before the output.
    pub norm_out: WanRmsNorm<B, 4>,
    /// To RGB (its patches' channels in Wan 2.2).
    pub conv_out: WanCausalConv3d<B>,
}

impl<B: FusedOps> WanDecoder3d<B> {
    fn new(config: &WanVaeConfig, device: &B::Device) -> Self {
        let coarsest = config.dim_mult.last().copied().unwrap_or(1);
        let dims: Vec<usize> = [coarsest]
            .iter()
            .chain(config.dim_mult.iter().rev())
            .map(|m| m * config.decoder_dim())
            .collect();
        let levels = config.dim_mult.len();
        let blocks = config.num_res_blocks + 1;
        let up_blocks = dims
            .windows(2)
            .enumerate()
            .map(|(level, pair)| {
                let output = pair[1];
                let upsample = (level + 1 < levels).then(|| {
                    match config.temperal_downsample[levels - 2 - level] {
                        true => ResampleMode::Upsample3d,
                        false => ResampleMode::Upsample2d,
                    }
                });
                if config.is_residual {
                    let block = WanResidualUpBlock::new(pair[0], output, blocks, upsample, device);
                    return WanUpLayer::Residual(block);
                }
                // Wan 2.1's upsamplers halve the channels: later levels start from half.
                let input = if level > 0 { pair[0] / 2 } else { pair[0] };
                WanUpLayer::Block(WanUpBlock {
                    resnets: residual_blocks(input, output, blocks, device),
                    upsamplers: upsample
                        .map(|mode| WanResample::new(output, mode, None, device))
                        .into_iter()
                        .collect(),
                })
            })
            .collect();
        let finest = dims[levels];
        let rgb = 3 * config.patch() * config.patch();
        Self {
            conv_in: WanCausalConv3d::new(config.z_dim, dims[0], [3; 3], 1, [1; 3], device),
            mid_block: WanMidBlock::new(dims[0], device),
            up_blocks,
            norm_out: WanRmsNorm::new(finest, device),
            conv_out: WanCausalConv3d::new(finest, rgb, [3; 3], 1, [1; 3], device),
        }
    }

    /// One latent frame, after the frames `cache` has seen; `first_chunk` for the clip's
    /// first.
    ///
    /// # Shapes
    /// - `x`: `[batch, 1, z_dim, height, width]`; output: `[batch, frames, 3 · patch²,
    ///   8 · height, 8 · width]`, one frame for the first chunk, four after
    pub fn forward(
        &self,
        x: Tensor<B, 5>,
        cache: &mut FrameCache<B>,
        first_chunk: bool,
    ) -> Tensor<B, 5> {
        let x = self.conv_in.forward_cached(x, cache.slot());
        let mut x = self.mid_block.forward(x, cache);
        for block in &self.up_blocks {
            x = block.forward(x, cache, first_chunk);
        }
        self.conv_out
            .forward_cached(silu(self.norm_out.forward(x)), cache.slot())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::module::conv3d;
    use burn::tensor::{Distribution, Tolerance};

    type B = Flex;

    fn random<const D: usize>(shape: [usize; D]) -> Tensor<B, D> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
    }

    /// A random 3×3×3 causal convolution (padding 1) of 3 channels to 2 with time stride
    /// `stride`.
    fn causal(stride: usize, padding: [usize; 3]) -> WanCausalConv3d<B> {
        WanCausalConv3d {
            weight: Param::from_tensor(random([2, 3, 3, 3, 3])),
            bias: Param::from_tensor(random([2])),
            stride,
            padding,
        }
    }

    /// Burn's own 3-D convolution of `x` (`[batch, channels, frames, h, w]`) after the causal
    /// time padding, frame-major.
    fn reference(conv: &WanCausalConv3d<B>, x: Tensor<B, 5>) -> Tensor<B, 5> {
        let [b, c, _, h, w] = x.dims();
        let causal = 2 * conv.padding[0];
        let padded = Tensor::cat(vec![Tensor::zeros([b, c, causal, h, w], &x.device()), x], 2);
        let options = ConvOptions::new(
            [conv.stride, 1, 1],
            [0, conv.padding[1], conv.padding[2]],
            [1, 1, 1],
            1,
        );
        conv3d(padded, conv.weight.val(), Some(conv.bias.val()), options).swap_dims(1, 2)
    }

    #[test]
    fn time_taps_of_2d_convolutions_are_a_causal_3d_convolution() {
        for (stride, padding) in [(1, [1, 1, 1]), (2, [0, 0, 0])] {
            let conv = causal(stride, padding);
            let x = random([2, 3, 5, 6, 7]);
            conv.forward(x.clone().swap_dims(1, 2), None)
                .into_data()
                .assert_approx_eq::<f32>(
                    &reference(&conv, x).into_data(),
                    Tolerance::rel_abs(1e-6, 1e-5),
                );
        }
    }

    #[test]
    fn chunks_through_the_cache_match_one_pass_over_the_clip() {
        let conv = causal(1, [1, 1, 1]);
        let x = random([1, 9, 3, 4, 4]);
        let mut slot = None;
        let chunks = [(0, 1), (1, 4), (5, 1), (6, 3)]
            .into_iter()
            .map(|(start, length)| {
                conv.forward_cached(x.clone().narrow(1, start, length), &mut slot)
            })
            .collect();
        Tensor::cat(chunks, 1).into_data().assert_approx_eq::<f32>(
            &conv.forward(x, None).into_data(),
            Tolerance::rel_abs(1e-6, 1e-5),
        );
    }

    #[test]
    fn parameter_paths_drop_the_layer_variants() {
        assert_eq!(
            checkpoint_name("encoder.down_blocks.2.Resample.resample.1.weight"),
            "encoder.down_blocks.2.resample.1.weight"
        );
        assert_eq!(
            checkpoint_name("encoder.down_blocks.0.Residual.norm1.gamma"),
            "encoder.down_blocks.0.norm1.gamma"
        );
        assert_eq!(
            checkpoint_name("encoder.down_blocks.1.Level.downsampler.time_conv.weight"),
            "encoder.down_blocks.1.downsampler.time_conv.weight"
        );
        assert_eq!(
            checkpoint_name("decoder.up_blocks.0.Residual.upsampler.resample.1.bias"),
            "decoder.up_blocks.0.upsampler.resample.1.bias"
        );
        assert_eq!(
            checkpoint_name("decoder.up_blocks.0.Block.upsamplers.0.resample.1.bias"),
            "decoder.up_blocks.0.upsamplers.0.resample.1.bias"
        );
    }

    #[test]
    fn patches_unfold_to_the_pixels_they_folded() {
        let x = random([2, 3, 3, 4, 6]);
        let patched = patchify(x.clone(), 2);
        assert_eq!(patched.dims(), [2, 3, 12, 2, 3]);
        unpatchify(patched, 2)
            .into_data()
            .assert_eq(&x.into_data(), true);
    }
}
