//! The FLUX.1 transformer, block by block as BFL wrote it.
//!
//! Numerics follow diffusers' `FluxTransformer2DModel`, the parity target: norms and rotary
//! embedding in f32, the timestep scaled in the model's dtype before its sinusoidal embedding.

// ref: black-forest-labs/flux@802fb4713906133fcbd0d8dc5351620ca4773036 src/flux/model.py, src/flux/modules/layers.py
// ref: huggingface/diffusers@7d2e86a85a372df75ee2ccefe84e5a44cfc60429 src/diffusers/models/transformers/transformer_flux.py

use burn::module::{Module, Param};
use burn::nn::{Initializer, LinearConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Tensor, TensorData, backend::Backend};
use burn_kernels::Kernels;
use burn_lora::LoraLinear;

use super::FluxConfig;
use crate::blocks::{Modulation, Rope, gelu_tanh, layer_norm, sdpa, timestep_embedding};
use crate::checkpointing::{BlockRunner, Direct};

/// Epsilon of every layer norm and RMS norm of FLUX.
const EPS: f64 = 1e-6;
/// Width of the sinusoidal timestep and guidance embeddings.
pub(crate) const TIME_DIM: usize = 256;
/// Timesteps and guidance strengths are multiplied by this before their embedding.
const TIME_FACTOR: f64 = 1000.0;

/// The FLUX.1 transformer (dev or schnell, or any size of the same shape).
///
/// Every projection is a [`LoraLinear`] (a plain `nn::Linear` until an adapter is attached,
/// with the same parameter paths); fields follow the BFL checkpoint keys
/// (see [`super::linear_keys`] for the few that Rust cannot spell).
#[derive(Module, Debug)]
pub struct Flux<B: Backend> {
    /// Image tokens to the residual width.
    pub img_in: LoraLinear<B>,
    /// Timestep embedding.
    pub time_in: MlpEmbedder<B>,
    /// Pooled text embedding.
    pub vector_in: MlpEmbedder<B>,
    /// Guidance-strength embedding (FLUX.1-dev).
    pub guidance_in: Option<MlpEmbedder<B>>,
    /// Text tokens to the residual width.
    pub txt_in: LoraLinear<B>,
    /// Blocks with separate image and text weights.
    pub double_blocks: Vec<DoubleStreamBlock<B>>,
    /// Blocks over the joint sequence.
    pub single_blocks: Vec<SingleStreamBlock<B>>,
    /// Modulated projection of the image tokens to the output channels.
    pub final_layer: LastLayer<B>,
    config: FluxConfig,
}

/// One forward pass's inputs, as diffusers names them in brackets. Tensors are in the model's
/// dtype; positions stay on the host.
#[derive(Clone, Debug)]
pub struct FluxInput<B: Backend> {
    /// Image tokens (`hidden_states`), `[batch, img_tokens, in_channels]`.
    pub img: Tensor<B, 3>,
    /// Text tokens (`encoder_hidden_states`), `[batch, txt_tokens, context_in_dim]`.
    pub txt: Tensor<B, 3>,
    /// Pooled text vector (`pooled_projections`), `[batch, vec_in_dim]`.
    pub y: Tensor<B, 2>,
    /// Noise level σ in `[0, 1]` (`timestep`), `[batch]`.
    pub timesteps: Tensor<B, 1>,
    /// Guidance strength (`guidance`), `[batch]`; required when the model embeds it.
    pub guidance: Option<Tensor<B, 1>>,
    /// Positions of the image tokens (`img_ids`), `[img_tokens, axes]`, on the host.
    pub img_ids: TensorData,
    /// Positions of the text tokens (`txt_ids`), `[txt_tokens, axes]`, on the host.
    pub txt_ids: TensorData,
}

