//! The decoder, layer by layer as transformers writes Mistral and Qwen3: token embedding, then
//! pre-norm layers of causal grouped-query attention (rotary positions on the halves of each
//! head, Qwen3's per-head RMS norm of queries and keys before the rotation) and a SiLU-gated
//! feed-forward, RMS norms, no biases.

// ref: huggingface/transformers@v5.24.0 src/transformers/models/mistral/modeling_mistral.py
// ref: huggingface/transformers@v5.24.0 src/transformers/models/qwen3/modeling_qwen3.py
// ref: huggingface/transformers@v5.24.0 src/transformers/masking_utils.py (sdpa_mask)

use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Bool, FloatDType, Int, Tensor, backend::Backend};
use burn_kernels::Kernels;
use burn_quant::Checkpoint;

use super::TextDecoderConfig;
use crate::blocks::{Rope, ScoreBias, attention, rms_norm};
use crate::error::LoadError;
use crate::weights::{NamedTensors, PlaceWeight, component_folder};

/// A decoder-only language model without its LM head (transformers' `MistralModel`,
/// `Qwen3Model`; the language model of `Mistral3ForConditionalGeneration`), run for its hidden
/// states.
///
/// Field names are the checkpoint's keys without the model's prefix (`model.`,
/// `model.language_model.` or `language_model.model.`).
#[derive(Module, Debug)]
pub struct TextDecoder<B: Backend> {
    /// Token embedding.
    pub embed_tokens: Embedding<B>,
    /// The layers.
    pub layers: Vec<DecoderLayer<B>>,
    /// Norm of the last layer's output (absent from files cut after an inner layer).
    pub norm: Option<DecoderRmsNorm<B>>,
    config: TextDecoderConfig,
}

impl TextDecoderConfig {
    /// A model of this shape with Burn's default initialization (weights are created lazily, on
    /// first use, in the device's default float dtype).
    pub fn init<B: Kernels>(&self, device: &B::Device) -> TextDecoder<B> {
        TextDecoder {
            embed_tokens: EmbeddingConfig::new(self.vocab_size, self.hidden_size).init(device),
            layers: (0..self.num_hidden_layers)
                .map(|_| DecoderLayer::new(self, device))
                .collect(),
            norm: self
                .final_norm
                .then(|| DecoderRmsNorm::new(self.hidden_size, device)),
            config: self.clone(),
        }
    }
}

/// Key prefixes of the language model, longest first: transformers 5's
/// `Mistral3ForConditionalGeneration`, older transformers' one, and causal LMs and ComfyUI's
/// single files.
const PREFIXES: [&str; 3] = ["model.language_model.", "language_model.model.", "model."];

