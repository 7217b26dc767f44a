//! AutoencoderKL, block by block as diffusers writes it: the encoder (image → diagonal Gaussian
//! over latents) and the decoder (latent → image).
//!
//! Group norms compute their statistics and affine transform in f32 whatever the activations'
//! dtype, as PyTorch's kernels do, so that a bf16 VAE keeps its precision at 1024² pixels.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/autoencoders/autoencoder_kl.py
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/autoencoders/autoencoder_kl_flux2.py (AutoencoderKLFlux2: quant convolutions, `bn`)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux2/pipeline_flux2.py (_patchify_latents, _unpatchify_latents, _encode_vae_image, the batch-norm inverse before decoding)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/autoencoders/vae.py (Encoder, Decoder, DiagonalGaussianDistribution)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/unets/unet_2d_blocks.py (DownEncoderBlock2D, UpDecoderBlock2D, UNetMidBlock2D)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/resnet.py (ResnetBlock2D), downsampling.py, upsampling.py
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/attention_processor.py (Attention, AttnProcessor2_0)

use burn::module::{Module, RunningState};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{GroupNorm, GroupNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::silu;
use burn::tensor::{DType, Tensor, backend::Backend};
use burn_kernels::Kernels;

use super::{LatentBatchNormConfig, VaeConfig};
use crate::blocks::sdpa;

/// Epsilon of every group norm of the VAE.
const EPS: f64 = 1e-6;
/// diffusers clamps the log-variance of the latent distribution to this range.
const LOGVAR_RANGE: (f64, f64) = (-30.0, 20.0);

/// A variational autoencoder with a KL-regularized latent (FLUX.1's, FLUX.2's and SDXL's VAE).
///
/// Fields follow diffusers' keys (see [`super::VaeCheckpoint`] for the original layout).
#[derive(Module, Debug)]
pub struct AutoencoderKl<B: Backend> {
    /// Image to latent moments.
    pub encoder: Encoder<B>,
    /// Latent to image.
    pub decoder: Decoder<B>,
    /// 1×1 convolution over the moments (SDXL, FLUX.2).
    pub quant_conv: Option<Conv2d<B>>,
    /// 1×1 convolution over a latent before decoding (SDXL, FLUX.2).
    pub post_quant_conv: Option<Conv2d<B>>,
    /// The statistics that normalize a patchified latent (FLUX.2).
    pub bn: Option<LatentBatchNorm<B>>,
    config: VaeConfig,
}

/// The running mean and variance of a batch norm without affine transform, over the channels
/// of latents folded into `patch_size × patch_size` patches (FLUX.2's `vae.bn`). The statistics
/// are state, not trained parameters.
#[derive(Module, Debug)]
pub struct LatentBatchNorm<B: Backend> {
    /// `[latent_channels · patch_size²]`.
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// `[latent_channels · patch_size²]`.
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Side of the patches.
    pub patch_size: usize,
    /// Added to the variance.
    pub eps: f64,
}

impl<B: Kernels> LatentBatchNorm<B> {
    fn new(config: &LatentBatchNormConfig, latent_channels: usize, device: &B::Device) -> Self {
        let channels = latent_channels * config.patch_size * config.patch_size;
        Self {
            running_mean: RunningState::new(Tensor::zeros([channels], device)),
            running_var: RunningState::new(Tensor::ones([channels], device)),
            patch_size: config.patch_size,
            eps: config.eps,
        }
    }

    /// `(patchify(z) - mean) / sqrt(var + eps)`, in the latent's dtype (the pipeline's
    /// `_encode_vae_image` after the encoder).
    ///
    /// # Shapes
    /// - `latents`: `[batch, c, h, w]`, sides divisible by `patch_size`
    /// - output: `[batch, c · p², h / p, w / p]`
    pub fn normalize(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        let (mean, std) = self.statistics(latents.dtype());
        (patchify(latents, self.patch_size) - mean) / std
    }

    /// The inverse of [`LatentBatchNorm::normalize`].
    ///
    /// # Shapes
    /// - `latents`: `[batch, c · p², h, w]`; output: `[batch, c, h · p, w · p]`
    pub fn denormalize(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        let (mean, std) = self.statistics(latents.dtype());
        unpatchify(latents * std + mean, self.patch_size)
    }

    /// The mean and the standard deviation `sqrt(var + eps)` (computed in f32) as `[1, C, 1,
    /// 1]` in `dtype`.
    fn statistics(&self, dtype: DType) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let column = |t: Tensor<B, 1>| {
            let [c] = t.dims();
            t.reshape([1, c, 1, 1])
        };
        let var = self.running_var.value().cast(DType::F32);
        let std = (var + self.eps).sqrt().cast(dtype);
        (column(self.running_mean.value().cast(dtype)), column(std))
    }
}