impl FluxConfig {
    /// A model of this shape with Burn's default initialization (weights are created lazily,
    /// on first use, in the device's default float dtype).
    ///
    /// # Panics
    /// If the configuration is inconsistent (see [`FluxConfig::validate`]).
    pub fn init<B: Kernels>(&self, device: &B::Device) -> Flux<B> {
        if let Err(message) = self.validate() {
            panic!("invalid FLUX config: {message}");
        }
        let h = self.hidden_size;
        Flux {
            img_in: linear(self.in_channels, h, true, device),
            time_in: MlpEmbedder::new(TIME_DIM, h, true, device),
            vector_in: MlpEmbedder::new(self.vec_in_dim, h, true, device),
            guidance_in: self
                .guidance_embed
                .then(|| MlpEmbedder::new(TIME_DIM, h, true, device)),
            txt_in: linear(self.context_in_dim, h, true, device),
            double_blocks: (0..self.depth)
                .map(|_| DoubleStreamBlock::new(self, device))
                .collect(),
            single_blocks: (0..self.depth_single_blocks)
                .map(|_| SingleStreamBlock::new(self, device))
                .collect(),
            final_layer: LastLayer::new(h, self.out_channels, true, device),
            config: self.clone(),
        }
    }
}

impl<B: Kernels> Flux<B> {
    /// The model's configuration.
    pub fn config(&self) -> &FluxConfig {
        &self.config
    }

    /// One forward pass: the predicted velocity for every image token.
    ///
    /// # Shapes
    /// - output: `[batch, img_tokens, out_channels]`
    ///
    /// # Panics
    /// If the model embeds guidance and `input.guidance` is `None`.
    pub fn forward(&self, input: FluxInput<B>) -> Tensor<B, 3> {
        self.forward_with(input, &mut Direct)
    }

    /// [`Flux::forward`] with the blocks run by `runner`, e.g. a
    /// [`BlockTape`](crate::BlockTape) for training with block-level gradient checkpointing.
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        input: FluxInput<B>,
        runner: &mut R,
    ) -> Tensor<B, 3> {
        let dtype = input.img.dtype();
        let img = self.img_in.forward(input.img);
        let vec = time_guidance(
            &self.time_in,
            self.guidance_in.as_ref(),
            input.timesteps,
            input.guidance,
            dtype,
        );
        let vec = vec + self.vector_in.forward(input.y);
        let txt = self.txt_in.forward(input.txt);
        let pe = rope(
            &input.txt_ids,
            &input.img_ids,
            &self.config.axes_dim,
            self.config.theta,
            &img.device(),
        );

        let (mut img, mut txt, vec) = runner.input((img, txt, vec));
        for block in &self.double_blocks {
            let pe = pe.clone();
            (img, txt) = runner.run(block, (img, txt, vec.clone()), move |b, (img, txt, vec)| {
                b.forward(img, txt, vec, &pe)
            });
        }
        for block in &self.single_blocks {
            let pe = pe.clone();
            (img, txt) = runner.run(block, (img, txt, vec.clone()), move |b, (img, txt, vec)| {
                b.forward(img, txt, vec, &pe)
            });
        }
        self.final_layer.forward(img, vec)
    }
}

/// The conditioning vector of the timesteps σ, plus that of the guidance strengths when the
/// model embeds them (`guidance_in`): each scaled by 1000 and embedded sinusoidally in `dtype`.
///
/// # Panics
/// If the model embeds guidance and `guidance` is `None`.
pub(crate) fn time_guidance<B: Kernels>(
    time_in: &MlpEmbedder<B>,
    guidance_in: Option<&MlpEmbedder<B>>,
    timesteps: Tensor<B, 1>,
    guidance: Option<Tensor<B, 1>>,
    dtype: burn::tensor::DType,
) -> Tensor<B, 2> {
    let embed = |t: Tensor<B, 1>| timestep_embedding(t, TIME_DIM, TIME_FACTOR).cast(dtype);
    let vec = time_in.forward(embed(timesteps));
    match guidance_in {
        Some(guidance_in) => {
            let guidance =
                guidance.expect("this model embeds guidance: the guidance input is required");
            vec + guidance_in.forward(embed(guidance))
        }
        None => vec,
    }
}

/// Rotary tables for the joint sequence, text tokens first, from position ids `[tokens, axes]`.
///
/// # Panics
/// If the ids do not have one column per rotary axis.
pub(crate) fn rope<B: Kernels>(
    txt_ids: &TensorData,
    img_ids: &TensorData,
    axes_dim: &[usize],
    theta: f64,
    device: &B::Device,
) -> Rope<B> {
    let axes = axes_dim.len();
    let mut positions = Vec::new();
    for ids in [txt_ids, img_ids] {
        assert!(
            ids.shape.len() == 2 && ids.shape[1] == axes,
            "position ids must be [tokens, {axes}], got {:?}",
            ids.shape
        );
        positions.extend(ids.iter::<f64>());
    }
    Rope::new(&positions, axes_dim, theta, device)
}

