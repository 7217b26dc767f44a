//! The CLIP text encoder, layer by layer as transformers writes it: token and position
//! embeddings, pre-norm causal self-attention layers, a final layer norm, the pooled state of the
//! end-of-text token and, for `CLIPTextModelWithProjection`, its projection.

// ref: huggingface/transformers@v5.24.0 src/transformers/models/clip/modeling_clip.py

use burn_kernels::Kernels;
use std::path::Path;

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, sigmoid};
use burn::tensor::{FloatDType, Int, Tensor, TensorData, backend::Backend};
use burn_lora::LoraLinear;
use burn_quant::Checkpoint;

use super::keys::{SgmTextEncoder, canonical};
use super::{ClipActivation, ClipTextConfig};
use crate::blocks::{ScoreBias, attention};
use crate::error::LoadError;
use crate::weights::{KeyShapes, NamedTensors, PlaceWeight, component_folder};

/// The eos id of older CLIP configs, which pool at the largest id of each row instead.
const LEGACY_EOS_ID: u32 = 2;

/// A CLIP text encoder (`CLIPTextModel`, or `CLIPTextModelWithProjection` when the config has
/// a projection). Fields follow transformers' keys (the `text_model.` prefix of older files is
/// accepted).
#[derive(Module, Debug)]
pub struct ClipTextModel<B: Backend> {
    /// Token and position embeddings.
    pub embeddings: ClipTextEmbeddings<B>,
    /// The transformer layers.
    pub encoder: ClipEncoder<B>,
    /// Norm of the last layer's output.
    pub final_layer_norm: LayerNorm<B>,
    /// Projection of the pooled state (`CLIPTextModelWithProjection`).
    pub text_projection: Option<Linear<B>>,
    config: ClipTextConfig,
}

/// What the encoder gives for a batch of token rows.
#[derive(Clone, Debug)]
pub struct ClipTextOutput<B: Backend> {
    /// The final-normed states of every token, `[batch, tokens, hidden]`.
    pub last_hidden_state: Tensor<B, 3>,
    /// The final-normed state of each row's end-of-text token, `[batch, hidden]` (FLUX's
    /// pooled text vector).
    pub pooled: Tensor<B, 2>,
    /// The projected pooled state, `[batch, projection_dim]` (with a projection only).
    pub text_embeds: Option<Tensor<B, 2>>,
    /// The embeddings and the output of every layer, before the final norm (`num_hidden_layers
    /// + 1` tensors of `[batch, tokens, hidden]`; SDXL takes the next-to-last).
    pub hidden_states: Vec<Tensor<B, 3>>,
}

impl ClipTextConfig {
    /// A model of this shape with Burn's default initialization (weights are created lazily, on
    /// first use, in the device's default float dtype).
    ///
    /// # Panics
    /// If the configuration is inconsistent (see [`ClipTextConfig::validate`]).
    pub fn init<B: Kernels>(&self, device: &B::Device) -> ClipTextModel<B> {
        if let Err(message) = self.validate() {
            panic!("invalid CLIP config: {message}");
        }
        let d = self.hidden_size;
        ClipTextModel {
            embeddings: ClipTextEmbeddings {
                token_embedding: EmbeddingConfig::new(self.vocab_size, d).init(device),
                position_embedding: EmbeddingConfig::new(self.max_position_embeddings, d)
                    .init(device),
            },
            encoder: ClipEncoder {
                layers: (0..self.num_hidden_layers)
                    .map(|_| ClipEncoderLayer::new(self, device))
                    .collect(),
            },
            final_layer_norm: layer_norm(self, device),
            text_projection: self
                .projection_dim
                .map(|p| LinearConfig::new(d, p).with_bias(false).init(device)),
            config: self.clone(),
        }
    }
}