/// Each `p × p` patch folded into the channels, ordered `(channel, row, column)`.
///
/// # Panics
/// If a side is not divisible by `p`.
fn patchify<B: Kernels>(latents: Tensor<B, 4>, p: usize) -> Tensor<B, 4> {
    let [b, c, h, w] = latents.dims();
    assert!(
        h.is_multiple_of(p) && w.is_multiple_of(p),
        "latent sides must be multiples of the patch size {p}, got {h}×{w}"
    );
    latents
        .reshape([b, c, h / p, p, w / p, p])
        .permute([0, 1, 3, 5, 2, 4])
        .reshape([b, c * p * p, h / p, w / p])
}

/// The inverse of [`patchify`].
fn unpatchify<B: Kernels>(latents: Tensor<B, 4>, p: usize) -> Tensor<B, 4> {
    let [b, c, h, w] = latents.dims();
    latents
        .reshape([b, c / (p * p), p, p, h, w])
        .permute([0, 1, 4, 2, 5, 3])
        .reshape([b, c / (p * p), h * p, w * p])
}

/// The distribution the encoder gives for each latent element: a Gaussian with this mean and
/// log-variance (clamped to `[-30, 20]`).
#[derive(Clone, Debug)]
pub struct LatentDistribution<B: Backend> {
    /// `[batch, latent_channels, height / f, width / f]`.
    pub mean: Tensor<B, 4>,
    /// Same shape as `mean`.
    pub logvar: Tensor<B, 4>,
}

impl<B: Kernels> LatentDistribution<B> {
    /// The most likely latent (diffusers' `latent_dist.mode()`).
    pub fn mode(&self) -> Tensor<B, 4> {
        self.mean.clone()
    }

    /// A sample `mean + exp(logvar / 2) · noise`, with `noise` standard normal of the mean's shape
    /// (diffusers' `latent_dist.sample()`).
    pub fn sample(&self, noise: Tensor<B, 4>) -> Tensor<B, 4> {
        self.mean.clone() + (self.logvar.clone() * 0.5).exp() * noise
    }
}

impl VaeConfig {
    /// A model of this shape with Burn's default initialization (weights are created lazily, on
    /// first use, in the device's default float dtype).
    ///
    /// # Panics
    /// If the configuration is inconsistent (see [`VaeConfig::validate`]).
    pub fn init<B: Kernels>(&self, device: &B::Device) -> AutoencoderKl<B> {
        if let Err(message) = self.validate() {
            panic!("invalid VAE config: {message}");
        }
        let latent = self.latent_channels;
        AutoencoderKl {
            encoder: Encoder::new(self, device),
            decoder: Decoder::new(self, device),
            quant_conv: self
                .use_quant_conv
                .then(|| conv(2 * latent, 2 * latent, 1, device)),
            post_quant_conv: self
                .use_post_quant_conv
                .then(|| conv(latent, latent, 1, device)),
            bn: self
                .batch_norm
                .as_ref()
                .map(|norm| LatentBatchNorm::new(norm, latent, device)),
            config: self.clone(),
        }
    }
}

