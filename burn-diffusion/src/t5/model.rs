//! The T5 v1.1 encoder, layer by layer as transformers writes it: token embedding, pre-norm
//! self-attention without score scaling, biased by learned relative-position buckets (computed
//! in the first layer and shared by all), gated-GELU feed-forward, RMS norms.

// ref: huggingface/transformers@v5.24.0 src/transformers/models/t5/modeling_t5.py

use burn_kernels::Kernels;
use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{FloatDType, Int, Tensor, TensorData, backend::Backend};
use burn_quant::Checkpoint;

use super::T5Config;
use crate::blocks::{ScoreBias, attention, gelu_tanh, rms_norm};
use crate::error::LoadError;
use crate::weights::{NamedTensors, PlaceWeight, component_folder};

/// The encoder of a T5 v1.1 model (`T5EncoderModel`; FLUX.1's `text_encoder_2`) or of a umT5
/// model (`UMT5EncoderModel`; Wan's text encoder).
///
/// Field names are transformers' keys without the `encoder.` prefix, except where the
/// reference nests layers in a list (`layer.0` is [`T5Block::self_attention`], `layer.1`
/// [`T5Block::feed_forward`], `DenseReluDense` is folded into the feed-forward).
#[derive(Module, Debug)]
pub struct T5Encoder<B: Backend> {
    /// Token embedding (`encoder.embed_tokens`, tied to `shared`).
    pub embed_tokens: Embedding<B>,
    /// The layers.
    pub block: Vec<T5Block<B>>,
    /// Norm of the last layer's output.
    pub final_layer_norm: T5LayerNorm<B>,
    config: T5Config,
}

impl T5Config {
    /// A model of this shape with Burn's default initialization (weights are created lazily, on
    /// first use, in the device's default float dtype).
    pub fn init<B: Kernels>(&self, device: &B::Device) -> T5Encoder<B> {
        T5Encoder {
            embed_tokens: EmbeddingConfig::new(self.vocab_size, self.d_model).init(device),
            block: (0..self.num_layers)
                .map(|i| T5Block::new(self, i == 0 || self.position_bias_per_layer, device))
                .collect(),
            final_layer_norm: T5LayerNorm::new(self.d_model, device),
            config: self.clone(),
        }
    }
}

