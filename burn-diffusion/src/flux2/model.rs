//! The FLUX.2 transformer, block by block as diffusers writes it, in BFL's parameter layout.
//!
//! FLUX.2 differs from FLUX.1 in its conditioning (no pooled text vector; one modulation per
//! kind of block, computed once from the timestep and shared by every block), its MLPs
//! (SwiGLU, ratio 3), its projections (no biases) and its rotary embedding (four axes, θ 2000);
//! the blocks' computation is FLUX.1's ([`crate::flux::DoubleStreamBlock`],
//! [`crate::flux::SingleStreamBlock`]) and runs through the same functions.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/models/transformers/transformer_flux2.py

use burn::module::Module;
use burn::tensor::{Tensor, TensorData, backend::Backend};
use burn_kernels::Kernels;
use burn_lora::LoraLinear;

use super::Flux2Config;
use crate::blocks::{Modulation, Rope};
use crate::checkpointing::{BlockRunner, Direct};
use crate::flux::{
    LastLayer, Mlp, MlpActivation, MlpEmbedder, ModulationLinear, Parallel, QkNorm, SelfAttention,
    Stream, TIME_DIM, double_stream, linear, rope, time_guidance, two,
};

/// The FLUX.2 transformer (dev, klein, or any size of the same shape).
///
/// Every projection is a [`LoraLinear`] without bias; fields follow the BFL checkpoint keys
/// (see [`super::linear_keys`]).
#[derive(Module, Debug)]
pub struct Flux2<B: Backend> {
    /// Image tokens to the residual width.
    pub img_in: LoraLinear<B>,
    /// Timestep embedding.
    pub time_in: MlpEmbedder<B>,
    /// Guidance-strength embedding (FLUX.2-dev).
    pub guidance_in: Option<MlpEmbedder<B>>,
    /// Text tokens to the residual width.
    pub txt_in: LoraLinear<B>,
    /// The image stream's modulation of every double block (two sets: attention, MLP).
    pub double_stream_modulation_img: ModulationLinear<B>,
    /// The text stream's modulation of every double block.
    pub double_stream_modulation_txt: ModulationLinear<B>,
    /// The modulation of every single block (one set).
    pub single_stream_modulation: ModulationLinear<B>,
    /// Blocks with separate image and text weights.
    pub double_blocks: Vec<Flux2DoubleBlock<B>>,
    /// Blocks over the joint sequence.
    pub single_blocks: Vec<Flux2SingleBlock<B>>,
    /// Modulated projection of the image tokens to the output channels.
    pub final_layer: LastLayer<B>,
    config: Flux2Config,
}

/// One forward pass's inputs, as diffusers names them in brackets. Tensors are in the model's
/// dtype; positions stay on the host.
#[derive(Clone, Debug)]
pub struct Flux2Input<B: Backend> {
    /// Image tokens (`hidden_states`), `[batch, img_tokens, in_channels]`.
    pub img: Tensor<B, 3>,
    /// Text tokens (`encoder_hidden_states`), `[batch, txt_tokens, context_in_dim]`.
    pub txt: Tensor<B, 3>,
    /// Noise level σ in `[0, 1]` (`timestep`), `[batch]`.
    pub timesteps: Tensor<B, 1>,
    /// Guidance strength (`guidance`), `[batch]`; required when the model embeds it.
    pub guidance: Option<Tensor<B, 1>>,
    /// Positions `(t, h, w, l)` of the image tokens (`img_ids`), `[img_tokens, 4]`, on the host.
    pub img_ids: TensorData,
    /// Positions of the text tokens (`txt_ids`), `[txt_tokens, 4]`, on the host.
    pub txt_ids: TensorData,
}

impl Flux2Config {
    /// A model of this shape with Burn's default initialization (weights are created lazily,
    /// on first use, in the device's default float dtype).
    ///
    /// # Panics
    /// If the configuration is inconsistent (see [`Flux2Config::validate`]).
    pub fn init<B: Kernels>(&self, device: &B::Device) -> Flux2<B> {
        if let Err(message) = self.validate() {
            panic!("invalid FLUX.2 config: {message}");
        }
        let h = self.hidden_size;
        Flux2 {
            img_in: linear(self.in_channels, h, false, device),
            time_in: MlpEmbedder::new(TIME_DIM, h, false, device),
            guidance_in: self
                .guidance_embed
                .then(|| MlpEmbedder::new(TIME_DIM, h, false, device)),
            txt_in: linear(self.context_in_dim, h, false, device),
            double_stream_modulation_img: ModulationLinear::new(h, 2, false, device),
            double_stream_modulation_txt: ModulationLinear::new(h, 2, false, device),
            single_stream_modulation: ModulationLinear::new(h, 1, false, device),
            double_blocks: (0..self.depth)
                .map(|_| Flux2DoubleBlock::new(self, device))
                .collect(),
            single_blocks: (0..self.depth_single_blocks)
                .map(|_| Flux2SingleBlock::new(self, device))
                .collect(),
            final_layer: LastLayer::new(h, self.out_channels, false, device),
            config: self.clone(),
        }
    }
}

impl<B: Kernels> Flux2<B> {
    /// The model's configuration.
    pub fn config(&self) -> &Flux2Config {
        &self.config
    }

    /// One forward pass: the predicted velocity for every image token.
    ///
    /// # Shapes
    /// - output: `[batch, img_tokens, out_channels]`
    ///
    /// # Panics
    /// If the model embeds guidance and `input.guidance` is `None`.
    pub fn forward(&self, input: Flux2Input<B>) -> Tensor<B, 3> {
        self.forward_with(input, &mut Direct)
    }

