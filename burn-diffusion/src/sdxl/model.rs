//! The SDXL UNet, block by block as diffusers writes it: timestep and size-and-crop
//! embeddings, down blocks of residual blocks and transformers, a middle block, up blocks that
//! read the down blocks' outputs, and the output convolution.
//!
//! Group norms compute in f32 whatever the activations' dtype ([`norm_in_f32`], as the VAE's),
//! layer norms likewise ([`layer_norm`]); attention goes through [`sdpa`] and every projection
//! through [`LoraLinear`] / [`LoraConv2d`], so that LoRA and LoCon adapters attach anywhere.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/unets/unet_2d_condition.py (UNet2DConditionModel: get_time_embed, get_aug_embed "text_time", forward)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/unets/unet_2d_blocks.py (DownBlock2D, CrossAttnDownBlock2D, UNetMidBlock2DCrossAttn, CrossAttnUpBlock2D, UpBlock2D)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/resnet.py (ResnetBlock2D), downsampling.py (Downsample2D), upsampling.py (Upsample2D)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/transformers/transformer_2d.py (Transformer2DModel, continuous input, linear projection)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/attention.py (BasicTransformerBlock, FeedForward), activations.py (GEGLU), attention_processor.py (Attention, AttnProcessor2_0)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/embeddings.py (get_timestep_embedding, Timesteps, TimestepEmbedding)

use burn::module::Module;
use burn::nn::conv::Conv2dConfig;
use burn::nn::{Dropout, DropoutConfig, GroupNorm, LayerNorm, LayerNormConfig, PaddingConfig2d};
use burn::tensor::activation::{gelu, silu};
use burn::tensor::{DType, Int, Tensor, TensorData, backend::Backend};
use burn_kernels::Kernels;
use burn_lora::{LoraConv2d, LoraLinear};

use super::UNetConfig;
use crate::blocks::{layer_norm, sdpa, timestep_embedding};
use crate::checkpointing::{BlockRunner, Direct};
use crate::flux::linear;
use crate::vae::{conv, group_norm, nearest_2x, norm_in_f32};

/// Epsilon of a transformer's input group norm (fixed in diffusers' `Transformer2DModel`).
const TRANSFORMER_NORM_EPS: f64 = 1e-6;
/// Epsilon of a transformer block's layer norms.
const LAYER_NORM_EPS: f64 = 1e-5;
/// Hidden width of a transformer block's feed-forward relative to its width.
const FF_MULT: usize = 4;

/// The SDXL UNet (diffusers' `UNet2DConditionModel` as SDXL configures it): predicts the noise
/// of a latent at a DDPM timestep, conditioned on text tokens, a pooled text vector and the
/// size-and-crop values.
///
/// Fields follow diffusers' state-dict keys, so a diffusers `unet` folder loads without any
/// renaming (see [`super::UNetCheckpoint`]); every convolution is a [`LoraConv2d`] and every
/// projection a [`LoraLinear`].
#[derive(Module, Debug)]
pub struct UNet2DCondition<B: Backend> {
    /// Latent to the first level's width.
    pub conv_in: LoraConv2d<B>,
    /// Embedding of the sinusoidal timestep embedding.
    pub time_embedding: TimestepEmbedding<B>,
    /// Embedding of the pooled text vector beside the size-and-crop values.
    pub add_embedding: TimestepEmbedding<B>,
    /// The levels on the way down, finest first.
    pub down_blocks: Vec<CrossAttnDownBlock2D<B>>,
    /// The coarsest level's residual blocks around a transformer.
    pub mid_block: UNetMidBlock2DCrossAttn<B>,
    /// The levels on the way up, coarsest first.
    pub up_blocks: Vec<CrossAttnUpBlock2D<B>>,
    /// Norm before the output convolution.
    pub conv_norm_out: GroupNorm<B>,
    /// Output convolution.
    pub conv_out: LoraConv2d<B>,
    config: UNetConfig,
}