impl<B: Kernels> T5Encoder<B> {
    /// Loads transformers' layout: a pipeline folder with `text_encoder_2/`, a model folder
    /// (`config.json` and one safetensors file or a shard index), or a single `.safetensors`
    /// file (ComfyUI's `t5xxl_*.safetensors`, bf16, f16, f32 or FP8), whose configuration is
    /// inferred ([`T5Config::from_keys`]). The weights go to `device` in `dtype`. A decoder in
    /// the files (a full T5 checkpoint) is ignored.
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        Self::load_placed(path, device, dtype, None)
    }

    /// As [`T5Encoder::load`], but every `Linear` weight (Burn's layout, in `dtype`) is handed
    /// to `place`, by parameter path, instead of being uploaded to `device` (T5-XXL's 9.5 GB
    /// can then stay in host memory and stream to a small GPU).
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
            let folder = component_folder(path, "text_encoder_2").ok_or_else(|| {
                LoadError::UnknownLayout {
                    path: path.to_path_buf(),
                }
            })?;
            let config = T5Config::from_json(&folder.join("config.json"))?;
            (folder, Some(config))
        } else {
            (path.to_path_buf(), None)
        };
        let files = Checkpoint::open(&source)?;
        let tied = files.get(EMBEDDING).is_none();
        let tensors = NamedTensors::new(files, &source, |key| canonical(key, tied))?;
        let config = match config {
            Some(config) => config,
            None => T5Config::from_keys(&source, tensors.names(), |name| tensors.shape(name))?,
        };
        tensors.load(
            config.init::<B>(device),
            parameter_name,
            device,
            dtype,
            place,
        )
    }

    /// The model's configuration.
    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// The last hidden state of rows of token ids (FLUX.1's `prompt_embeds`). Every token
    /// attends to every other, padding included, as FLUX's pipeline runs it (no mask).
    ///
    /// # Shapes
    /// - `input_ids`: `[batch, tokens]`
    /// - output: `[batch, tokens, d_model]`
    pub fn forward(&self, input_ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.encode(input_ids, None)
    }

    /// The last hidden state of rows of token ids where no token attends to the positions
    /// `attention_mask` holds 0 at (transformers' `attention_mask`, as Wan's pipeline passes
    /// it).
    ///
    /// # Shapes
    /// - `input_ids`, `attention_mask`: `[batch, tokens]`
    /// - output: `[batch, tokens, d_model]`
    pub fn forward_masked(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Tensor<B, 2, Int>,
    ) -> Tensor<B, 3> {
        self.encode(input_ids, Some(attention_mask))
    }

    fn encode(
        &self,
        input_ids: Tensor<B, 2, Int>,
        attention_mask: Option<Tensor<B, 2, Int>>,
    ) -> Tensor<B, 3> {
        let [batch, tokens] = input_ids.dims();
        let device = input_ids.device();
        let shape = [batch, self.config.num_heads, tokens, tokens];
        // transformers adds the dtype's lowest value to the scores of masked keys; setting
        // them to it gives the same weights and cannot overflow (in bf16, `0 · f32::MIN` is
        // `0 · −∞`, not a number).
        let masked = attention_mask.map(|mask| {
            mask.equal_elem(0)
                .reshape([batch, 1, 1, tokens])
                .expand(shape)
        });
        let bias_of = |attention: &T5SelfAttention<B>| {
            let bias = attention
                .position_bias(tokens, &self.config, &device)
                .expand(shape);
            match &masked {
                Some(masked) => {
                    let lowest = bias.dtype().finfo().expect("scores are floats").min;
                    bias.mask_fill(masked.clone(), lowest)
                }
                None => bias,
            }
        };
        let mut x = self.embed_tokens.forward(input_ids);
        let shared =
            (!self.config.position_bias_per_layer).then(|| bias_of(&self.block[0].self_attention));
        for block in &self.block {
            let bias = match &shared {
                Some(bias) => bias.clone(),
                None => bias_of(&block.self_attention),
            };
            x = block.forward(x, bias, &self.config);
        }
        self.final_layer_norm
            .forward(x, self.config.layer_norm_epsilon)
    }
}

/// Key of the token embedding in transformers' files.
const EMBEDDING: &str = "encoder.embed_tokens.weight";

/// The canonical name of a key, or `None` for what the encoder does not use (a decoder, an LM
/// head, and `shared.weight` when the file also holds its tied copy). `tied` says that the
/// embedding is only stored as `shared.weight`.
fn canonical(key: &str, tied: bool) -> Option<String> {
    match key {
        "shared.weight" => tied.then(|| EMBEDDING.to_string()),
        _ if key.starts_with("encoder.") => Some(key.to_string()),
        _ => None,
    }
}

/// The transformers key of a parameter from its path in the model.
fn parameter_name(path: &str) -> String {
    let parts: Vec<&str> = path.split('.').collect();
    let renamed = match parts.as_slice() {
        ["block", i, "self_attention", "layer_norm", field] => {
            format!("block.{i}.layer.0.layer_norm.{field}")
        }
        ["block", i, "self_attention", layer, field] => {
            format!("block.{i}.layer.0.SelfAttention.{layer}.{field}")
        }
        ["block", i, "feed_forward", "layer_norm", field] => {
            format!("block.{i}.layer.1.layer_norm.{field}")
        }
        ["block", i, "feed_forward", layer, field] => {
            format!("block.{i}.layer.1.DenseReluDense.{layer}.{field}")
        }
        _ => path.to_string(),
    };
    format!("encoder.{renamed}")
}

/// Self-attention, then feed-forward, each pre-normed and residual.
#[derive(Module, Debug)]
pub struct T5Block<B: Backend> {
    /// `layer.0`.
    pub self_attention: T5SelfAttention<B>,
    /// `layer.1`.
    pub feed_forward: T5FeedForward<B>,
}