impl<B: Kernels> ClipTextModel<B> {
    /// Loads transformers' text-encoder folder (a pipeline folder with `text_encoder/`, or the
    /// folder itself: `config.json` and its safetensors), or a single `.safetensors` file
    /// (ComfyUI's `clip_l.safetensors`), whose configuration is inferred
    /// ([`ClipTextConfig::from_keys`]). The weights go to `device` in `dtype`, the weight
    /// matrices to `place` when given (host memory, for streaming). Keys may carry the
    /// `text_model.` prefix; a text projection or vision tower in the files is ignored when the
    /// config does not use it.
    pub fn load(
        path: &Path,
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<Self, LoadError> {
        let (source, config) = if path.is_dir() {
            let folder =
                component_folder(path, "text_encoder").ok_or_else(|| LoadError::UnknownLayout {
                    path: path.to_path_buf(),
                })?;
            let config = ClipTextConfig::from_json(&folder.join("config.json"))?;
            (folder, Some(config))
        } else {
            (path.to_path_buf(), None)
        };
        let files = Checkpoint::open(&source)?;
        let projection = config.as_ref().is_some_and(|c| c.projection_dim.is_some());
        let tensors = NamedTensors::new(files, &source, |key| canonical(key, projection))?;
        let config = match config {
            Some(config) => config,
            None => {
                ClipTextConfig::from_keys(&source, tensors.names(), |name| tensors.shape(name))?
            }
        };
        tensors.load(
            config.init::<B>(device),
            str::to_string,
            device,
            dtype,
            place,
        )
    }

    /// Loads one of the two text encoders of SDXL's original (SGM) single file
    /// (`sd_xl_base_1.0.safetensors`, see [`SgmTextEncoder`]), ignoring the file's other
    /// components. The configuration is inferred from the tensors
    /// ([`ClipTextConfig::from_keys`]) with the encoder's activation and, for bigG, the width of
    /// its text projection. The weights go to `device` in `dtype`, the weight matrices to
    /// `place` when given.
    pub fn load_sgm(
        path: &Path,
        encoder: SgmTextEncoder,
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<Self, LoadError> {
        let files = Checkpoint::open(path)?;
        let tensors = NamedTensors::with_parts(files, path, |key| encoder.canonical(key))?;
        let shape = |name: &str| tensors.shape(name);
        let inferred = ClipTextConfig::from_keys(path, tensors.names(), shape)?;
        let projection_dim = match encoder {
            SgmTextEncoder::ClipL => None,
            SgmTextEncoder::BigG => {
                let shapes = KeyShapes {
                    file: path,
                    model: "CLIP",
                    shape_of: shape,
                };
                let [projection_dim, _] = shapes.matrix("text_projection.weight")?;
                Some(projection_dim)
            }
        };
        let config = ClipTextConfig {
            hidden_act: encoder.activation(),
            projection_dim,
            ..inferred
        };
        tensors.load(
            config.init::<B>(device),
            str::to_string,
            device,
            dtype,
            place,
        )
    }

    /// The model's configuration.
    pub fn config(&self) -> &ClipTextConfig {
        &self.config
    }

    /// Encodes rows of token ids (each holding an end-of-text token, as the tokenizer makes
    /// them).
    ///
    /// # Shapes
    /// - `input_ids`: `[batch, tokens]`, at most `max_position_embeddings` tokens
    pub fn forward(&self, input_ids: Tensor<B, 2, Int>) -> ClipTextOutput<B> {
        let [batch, tokens] = input_ids.dims();
        let pooled_at = self.pooled_positions(&input_ids.to_data());
        let mut x = self.embeddings.forward(input_ids);
        let mut hidden_states = vec![x.clone()];
        for layer in &self.encoder.layers {
            x = layer.forward(x, &self.config);
            hidden_states.push(x.clone());
        }
        let last_hidden_state = self.final_layer_norm.forward(x);
        let d = self.config.hidden_size;
        let rows: Vec<i64> = pooled_at
            .iter()
            .enumerate()
            .map(|(b, &t)| (b * tokens + t) as i64)
            .collect();
        let device = last_hidden_state.device();
        let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [batch]), &device);
        let pooled = last_hidden_state
            .clone()
            .reshape([batch * tokens, d])
            .select(0, rows);
        let text_embeds = self
            .text_projection
            .as_ref()
            .map(|p| p.forward(pooled.clone()));
        ClipTextOutput {
            last_hidden_state,
            pooled,
            text_embeds,
            hidden_states,
        }
    }

    /// The position of each row's end-of-text token: the first occurrence of `eos_token_id`,
    /// or of the row's largest id for the legacy eos id 2.
    fn pooled_positions(&self, ids: &TensorData) -> Vec<usize> {
        let tokens = ids.shape[1];
        let ids: Vec<i64> = ids.iter::<i64>().collect();
        ids.chunks_exact(tokens)
            .map(|row| {
                let target = if self.config.eos_token_id == LEGACY_EOS_ID {
                    row.iter().copied().max().unwrap_or_default()
                } else {
                    i64::from(self.config.eos_token_id)
                };
                row.iter().position(|&id| id == target).unwrap_or(0)
            })
            .collect()
    }
}

/// Token and learned position embeddings, summed.
#[derive(Module, Debug)]
pub struct ClipTextEmbeddings<B: Backend> {
    /// Token embedding.
    pub token_embedding: Embedding<B>,
    /// Position embedding.
    pub position_embedding: Embedding<B>,
}

impl<B: Kernels> ClipTextEmbeddings<B> {
    /// # Shapes
    /// - `input_ids`: `[batch, tokens]`; output: `[batch, tokens, hidden]`
    pub fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let [_, tokens] = input_ids.dims();
        let positions =
            Tensor::<B, 1, Int>::arange(0..tokens as i64, &input_ids.device()).unsqueeze::<2>();
        self.token_embedding.forward(input_ids) + self.position_embedding.forward(positions)
    }
}

/// The transformer layers.
#[derive(Module, Debug)]
pub struct ClipEncoder<B: Backend> {
    /// One per `num_hidden_layers`.
    pub layers: Vec<ClipEncoderLayer<B>>,
}