/// `out_layer(silu(in_layer(x)))`: the timestep, guidance and pooled-text embedders.
#[derive(Module, Debug)]
pub struct MlpEmbedder<B: Backend> {
    /// Input projection.
    pub in_layer: LoraLinear<B>,
    /// Output projection.
    pub out_layer: LoraLinear<B>,
}

impl<B: Kernels> MlpEmbedder<B> {
    pub(crate) fn new(d_input: usize, hidden: usize, bias: bool, device: &B::Device) -> Self {
        Self {
            in_layer: linear(d_input, hidden, bias, device),
            out_layer: linear(hidden, hidden, bias, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, d_input]`; output: `[batch, hidden]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out_layer.forward(silu(self.in_layer.forward(x)))
    }
}

/// `lin(silu(vec))`, split into one or two [`Modulation`] sets.
#[derive(Module, Debug)]
pub struct ModulationLinear<B: Backend> {
    /// The projection (`3 · sets · hidden` outputs).
    pub lin: LoraLinear<B>,
    sets: usize,
}

impl<B: Kernels> ModulationLinear<B> {
    pub(crate) fn new(hidden: usize, sets: usize, bias: bool, device: &B::Device) -> Self {
        Self {
            lin: linear(hidden, 3 * sets * hidden, bias, device),
            sets,
        }
    }

    /// `lin(silu(vec))`, `[batch, 3 · sets · hidden]`, before it is split into sets.
    pub(crate) fn project(&self, vec: Tensor<B, 2>) -> Tensor<B, 2> {
        self.lin.forward(silu(vec))
    }

    fn forward(&self, vec: Tensor<B, 2>) -> Vec<Modulation<B>> {
        Modulation::split(self.project(vec), self.sets)
    }
}

/// A learned RMS-norm scale.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Multiplies the normalized values.
    pub scale: Param<Tensor<B, 1>>,
}

impl<B: Kernels> RmsNorm<B> {
    fn new(dim: usize, device: &B::Device) -> Self {
        Self {
            scale: Initializer::Ones.init([dim], device),
        }
    }
}

/// RMS norms of the queries and keys, per head.
#[derive(Module, Debug)]
pub struct QkNorm<B: Backend> {
    /// Norm of the queries.
    pub query_norm: RmsNorm<B>,
    /// Norm of the keys.
    pub key_norm: RmsNorm<B>,
}

impl<B: Kernels> QkNorm<B> {
    pub(crate) fn new(head_dim: usize, device: &B::Device) -> Self {
        Self {
            query_norm: RmsNorm::new(head_dim, device),
            key_norm: RmsNorm::new(head_dim, device),
        }
    }

    /// `[batch, tokens, 3 · heads · head_dim]` → q, k, v as `[batch, heads, tokens, head_dim]`,
    /// q and k normalized and turned by the rotary embedding `pe` of these tokens.
    pub(crate) fn heads(&self, qkv: Tensor<B, 3>, heads: usize, pe: &Rope<B>) -> [Tensor<B, 4>; 3] {
        let [b, l, width] = qkv.dims();
        let head_dim = width / 3 / heads;
        let qkv = qkv.reshape([b, l, 3, heads, head_dim]);
        let [q, k, v] = [0, 1, 2].map(|i| {
            qkv.clone()
                .narrow(2, i, 1)
                .reshape([b, l, heads, head_dim])
                .swap_dims(1, 2)
        });
        [
            pe.apply_normalized(q, self.query_norm.scale.val(), EPS),
            pe.apply_normalized(k, self.key_norm.scale.val(), EPS),
            v,
        ]
    }
}

/// The attention weights of one stream of a double block.
#[derive(Module, Debug)]
pub struct SelfAttention<B: Backend> {
    /// Fused query, key, value projection.
    pub qkv: LoraLinear<B>,
    /// Query and key norms.
    pub norm: QkNorm<B>,
    /// Output projection.
    pub proj: LoraLinear<B>,
}

