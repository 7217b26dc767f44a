//! Wan transformer and VAE hyperparameters: the Wan 2.1 presets and diffusers' `config.json`.

use std::path::Path;

use burn::config::Config;
use serde::Deserialize;

use crate::error::LoadError;
use crate::weights::{KeyShapes, numbered, read_json};

/// Width of a head in every Wan transformer, which a single file's shapes do not record.
const WAN_HEAD_DIM: usize = 128;

/// The shape of a Wan text-to-video transformer. Field names follow diffusers'
/// `WanTransformer3DModel`; image conditioning (`image_dim`) is not supported.
#[derive(Config, Debug, PartialEq)]
pub struct WanConfig {
    /// Patch size over (frames, height, width).
    pub patch_size: [usize; 3],
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Width of one head.
    pub attention_head_dim: usize,
    /// Latent channels in.
    pub in_channels: usize,
    /// Latent channels out.
    pub out_channels: usize,
    /// Width of the text encoder's states.
    pub text_dim: usize,
    /// Width of the sinusoidal timestep features.
    pub freq_dim: usize,
    /// Hidden width of the feed-forward layers.
    pub ffn_dim: usize,
    /// Transformer blocks.
    pub num_layers: usize,
    /// Whether the cross-attention's input is layer-normed (with a learned affine).
    pub cross_attn_norm: bool,
    /// Epsilon of the layer and RMS norms.
    pub eps: f64,
    /// Positions the rotary tables cover per axis.
    pub rope_max_seq_len: usize,
}

impl WanConfig {
    /// Wan 2.1 text-to-video 14B (also each expert of Wan 2.2 A14B).
    pub fn wan21_14b() -> Self {
        Self {
            patch_size: [1, 2, 2],
            num_attention_heads: 40,
            attention_head_dim: 128,
            in_channels: 16,
            out_channels: 16,
            text_dim: 4096,
            freq_dim: 256,
            ffn_dim: 13824,
            num_layers: 40,
            cross_attn_norm: true,
            eps: 1e-6,
            rope_max_seq_len: 1024,
        }
    }

    /// Wan 2.1 text-to-video 1.3B.
    pub fn wan21_1_3b() -> Self {
        Self {
            num_attention_heads: 12,
            ffn_dim: 8960,
            num_layers: 30,
            ..Self::wan21_14b()
        }
    }

    /// Wan 2.2 text-image-to-video 5B, on the 48 channels of Wan 2.2's VAE.
    pub fn wan22_5b() -> Self {
        Self {
            num_attention_heads: 24,
            in_channels: 48,
            out_channels: 48,
            ffn_dim: 14336,
            num_layers: 30,
            ..Self::wan21_14b()
        }
    }

    /// Width of the residual stream.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Widths of a head's rotary lanes for frames, rows and columns (44, 42, 42 for heads of
    /// 128).
    pub fn rope_axes(&self) -> [usize; 3] {
        let spatial = 2 * (self.attention_head_dim / 6);
        [self.attention_head_dim - 2 * spatial, spatial, spatial]
    }

    /// Reads diffusers' `transformer/config.json`; refuses image conditioning and the
    /// query-key norms other than `rms_norm_across_heads`.
    pub fn from_json(file: &Path) -> Result<Self, LoadError> {
        let raw: DiffusersWanConfig = read_json(file)?;
        let refuse = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        if raw.image_dim.is_some() || raw.added_kv_proj_dim.is_some() {
            return Err(refuse(
                "image conditioning (image_dim) is not supported".into(),
            ));
        }
        if raw.qk_norm.as_deref() != Some("rms_norm_across_heads") {
            return Err(refuse(format!(
                "qk_norm {:?} is not supported (rms_norm_across_heads)",
                raw.qk_norm
            )));
        }
        let patch_size = <[usize; 3]>::try_from(raw.patch_size.as_slice())
            .map_err(|_| refuse(format!("patch_size {:?} is not 3 sizes", raw.patch_size)))?;
        Ok(Self {
            patch_size,
            num_attention_heads: raw.num_attention_heads,
            attention_head_dim: raw.attention_head_dim,
            in_channels: raw.in_channels,
            out_channels: raw.out_channels.unwrap_or(raw.in_channels),
            text_dim: raw.text_dim,
            freq_dim: raw.freq_dim,
            ffn_dim: raw.ffn_dim,
            num_layers: raw.num_layers,
            cross_attn_norm: raw.cross_attn_norm,
            eps: raw.eps,
            rope_max_seq_len: raw.rope_max_seq_len,
        })
    }
}