/// One forward pass's inputs, named as diffusers' `UNet2DConditionModel.forward` arguments
/// (`text_embeds` and `time_ids` are its `added_cond_kwargs`). Tensors are in the model's
/// dtype, except that `timestep` and `time_ids` may be f32 in a bf16 model (they are embedded
/// in f32).
#[derive(Clone, Debug)]
pub struct UNetInput<B: Backend> {
    /// Noisy latents, `[batch, in_channels, height, width]`.
    pub sample: Tensor<B, 4>,
    /// DDPM timesteps in `[0, 1000)`, `[batch]`.
    pub timestep: Tensor<B, 1>,
    /// Text tokens (both encoders' penultimate states side by side),
    /// `[batch, tokens, cross_attention_dim]`.
    pub encoder_hidden_states: Tensor<B, 3>,
    /// Pooled text vector (OpenCLIP-bigG's projected output), `[batch, pooled]`.
    pub text_embeds: Tensor<B, 2>,
    /// Original size, crop top-left and target size, `[batch, 6]`.
    pub time_ids: Tensor<B, 2>,
}

impl UNetConfig {
    /// A model of this shape with Burn's default initialization (weights are created lazily,
    /// on first use, in the device's default float dtype).
    ///
    /// # Panics
    /// If the configuration is inconsistent (see [`UNetConfig::validate`]).
    pub fn init<B: Kernels>(&self, device: &B::Device) -> UNet2DCondition<B> {
        if let Err(message) = self.validate() {
            panic!("invalid SDXL UNet config: {message}");
        }
        let widths = &self.block_out_channels;
        let (levels, layers, temb) = (self.levels(), self.layers_per_block, self.time_embed_dim());
        let transformers =
            |width: usize, level: usize, count: usize| -> Vec<Transformer2DModel<B>> {
                (0..count)
                    .map(|_| Transformer2DModel::new(width, level, self, device))
                    .collect()
            };
        let down_blocks = (0..levels)
            .map(|level| {
                let width = widths[level];
                let input = widths[level.saturating_sub(1)];
                CrossAttnDownBlock2D {
                    resnets: (0..layers)
                        .map(|i| {
                            let from = if i == 0 { input } else { width };
                            ResnetBlock2D::new(from, width, temb, self, device)
                        })
                        .collect(),
                    attentions: if self.down_has_attention(level) {
                        transformers(width, level, layers)
                    } else {
                        Vec::new()
                    },
                    downsamplers: (level + 1 < levels)
                        .then(|| Downsample2D::new(width, device))
                        .into_iter()
                        .collect(),
                }
            })
            .collect();
        let last = levels - 1;
        let coarsest = widths[last];
        let mid_block = UNetMidBlock2DCrossAttn {
            resnets: (0..2)
                .map(|_| ResnetBlock2D::new(coarsest, coarsest, temb, self, device))
                .collect(),
            attentions: transformers(coarsest, last, 1),
        };
        let up_blocks = (0..levels)
            .map(|index| {
                let level = last - index;
                let width = widths[level];
                // The previous up block's width, and the width of this level's first skip.
                let previous = widths[(level + 1).min(last)];
                let input = widths[level.saturating_sub(1)];
                CrossAttnUpBlock2D {
                    resnets: (0..=layers)
                        .map(|i| {
                            let from = if i == 0 { previous } else { width };
                            let skip = if i == layers { input } else { width };
                            ResnetBlock2D::new(from + skip, width, temb, self, device)
                        })
                        .collect(),
                    attentions: if self.up_has_attention(index) {
                        transformers(width, level, layers + 1)
                    } else {
                        Vec::new()
                    },
                    upsamplers: (level > 0)
                        .then(|| Upsample2D::new(width, device))
                        .into_iter()
                        .collect(),
                }
            })
            .collect();
        UNet2DCondition {
            conv_in: conv(self.in_channels, widths[0], 3, device).into(),
            time_embedding: TimestepEmbedding::new(widths[0], temb, device),
            add_embedding: TimestepEmbedding::new(
                self.projection_class_embeddings_input_dim,
                temb,
                device,
            ),
            down_blocks,
            mid_block,
            up_blocks,
            conv_norm_out: group_norm(widths[0], self.norm_num_groups, self.norm_eps, device),
            conv_out: conv(widths[0], self.out_channels, 3, device).into(),
            config: self.clone(),
        }
    }
}

impl<B: Kernels> UNet2DCondition<B> {
    /// The model's configuration.
    pub fn config(&self) -> &UNetConfig {
        &self.config
    }