/// `x + attn(norm1(x))`, then `x + mlp(norm2(x))`.
#[derive(Module, Debug)]
pub struct ClipEncoderLayer<B: Backend> {
    /// Causal self-attention.
    pub self_attn: ClipAttention<B>,
    /// Norm before the attention.
    pub layer_norm1: LayerNorm<B>,
    /// Feed-forward.
    pub mlp: ClipMlp<B>,
    /// Norm before the MLP.
    pub layer_norm2: LayerNorm<B>,
}

impl<B: Kernels> ClipEncoderLayer<B> {
    fn new(config: &ClipTextConfig, device: &B::Device) -> Self {
        let (d, ff) = (config.hidden_size, config.intermediate_size);
        let linear = |i, o| LinearConfig::new(i, o).init(device).into();
        Self {
            self_attn: ClipAttention {
                q_proj: linear(d, d),
                k_proj: linear(d, d),
                v_proj: linear(d, d),
                out_proj: linear(d, d),
            },
            layer_norm1: layer_norm(config, device),
            mlp: ClipMlp {
                fc1: linear(d, ff),
                fc2: linear(ff, d),
            },
            layer_norm2: layer_norm(config, device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, tokens, hidden]`; output: same
    pub fn forward(&self, x: Tensor<B, 3>, config: &ClipTextConfig) -> Tensor<B, 3> {
        let x = x.clone()
            + self
                .self_attn
                .forward(self.layer_norm1.forward(x), config.num_attention_heads);
        x.clone()
            + self
                .mlp
                .forward(self.layer_norm2.forward(x), config.hidden_act)
    }
}

/// Multi-head causal self-attention with biased projections.
#[derive(Module, Debug)]
pub struct ClipAttention<B: Backend> {
    /// Query projection.
    pub q_proj: LoraLinear<B>,
    /// Key projection.
    pub k_proj: LoraLinear<B>,
    /// Value projection.
    pub v_proj: LoraLinear<B>,
    /// Output projection.
    pub out_proj: LoraLinear<B>,
}

impl<B: Kernels> ClipAttention<B> {
    /// # Shapes
    /// - `x`: `[batch, tokens, hidden]`; output: same
    pub fn forward(&self, x: Tensor<B, 3>, heads: usize) -> Tensor<B, 3> {
        let [b, l, d] = x.dims();
        let split = |linear: &LoraLinear<B>| {
            linear
                .forward(x.clone())
                .reshape([b, l, heads, d / heads])
                .swap_dims(1, 2)
        };
        let scale = ((d / heads) as f64).sqrt().recip();
        let out = attention(
            split(&self.q_proj),
            split(&self.k_proj),
            split(&self.v_proj),
            scale,
            ScoreBias::Causal,
        );
        self.out_proj
            .forward(out.swap_dims(1, 2).reshape([b, l, d]))
    }
}

/// `fc2(act(fc1(x)))`.
#[derive(Module, Debug)]
pub struct ClipMlp<B: Backend> {
    /// Up projection.
    pub fc1: LoraLinear<B>,
    /// Down projection.
    pub fc2: LoraLinear<B>,
}

impl<B: Kernels> ClipMlp<B> {
    /// # Shapes
    /// - `x`: `[batch, tokens, hidden]`; output: same
    pub fn forward(&self, x: Tensor<B, 3>, activation: ClipActivation) -> Tensor<B, 3> {
        let h = self.fc1.forward(x);
        let h = match activation {
            ClipActivation::QuickGelu => h.clone() * sigmoid(h * 1.702),
            ClipActivation::Gelu => gelu(h),
        };
        self.fc2.forward(h)
    }
}

fn layer_norm<B: Kernels>(config: &ClipTextConfig, device: &B::Device) -> LayerNorm<B> {
    LayerNormConfig::new(config.hidden_size)
        .with_epsilon(config.layer_norm_eps)
        .init(device)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    fn tiny(eos_token_id: u32) -> ClipTextModel<Flex> {
        ClipTextConfig {
            vocab_size: 50,
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            max_position_embeddings: 6,
            hidden_act: ClipActivation::QuickGelu,
            layer_norm_eps: 1e-5,
            eos_token_id,
            projection_dim: None,
        }
        .init(&Default::default())
    }

    #[test]
    fn pooled_token_is_the_largest_id_or_the_first_eos() {
        let ids = TensorData::new(vec![0i64, 7, 49, 49, 3, 49, 0, 5, 9, 40, 9, 1], [2, 6]);
        assert_eq!(tiny(LEGACY_EOS_ID).pooled_positions(&ids), [2, 3]);
        // A row without the eos id pools its first token, as transformers' argmax of zeros.
        assert_eq!(tiny(9).pooled_positions(&ids), [0, 2]);
    }

    #[test]
    fn every_hidden_state_is_returned() {
        let model = tiny(LEGACY_EOS_ID);
        let ids = Tensor::<Flex, 2, Int>::from_data(
            TensorData::new(vec![1i64, 4, 49, 49, 49, 49], [1, 6]),
            &Default::default(),
        );
        let out = model.forward(ids);
        assert_eq!(out.hidden_states.len(), 2);
        assert_eq!(out.pooled.dims(), [1, 8]);
        assert!(out.text_embeds.is_none());
    }
}