impl<B: Kernels> SelfAttention<B> {
    pub(crate) fn new(hidden: usize, head_dim: usize, bias: bool, device: &B::Device) -> Self {
        Self {
            qkv: linear(hidden, 3 * hidden, bias, device),
            norm: QkNorm::new(head_dim, device),
            proj: linear(hidden, hidden, bias, device),
        }
    }
}

/// The activation between the two projections of an MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpActivation {
    /// GELU with the tanh approximation (FLUX.1).
    GeluTanh,
    /// SwiGLU: the expansion is twice as wide, `silu(first half) · second half` (FLUX.2).
    SwiGlu,
}

impl MlpActivation {
    /// How many times wider the expansion's output is than the contraction's input.
    pub fn expansion(self) -> usize {
        match self {
            MlpActivation::GeluTanh => 1,
            MlpActivation::SwiGlu => 2,
        }
    }

    /// Applies the activation to an expansion's output.
    pub fn apply<B: Kernels>(self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            MlpActivation::GeluTanh => gelu_tanh(x),
            MlpActivation::SwiGlu => {
                let [gate, value] = x.chunk(2, 2).try_into().expect("two halves");
                silu(gate) * value
            }
        }
    }
}

/// `lin2(activation(lin1(x)))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Expansion (BFL key `0`).
    pub lin1: LoraLinear<B>,
    /// Contraction (BFL key `2`).
    pub lin2: LoraLinear<B>,
    activation: MlpActivation,
}

impl<B: Kernels> Mlp<B> {
    pub(crate) fn new(
        hidden: usize,
        mlp_hidden: usize,
        activation: MlpActivation,
        bias: bool,
        device: &B::Device,
    ) -> Self {
        Self {
            lin1: linear(hidden, activation.expansion() * mlp_hidden, bias, device),
            lin2: linear(mlp_hidden, hidden, bias, device),
            activation,
        }
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.lin2
            .forward(self.activation.apply(self.lin1.forward(x)))
    }
}

/// A block with separate weights for the image and text streams and joint attention.
#[derive(Module, Debug)]
pub struct DoubleStreamBlock<B: Backend> {
    /// Image modulation (two sets: attention, MLP).
    pub img_mod: ModulationLinear<B>,
    /// Image attention weights.
    pub img_attn: SelfAttention<B>,
    /// Image MLP.
    pub img_mlp: Mlp<B>,
    /// Text modulation.
    pub txt_mod: ModulationLinear<B>,
    /// Text attention weights.
    pub txt_attn: SelfAttention<B>,
    /// Text MLP.
    pub txt_mlp: Mlp<B>,
    num_heads: usize,
}

impl<B: Kernels> DoubleStreamBlock<B> {
    fn new(config: &FluxConfig, device: &B::Device) -> Self {
        let (h, d, mlp) = (
            config.hidden_size,
            config.head_dim(),
            config.mlp_hidden_dim(),
        );
        let mlp = || Mlp::new(h, mlp, MlpActivation::GeluTanh, true, device);
        Self {
            img_mod: ModulationLinear::new(h, 2, true, device),
            img_attn: SelfAttention::new(h, d, true, device),
            img_mlp: mlp(),
            txt_mod: ModulationLinear::new(h, 2, true, device),
            txt_attn: SelfAttention::new(h, d, true, device),
            txt_mlp: mlp(),
            num_heads: config.num_heads,
        }
    }

    /// # Shapes
    /// - `img`: `[batch, img_tokens, hidden]`, `txt`: `[batch, txt_tokens, hidden]`,
    ///   `vec`: `[batch, hidden]`; `pe` covers text then image tokens.
    /// - output: the updated `(img, txt)`.
    pub fn forward(
        &self,
        img: Tensor<B, 3>,
        txt: Tensor<B, 3>,
        vec: Tensor<B, 2>,
        pe: &Rope<B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let img_stream = Stream {
            attn: &self.img_attn,
            mlp: &self.img_mlp,
            modulation: two(self.img_mod.forward(vec.clone())),
        };
        let txt_stream = Stream {
            attn: &self.txt_attn,
            mlp: &self.txt_mlp,
            modulation: two(self.txt_mod.forward(vec)),
        };
        double_stream(img, txt, img_stream, txt_stream, self.num_heads, pe)
    }
}

