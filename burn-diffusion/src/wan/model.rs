//! The Wan transformer, block by block as diffusers writes it: a patch embedding, the timestep
//! and text embeddings, blocks of self-attention with a 3-axis rotary embedding, cross-attention
//! to the text and a feed-forward, each modulated by the timestep, and the output projection
//! back to patches.
//!
//! Norms and modulations compute in f32 whatever the activations' dtype, as diffusers'
//! `FP32LayerNorm` and its `.float()` calls do; every projection is a [`LoraLinear`].

// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/transformers/transformer_wan.py (WanAttnProcessor, WanAttention, WanTimeTextImageEmbedding, WanRotaryPosEmbed, WanTransformerBlock, WanTransformer3DModel)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/embeddings.py (Timesteps, TimestepEmbedding, PixArtAlphaTextProjection)

use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig};
use burn::tensor::activation::silu;
use burn::tensor::{DType, FloatDType, Tensor, backend::Backend};
use burn_kernels::Kernels;
use burn_lora::LoraLinear;

use super::{WanCheckpoint, WanConfig};
use crate::blocks::{Rope, gelu_tanh, layer_norm, rms_norm, sdpa, timestep_embedding};
use crate::checkpointing::{BlockRunner, Direct};
use crate::error::LoadError;
use crate::flux::linear;
use crate::sdxl::TimestepEmbedding;

/// Period of the rotary embedding's slowest lane.
const ROPE_THETA: f64 = 10000.0;

/// The Wan transformer (diffusers' `WanTransformer3DModel`, text-to-video): predicts the flow
/// of a video latent at a timestep, conditioned on text states.
///
/// Fields follow diffusers' state-dict keys, so a diffusers `transformer` folder loads without
/// renaming.
#[derive(Module, Debug)]
pub struct WanTransformer3D<B: Backend> {
    /// Patches of the latent to tokens.
    pub patch_embedding: WanPatchEmbedding<B>,
    /// Timestep and text embeddings.
    pub condition_embedder: WanConditionEmbedder<B>,
    /// The blocks.
    pub blocks: Vec<WanBlock<B>>,
    /// Tokens back to patches.
    pub proj_out: LoraLinear<B>,
    /// Shift and scale of the output norm, added to the timestep embedding: `[1, 2, width]`.
    pub scale_shift_table: Param<Tensor<B, 3>>,
    config: WanConfig,
}

/// What the transformer reads, named as diffusers' `forward` arguments.
#[derive(Debug, Clone)]
pub struct WanInput<B: Backend> {
    /// The noisy latent video: `[batch, channels, frames, height, width]`.
    pub hidden_states: Tensor<B, 5>,
    /// The timestep (0–1000): `[batch]`.
    pub timestep: Tensor<B, 1>,
    /// The text encoder's states: `[batch, tokens, text_dim]`.
    pub encoder_hidden_states: Tensor<B, 3>,
}

impl WanConfig {
    /// A model of this shape with Burn's default initialization, in the device's default float
    /// dtype: the projections' weights are created lazily, on first use; the patch embedding and
    /// the modulation tables start at zero.
    pub fn init<B: Kernels>(&self, device: &B::Device) -> WanTransformer3D<B> {
        let width = self.inner_dim();
        let [pt, ph, pw] = self.patch_size;
        let table = |rows: usize| Param::from_tensor(Tensor::zeros([1, rows, width], device));
        WanTransformer3D {
            patch_embedding: WanPatchEmbedding {
                weight: Param::from_tensor(Tensor::zeros(
                    [width, self.in_channels, pt, ph, pw],
                    device,
                )),
                bias: Param::from_tensor(Tensor::zeros([width], device)),
            },
            condition_embedder: WanConditionEmbedder {
                time_embedder: TimestepEmbedding::new(self.freq_dim, width, device),
                time_proj: linear(width, 6 * width, true, device),
                text_embedder: TextProjection {
                    linear_1: linear(self.text_dim, width, true, device),
                    linear_2: linear(width, width, true, device),
                },
            },
            blocks: (0..self.num_layers)
                .map(|_| WanBlock {
                    attn1: WanAttention::new(width, self.num_attention_heads, device),
                    attn2: WanAttention::new(width, self.num_attention_heads, device),
                    norm2: self.cross_attn_norm.then(|| {
                        LayerNormConfig::new(width)
                            .with_epsilon(self.eps)
                            .init(device)
                    }),
                    ffn: WanFeedForward {
                        net: (
                            GeluProjection {
                                proj: linear(width, self.ffn_dim, true, device),
                            },
                            DropoutConfig::new(0.0).init(),
                            linear(self.ffn_dim, width, true, device),
                        ),
                    },
                    scale_shift_table: table(6),
                })
                .collect(),
            proj_out: linear(width, self.out_channels * pt * ph * pw, true, device),
            scale_shift_table: table(2),
            config: self.clone(),
        }
    }
}