    /// One forward pass: the predicted noise.
    ///
    /// # Shapes
    /// - output: `[batch, out_channels, height, width]`
    ///
    /// # Panics
    /// If the widths of `text_embeds` and `time_ids` do not add up to the addition embedding's
    /// input (`projection_class_embeddings_input_dim`).
    pub fn forward(&self, input: UNetInput<B>) -> Tensor<B, 4> {
        self.forward_with(input, &mut Direct)
    }

    /// [`UNet2DCondition::forward`] with every residual block, transformer block, transformer
    /// projection, downsampler and upsampler run by `runner`, e.g. a
    /// [`BlockTape`](crate::BlockTape) for training with gradient checkpointing. The skip
    /// connections are outputs of those units, so they are kept, not recomputed.
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        input: UNetInput<B>,
        runner: &mut R,
    ) -> Tensor<B, 4> {
        let dtype = input.sample.dtype();
        let emb = self.embedding(input.timestep, input.text_embeds, input.time_ids, dtype);
        let sample = self.conv_in.forward(input.sample);
        let (mut x, emb, context) = runner.input((sample, emb, input.encoder_hidden_states));

        let mut skips = vec![x.clone()];
        for block in &self.down_blocks {
            let (out, outputs) = block.forward_with(x, &emb, &context, runner);
            x = out;
            skips.extend(outputs);
        }
        x = self.mid_block.forward_with(x, &emb, &context, runner);
        for block in &self.up_blocks {
            let own = skips.split_off(skips.len() - block.resnets.len());
            // The upsampler restores the size of the next skip (odd sizes included).
            let size = skips.last().map(|s| {
                let [_, _, h, w] = s.dims();
                [h, w]
            });
            x = block.forward_with(x, own, &emb, &context, size, runner);
        }
        self.conv_out
            .forward(silu(norm_in_f32(&self.conv_norm_out, x)))
    }

    /// The conditioning vector: the timestep's embedding plus that of the pooled text vector
    /// beside the sinusoidal embeddings of the size-and-crop values, `[batch, time_embed_dim]`
    /// in `dtype`.
    fn embedding(
        &self,
        timestep: Tensor<B, 1>,
        text_embeds: Tensor<B, 2>,
        time_ids: Tensor<B, 2>,
        dtype: DType,
    ) -> Tensor<B, 2> {
        let config = &self.config;
        let t_emb =
            timestep_embedding(timestep.cast(DType::F32), config.block_out_channels[0], 1.0);
        let emb = self.time_embedding.forward(t_emb.cast(dtype));
        let [batch, values] = time_ids.dims();
        let [_, pooled] = text_embeds.dims();
        let width = config.addition_time_embed_dim;
        assert_eq!(
            pooled + values * width,
            config.projection_class_embeddings_input_dim,
            "text_embeds ({pooled} wide) and {values} time_ids × {width} must fill \
             projection_class_embeddings_input_dim"
        );
        let time_embeds = timestep_embedding(
            time_ids.cast(DType::F32).reshape([batch * values]),
            width,
            1.0,
        )
        .reshape([batch, values * width]);
        let add_embeds =
            Tensor::cat(vec![text_embeds.cast(DType::F32), time_embeds], 1).cast(dtype);
        emb + self.add_embedding.forward(add_embeds)
    }
}

/// `linear_2(silu(linear_1(x)))`: the timestep and addition embeddings.
#[derive(Module, Debug)]
pub struct TimestepEmbedding<B: Backend> {
    /// Input projection.
    pub linear_1: LoraLinear<B>,
    /// Output projection.
    pub linear_2: LoraLinear<B>,
}