/// The weights and modulation of one stream of a double-stream block.
pub(crate) struct Stream<'a, B: Backend> {
    pub attn: &'a SelfAttention<B>,
    pub mlp: &'a Mlp<B>,
    /// Attention, then MLP.
    pub modulation: [Modulation<B>; 2],
}

/// A double-stream block's computation: each stream normalized, modulated and projected to
/// q, k, v; joint attention over `[txt; img]`; then each stream's two residual updates.
pub(crate) fn double_stream<B: Kernels>(
    img: Tensor<B, 3>,
    txt: Tensor<B, 3>,
    img_stream: Stream<'_, B>,
    txt_stream: Stream<'_, B>,
    heads: usize,
    pe: &Rope<B>,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let (txt_len, img_len) = (txt.dims()[1], img.dims()[1]);
    let (txt_pe, img_pe) = (pe.narrow(0, txt_len), pe.narrow(txt_len, img_len));
    let qkv = |x: &Tensor<B, 3>, stream: &Stream<'_, B>, pe: &Rope<B>| {
        let projected = stream
            .attn
            .qkv
            .forward(stream.modulation[0].scale_shift(layer_norm(x.clone(), EPS)));
        stream.attn.norm.heads(projected, heads, pe)
    };
    let [img_q, img_k, img_v] = qkv(&img, &img_stream, &img_pe);
    let [txt_q, txt_k, txt_v] = qkv(&txt, &txt_stream, &txt_pe);
    let attn = attention(
        Tensor::cat(vec![txt_q, img_q], 2),
        Tensor::cat(vec![txt_k, img_k], 2),
        Tensor::cat(vec![txt_v, img_v], 2),
    );
    let txt_attn = attn.clone().narrow(1, 0, txt_len);
    let img_attn = attn.narrow(1, txt_len, img_len);
    (
        residuals(img, img_attn, img_stream),
        residuals(txt, txt_attn, txt_stream),
    )
}

/// A block over the joint sequence, with attention and MLP in parallel.
#[derive(Module, Debug)]
pub struct SingleStreamBlock<B: Backend> {
    /// Fused query, key, value and MLP expansion.
    pub linear1: LoraLinear<B>,
    /// Fused attention output and MLP contraction.
    pub linear2: LoraLinear<B>,
    /// Query and key norms.
    pub norm: QkNorm<B>,
    /// Modulation (one set).
    pub modulation: ModulationLinear<B>,
    num_heads: usize,
}

impl<B: Kernels> SingleStreamBlock<B> {
    fn new(config: &FluxConfig, device: &B::Device) -> Self {
        let (h, mlp) = (config.hidden_size, config.mlp_hidden_dim());
        Self {
            linear1: linear(h, 3 * h + mlp, true, device),
            linear2: linear(h + mlp, h, true, device),
            norm: QkNorm::new(config.head_dim(), device),
            modulation: ModulationLinear::new(h, 1, true, device),
            num_heads: config.num_heads,
        }
    }

    /// Runs on `[txt; img]` and returns the two parts, so that every block passes the same
    /// tensors on.
    ///
    /// # Shapes
    /// - as [`DoubleStreamBlock::forward`].
    pub fn forward(
        &self,
        img: Tensor<B, 3>,
        txt: Tensor<B, 3>,
        vec: Tensor<B, 2>,
        pe: &Rope<B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let [modulation] = self
            .modulation
            .forward(vec)
            .try_into()
            .expect("one modulation set");
        let parallel = Parallel {
            linear1: &self.linear1,
            linear2: &self.linear2,
            norm: &self.norm,
            activation: MlpActivation::GeluTanh,
            heads: self.num_heads,
        };
        parallel.forward(img, txt, modulation, pe)
    }
}

/// The weights of a single-stream block: attention and MLP side by side.
pub(crate) struct Parallel<'a, B: Backend> {
    pub linear1: &'a LoraLinear<B>,
    pub linear2: &'a LoraLinear<B>,
    pub norm: &'a QkNorm<B>,
    pub activation: MlpActivation,
    pub heads: usize,
}