impl<B: Kernels> WanTransformer3D<B> {
    /// Loads a diffusers folder or a single file ([`WanCheckpoint::open`]) with its weights in
    /// `dtype` on `device`.
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        WanCheckpoint::open(path)?.load(device, dtype)
    }

    /// The model's configuration.
    pub fn config(&self) -> &WanConfig {
        &self.config
    }

    /// The predicted flow, shaped as the input latent.
    ///
    /// # Shapes
    /// - see [`WanInput`]; output: `[batch, out_channels, frames, height, width]`
    pub fn forward(&self, input: WanInput<B>) -> Tensor<B, 5> {
        self.forward_with(input, &mut Direct)
    }

    /// [`WanTransformer3D::forward`] with each block run by `runner`, e.g. a
    /// [`BlockTape`](crate::BlockTape) for training with gradient checkpointing.
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        input: WanInput<B>,
        runner: &mut R,
    ) -> Tensor<B, 5> {
        let [batch, _, frames, height, width] = input.hidden_states.dims();
        let [pt, ph, pw] = self.config.patch_size;
        let grid = [frames / pt, height / ph, width / pw];
        let rope = self.rope(grid, &input.hidden_states.device());
        let x = self
            .patch_embedding
            .forward(input.hidden_states, self.config.patch_size);
        let (temb, timestep_proj, context) = self.condition_embedder.forward(
            input.timestep,
            input.encoder_hidden_states,
            self.config.freq_dim,
        );
        let (mut x, context, timestep_proj, temb) = runner.input((x, context, timestep_proj, temb));
        for block in &self.blocks {
            let (rope, config) = (rope.clone(), self.config.clone());
            x = runner.run(
                block,
                (x, context.clone(), timestep_proj.clone()),
                move |b, (x, context, timestep_proj)| {
                    b.forward(x, context, timestep_proj, &rope, &config)
                },
            );
        }
        let [shift, scale] = modulations(self.scale_shift_table.val(), temb.unsqueeze_dim(1));
        let x = modulate(x, shift, scale, self.config.eps);
        let patches = self.proj_out.forward(x);
        let channels = self.config.out_channels;
        let [f, h, w] = grid;
        patches
            .reshape([batch, f, h, w, pt, ph, pw, channels])
            .permute([0, 7, 1, 4, 2, 5, 3, 6])
            .reshape([batch, channels, frames, height, width])
    }

    /// The rotary tables of a `[frames, rows, columns]` grid of patches, frame-major as the
    /// tokens are.
    fn rope(&self, [f, h, w]: [usize; 3], device: &B::Device) -> Rope<B> {
        let positions: Vec<f64> = (0..f)
            .flat_map(|t| (0..h).flat_map(move |y| (0..w).flat_map(move |x| [t, y, x])))
            .map(|p| p as f64)
            .collect();
        Rope::new(&positions, &self.config.rope_axes(), ROPE_THETA, device)
    }
}

/// The patch embedding: a convolution whose kernel is its stride (`patch_embedding`, a
/// `Conv3d`), computed as one product over each patch's values.
#[derive(Module, Debug)]
pub struct WanPatchEmbedding<B: Backend> {
    /// `[width, in_channels, pt, ph, pw]`.
    pub weight: Param<Tensor<B, 5>>,
    /// `[width]`.
    pub bias: Param<Tensor<B, 1>>,
}

impl<B: Kernels> WanPatchEmbedding<B> {
    /// # Shapes
    /// - `x`: `[batch, channels, frames, height, width]`; output: `[batch, tokens, width]`
    fn forward(&self, x: Tensor<B, 5>, [pt, ph, pw]: [usize; 3]) -> Tensor<B, 3> {
        let [b, c, frames, height, width] = x.dims();
        let [f, h, w] = [frames / pt, height / ph, width / pw];
        let patch = c * pt * ph * pw;
        let tokens = x
            .reshape([b, c, f, pt, h, ph, w, pw])
            .permute([0, 2, 4, 6, 1, 3, 5, 7])
            .reshape([b, f * h * w, patch]);
        let weight = self.weight.val();
        let out = weight.dims()[0];
        tokens.matmul(weight.reshape([out, patch]).transpose().unsqueeze())
            + self.bias.val().unsqueeze::<3>()
    }
}

/// The timestep and text embeddings (diffusers' `WanTimeTextImageEmbedding` without the image).
#[derive(Module, Debug)]
pub struct WanConditionEmbedder<B: Backend> {
    /// Sinusoidal features to the timestep embedding.
    pub time_embedder: TimestepEmbedding<B>,
    /// The timestep embedding to the blocks' six modulations.
    pub time_proj: LoraLinear<B>,
    /// The text states to the model's width.
    pub text_embedder: TextProjection<B>,
}