impl<B: Kernels> TimestepEmbedding<B> {
    pub(crate) fn new(d_input: usize, width: usize, device: &B::Device) -> Self {
        Self {
            linear_1: linear(d_input, width, true, device),
            linear_2: linear(width, width, true, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, d_input]`; output: `[batch, width]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear_2.forward(silu(self.linear_1.forward(x)))
    }
}

/// A level on the way down: residual blocks, each followed by a transformer when the level has
/// attention (diffusers' `CrossAttnDownBlock2D`; without `attentions`, its `DownBlock2D`), then a
/// stride-2 convolution except at the coarsest level.
#[derive(Module, Debug)]
pub struct CrossAttnDownBlock2D<B: Backend> {
    /// The residual blocks.
    pub resnets: Vec<ResnetBlock2D<B>>,
    /// One transformer after each residual block, or none.
    pub attentions: Vec<Transformer2DModel<B>>,
    /// The downsampler (none at the coarsest level).
    pub downsamplers: Vec<Downsample2D<B>>,
}

impl<B: Kernels> CrossAttnDownBlock2D<B> {
    /// Runs the level; returns its output and the outputs the up blocks read (one per residual
    /// block, and the downsampler's), in order.
    ///
    /// # Shapes
    /// - `x`: `[batch, c_in, h, w]`, `temb`: `[batch, time_embed_dim]`, `context`:
    ///   `[batch, tokens, cross_attention_dim]`
    /// - output: `[batch, c_out, ⌈h / 2⌉, ⌈w / 2⌉]` (no halving at the coarsest level)
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        mut x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
        runner: &mut R,
    ) -> (Tensor<B, 4>, Vec<Tensor<B, 4>>) {
        let mut outputs = Vec::with_capacity(self.resnets.len() + self.downsamplers.len());
        for (i, resnet) in self.resnets.iter().enumerate() {
            x = resnet.forward_with(x, temb, runner);
            if let Some(attention) = self.attentions.get(i) {
                x = attention.forward_with(x, context, runner);
            }
            outputs.push(x.clone());
        }
        for downsampler in &self.downsamplers {
            x = runner.run(downsampler, x, |d, x| d.forward(x));
            outputs.push(x.clone());
        }
        (x, outputs)
    }
}

/// The coarsest level between the way down and the way up: a residual block, then a
/// transformer and a residual block.
#[derive(Module, Debug)]
pub struct UNetMidBlock2DCrossAttn<B: Backend> {
    /// Two residual blocks.
    pub resnets: Vec<ResnetBlock2D<B>>,
    /// The transformer between them.
    pub attentions: Vec<Transformer2DModel<B>>,
}

impl<B: Kernels> UNetMidBlock2DCrossAttn<B> {
    /// # Shapes
    /// - `x`: `[batch, c, h, w]`; output: same (other inputs as
    ///   [`CrossAttnDownBlock2D::forward_with`])
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
        runner: &mut R,
    ) -> Tensor<B, 4> {
        let mut x = self.resnets[0].forward_with(x, temb, runner);
        for (attention, resnet) in self.attentions.iter().zip(&self.resnets[1..]) {
            x = attention.forward_with(x, context, runner);
            x = resnet.forward_with(x, temb, runner);
        }
        x
    }
}

/// A level on the way up: residual blocks over the input beside a skip from the way down, each
/// followed by a transformer when the level has attention (diffusers' `CrossAttnUpBlock2D`;
/// without `attentions`, its `UpBlock2D`), then nearest upsampling and a convolution except at
/// the finest level.
#[derive(Module, Debug)]
pub struct CrossAttnUpBlock2D<B: Backend> {
    /// The residual blocks (one more than on the way down).
    pub resnets: Vec<ResnetBlock2D<B>>,
    /// One transformer after each residual block, or none.
    pub attentions: Vec<Transformer2DModel<B>>,
    /// The upsampler (none at the finest level).
    pub upsamplers: Vec<Upsample2D<B>>,
}

impl<B: Kernels> CrossAttnUpBlock2D<B> {
    /// Runs the level on `x` and its skips (`skips`, one per residual block, in the order the
    /// way down made them: the last is read first); the upsampler, if any, resizes to `size`
    /// (twice the input's sides when `None`).
    ///
    /// # Shapes
    /// - `x`: `[batch, c_prev, h, w]`; output: `[batch, c_out, size]` (`[.., h, w]` at the
    ///   finest level); other inputs as [`CrossAttnDownBlock2D::forward_with`]
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        mut x: Tensor<B, 4>,
        mut skips: Vec<Tensor<B, 4>>,
        temb: &Tensor<B, 2>,
        context: &Tensor<B, 3>,
        size: Option<[usize; 2]>,
        runner: &mut R,
    ) -> Tensor<B, 4> {
        assert_eq!(
            skips.len(),
            self.resnets.len(),
            "one skip per residual block"
        );
        for (i, resnet) in self.resnets.iter().enumerate() {
            let skip = skips.pop().expect("one skip per residual block");
            x = runner.run(resnet, (x, skip, temb.clone()), |r, (x, skip, temb)| {
                r.forward(Tensor::cat(vec![x, skip], 1), temb)
            });
            if let Some(attention) = self.attentions.get(i) {
                x = attention.forward_with(x, context, runner);
            }
        }
        for upsampler in &self.upsamplers {
            let [_, _, h, w] = x.dims();
            let size = size.unwrap_or([2 * h, 2 * w]);
            x = runner.run(upsampler, x, move |u, x| u.forward(x, size));
        }
        x
    }
}