impl<B: Kernels> T5Block<B> {
    fn new(config: &T5Config, position_bias: bool, device: &B::Device) -> Self {
        let inner = config.num_heads * config.d_kv;
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        Self {
            self_attention: T5SelfAttention {
                layer_norm: T5LayerNorm::new(config.d_model, device),
                q: linear(config.d_model, inner),
                k: linear(config.d_model, inner),
                v: linear(config.d_model, inner),
                o: linear(inner, config.d_model),
                relative_attention_bias: position_bias.then(|| {
                    EmbeddingConfig::new(config.relative_attention_num_buckets, config.num_heads)
                        .init(device)
                }),
            },
            feed_forward: T5FeedForward {
                layer_norm: T5LayerNorm::new(config.d_model, device),
                wi_0: linear(config.d_model, config.d_ff),
                wi_1: linear(config.d_model, config.d_ff),
                wo: linear(config.d_ff, config.d_model),
            },
        }
    }

    /// # Shapes
    /// - `x`: `[batch, tokens, d_model]`; `bias`: `[batch, heads, tokens, tokens]`; output:
    ///   like `x`
    pub fn forward(&self, x: Tensor<B, 3>, bias: Tensor<B, 4>, config: &T5Config) -> Tensor<B, 3> {
        let x = self.self_attention.forward(x, bias, config);
        self.feed_forward.forward(x, config)
    }
}

/// `x + o(attention(q, k, v) + bias)` over `layer_norm(x)`, scores not scaled.
#[derive(Module, Debug)]
pub struct T5SelfAttention<B: Backend> {
    /// Norm of the input.
    pub layer_norm: T5LayerNorm<B>,
    /// Query projection.
    pub q: Linear<B>,
    /// Key projection.
    pub k: Linear<B>,
    /// Value projection.
    pub v: Linear<B>,
    /// Output projection.
    pub o: Linear<B>,
    /// One learned bias per head and relative-position bucket (T5: the first layer only; umT5:
    /// every layer).
    pub relative_attention_bias: Option<Embedding<B>>,
}

impl<B: Kernels> T5SelfAttention<B> {
    /// # Shapes
    /// - `x`: `[batch, tokens, d_model]`; `bias`: `[batch, heads, tokens, tokens]`; output:
    ///   like `x`
    pub fn forward(&self, x: Tensor<B, 3>, bias: Tensor<B, 4>, config: &T5Config) -> Tensor<B, 3> {
        let [b, l, _] = x.dims();
        let normed = self
            .layer_norm
            .forward(x.clone(), config.layer_norm_epsilon);
        let split = |linear: &Linear<B>| {
            linear
                .forward(normed.clone())
                .reshape([b, l, config.num_heads, config.d_kv])
                .swap_dims(1, 2)
        };
        let out = attention(
            split(&self.q),
            split(&self.k),
            split(&self.v),
            1.0,
            ScoreBias::Add(bias),
        );
        let out = out
            .swap_dims(1, 2)
            .reshape([b, l, config.num_heads * config.d_kv]);
        x + self.o.forward(out)
    }

    /// The bias of every (query, key) pair from this layer's bucket embedding.
    ///
    /// # Shapes
    /// - output: `[1, heads, tokens, tokens]`
    ///
    /// # Panics
    /// If this layer has no relative position bias (in T5, only the first one has).
    pub fn position_bias(
        &self,
        tokens: usize,
        config: &T5Config,
        device: &B::Device,
    ) -> Tensor<B, 4> {
        let embedding = self
            .relative_attention_bias
            .as_ref()
            .expect("a T5 layer with a relative position bias");
        let buckets: Vec<i64> = (0..tokens as i64)
            .flat_map(|query| {
                (0..tokens as i64).map(move |key| {
                    relative_position_bucket(
                        key - query,
                        config.relative_attention_num_buckets,
                        config.relative_attention_max_distance,
                    ) as i64
                })
            })
            .collect();
        let buckets =
            Tensor::<B, 2, Int>::from_data(TensorData::new(buckets, [1, tokens * tokens]), device);
        embedding
            .forward(buckets)
            .reshape([tokens, tokens, config.num_heads])
            .permute([2, 0, 1])
            .unsqueeze::<4>()
    }
}