impl WanConfig {
    /// Infers the configuration of a single file (diffusers' names, as the `keys` module gives
    /// them) from the shapes of its tensors: widths from the patch embedding, the embeddings
    /// and the first block, layers from the block indices, the cross-attention norm from its
    /// presence; heads of 128 (every Wan model's), epsilon 1e-6 and 1024 rotary positions.
    pub fn from_keys<'a>(
        file: &Path,
        names: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        let shapes = KeyShapes {
            file,
            model: "Wan",
            shape_of,
        };
        let names: Vec<&str> = names.collect();
        let patch = shapes.shape("patch_embedding.weight", 5)?;
        let (width, in_channels) = (patch[0], patch[1]);
        let patch_size = [patch[2], patch[3], patch[4]];
        if !width.is_multiple_of(WAN_HEAD_DIM) {
            return Err(shapes.error(format!(
                "width {width} is not a multiple of Wan's heads of {WAN_HEAD_DIM}"
            )));
        }
        let [_, text_dim] = shapes.matrix("condition_embedder.text_embedder.linear_1.weight")?;
        let [_, freq_dim] = shapes.matrix("condition_embedder.time_embedder.linear_1.weight")?;
        let [ffn_dim, _] = shapes.matrix("blocks.0.ffn.net.0.proj.weight")?;
        let [out, _] = shapes.matrix("proj_out.weight")?;
        Ok(Self {
            patch_size,
            num_attention_heads: width / WAN_HEAD_DIM,
            attention_head_dim: WAN_HEAD_DIM,
            in_channels,
            out_channels: out / patch_size.iter().product::<usize>(),
            text_dim,
            freq_dim,
            ffn_dim,
            num_layers: numbered(names.iter().copied(), "blocks."),
            cross_attn_norm: names.contains(&"blocks.0.norm2.weight"),
            eps: 1e-6,
            rope_max_seq_len: 1024,
        })
    }
}

/// The fields of diffusers' `WanTransformer3DModel` config the model uses.
#[derive(Deserialize)]
struct DiffusersWanConfig {
    patch_size: Vec<usize>,
    num_attention_heads: usize,
    attention_head_dim: usize,
    in_channels: usize,
    out_channels: Option<usize>,
    text_dim: usize,
    freq_dim: usize,
    ffn_dim: usize,
    num_layers: usize,
    cross_attn_norm: bool,
    qk_norm: Option<String>,
    eps: f64,
    image_dim: Option<usize>,
    added_kv_proj_dim: Option<usize>,
    #[serde(default = "rope_max_seq_len")]
    rope_max_seq_len: usize,
}

fn rope_max_seq_len() -> usize {
    1024
}

/// The shape of Wan's causal video VAE (diffusers' `AutoencoderKLWan`): Wan 2.1's, and Wan 2.2
/// TI2V-5B's with residual levels and pixels folded into channels in 2×2 patches. RGB clips go
/// to `z_dim` latent channels, [`spatial_compression`](Self::spatial_compression)× smaller in
/// space and 4× in time, with the statistics that normalize those latents. Field names follow
/// diffusers' config, `temperal_downsample` spelling included.
#[derive(Config, Debug, PartialEq)]
pub struct WanVaeConfig {
    /// Channels of the encoder's finest level (and of the decoder's without
    /// `decoder_base_dim`).
    pub base_dim: usize,
    /// Channels of the decoder's finest level, when they differ from `base_dim` (Wan 2.2).
    pub decoder_base_dim: Option<usize>,
    /// Latent channels.
    pub z_dim: usize,
    /// Each level's channels, as multiples of `base_dim`, finest first.
    pub dim_mult: Vec<usize>,
    /// Residual blocks per encoder level (the decoder has one more per level).
    pub num_res_blocks: usize,
    /// For each step down between levels, whether it halves time as well as space (the
    /// decoder doubles time where the encoder halves it).
    pub temperal_downsample: Vec<bool>,
    /// Whether each level is one residual block around its blocks and resample, with a
    /// parameter-free shortcut that averages (encoder) or duplicates (decoder) channels into
    /// the resampled shape (Wan 2.2).
    pub is_residual: bool,
    /// Side of the pixel squares folded into channels before the encoder and unfolded after
    /// the decoder (Wan 2.2's 2); none folded without it.
    pub patch_size: Option<usize>,
    /// Per-channel mean of the latents, subtracted before the transformer sees them.
    pub latents_mean: Vec<f64>,
    /// Per-channel standard deviation of the latents, divided out after the mean.
    pub latents_std: Vec<f64>,
}