impl<B: Kernels> AutoencoderKl<B> {
    /// The model's configuration.
    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// The latent distribution of images with pixels in `[-1, 1]`, in the dtype of the model's
    /// weights (the convolutions take operands of one dtype).
    ///
    /// # Shapes
    /// - `images`: `[batch, in_channels, height, width]`, sides divisible by
    ///   [`VaeConfig::downscale_factor`]
    /// - output: `[batch, latent_channels, height / f, width / f]`
    pub fn encode(&self, images: Tensor<B, 4>) -> LatentDistribution<B> {
        let moments = self.encoder.forward(images);
        let moments = match &self.quant_conv {
            Some(conv) => conv.forward(moments),
            None => moments,
        };
        let [mean, logvar]: [Tensor<B, 4>; 2] = moments
            .chunk(2, 1)
            .try_into()
            .expect("the encoder gives twice the latent channels");
        let (low, high) = LOGVAR_RANGE;
        LatentDistribution {
            mean,
            logvar: logvar.clamp(low, high),
        }
    }

    /// Images with pixels in about `[-1, 1]` from latents (not normalized: see
    /// [`AutoencoderKl::denormalize_latents`]) in the dtype of the model's weights.
    ///
    /// # Shapes
    /// - `latents`: `[batch, latent_channels, h, w]`
    /// - output: `[batch, out_channels, h · f, w · f]`
    pub fn decode(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        let latents = match &self.post_quant_conv {
            Some(conv) => conv.forward(latents),
            None => latents,
        };
        self.decoder.forward(latents)
    }

    /// A latent as the diffusion model sees it: `(z - shift_factor) · scaling_factor`, or, for a
    /// VAE with batch-norm statistics (FLUX.2), the latent folded into patches and normalized by
    /// them ([`LatentBatchNorm::normalize`]).
    ///
    /// # Shapes
    /// - `latents`: `[batch, latent_channels, h, w]`
    /// - output: the same, or `[batch, latent_channels · p², h / p, w / p]` with batch-norm
    ///   statistics
    pub fn normalize_latents(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        if let Some(bn) = &self.bn {
            return bn.normalize(latents);
        }
        let shift = self.config.shift_factor.unwrap_or(0.0);
        (latents - shift) * self.config.scaling_factor
    }

    /// The inverse of [`AutoencoderKl::normalize_latents`]: `z / scaling_factor + shift_factor`,
    /// or [`LatentBatchNorm::denormalize`].
    pub fn denormalize_latents(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        if let Some(bn) = &self.bn {
            return bn.denormalize(latents);
        }
        let shift = self.config.shift_factor.unwrap_or(0.0);
        latents / self.config.scaling_factor + shift
    }

    /// The normalized most likely latents of images with pixels in `[-1, 1]`: what the
    /// diffusion model is trained on (FLUX.2's pipeline: `_encode_vae_image`).
    ///
    /// # Shapes
    /// - `images`: `[batch, in_channels, height, width]`
    /// - output: see [`AutoencoderKl::normalize_latents`] (FLUX.2: `[batch, 128, height / 16,
    ///   width / 16]`)
    pub fn encode_latents(&self, images: Tensor<B, 4>) -> Tensor<B, 4> {
        self.normalize_latents(self.encode(images).mode())
    }

    /// Images from normalized latents ([`AutoencoderKl::denormalize_latents`], then
    /// [`AutoencoderKl::decode`]).
    pub fn decode_latents(&self, latents: Tensor<B, 4>) -> Tensor<B, 4> {
        self.decode(self.denormalize_latents(latents))
    }
}