impl<B: Kernels> WanConditionEmbedder<B> {
    /// The timestep embedding `[batch, width]`, its six modulations `[batch, 6, width]`, and the
    /// projected text `[batch, tokens, width]`.
    fn forward(
        &self,
        timestep: Tensor<B, 1>,
        text: Tensor<B, 3>,
        freq_dim: usize,
    ) -> (Tensor<B, 2>, Tensor<B, 3>, Tensor<B, 3>) {
        let dtype = text.dtype();
        let features = timestep_embedding(timestep, freq_dim, 1.0).cast(dtype);
        let temb = self.time_embedder.forward(features);
        let [batch, width] = temb.dims();
        let projected = self
            .time_proj
            .forward(silu(temb.clone()))
            .reshape([batch, 6, width]);
        (temb, projected, self.text_embedder.forward(text))
    }
}

/// `linear_2(gelu_tanh(linear_1(x)))` (diffusers' `PixArtAlphaTextProjection`).
#[derive(Module, Debug)]
pub struct TextProjection<B: Backend> {
    /// Input projection.
    pub linear_1: LoraLinear<B>,
    /// Output projection.
    pub linear_2: LoraLinear<B>,
}

impl<B: Kernels> TextProjection<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.linear_2.forward(gelu_tanh(self.linear_1.forward(x)))
    }
}

/// Self-attention with the rotary embedding, cross-attention to the text, and a feed-forward;
/// the first and last modulated by the timestep.
#[derive(Module, Debug)]
pub struct WanBlock<B: Backend> {
    /// Self-attention.
    pub attn1: WanAttention<B>,
    /// Cross-attention to the text.
    pub attn2: WanAttention<B>,
    /// Layer norm (with affine) before the cross-attention, where the model has it.
    pub norm2: Option<LayerNorm<B>>,
    /// Feed-forward.
    pub ffn: WanFeedForward<B>,
    /// The six modulations, added to the timestep's: `[1, 6, width]`.
    pub scale_shift_table: Param<Tensor<B, 3>>,
}

impl<B: Kernels> WanBlock<B> {
    /// # Shapes
    /// - `x`: `[batch, tokens, width]`, `context`: `[batch, text tokens, width]`,
    ///   `timestep_proj`: `[batch, 6, width]`; output: like `x`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        context: Tensor<B, 3>,
        timestep_proj: Tensor<B, 3>,
        rope: &Rope<B>,
        config: &WanConfig,
    ) -> Tensor<B, 3> {
        let dtype = x.dtype();
        let [shift, scale, gate, c_shift, c_scale, c_gate] =
            modulations(self.scale_shift_table.val(), timestep_proj);
        let attended = self.attn1.forward(
            modulate(x.clone(), shift, scale, config.eps),
            None,
            Some(rope),
            config,
        );
        let x = gated(x, attended, gate, dtype);
        let normed = match &self.norm2 {
            Some(norm) => affine_layer_norm(norm, x.clone(), config.eps).cast(dtype),
            None => x.clone(),
        };
        let x = self.attn2.forward(normed, Some(context), None, config) + x;
        let fed = self
            .ffn
            .forward(modulate(x.clone(), c_shift, c_scale, config.eps));
        gated(x, fed, c_gate, dtype)
    }
}

/// The rows of `table + offsets` in f32 (`table` `[1, n, width]`, `offsets` `[batch, n, width]`),
/// each `[batch, 1, width]`.
fn modulations<B: Backend, const N: usize>(
    table: Tensor<B, 3>,
    offsets: Tensor<B, 3>,
) -> [Tensor<B, 3>; N] {
    let sum = table.cast(DType::F32) + offsets.cast(DType::F32);
    let rows: Vec<Tensor<B, 3>> = sum.chunk(N, 1);
    rows.try_into().expect("one row per modulation")
}

/// `layer_norm(x) · (1 + scale) + shift` in f32, in `x`'s dtype.
fn modulate<B: Kernels>(
    x: Tensor<B, 3>,
    shift: Tensor<B, 3>,
    scale: Tensor<B, 3>,
    eps: f64,
) -> Tensor<B, 3> {
    let dtype = x.dtype();
    (layer_norm(x.cast(DType::F32), eps) * (scale + 1.0) + shift).cast(dtype)
}

/// `x + y · gate` in f32, in `dtype`.
fn gated<B: Backend>(
    x: Tensor<B, 3>,
    y: Tensor<B, 3>,
    gate: Tensor<B, 3>,
    dtype: DType,
) -> Tensor<B, 3> {
    (x.cast(DType::F32) + y.cast(DType::F32) * gate).cast(dtype)
}