impl WanVaeConfig {
    /// Wan 2.1's VAE (also Wan 2.2 A14B's).
    pub fn wan21() -> Self {
        Self {
            base_dim: 96,
            decoder_base_dim: None,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temperal_downsample: vec![false, true, true],
            is_residual: false,
            patch_size: None,
            latents_mean: vec![
                -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134,
                -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
            ],
            latents_std: vec![
                2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526,
                2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
            ],
        }
    }

    /// Wan 2.2 TI2V-5B's VAE: 48 latent channels, 16× smaller in space.
    pub fn wan22() -> Self {
        Self {
            base_dim: 160,
            decoder_base_dim: Some(256),
            z_dim: 48,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            temperal_downsample: vec![false, true, true],
            is_residual: true,
            patch_size: Some(2),
            latents_mean: vec![
                -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382,
                0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207,
                -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109,
                0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
                -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573,
                -0.0548, -0.1681, -0.0667,
            ],
            latents_std: vec![
                0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344,
                0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804,
                0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999,
                0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
            ],
        }
    }

    /// Side of the pixel squares folded into channels: `patch_size`, or 1 without it.
    pub(super) fn patch(&self) -> usize {
        self.patch_size.unwrap_or(1)
    }

    /// How many times smaller than the clip a latent frame is in height and width: the patch
    /// side times 2 per step down between levels (8 for Wan 2.1, 16 for Wan 2.2).
    pub fn spatial_compression(&self) -> usize {
        self.patch() << self.temperal_downsample.len()
    }

    /// Channels of the decoder's finest level: `decoder_base_dim`, or `base_dim` without it.
    pub(super) fn decoder_dim(&self) -> usize {
        self.decoder_base_dim.unwrap_or(self.base_dim)
    }

    /// Reads diffusers' `vae/config.json` of an `AutoencoderKLWan`, Wan 2.1's or Wan 2.2's;
    /// refuses attention between the encoder's blocks and channels other than RGB (folded
    /// into patches where `patch_size` says).
    pub fn from_json(file: &Path) -> Result<Self, LoadError> {
        let raw: DiffusersWanVaeConfig = read_json(file)?;
        let refuse = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        if !raw.attn_scales.is_empty() {
            return Err(refuse(format!(
                "attn_scales {:?} are not supported (none)",
                raw.attn_scales
            )));
        }
        if raw.patch_size == Some(0) {
            return Err(refuse("patch_size 0 is not a patch".into()));
        }
        let config = Self {
            base_dim: raw.base_dim,
            decoder_base_dim: raw.decoder_base_dim,
            z_dim: raw.z_dim,
            dim_mult: raw.dim_mult,
            num_res_blocks: raw.num_res_blocks,
            temperal_downsample: raw.temperal_downsample,
            is_residual: raw.is_residual,
            patch_size: raw.patch_size,
            latents_mean: raw.latents_mean,
            latents_std: raw.latents_std,
        };
        let rgb = 3 * config.patch() * config.patch();
        if (raw.in_channels, raw.out_channels) != (rgb, rgb) {
            return Err(refuse(format!(
                "{} channels in and {} out are not supported (RGB: {rgb} with patch_size {:?})",
                raw.in_channels, raw.out_channels, config.patch_size
            )));
        }
        if config.temperal_downsample.len() + 1 != config.dim_mult.len() {
            return Err(refuse(format!(
                "temperal_downsample {:?} needs one entry per step between the levels {:?}",
                config.temperal_downsample, config.dim_mult
            )));
        }
        if [&config.latents_mean, &config.latents_std]
            .iter()
            .any(|values| values.len() != config.z_dim)
        {
            return Err(refuse(format!(
                "latents_mean and latents_std need {} values each",
                config.z_dim
            )));
        }
        Ok(config)
    }
}

/// The fields of diffusers' `AutoencoderKLWan` config the model uses or refuses.
#[derive(Deserialize)]
struct DiffusersWanVaeConfig {
    base_dim: usize,
    decoder_base_dim: Option<usize>,
    z_dim: usize,
    dim_mult: Vec<usize>,
    num_res_blocks: usize,
    #[serde(default)]
    attn_scales: Vec<f64>,
    temperal_downsample: Vec<bool>,
    latents_mean: Vec<f64>,
    latents_std: Vec<f64>,
    #[serde(default)]
    is_residual: bool,
    #[serde(default = "rgb")]
    in_channels: usize,
    #[serde(default = "rgb")]
    out_channels: usize,
    patch_size: Option<usize>,
}

fn rgb() -> usize {
    3
}