/// Image to latent moments (mean and log-variance stacked on the channels).
#[derive(Module, Debug)]
pub struct Encoder<B: Backend> {
    /// Image channels to the first width.
    pub conv_in: Conv2d<B>,
    /// One block per resolution level, finest first.
    pub down_blocks: Vec<DownEncoderBlock2D<B>>,
    /// Residual blocks and attention at the coarsest level.
    pub mid_block: UNetMidBlock2D<B>,
    /// Norm before the output convolution.
    pub conv_norm_out: GroupNorm<B>,
    /// To `2 · latent_channels`.
    pub conv_out: Conv2d<B>,
}

impl<B: Kernels> Encoder<B> {
    fn new(config: &VaeConfig, device: &B::Device) -> Self {
        let widths = &config.block_out_channels;
        let last = *widths.last().expect("validated: at least one level");
        let down_blocks = widths
            .iter()
            .enumerate()
            .map(|(i, &width)| {
                let input = if i == 0 { widths[0] } else { widths[i - 1] };
                let resnets = (0..config.layers_per_block)
                    .map(|j| {
                        ResnetBlock2D::new(
                            if j == 0 { input } else { width },
                            width,
                            config,
                            device,
                        )
                    })
                    .collect();
                let downsamplers = (i + 1 < widths.len())
                    .then(|| Downsample2D::new(width, device))
                    .into_iter()
                    .collect();
                DownEncoderBlock2D {
                    resnets,
                    downsamplers,
                }
            })
            .collect();
        Self {
            conv_in: conv(config.in_channels, widths[0], 3, device),
            down_blocks,
            mid_block: UNetMidBlock2D::new(last, config, device),
            conv_norm_out: group_norm(last, config.norm_num_groups, EPS, device),
            conv_out: conv(last, 2 * config.latent_channels, 3, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, in_channels, h, w]`; output: `[batch, 2 · latent_channels, h / f, w / f]`
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = self.conv_in.forward(x);
        for block in &self.down_blocks {
            x = block.forward(x);
        }
        let x = self.mid_block.forward(x);
        self.conv_out
            .forward(silu(norm_in_f32(&self.conv_norm_out, x)))
    }
}

/// Latent to image.
#[derive(Module, Debug)]
pub struct Decoder<B: Backend> {
    /// Latent channels to the coarsest width.
    pub conv_in: Conv2d<B>,
    /// Residual blocks and attention at the coarsest level.
    pub mid_block: UNetMidBlock2D<B>,
    /// One block per resolution level, coarsest first.
    pub up_blocks: Vec<UpDecoderBlock2D<B>>,
    /// Norm before the output convolution.
    pub conv_norm_out: GroupNorm<B>,
    /// To image channels.
    pub conv_out: Conv2d<B>,
}

impl<B: Kernels> Decoder<B> {
    fn new(config: &VaeConfig, device: &B::Device) -> Self {
        let reversed: Vec<usize> = config.block_out_channels.iter().rev().copied().collect();
        let first = reversed[0];
        let finest = *reversed.last().expect("validated: at least one level");
        let up_blocks = reversed
            .iter()
            .enumerate()
            .map(|(i, &width)| {
                let input = if i == 0 { first } else { reversed[i - 1] };
                let resnets = (0..config.layers_per_block + 1)
                    .map(|j| {
                        ResnetBlock2D::new(
                            if j == 0 { input } else { width },
                            width,
                            config,
                            device,
                        )
                    })
                    .collect();
                let upsamplers = (i + 1 < reversed.len())
                    .then(|| Upsample2D::new(width, device))
                    .into_iter()
                    .collect();
                UpDecoderBlock2D {
                    resnets,
                    upsamplers,
                }
            })
            .collect();
        Self {
            conv_in: conv(config.latent_channels, first, 3, device),
            mid_block: UNetMidBlock2D::new(first, config, device),
            up_blocks,
            conv_norm_out: group_norm(finest, config.norm_num_groups, EPS, device),
            conv_out: conv(finest, config.out_channels, 3, device),
        }
    }

    /// # Shapes
    /// - `z`: `[batch, latent_channels, h, w]`; output: `[batch, out_channels, h · f, w · f]`
    pub fn forward(&self, z: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = self.mid_block.forward(self.conv_in.forward(z));
        for block in &self.up_blocks {
            x = block.forward(x);
        }
        self.conv_out
            .forward(silu(norm_in_f32(&self.conv_norm_out, x)))
    }
}

/// Residual blocks, then a stride-2 convolution (except at the coarsest level).
#[derive(Module, Debug)]
pub struct DownEncoderBlock2D<B: Backend> {
    /// The residual blocks.
    pub resnets: Vec<ResnetBlock2D<B>>,
    /// The downsampler (none at the coarsest level).
    pub downsamplers: Vec<Downsample2D<B>>,
}

impl<B: Kernels> DownEncoderBlock2D<B> {
    /// # Shapes
    /// - `x`: `[batch, c_in, h, w]`; output: `[batch, c_out, h / 2, w / 2]` (no halving at the
    ///   coarsest level)
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = self.resnets.iter().fold(x, |x, r| r.forward(x));
        self.downsamplers.iter().fold(x, |x, d| d.forward(x))
    }
}

/// Residual blocks, then nearest-neighbour upsampling and a convolution (except at the finest
/// level).
#[derive(Module, Debug)]
pub struct UpDecoderBlock2D<B: Backend> {
    /// The residual blocks.
    pub resnets: Vec<ResnetBlock2D<B>>,
    /// The upsampler (none at the finest level).
    pub upsamplers: Vec<Upsample2D<B>>,
}

impl<B: Kernels> UpDecoderBlock2D<B> {
    /// # Shapes
    /// - `x`: `[batch, c_in, h, w]`; output: `[batch, c_out, 2h, 2w]` (no doubling at the finest
    ///   level)
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let x = self.resnets.iter().fold(x, |x, r| r.forward(x));
        self.upsamplers.iter().fold(x, |x, u| u.forward(x))
    }
}

/// A residual block, an attention layer (unless disabled), and a second residual block.
#[derive(Module, Debug)]
pub struct UNetMidBlock2D<B: Backend> {
    /// Two residual blocks.
    pub resnets: Vec<ResnetBlock2D<B>>,
    /// The attention between them (none when `mid_block_add_attention` is off).
    pub attentions: Vec<SpatialAttention<B>>,
}

impl<B: Kernels> UNetMidBlock2D<B> {
    fn new(width: usize, config: &VaeConfig, device: &B::Device) -> Self {
        Self {
            resnets: (0..2)
                .map(|_| ResnetBlock2D::new(width, width, config, device))
                .collect(),
            attentions: config
                .mid_block_add_attention
                .then(|| SpatialAttention::new(width, config, device))
                .into_iter()
                .collect(),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c, h, w]`; output: same
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut x = self.resnets[0].forward(x);
        for (i, resnet) in self.resnets.iter().enumerate().skip(1) {
            if let Some(attention) = self.attentions.get(i - 1) {
                x = attention.forward(x);
            }
            x = resnet.forward(x);
        }
        x
    }
}

/// `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))`, the shortcut a 1×1 convolution
/// when the width changes.
#[derive(Module, Debug)]
pub struct ResnetBlock2D<B: Backend> {
    /// First norm.
    pub norm1: GroupNorm<B>,
    /// First 3×3 convolution.
    pub conv1: Conv2d<B>,
    /// Second norm.
    pub norm2: GroupNorm<B>,
    /// Second 3×3 convolution.
    pub conv2: Conv2d<B>,
    /// 1×1 projection of the input when the width changes.
    pub conv_shortcut: Option<Conv2d<B>>,
}

impl<B: Kernels> ResnetBlock2D<B> {
    fn new(input: usize, output: usize, config: &VaeConfig, device: &B::Device) -> Self {
        Self {
            norm1: group_norm(input, config.norm_num_groups, EPS, device),
            conv1: conv(input, output, 3, device),
            norm2: group_norm(output, config.norm_num_groups, EPS, device),
            conv2: conv(output, output, 3, device),
            conv_shortcut: (input != output).then(|| conv(input, output, 1, device)),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c_in, h, w]`; output: `[batch, c_out, h, w]`
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let h = self
            .conv1
            .forward(silu(norm_in_f32(&self.norm1, x.clone())));
        let h = self.conv2.forward(silu(norm_in_f32(&self.norm2, h)));
        let shortcut = match &self.conv_shortcut {
            Some(conv) => conv.forward(x),
            None => x,
        };
        shortcut + h
    }
}

/// A stride-2 3×3 convolution, the input padded by one row and column at the bottom and right
/// (diffusers' `Downsample2D` with `padding=0`).
#[derive(Module, Debug)]
pub struct Downsample2D<B: Backend> {
    /// The convolution.
    pub conv: Conv2d<B>,
}

impl<B: Kernels> Downsample2D<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        Self {
            conv: Conv2dConfig::new([width, width], [3, 3])
                .with_stride([2, 2])
                .init(device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c, h, w]`; output: `[batch, c, ⌈h / 2⌉, ⌈w / 2⌉]`
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(pad_bottom_right(x))
    }
}

/// One row of zeros below and one column on the right (PyTorch's `F.pad(x, (0, 1, 0, 1))`), in
/// the input's dtype. Burn 0.21's asymmetric convolution padding makes its zeros in the
/// device's default dtype, which fails for bf16 activations on an f32 device.
pub(crate) fn pad_bottom_right<B: Kernels>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    let [b, c, h, w] = x.dims();
    let (device, dtype) = (x.device(), x.dtype());
    let x = Tensor::cat(vec![x, Tensor::zeros([b, c, h, 1], (&device, dtype))], 3);
    Tensor::cat(
        vec![x, Tensor::zeros([b, c, 1, w + 1], (&device, dtype))],
        2,
    )
}