/// `norm`'s layer norm with its weight and bias, all in f32 (diffusers' `FP32LayerNorm`).
fn affine_layer_norm<B: Kernels>(norm: &LayerNorm<B>, x: Tensor<B, 3>, eps: f64) -> Tensor<B, 3> {
    let normalized =
        layer_norm(x.cast(DType::F32), eps) * norm.gamma.val().cast(DType::F32).unsqueeze();
    match &norm.beta {
        Some(beta) => normalized + beta.val().cast(DType::F32).unsqueeze(),
        None => normalized,
    }
}

/// Attention with projections in and out (biases on all four) and RMS norms of the queries and
/// keys across heads.
#[derive(Module, Debug)]
pub struct WanAttention<B: Backend> {
    /// Query projection.
    pub to_q: LoraLinear<B>,
    /// Key projection.
    pub to_k: LoraLinear<B>,
    /// Value projection.
    pub to_v: LoraLinear<B>,
    /// Output projection and diffusers' dropout (keys `to_out.0`).
    pub to_out: (LoraLinear<B>, Dropout),
    /// RMS norm of the queries, across heads.
    pub norm_q: RmsScale<B>,
    /// RMS norm of the keys, across heads.
    pub norm_k: RmsScale<B>,
    heads: usize,
}

/// The learned scale of an RMS norm (`torch.nn.RMSNorm`'s `weight`).
#[derive(Module, Debug)]
pub struct RmsScale<B: Backend> {
    /// `[width]`.
    pub weight: Param<Tensor<B, 1>>,
}

impl<B: Kernels> WanAttention<B> {
    fn new(width: usize, heads: usize, device: &B::Device) -> Self {
        let scale = || RmsScale {
            weight: Param::from_tensor(Tensor::ones([width], device)),
        };
        Self {
            to_q: linear(width, width, true, device),
            to_k: linear(width, width, true, device),
            to_v: linear(width, width, true, device),
            to_out: (
                linear(width, width, true, device),
                DropoutConfig::new(0.0).init(),
            ),
            norm_q: scale(),
            norm_k: scale(),
            heads,
        }
    }

    /// Attention of `x`'s tokens over `context`'s (`x`'s own when `None`), with the rotary
    /// embedding on queries and keys where given.
    ///
    /// # Shapes
    /// - `x`: `[batch, tokens, width]`, `context`: `[batch, context tokens, width]`; output:
    ///   like `x`
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        context: Option<Tensor<B, 3>>,
        rope: Option<&Rope<B>>,
        config: &WanConfig,
    ) -> Tensor<B, 3> {
        let context = context.unwrap_or_else(|| x.clone());
        let heads = |t: Tensor<B, 3>| {
            let [b, l, width] = t.dims();
            t.reshape([b, l, self.heads, width / self.heads])
                .swap_dims(1, 2)
        };
        let (q, k) = (self.to_q.forward(x), self.to_k.forward(context.clone()));
        let (q_scale, k_scale) = (self.norm_q.weight.val(), self.norm_k.weight.val());
        let (q, k) = match rope {
            Some(rope) => (
                rope.apply_normalized_across_heads(q, q_scale, self.heads, config.eps),
                rope.apply_normalized_across_heads(k, k_scale, self.heads, config.eps),
            ),
            None => (
                heads(rms_norm(q, q_scale, config.eps)),
                heads(rms_norm(k, k_scale, config.eps)),
            ),
        };
        let out = sdpa(q, k, heads(self.to_v.forward(context)));
        let [b, h, l, d] = out.dims();
        self.to_out
            .0
            .forward(out.swap_dims(1, 2).reshape([b, l, h * d]))
    }
}

/// `net.2(gelu_tanh(net.0.proj(x)))` (diffusers' `FeedForward` with
/// `activation_fn="gelu-approximate"`; `net.1` is its dropout, which holds nothing).
#[derive(Module, Debug)]
pub struct WanFeedForward<B: Backend> {
    /// Expansion through GELU, dropout, projection back.
    pub net: (GeluProjection<B>, Dropout, LoraLinear<B>),
}

impl<B: Kernels> WanFeedForward<B> {
    /// # Shapes
    /// - `x`: `[batch, tokens, width]`; output: same
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.net.2.forward(gelu_tanh(self.net.0.proj.forward(x)))
    }
}

/// The expansion of [`WanFeedForward`] (diffusers' `GELU` module: `proj`, then the activation).
#[derive(Module, Debug)]
pub struct GeluProjection<B: Backend> {
    /// Projection to the hidden width.
    pub proj: LoraLinear<B>,
}