impl<B: Kernels> Parallel<'_, B> {
    /// On `[txt; img]`: `linear1` gives q, k, v and the MLP's expansion, `linear2` takes the
    /// attention output beside the activated expansion; one gated residual update. Returns
    /// `(img, txt)`.
    pub fn forward(
        &self,
        img: Tensor<B, 3>,
        txt: Tensor<B, 3>,
        modulation: Modulation<B>,
        pe: &Rope<B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let txt_len = txt.dims()[1];
        let img_len = img.dims()[1];
        let x = Tensor::cat(vec![txt, img], 1);
        let hidden = x.dims()[2];
        let projected = self
            .linear1
            .forward(modulation.scale_shift(layer_norm(x.clone(), EPS)));
        let mlp_width = projected.dims()[2] - 3 * hidden;
        let [qkv, mlp] = projected
            .split_with_sizes(vec![3 * hidden, mlp_width], 2)
            .try_into()
            .expect("two parts");
        let [q, k, v] = self.norm.heads(qkv, self.heads, pe);
        let attn = attention(q, k, v);
        let out = self
            .linear2
            .forward(Tensor::cat(vec![attn, self.activation.apply(mlp)], 2));
        let x = x + modulation.gate(out);
        (
            x.clone().narrow(1, txt_len, img_len),
            x.narrow(1, 0, txt_len),
        )
    }
}

/// The output layer: modulated layer norm, then projection to the output channels.
#[derive(Module, Debug)]
pub struct LastLayer<B: Backend> {
    /// Projection to the output channels.
    pub linear: LoraLinear<B>,
    /// `(shift, scale)` from the conditioning vector (BFL key `adaLN_modulation.1`).
    pub ada_ln_modulation: LoraLinear<B>,
}

impl<B: Kernels> LastLayer<B> {
    pub(crate) fn new(hidden: usize, out_channels: usize, bias: bool, device: &B::Device) -> Self {
        Self {
            linear: linear(hidden, out_channels, bias, device),
            ada_ln_modulation: linear(hidden, 2 * hidden, bias, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, tokens, hidden]`, `vec`: `[batch, hidden]`; output:
    ///   `[batch, tokens, out_channels]`
    pub fn forward(&self, x: Tensor<B, 3>, vec: Tensor<B, 2>) -> Tensor<B, 3> {
        let [shift, scale] = self
            .ada_ln_modulation
            .forward(silu(vec))
            .unsqueeze_dim::<3>(1)
            .chunk(2, 2)
            .try_into()
            .expect("two halves");
        self.linear
            .forward(layer_norm(x, EPS) * (scale + 1.0) + shift)
    }
}

/// A projection, with or without bias, as a plain layer until an adapter is attached.
pub(crate) fn linear<B: Kernels>(
    d_input: usize,
    d_output: usize,
    bias: bool,
    device: &B::Device,
) -> LoraLinear<B> {
    LinearConfig::new(d_input, d_output)
        .with_bias(bias)
        .init(device)
        .into()
}

/// The two residual updates of one stream of a double block: attention output, then MLP.
fn residuals<B: Kernels>(
    x: Tensor<B, 3>,
    attn_out: Tensor<B, 3>,
    stream: Stream<'_, B>,
) -> Tensor<B, 3> {
    let [attn_mod, mlp_mod] = stream.modulation;
    let x = x + attn_mod.gate(stream.attn.proj.forward(attn_out));
    x.clone() + mlp_mod.gate(stream.mlp.forward(mlp_mod.scale_shift(layer_norm(x, EPS))))
}

/// Attention of q and k already turned by the rotary embedding, heads merged:
/// `[batch, tokens, heads · head_dim]`.
fn attention<B: Kernels>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 3> {
    let out = sdpa(q, k, v);
    let [b, h, l, d] = out.dims();
    out.swap_dims(1, 2).reshape([b, l, h * d])
}

/// The two modulation sets of a double-stream block's stream.
pub(crate) fn two<B: Kernels>(sets: Vec<Modulation<B>>) -> [Modulation<B>; 2] {
    sets.try_into().expect("two modulation sets")
}