    /// [`Flux2::forward`] with the blocks run by `runner`, e.g. a
    /// [`BlockTape`](crate::BlockTape) for training with block-level gradient checkpointing.
    /// The shared modulations enter the blocks as tensors, unsplit, so that a recomputed block
    /// reads them as it reads its other inputs.
    pub fn forward_with<R: BlockRunner<B>>(
        &self,
        input: Flux2Input<B>,
        runner: &mut R,
    ) -> Tensor<B, 3> {
        let dtype = input.img.dtype();
        let vec = time_guidance(
            &self.time_in,
            self.guidance_in.as_ref(),
            input.timesteps,
            input.guidance,
            dtype,
        );
        let modulations = (
            self.double_stream_modulation_img.project(vec.clone()),
            self.double_stream_modulation_txt.project(vec.clone()),
            self.single_stream_modulation.project(vec.clone()),
        );
        let img = self.img_in.forward(input.img);
        let txt = self.txt_in.forward(input.txt);
        let pe = rope(
            &input.txt_ids,
            &input.img_ids,
            &self.config.axes_dim,
            self.config.theta,
            &img.device(),
        );

        let (mut img, mut txt, vec, (mod_img, mod_txt, mod_single)) =
            runner.input((img, txt, vec, modulations));
        for block in &self.double_blocks {
            let pe = pe.clone();
            (img, txt) = runner.run(
                block,
                (img, txt, mod_img.clone(), mod_txt.clone()),
                move |b, (img, txt, mod_img, mod_txt)| b.forward(img, txt, mod_img, mod_txt, &pe),
            );
        }
        for block in &self.single_blocks {
            let pe = pe.clone();
            (img, txt) = runner.run(
                block,
                (img, txt, mod_single.clone()),
                move |b, (img, txt, modulation)| b.forward(img, txt, modulation, &pe),
            );
        }
        self.final_layer.forward(img, vec)
    }
}

/// A double-stream block: FLUX.1's without its own modulation.
#[derive(Module, Debug)]
pub struct Flux2DoubleBlock<B: Backend> {
    /// Image attention weights.
    pub img_attn: SelfAttention<B>,
    /// Image SwiGLU MLP.
    pub img_mlp: Mlp<B>,
    /// Text attention weights.
    pub txt_attn: SelfAttention<B>,
    /// Text SwiGLU MLP.
    pub txt_mlp: Mlp<B>,
    num_heads: usize,
}

impl<B: Kernels> Flux2DoubleBlock<B> {
    fn new(config: &Flux2Config, device: &B::Device) -> Self {
        let (h, d, mlp) = (
            config.hidden_size,
            config.head_dim(),
            config.mlp_hidden_dim(),
        );
        let mlp = || Mlp::new(h, mlp, MlpActivation::SwiGlu, false, device);
        Self {
            img_attn: SelfAttention::new(h, d, false, device),
            img_mlp: mlp(),
            txt_attn: SelfAttention::new(h, d, false, device),
            txt_mlp: mlp(),
            num_heads: config.num_heads,
        }
    }

    /// # Shapes
    /// - `img`: `[batch, img_tokens, hidden]`, `txt`: `[batch, txt_tokens, hidden]`,
    ///   `mod_img`, `mod_txt`: `[batch, 6 · hidden]` (the shared modulations, unsplit);
    ///   `pe` covers text then image tokens.
    /// - output: the updated `(img, txt)`.
    pub fn forward(
        &self,
        img: Tensor<B, 3>,
        txt: Tensor<B, 3>,
        mod_img: Tensor<B, 2>,
        mod_txt: Tensor<B, 2>,
        pe: &Rope<B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let img_stream = Stream {
            attn: &self.img_attn,
            mlp: &self.img_mlp,
            modulation: two(Modulation::split(mod_img, 2)),
        };
        let txt_stream = Stream {
            attn: &self.txt_attn,
            mlp: &self.txt_mlp,
            modulation: two(Modulation::split(mod_txt, 2)),
        };
        double_stream(img, txt, img_stream, txt_stream, self.num_heads, pe)
    }
}

/// A single-stream block: FLUX.1's with a SwiGLU MLP and without its own modulation.
#[derive(Module, Debug)]
pub struct Flux2SingleBlock<B: Backend> {
    /// Fused query, key, value and MLP expansion (gate and value).
    pub linear1: LoraLinear<B>,
    /// Fused attention output and MLP contraction.
    pub linear2: LoraLinear<B>,
    /// Query and key norms.
    pub norm: QkNorm<B>,
    num_heads: usize,
}

impl<B: Kernels> Flux2SingleBlock<B> {
    fn new(config: &Flux2Config, device: &B::Device) -> Self {
        let (h, mlp) = (config.hidden_size, config.mlp_hidden_dim());
        Self {
            linear1: linear(h, 3 * h + 2 * mlp, false, device),
            linear2: linear(h + mlp, h, false, device),
            norm: QkNorm::new(config.head_dim(), device),
            num_heads: config.num_heads,
        }
    }

    /// Runs on `[txt; img]` and returns the two parts.
    ///
    /// # Shapes
    /// - as [`Flux2DoubleBlock::forward`], with `modulation`: `[batch, 3 · hidden]`.
    pub fn forward(
        &self,
        img: Tensor<B, 3>,
        txt: Tensor<B, 3>,
        modulation: Tensor<B, 2>,
        pe: &Rope<B>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let [modulation] = Modulation::split(modulation, 1)
            .try_into()
            .expect("one modulation set");
        let parallel = Parallel {
            linear1: &self.linear1,
            linear2: &self.linear2,
            norm: &self.norm,
            activation: MlpActivation::SwiGlu,
            heads: self.num_heads,
        };
        parallel.forward(img, txt, modulation, pe)
    }
}