/// Nearest-neighbour 2× upsampling, then a 3×3 convolution.
#[derive(Module, Debug)]
pub struct Upsample2D<B: Backend> {
    /// The convolution.
    pub conv: Conv2d<B>,
}

impl<B: Kernels> Upsample2D<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        Self {
            conv: conv(width, width, 3, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c, h, w]`; output: `[batch, c, 2h, 2w]`
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(nearest_2x(x))
    }
}

/// Each pixel repeated twice along both sides (PyTorch's `interpolate(scale_factor=2,
/// mode="nearest")`).
pub(crate) fn nearest_2x<B: Kernels>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    let [b, c, h, w] = x.dims();
    x.reshape([b, c, h, 1, w, 1])
        .expand([b, c, h, 2, w, 2])
        .reshape([b, c, 2 * h, 2 * w])
}

/// Single-head self-attention over the pixels of a feature map, with its own group norm and a
/// residual connection (diffusers' `Attention` with `heads = 1` in the middle blocks).
#[derive(Module, Debug)]
pub struct SpatialAttention<B: Backend> {
    /// Norm of the input.
    pub group_norm: GroupNorm<B>,
    /// Query projection.
    pub to_q: Linear<B>,
    /// Key projection.
    pub to_k: Linear<B>,
    /// Value projection.
    pub to_v: Linear<B>,
    /// Output projection (diffusers' `to_out.0`).
    pub to_out: Linear<B>,
}

impl<B: Kernels> SpatialAttention<B> {
    fn new(width: usize, config: &VaeConfig, device: &B::Device) -> Self {
        let linear = || LinearConfig::new(width, width).init(device);
        Self {
            group_norm: group_norm(width, config.norm_num_groups, EPS, device),
            to_q: linear(),
            to_k: linear(),
            to_v: linear(),
            to_out: linear(),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c, h, w]`; output: same
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, c, h, w] = x.dims();
        let tokens = norm_in_f32(&self.group_norm, x.clone())
            .reshape([b, c, h * w])
            .swap_dims(1, 2);
        let heads = |linear: &Linear<B>| linear.forward(tokens.clone()).unsqueeze_dim::<4>(1);
        let attended = sdpa(heads(&self.to_q), heads(&self.to_k), heads(&self.to_v));
        let out = self
            .to_out
            .forward(attended.squeeze_dim::<3>(1))
            .swap_dims(1, 2)
            .reshape([b, c, h, w]);
        out + x
    }
}

/// A 3×3 (padding 1) or 1×1 convolution with bias.
pub(crate) fn conv<B: Kernels>(
    input: usize,
    output: usize,
    kernel: usize,
    device: &B::Device,
) -> Conv2d<B> {
    Conv2dConfig::new([input, output], [kernel, kernel])
        .with_padding(PaddingConfig2d::Explicit(
            kernel / 2,
            kernel / 2,
            kernel / 2,
            kernel / 2,
        ))
        .init(device)
}

/// A group norm of `channels` in `groups` with epsilon `eps`.
pub(crate) fn group_norm<B: Kernels>(
    channels: usize,
    groups: usize,
    eps: f64,
    device: &B::Device,
) -> GroupNorm<B> {
    GroupNormConfig::new(groups, channels)
        .with_epsilon(eps)
        .init(device)
}

/// `norm`'s group normalization with its statistics and affine transform in f32, the result in
/// the input's dtype: the normalization every block of the VAE uses.
pub fn norm_in_f32<B: Kernels>(norm: &GroupNorm<B>, x: Tensor<B, 4>) -> Tensor<B, 4> {
    let dtype = x.dtype();
    let [b, c, h, w] = x.dims();
    let groups = norm.num_groups;
    let grouped = x.cast(DType::F32).reshape([b, groups, c / groups * h * w]);
    let centered = grouped.clone() - grouped.mean_dim(2);
    let var = centered.clone().square().mean_dim(2);
    let normalized = (centered / (var + norm.epsilon).sqrt()).reshape([b, c, h, w]);
    let affine = |p: &Option<burn::module::Param<Tensor<B, 1>>>| {
        p.as_ref()
            .map(|p| p.val().cast(DType::F32).reshape([1, c, 1, 1]))
    };
    let normalized = match (affine(&norm.gamma), affine(&norm.beta)) {
        (Some(gamma), Some(beta)) => normalized * gamma + beta,
        _ => normalized,
    };
    normalized.cast(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{Distribution, TensorData, Tolerance};

    type B = Flex;

    #[test]
    fn group_norm_in_f32_matches_burns_group_norm() {
        let device = Default::default();
        let layer = GroupNormConfig::new(2, 6)
            .with_epsilon(EPS)
            .init::<B>(&device);
        let x = Tensor::<B, 4>::random([2, 6, 3, 5], Distribution::Normal(1.0, 2.0), &device);
        norm_in_f32(&layer, x.clone())
            .into_data()
            .assert_approx_eq::<f32>(&layer.forward(x).into_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn padding_adds_zeros_below_and_right_in_the_input_dtype() {
        let device = Default::default();
        let x = Tensor::<B, 4>::from_data([[[[1.0, 2.0], [3.0, 4.0]]]], (&device, DType::BF16));
        let padded = pad_bottom_right(x);
        assert_eq!(padded.dtype(), DType::BF16);
        let expected = TensorData::from([[[[1.0f32, 2.0, 0.0], [3.0, 4.0, 0.0], [0.0, 0.0, 0.0]]]]);
        padded
            .cast(DType::F32)
            .into_data()
            .assert_eq(&expected, true);
    }

    #[test]
    fn upsampling_repeats_each_pixel_twice_per_side() {
        let device = Default::default();
        let x = Tensor::<B, 4>::from_floats([[[[1.0, 2.0], [3.0, 4.0]]]], &device);
        let expected = TensorData::from([[[
            [1.0f32, 1.0, 2.0, 2.0],
            [1.0, 1.0, 2.0, 2.0],
            [3.0, 3.0, 4.0, 4.0],
            [3.0, 3.0, 4.0, 4.0],
        ]]]);
        nearest_2x(x).into_data().assert_eq(&expected, true);
    }

    #[test]
    fn shapes_follow_the_levels() {
        let device = Default::default();
        let config = VaeConfig {
            block_out_channels: vec![8, 16],
            layers_per_block: 1,
            norm_num_groups: 4,
            ..VaeConfig::sdxl()
        };
        let vae = config.init::<B>(&device);
        let images =
            Tensor::<B, 4>::random([1, 3, 10, 6], Distribution::Uniform(-1.0, 1.0), &device);
        let latents = vae.encode(images);
        assert_eq!(latents.mean.dims(), [1, 4, 5, 3]);
        assert_eq!(vae.decode(latents.mode()).dims(), [1, 3, 10, 6]);
    }

    #[test]
    fn patches_fold_into_channels_row_by_row() {
        let device = Default::default();
        // 1 batch, 2 channels, 2×4 latent: values encode (channel, row, column).
        let z = Tensor::<B, 1, burn::tensor::Int>::arange(0..16, &device)
            .float()
            .reshape([1, 2, 2, 4]);
        let folded = patchify(z.clone(), 2);
        assert_eq!(folded.dims(), [1, 8, 1, 2]);
        let values = folded.clone().into_data().to_vec::<f32>().unwrap();
        // Channel 1 of the output is channel 0's row 0, column 1 of each patch.
        assert_eq!(&values[2..4], [1.0, 3.0]);
        assert_eq!(&values[14..16], [13.0, 15.0]);
        unpatchify(folded, 2)
            .into_data()
            .assert_eq(&z.into_data(), true);
    }

    #[test]
    fn batch_norm_normalization_round_trips() {
        let device = Default::default();
        let config = VaeConfig {
            block_out_channels: vec![8],
            layers_per_block: 1,
            norm_num_groups: 4,
            latent_channels: 3,
            ..VaeConfig::flux2()
        };
        let mut vae = config.init::<B>(&device);
        let bn = vae.bn.as_mut().unwrap();
        bn.running_mean = RunningState::new(Tensor::random(
            [12],
            Distribution::Normal(0.0, 1.0),
            &device,
        ));
        bn.running_var = RunningState::new(Tensor::random(
            [12],
            Distribution::Uniform(0.5, 2.0),
            &device,
        ));
        let z = Tensor::<B, 4>::random([2, 3, 4, 6], Distribution::Normal(0.0, 1.0), &device);
        let normalized = vae.normalize_latents(z.clone());
        assert_eq!(normalized.dims(), [2, 12, 2, 3]);
        vae.denormalize_latents(normalized)
            .into_data()
            .assert_approx_eq::<f32>(&z.into_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn normalization_round_trips() {
        let device = Default::default();
        let config = VaeConfig {
            block_out_channels: vec![8],
            layers_per_block: 1,
            norm_num_groups: 4,
            ..VaeConfig::flux()
        };
        let vae = config.init::<B>(&device);
        let z = Tensor::<B, 4>::random([1, 16, 2, 2], Distribution::Normal(0.0, 1.0), &device);
        let normalized = vae.normalize_latents(z.clone());
        let first = normalized.clone().into_data().to_vec::<f32>().unwrap()[0];
        let z0 = z.clone().into_data().to_vec::<f32>().unwrap()[0];
        assert!((first - (z0 - 0.1159) * 0.3611).abs() < 1e-6);
        vae.denormalize_latents(normalized)
            .into_data()
            .assert_approx_eq::<f32>(&z.into_data(), Tolerance::absolute(1e-6));
    }
}