/// `shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))) + time_emb_proj(silu(temb)))))`, the
/// shortcut a 1×1 convolution when the width changes.
#[derive(Module, Debug)]
pub struct ResnetBlock2D<B: Backend> {
    /// First norm.
    pub norm1: GroupNorm<B>,
    /// First 3×3 convolution.
    pub conv1: LoraConv2d<B>,
    /// Projection of the timestep embedding, added per channel.
    pub time_emb_proj: LoraLinear<B>,
    /// Second norm.
    pub norm2: GroupNorm<B>,
    /// Second 3×3 convolution.
    pub conv2: LoraConv2d<B>,
    /// 1×1 projection of the input when the width changes.
    pub conv_shortcut: Option<LoraConv2d<B>>,
}

impl<B: Kernels> ResnetBlock2D<B> {
    fn new(
        input: usize,
        output: usize,
        temb: usize,
        config: &UNetConfig,
        device: &B::Device,
    ) -> Self {
        let (groups, eps) = (config.norm_num_groups, config.norm_eps);
        Self {
            norm1: group_norm(input, groups, eps, device),
            conv1: conv(input, output, 3, device).into(),
            time_emb_proj: linear(temb, output, true, device),
            norm2: group_norm(output, groups, eps, device),
            conv2: conv(output, output, 3, device).into(),
            conv_shortcut: (input != output).then(|| conv(input, output, 1, device).into()),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c_in, h, w]`, `temb`: `[batch, time_embed_dim]`; output:
    ///   `[batch, c_out, h, w]`
    pub fn forward(&self, x: Tensor<B, 4>, temb: Tensor<B, 2>) -> Tensor<B, 4> {
        let h = self
            .conv1
            .forward(silu(norm_in_f32(&self.norm1, x.clone())));
        let [batch, channels] = [h.dims()[0], h.dims()[1]];
        let t = self
            .time_emb_proj
            .forward(silu(temb))
            .reshape([batch, channels, 1, 1]);
        let h = self.conv2.forward(silu(norm_in_f32(&self.norm2, h + t)));
        let shortcut = match &self.conv_shortcut {
            Some(conv) => conv.forward(x),
            None => x,
        };
        shortcut + h
    }

    /// [`ResnetBlock2D::forward`] run by `runner` as one unit.
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        x: Tensor<B, 4>,
        temb: &Tensor<B, 2>,
        runner: &mut R,
    ) -> Tensor<B, 4> {
        runner.run(self, (x, temb.clone()), |r, (x, temb)| r.forward(x, temb))
    }
}

/// A stride-2 3×3 convolution with one pixel of zero padding on every side.
#[derive(Module, Debug)]
pub struct Downsample2D<B: Backend> {
    /// The convolution.
    pub conv: LoraConv2d<B>,
}

impl<B: Kernels> Downsample2D<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        Self {
            conv: Conv2dConfig::new([width, width], [3, 3])
                .with_stride([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
                .into(),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c, h, w]`; output: `[batch, c, ⌈h / 2⌉, ⌈w / 2⌉]`
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.conv.forward(x)
    }
}

/// Nearest-neighbour upsampling, then a 3×3 convolution.
#[derive(Module, Debug)]
pub struct Upsample2D<B: Backend> {
    /// The convolution.
    pub conv: LoraConv2d<B>,
}