impl<B: Kernels> TextDecoder<B> {
    /// Loads transformers' layout: a pipeline folder with `text_encoder/`, a model folder
    /// (`config.json` and one safetensors file or a shard index), or a single `.safetensors`
    /// file (ComfyUI's FLUX.2 text encoders, bf16, f16, f32 or FP8), whose configuration is
    /// inferred ([`TextDecoderConfig::from_keys`]). The weights go to `device` in `dtype`. A
    /// vision tower, projector, LM head or embedded tokenizer in the files is ignored; every layer
    /// of the files is loaded.
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        Self::load_placed(path, device, dtype, None)
    }

    /// As [`TextDecoder::load`], but every `Linear` weight (Burn's layout, in `dtype`) is handed
    /// to `place`, by parameter path, instead of being uploaded to `device` (Mistral Small's
    /// 48 GB can then stay in host memory and stream to the GPU).
    pub fn load_with(
        path: &Path,
        device: &B::Device,
        dtype: FloatDType,
        place: &mut PlaceWeight<'_, B>,
    ) -> Result<Self, LoadError> {
        Self::load_placed(path, device, dtype, Some(place))
    }

    fn load_placed(
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
            let config = TextDecoderConfig::from_json(&folder.join("config.json"))?;
            (folder, Some(config))
        } else {
            (path.to_path_buf(), None)
        };
        let files = Checkpoint::open(&source)?;
        let tensors = NamedTensors::new(files, &source, canonical)?;
        let config = match config {
            Some(config) => config,
            None => {
                let names: Vec<&str> = tensors.names().collect();
                TextDecoderConfig::from_keys(&source, names.iter().copied(), |name| {
                    tensors.shape(name)
                })?
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

    /// The model's configuration.
    pub fn config(&self) -> &TextDecoderConfig {
        &self.config
    }

    /// The hidden states `layers` of rows of token ids, concatenated per token in the order
    /// given: FLUX.2's `prompt_embeds`. Index `i` is transformers' `hidden_states[i]`: 0 is the
    /// embedding, `i` the output of layer `i - 1`, and the number of layers the normed output of
    /// the last (not normed in a file cut without the final norm, whose last layer is an inner
    /// one of the full model). Only the layers up to the deepest index run. Each query sees the keys at and
    /// before it whose mask is 1; a query that sees none (left padding) gets no attention output,
    /// as PyTorch's fused attention gives it.
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask` (1 for a token, 0 for padding): `[batch, tokens]`
    /// - output: `[batch, tokens, layers.len() * hidden_size]`
    ///
    /// # Panics
    /// If `layers` is empty or an index exceeds the number of layers.
    pub fn hidden_states(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2, Int>,
        layers: &[usize],
    ) -> Tensor<B, 3> {
        let depth = *layers.iter().max().expect("at least one hidden state");
        let count = self.layers.len();
        assert!(
            depth <= count,
            "hidden state {depth} of a {count}-layer decoder"
        );
        let [_, tokens] = input_ids.dims();
        let device = input_ids.device();
        let mask = CausalMask::new(attention_mask, self.config.num_attention_heads);
        let rope = Rope::halves(
            tokens,
            self.config.head_dim,
            self.config.rope_theta,
            &device,
        );
        let mut x = self.embed_tokens.forward(input_ids);
        let mut states = vec![None; depth + 1];
        states[0] = Some(x.clone());
        for (i, layer) in self.layers[..depth].iter().enumerate() {
            x = layer.forward(x, &mask, &rope, &self.config);
            states[i + 1] = Some(x.clone());
        }
        if depth == count
            && let Some(norm) = &self.norm
        {
            states[depth] = Some(norm.forward(x, self.config.rms_norm_eps));
        }
        let picked = layers
            .iter()
            .map(|&i| {
                states[i]
                    .clone()
                    .expect("every index up to the deepest ran")
            })
            .collect();
        Tensor::cat(picked, 2)
    }
}

/// The canonical name of a key (without the language model's prefix), or `None` for what the
/// decoder does not use (vision tower, projector, LM head, ComfyUI's `tekken_model`).
fn canonical(key: &str) -> Option<String> {
    let rest = PREFIXES
        .iter()
        .find_map(|prefix| key.strip_prefix(prefix))?;
    ["embed_tokens.", "layers.", "norm."]
        .iter()
        .any(|part| rest.starts_with(part))
        .then(|| rest.to_string())
}

/// The additive attention bias of causal attention over padded rows, and the queries that see no
/// key at all.
struct CausalMask<B: Backend> {
    /// `[batch, heads, tokens, tokens]`: 0 where a query sees a key, -∞ elsewhere (0 on rows
    /// that see nothing, so that their softmax stays finite).
    bias: Tensor<B, 4>,
    /// `[batch, 1, tokens, 1]`: 1 for a query that sees some key, else 0.
    seen: Tensor<B, 4>,
}

impl<B: Backend> CausalMask<B> {
    fn new(attention_mask: Tensor<B, 2, Int>, heads: usize) -> Self {
        let [batch, tokens] = attention_mask.dims();
        let device = attention_mask.device();
        let padding = attention_mask
            .equal_elem(0)
            .reshape([batch, 1, 1, tokens])
            .expand([batch, 1, tokens, tokens]);
        let future = Tensor::<B, 2, Bool>::tril_mask([tokens, tokens], 0, &device)
            .unsqueeze::<4>()
            .expand([batch, 1, tokens, tokens]);
        let hidden = padding.bool_or(future);
        let blind = hidden.clone().all_dim(3);
        let hidden = hidden.bool_and(blind.clone().bool_not().expand([batch, 1, tokens, tokens]));
        let bias = Tensor::<B, 4>::zeros([batch, 1, tokens, tokens], &device)
            .mask_fill(hidden, f32::NEG_INFINITY)
            .expand([batch, heads, tokens, tokens]);
        Self {
            bias,
            seen: blind.bool_not().float(),
        }
    }
}

/// Attention, then feed-forward, each pre-normed and residual.
#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    /// Norm before the attention.
    pub input_layernorm: DecoderRmsNorm<B>,
    /// Causal grouped-query self-attention.
    pub self_attn: DecoderAttention<B>,
    /// Norm before the feed-forward.
    pub post_attention_layernorm: DecoderRmsNorm<B>,
    /// SiLU-gated feed-forward.
    pub mlp: DecoderMlp<B>,
}

impl<B: Kernels> DecoderLayer<B> {
    fn new(config: &TextDecoderConfig, device: &B::Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        let (hidden, head) = (config.hidden_size, config.head_dim);
        let head_norm = || {
            config
                .qk_norm
                .then(|| DecoderRmsNorm::new(config.head_dim, device))
        };
        Self {
            input_layernorm: DecoderRmsNorm::new(hidden, device),
            self_attn: DecoderAttention {
                q_proj: linear(hidden, config.num_attention_heads * head),
                k_proj: linear(hidden, config.num_key_value_heads * head),
                v_proj: linear(hidden, config.num_key_value_heads * head),
                o_proj: linear(config.num_attention_heads * head, hidden),
                q_norm: head_norm(),
                k_norm: head_norm(),
            },
            post_attention_layernorm: DecoderRmsNorm::new(hidden, device),
            mlp: DecoderMlp {
                gate_proj: linear(hidden, config.intermediate_size),
                up_proj: linear(hidden, config.intermediate_size),
                down_proj: linear(config.intermediate_size, hidden),
            },
        }
    }

    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask: &CausalMask<B>,
        rope: &Rope<B>,
        config: &TextDecoderConfig,
    ) -> Tensor<B, 3> {
        let eps = config.rms_norm_eps;
        let attended = self.self_attn.forward(
            self.input_layernorm.forward(x.clone(), eps),
            mask,
            rope,
            config,
        );
        let x = x + attended;
        let fed = self
            .mlp
            .forward(self.post_attention_layernorm.forward(x.clone(), eps));
        x + fed
    }
}

/// `o_proj(attention(rope(q), rope(k), v))`, each key-value head shared by a group of query
/// heads, queries scaled by `1/√head_dim`.
#[derive(Module, Debug)]
pub struct DecoderAttention<B: Backend> {
    /// Query projection.
    pub q_proj: Linear<B>,
    /// Key projection.
    pub k_proj: Linear<B>,
    /// Value projection.
    pub v_proj: Linear<B>,
    /// Output projection.
    pub o_proj: Linear<B>,
    /// RMS norm of each query head (Qwen3).
    pub q_norm: Option<DecoderRmsNorm<B>>,
    /// RMS norm of each key head (Qwen3).
    pub k_norm: Option<DecoderRmsNorm<B>>,
}

impl<B: Kernels> DecoderAttention<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        mask: &CausalMask<B>,
        rope: &Rope<B>,
        config: &TextDecoderConfig,
    ) -> Tensor<B, 3> {
        let [b, l, _] = x.dims();
        let (heads, kv_heads, d) = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        );
        let split = |linear: &Linear<B>, n: usize| {
            linear
                .forward(x.clone())
                .reshape([b, l, n, d])
                .swap_dims(1, 2)
        };
        let turn = |t: Tensor<B, 4>, norm: &Option<DecoderRmsNorm<B>>| match norm {
            Some(norm) => rope.apply_normalized(t, norm.weight.val(), config.rms_norm_eps),
            None => rope.apply(t),
        };
        let q = turn(split(&self.q_proj, heads), &self.q_norm);
        let k = turn(split(&self.k_proj, kv_heads), &self.k_norm);
        let v = split(&self.v_proj, kv_heads);
        let shared = |t: Tensor<B, 4>| {
            t.unsqueeze_dim::<5>(2)
                .expand([b, kv_heads, heads / kv_heads, l, d])
                .reshape([b, heads, l, d])
        };
        let scale = (d as f64).sqrt().recip();
        let out = attention(
            q,
            shared(k),
            shared(v),
            scale,
            ScoreBias::Add(mask.bias.clone()),
        );
        let dtype = out.dtype();
        let out = out * mask.seen.clone().cast(dtype);
        let out = out.swap_dims(1, 2).reshape([b, l, heads * d]);
        self.o_proj.forward(out)
    }
}

/// `down_proj(silu(gate_proj(x)) · up_proj(x))`.
#[derive(Module, Debug)]
pub struct DecoderMlp<B: Backend> {
    /// Gate projection (through SiLU).
    pub gate_proj: Linear<B>,
    /// Linear projection.
    pub up_proj: Linear<B>,
    /// Down projection.
    pub down_proj: Linear<B>,
}

impl<B: Kernels> DecoderMlp<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gated = silu(self.gate_proj.forward(x.clone())) * self.up_proj.forward(x);
        self.down_proj.forward(gated)
    }
}

/// An RMS norm with a learned scale and no bias (transformers' `MistralRMSNorm`).
#[derive(Module, Debug)]
pub struct DecoderRmsNorm<B: Backend> {
    /// Multiplies the normalized values.
    pub weight: Param<Tensor<B, 1>>,
}

impl<B: Kernels> DecoderRmsNorm<B> {
    fn new(dim: usize, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Ones.init([dim], device),
        }
    }

    fn forward(&self, x: Tensor<B, 3>, eps: f64) -> Tensor<B, 3> {
        rms_norm(x, self.weight.val(), eps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    #[test]
    fn every_language_model_prefix_is_stripped_and_the_rest_ignored() {
        let key = "layers.3.self_attn.q_proj.weight";
        for prefix in PREFIXES {
            assert_eq!(canonical(&format!("{prefix}{key}")).as_deref(), Some(key));
        }
        assert_eq!(
            canonical("model.norm.weight").as_deref(),
            Some("norm.weight")
        );
        for ignored in [
            "lm_head.weight",
            "language_model.lm_head.weight",
            "model.vision_tower.ln_pre.weight",
            "vision_tower.ln_pre.weight",
            "model.multi_modal_projector.linear_1.weight",
            "tekken_model",
        ] {
            assert_eq!(canonical(ignored), None, "{ignored}");
        }
    }

    #[test]
    fn left_padded_queries_see_nothing_and_others_see_their_past() {
        let device = Default::default();
        let ids = TensorData::new(vec![0i64, 0, 1, 1], [1, 4]);
        let mask = CausalMask::<Flex>::new(Tensor::from_data(ids, &device), 1);
        let seen = mask.seen.into_data().to_vec::<f32>().unwrap();
        assert_eq!(seen, [0.0, 0.0, 1.0, 1.0]);
        let bias = mask.bias.into_data().to_vec::<f32>().unwrap();
        let ninf = f32::NEG_INFINITY;
        #[rustfmt::skip]
        let expected = [
            0.0, 0.0, 0.0, 0.0,
            0.0, 0.0, 0.0, 0.0,
            ninf, ninf, 0.0, ninf,
            ninf, ninf, 0.0, 0.0,
        ];
        assert_eq!(bias, expected);
    }
}