/// The bucket of a relative position `key - query` in a bidirectional encoder: half the buckets
/// per direction; within one, exact buckets for distances below a quarter of all buckets, then
/// logarithmically wider ones up to `max_distance`, beyond which all share the last. Computed in
/// f32 as the reference does, so that boundaries fall on the same distances.
fn relative_position_bucket(
    relative_position: i64,
    num_buckets: usize,
    max_distance: usize,
) -> usize {
    let half = num_buckets / 2;
    let direction = if relative_position > 0 { half } else { 0 };
    let distance = relative_position.unsigned_abs() as usize;
    let max_exact = half / 2;
    if distance < max_exact {
        return direction + distance;
    }
    let log_ratio = (distance as f32 / max_exact as f32).ln();
    let log_range = (max_distance as f64 / max_exact as f64).ln() as f32;
    let large = max_exact + (log_ratio / log_range * (half - max_exact) as f32) as usize;
    direction + large.min(half - 1)
}

/// `wo(gelu_tanh(wi_0(x)) · wi_1(x))` over `layer_norm(x)`, added to `x`.
#[derive(Module, Debug)]
pub struct T5FeedForward<B: Backend> {
    /// Norm of the input.
    pub layer_norm: T5LayerNorm<B>,
    /// Gate projection (through GELU).
    pub wi_0: Linear<B>,
    /// Linear projection.
    pub wi_1: Linear<B>,
    /// Down projection.
    pub wo: Linear<B>,
}

impl<B: Kernels> T5FeedForward<B> {
    /// # Shapes
    /// - `x`: `[batch, tokens, d_model]`; output: same
    pub fn forward(&self, x: Tensor<B, 3>, config: &T5Config) -> Tensor<B, 3> {
        let normed = self
            .layer_norm
            .forward(x.clone(), config.layer_norm_epsilon);
        let gated = gelu_tanh(self.wi_0.forward(normed.clone())) * self.wi_1.forward(normed);
        x + self.wo.forward(gated)
    }
}

/// T5's RMS norm with a learned scale and no bias.
#[derive(Module, Debug)]
pub struct T5LayerNorm<B: Backend> {
    /// Multiplies the normalized values.
    pub weight: Param<Tensor<B, 1>>,
}

impl<B: Kernels> T5LayerNorm<B> {
    fn new(dim: usize, device: &B::Device) -> Self {
        Self {
            weight: Initializer::Ones.init([dim], device),
        }
    }

    /// # Shapes
    /// - `x`: `[batch, tokens, d_model]`; output: same
    pub fn forward(&self, x: Tensor<B, 3>, epsilon: f64) -> Tensor<B, 3> {
        rms_norm(x, self.weight.val(), epsilon)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_match_transformers_for_every_distance() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/flux_text/expected.safetensors");
        let files = Checkpoint::open(&file).unwrap();
        let entry = files.get("t5_buckets_1000").unwrap();
        let expected: Vec<i64> = entry
            .data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(expected.len(), 2001);
        for (relative, expected) in (-1000..=1000).zip(expected) {
            let bucket = relative_position_bucket(relative, 32, 128);
            assert_eq!(bucket as i64, expected, "relative position {relative}");
        }
    }

    #[test]
    fn parameter_paths_map_to_transformers_keys() {
        let cases = [
            ("embed_tokens.weight", "encoder.embed_tokens.weight"),
            (
                "block.0.self_attention.layer_norm.weight",
                "encoder.block.0.layer.0.layer_norm.weight",
            ),
            (
                "block.0.self_attention.relative_attention_bias.weight",
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            ),
            (
                "block.3.self_attention.o.weight",
                "encoder.block.3.layer.0.SelfAttention.o.weight",
            ),
            (
                "block.3.feed_forward.layer_norm.weight",
                "encoder.block.3.layer.1.layer_norm.weight",
            ),
            (
                "block.3.feed_forward.wi_1.weight",
                "encoder.block.3.layer.1.DenseReluDense.wi_1.weight",
            ),
            ("final_layer_norm.weight", "encoder.final_layer_norm.weight"),
        ];
        for (path, key) in cases {
            assert_eq!(parameter_name(path), key);
        }
    }

    #[test]
    fn shared_embedding_is_read_only_when_untied_copy_is_absent() {
        assert_eq!(canonical("shared.weight", true).as_deref(), Some(EMBEDDING));
        assert_eq!(canonical("shared.weight", false), None);
        assert_eq!(canonical(EMBEDDING, false).as_deref(), Some(EMBEDDING));
        assert_eq!(
            canonical("decoder.block.0.layer.0.SelfAttention.q.weight", true),
            None
        );
        assert_eq!(canonical("lm_head.weight", true), None);
    }
}