impl<B: Kernels> Upsample2D<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        Self {
            conv: conv(width, width, 3, device).into(),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, c, h, w]`; output: `[batch, c, size[0], size[1]]`
    pub fn forward(&self, x: Tensor<B, 4>, size: [usize; 2]) -> Tensor<B, 4> {
        self.conv.forward(nearest(x, size))
    }
}

/// Nearest-neighbour resizing as PyTorch's `interpolate(size=…, mode="nearest")`: output pixel
/// `i` of a side reads input pixel `⌊i · in / out⌋` (the ratio in f32).
fn nearest<B: Kernels>(x: Tensor<B, 4>, [height, width]: [usize; 2]) -> Tensor<B, 4> {
    let [_, _, h, w] = x.dims();
    if [height, width] == [2 * h, 2 * w] {
        return nearest_2x(x);
    }
    let device = x.device();
    let indices = |from: usize, to: usize| {
        let ratio = from as f32 / to as f32;
        let index: Vec<i64> = (0..to)
            .map(|i| ((i as f32 * ratio).floor() as usize).min(from - 1) as i64)
            .collect();
        Tensor::<B, 1, Int>::from_data(TensorData::new(index, [to]), &device)
    };
    x.select(2, indices(h, height)).select(3, indices(w, width))
}

/// Self- and cross-attention transformer blocks over the pixels of a feature map: group norm,
/// linear projection in, the blocks, linear projection out, plus the input.
#[derive(Module, Debug)]
pub struct Transformer2DModel<B: Backend> {
    /// Norm of the input.
    pub norm: GroupNorm<B>,
    /// Projection of the normalized pixels.
    pub proj_in: LoraLinear<B>,
    /// The blocks.
    pub transformer_blocks: Vec<BasicTransformerBlock<B>>,
    /// Projection back to the input's width.
    pub proj_out: LoraLinear<B>,
}

impl<B: Kernels> Transformer2DModel<B> {
    fn new(width: usize, level: usize, config: &UNetConfig, device: &B::Device) -> Self {
        let heads = config.attention_head_dim[level];
        Self {
            norm: group_norm(width, config.norm_num_groups, TRANSFORMER_NORM_EPS, device),
            proj_in: linear(width, width, true, device),
            transformer_blocks: (0..config.transformer_layers_per_block[level])
                .map(|_| {
                    BasicTransformerBlock::new(width, heads, config.cross_attention_dim, device)
                })
                .collect(),
            proj_out: linear(width, width, true, device),
        }
    }

    /// Runs the input projection, each block, and the output projection with the residual,
    /// each as one unit of `runner`.
    ///
    /// # Shapes
    /// - `x`: `[batch, c, h, w]`, `context`: `[batch, tokens, cross_attention_dim]`; output:
    ///   same as `x`
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        x: Tensor<B, 4>,
        context: &Tensor<B, 3>,
        runner: &mut R,
    ) -> Tensor<B, 4> {
        let mut hidden = runner.run(self, x.clone(), |t, x| t.project_in(x));
        for block in &self.transformer_blocks {
            hidden = runner.run(block, (hidden, context.clone()), |b, (h, c)| {
                b.forward(h, c)
            });
        }
        runner.run(self, (hidden, x), |t, (hidden, x)| t.project_out(hidden, x))
    }

    /// The normalized pixels as tokens, projected: `[batch, h · w, c]`.
    fn project_in(&self, x: Tensor<B, 4>) -> Tensor<B, 3> {
        let [b, c, h, w] = x.dims();
        let tokens = norm_in_f32(&self.norm, x)
            .reshape([b, c, h * w])
            .swap_dims(1, 2);
        self.proj_in.forward(tokens)
    }

    /// The tokens projected back to a feature map of `x`'s shape, plus `x`.
    fn project_out(&self, hidden: Tensor<B, 3>, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let [b, c, h, w] = x.dims();
        let out = self
            .proj_out
            .forward(hidden)
            .swap_dims(1, 2)
            .reshape([b, c, h, w]);
        out + x
    }
}

/// Self-attention, cross-attention to the text tokens, and a GEGLU feed-forward, each after a
/// layer norm and added to its input.
#[derive(Module, Debug)]
pub struct BasicTransformerBlock<B: Backend> {
    /// Norm before the self-attention.
    pub norm1: LayerNorm<B>,
    /// Self-attention.
    pub attn1: Attention<B>,
    /// Norm before the cross-attention.
    pub norm2: LayerNorm<B>,
    /// Cross-attention to the text tokens.
    pub attn2: Attention<B>,
    /// Norm before the feed-forward.
    pub norm3: LayerNorm<B>,
    /// Feed-forward.
    pub ff: FeedForward<B>,
}

impl<B: Kernels> BasicTransformerBlock<B> {
    fn new(width: usize, heads: usize, context: usize, device: &B::Device) -> Self {
        let norm = || {
            LayerNormConfig::new(width)
                .with_epsilon(LAYER_NORM_EPS)
                .init(device)
        };
        Self {
            norm1: norm(),
            attn1: Attention::new(width, width, heads, device),
            norm2: norm(),
            attn2: Attention::new(width, context, heads, device),
            norm3: norm(),
            ff: FeedForward::new(width, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, pixels, c]`, `context`: `[batch, tokens, cross_attention_dim]`; output:
    ///   same as `x`
    pub fn forward(&self, x: Tensor<B, 3>, context: Tensor<B, 3>) -> Tensor<B, 3> {
        let h = affine_layer_norm(&self.norm1, x.clone());
        let x = self.attn1.forward(h.clone(), h) + x;
        let h = affine_layer_norm(&self.norm2, x.clone());
        let x = self.attn2.forward(h, context) + x;
        let h = affine_layer_norm(&self.norm3, x.clone());
        self.ff.forward(h) + x
    }
}

/// A layer norm computed in f32 ([`layer_norm`]), then `norm`'s scale and shift.
fn affine_layer_norm<B: Kernels>(norm: &LayerNorm<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    let normalized = layer_norm(x, LAYER_NORM_EPS) * norm.gamma.val().unsqueeze();
    match &norm.beta {
        Some(beta) => normalized + beta.val().unsqueeze(),
        None => normalized,
    }
}

/// Multi-head attention of queries from `x` over keys and values from a context (`x` itself
/// for self-attention); projections in without bias, out with.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection.
    pub to_q: LoraLinear<B>,
    /// Key projection.
    pub to_k: LoraLinear<B>,
    /// Value projection.
    pub to_v: LoraLinear<B>,
    /// Output projection and diffusers' dropout (keys `to_out.0`; the dropout holds nothing).
    pub to_out: (LoraLinear<B>, Dropout),
    heads: usize,
}

impl<B: Kernels> Attention<B> {
    fn new(width: usize, context: usize, heads: usize, device: &B::Device) -> Self {
        Self {
            to_q: linear(width, width, false, device),
            to_k: linear(context, width, false, device),
            to_v: linear(context, width, false, device),
            to_out: (
                linear(width, width, true, device),
                DropoutConfig::new(0.0).init(),
            ),
            heads,
        }
    }

    /// # Shapes
    /// - `x`: `[batch, len_q, width]`, `context`: `[batch, len_k, d_context]`; output:
    ///   `[batch, len_q, width]`
    pub fn forward(&self, x: Tensor<B, 3>, context: Tensor<B, 3>) -> Tensor<B, 3> {
        let heads = |t: Tensor<B, 3>| {
            let [b, l, width] = t.dims();
            t.reshape([b, l, self.heads, width / self.heads])
                .swap_dims(1, 2)
        };
        let q = heads(self.to_q.forward(x));
        let k = heads(self.to_k.forward(context.clone()));
        let v = heads(self.to_v.forward(context));
        let out = sdpa(q, k, v);
        let [b, h, l, d] = out.dims();
        self.to_out
            .0
            .forward(out.swap_dims(1, 2).reshape([b, l, h * d]))
    }
}

/// `net.2(net.0(x))`: a GEGLU expansion to 4 × the width, then a projection back (diffusers'
/// `FeedForward` with `activation_fn="geglu"`; `net.1` is its dropout, which holds nothing).
#[derive(Module, Debug)]
pub struct FeedForward<B: Backend> {
    /// GEGLU, dropout, output projection.
    pub net: (Geglu<B>, Dropout, LoraLinear<B>),
}

impl<B: Kernels> FeedForward<B> {
    fn new(width: usize, device: &B::Device) -> Self {
        let hidden = FF_MULT * width;
        Self {
            net: (
                Geglu {
                    proj: linear(width, 2 * hidden, true, device),
                },
                DropoutConfig::new(0.0).init(),
                linear(hidden, width, true, device),
            ),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, tokens, width]`; output: same
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.net.2.forward(self.net.0.forward(x))
    }
}

/// `value · gelu(gate)` of the two halves of one projection (GELU exact, with erf).
#[derive(Module, Debug)]
pub struct Geglu<B: Backend> {
    /// Projection to twice the hidden width: values, then gates.
    pub proj: LoraLinear<B>,
}

impl<B: Kernels> Geglu<B> {
    /// # Shapes
    /// - `x`: `[batch, tokens, width]`; output: `[batch, tokens, hidden]`
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [value, gate] = self
            .proj
            .forward(x)
            .chunk(2, 2)
            .try_into()
            .expect("two halves");
        value * gelu(gate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type B = Flex;

    #[test]
    fn nearest_resizing_reads_as_pytorch_does() {
        let device = Default::default();
        let x = Tensor::<B, 1>::from_floats([0.0, 1.0, 2.0], &device).reshape([1, 1, 1, 3]);
        // interpolate(size=(1, 5)): ratio 0.6 → sources 0, 0, 1, 1, 2.
        let out = nearest(x.clone(), [1, 5])
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(out, [0.0, 0.0, 1.0, 1.0, 2.0]);
        let doubled = nearest(x, [2, 6]).into_data().to_vec::<f32>().unwrap();
        assert_eq!(
            doubled,
            [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        );
    }

    #[test]
    fn the_sdxl_preset_has_the_tensors_of_sdxl_base() {
        // diffusers' UNet2DConditionModel of SDXL base 1.0's config (built on the meta
        // device): 1680 tensors, 2 567 463 684 parameters.
        let model = UNetConfig::sdxl().init::<B>(&Default::default());
        let shapes = crate::weights::param_shapes(&model);
        assert_eq!(shapes.len(), 1680);
        let total: usize = shapes
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(total, 2_567_463_684);
        let shape = |path: &str| {
            shapes
                .iter()
                .find(|(p, _)| p == path)
                .unwrap_or_else(|| panic!("no {path}"))
                .1
                .clone()
        };
        // Burn's Linear weights are [d_input, d_output].
        let block = "up_blocks.0.attentions.2.transformer_blocks.9";
        assert_eq!(shape(&format!("{block}.attn2.to_k.weight")), [2048, 1280]);
        assert_eq!(
            shape(&format!("{block}.ff.net.0.proj.weight")),
            [1280, 10240]
        );
        assert_eq!(shape(&format!("{block}.attn1.to_out.0.bias")), [1280]);
        assert_eq!(shape("add_embedding.linear_1.weight"), [2816, 1280]);
        assert_eq!(
            shape("up_blocks.1.resnets.2.conv_shortcut.weight"),
            [640, 960, 1, 1]
        );
        assert_eq!(
            shape("down_blocks.1.downsamplers.0.conv.weight"),
            [640, 640, 3, 3]
        );
    }

    #[test]
    fn odd_latent_sides_come_back_whole() {
        let device = Default::default();
        let config = UNetConfig {
            block_out_channels: vec![16, 32],
            layers_per_block: 1,
            transformer_layers_per_block: vec![1, 1],
            attention_head_dim: vec![2, 2],
            cross_attention_dim: 8,
            addition_time_embed_dim: 4,
            projection_class_embeddings_input_dim: 6 + 2 * 4,
            norm_num_groups: 8,
            down_block_types: vec!["CrossAttnDownBlock2D".into(), "DownBlock2D".into()],
            up_block_types: vec!["UpBlock2D".into(), "CrossAttnUpBlock2D".into()],
            ..UNetConfig::sdxl()
        };
        let model = config.init::<B>(&device);
        let normal = burn::tensor::Distribution::Normal(0.0, 1.0);
        let input = UNetInput {
            sample: Tensor::random([2, 4, 5, 3], normal, &device),
            timestep: Tensor::from_floats([10.0, 900.0], &device),
            encoder_hidden_states: Tensor::random([2, 3, 8], normal, &device),
            text_embeds: Tensor::random([2, 6], normal, &device),
            time_ids: Tensor::from_floats([[64.0, 48.0], [0.0, 8.0]], &device),
        };
        assert_eq!(model.forward(input).dims(), [2, 4, 5, 3]);
    }
}
