//! The names of the CLIP text encoder's tensors. The model's fields follow transformers' keys;
//! the `text_model.` prefix of older files and the layouts of SDXL's original single file are
//! renamed to them here, in one place.
//!
//! SDXL's original (SGM) single file (`sd_xl_base_1.0.safetensors`) holds its two encoders
//! beside the UNet and the VAE. CLIP-L is under `conditioner.embedders.0.transformer.` in
//! transformers' layout. OpenCLIP's bigG is under `conditioner.embedders.1.model.` in
//! OpenCLIP's layout: `token_embedding.weight` → `embeddings.token_embedding.weight`,
//! `positional_embedding` (a bare tensor) → `embeddings.position_embedding.weight`, `ln_final`
//! → `final_layer_norm`, `text_projection` (stored `[hidden, projection]`, applied as `x · W`)
//! → `text_projection.weight` transposed, and in `transformer.resblocks.{i}` →
//! `encoder.layers.{i}`: `ln_1` / `ln_2` → `layer_norm1` / `layer_norm2`, `mlp.c_fc` /
//! `mlp.c_proj` → `mlp.fc1` / `mlp.fc2`, `attn.out_proj` → `self_attn.out_proj`, and the fused
//! `attn.in_proj_weight` / `in_proj_bias` → `self_attn.{q,k,v}_proj`, its thirds in that order.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/loaders/single_file_utils.py (convert_ldm_clip_checkpoint, convert_open_clip_checkpoint)

use super::ClipActivation;
use crate::weights::Stored;

/// One of the two text encoders of SDXL's original (SGM) single file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SgmTextEncoder {
    /// OpenAI's CLIP ViT-L/14 (`conditioner.embedders.0.transformer.`, transformers' layout):
    /// diffusers' `text_encoder`, a `CLIPTextModel` with `quick_gelu`.
    ClipL,
    /// OpenCLIP's ViT-bigG/14 (`conditioner.embedders.1.model.`, OpenCLIP's layout):
    /// diffusers' `text_encoder_2`, a `CLIPTextModelWithProjection` with `gelu`.
    BigG,
}

impl SgmTextEncoder {
    /// The prefix of the encoder's keys.
    pub fn prefix(self) -> &'static str {
        match self {
            Self::ClipL => "conditioner.embedders.0.transformer.",
            Self::BigG => "conditioner.embedders.1.model.",
        }
    }

    /// The encoder's MLP activation.
    pub fn activation(self) -> ClipActivation {
        match self {
            Self::ClipL => ClipActivation::QuickGelu,
            Self::BigG => ClipActivation::Gelu,
        }
    }

    /// The canonical tensors a key of an SGM file holds and how: none for another component's
    /// key, for OpenCLIP's `logit_scale` and `attn_mask`, or for what [`canonical`] drops.
    pub(crate) fn canonical(self, key: &str) -> Vec<(String, Stored)> {
        let Some(key) = key.strip_prefix(self.prefix()) else {
            return Vec::new();
        };
        let whole = |name: String| vec![(name, Stored::Whole)];
        match self {
            Self::ClipL => canonical(key, false).map(whole).unwrap_or_default(),
            Self::BigG => match key {
                "logit_scale" | "attn_mask" => Vec::new(),
                "token_embedding.weight" => whole("embeddings.token_embedding.weight".into()),
                "positional_embedding" => whole("embeddings.position_embedding.weight".into()),
                "text_projection" => vec![("text_projection.weight".into(), Stored::Transposed)],
                _ => open_clip_layer(key)
                    .unwrap_or_else(|| whole(key.replacen("ln_final.", "final_layer_norm.", 1))),
            },
        }
    }
}

/// The canonical tensors of a key of one of OpenCLIP's `transformer.resblocks`, `None` for
/// another key.
fn open_clip_layer(key: &str) -> Option<Vec<(String, Stored)>> {
    let rest = key.strip_prefix("transformer.resblocks.")?;
    let (layer, rest) = rest.split_once('.')?;
    let prefix = format!("encoder.layers.{layer}");
    if let Some(param) = rest.strip_prefix("attn.in_proj_") {
        return Some(
            ["q_proj", "k_proj", "v_proj"]
                .into_iter()
                .enumerate()
                .map(|(index, projection)| {
                    (
                        format!("{prefix}.self_attn.{projection}.{param}"),
                        Stored::Rows { index, parts: 3 },
                    )
                })
                .collect(),
        );
    }
    let renamed = [
        ("ln_1.", "layer_norm1."),
        ("ln_2.", "layer_norm2."),
        ("mlp.c_fc.", "mlp.fc1."),
        ("mlp.c_proj.", "mlp.fc2."),
        ("attn.out_proj.", "self_attn.out_proj."),
    ]
    .into_iter()
    .find_map(|(from, to)| rest.strip_prefix(from).map(|param| format!("{to}{param}")))
    .unwrap_or_else(|| rest.to_string());
    Some(vec![(format!("{prefix}.{renamed}"), Stored::Whole)])
}

/// The canonical (transformers 5) name of a key of transformers' layout, or `None` for what
/// the text encoder does not use: the vision tower, `logit_scale`, the position-ids buffer,
/// and the projection of a model without one.
pub(crate) fn canonical(key: &str, projection: bool) -> Option<String> {
    let key = key.strip_prefix("text_model.").unwrap_or(key);
    let own = key.starts_with("embeddings.")
        || key.starts_with("encoder.")
        || key.starts_with("final_layer_norm.")
        || (projection && key.starts_with("text_projection."));
    (own && key != "embeddings.position_ids").then(|| key.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_other_parts_are_ignored() {
        assert_eq!(
            canonical("text_model.encoder.layers.0.mlp.fc1.weight", false).as_deref(),
            Some("encoder.layers.0.mlp.fc1.weight")
        );
        assert_eq!(canonical("text_model.embeddings.position_ids", false), None);
        assert_eq!(canonical("text_projection.weight", false), None);
        assert_eq!(
            canonical("text_projection.weight", true).as_deref(),
            Some("text_projection.weight")
        );
        assert_eq!(
            canonical("vision_model.encoder.layers.0.mlp.fc1.weight", true),
            None
        );
        assert_eq!(canonical("logit_scale", true), None);
    }

    fn whole(name: &str) -> Vec<(String, Stored)> {
        vec![(name.to_string(), Stored::Whole)]
    }

    #[test]
    fn sgm_clip_l_is_transformers_layout_under_its_prefix() {
        let clip_l = SgmTextEncoder::ClipL;
        assert_eq!(
            clip_l.canonical(
                "conditioner.embedders.0.transformer.text_model.encoder.layers.3.self_attn.q_proj.weight"
            ),
            whole("encoder.layers.3.self_attn.q_proj.weight")
        );
        for other in [
            "conditioner.embedders.0.transformer.text_model.embeddings.position_ids",
            "conditioner.embedders.1.model.ln_final.weight",
            "model.diffusion_model.input_blocks.0.0.weight",
            "first_stage_model.encoder.conv_in.weight",
        ] {
            assert_eq!(clip_l.canonical(other), [], "{other}");
        }
    }

    #[test]
    fn sgm_big_g_is_renamed_from_open_clip() {
        let big_g = SgmTextEncoder::BigG;
        let p = "conditioner.embedders.1.model.";
        let cases = [
            (
                "positional_embedding",
                "embeddings.position_embedding.weight",
            ),
            (
                "token_embedding.weight",
                "embeddings.token_embedding.weight",
            ),
            ("ln_final.bias", "final_layer_norm.bias"),
            (
                "transformer.resblocks.31.ln_1.weight",
                "encoder.layers.31.layer_norm1.weight",
            ),
            (
                "transformer.resblocks.0.ln_2.bias",
                "encoder.layers.0.layer_norm2.bias",
            ),
            (
                "transformer.resblocks.2.mlp.c_fc.weight",
                "encoder.layers.2.mlp.fc1.weight",
            ),
            (
                "transformer.resblocks.2.mlp.c_proj.bias",
                "encoder.layers.2.mlp.fc2.bias",
            ),
            (
                "transformer.resblocks.7.attn.out_proj.weight",
                "encoder.layers.7.self_attn.out_proj.weight",
            ),
        ];
        for (key, name) in cases {
            assert_eq!(big_g.canonical(&format!("{p}{key}")), whole(name), "{key}");
        }
        assert_eq!(
            big_g.canonical(&format!("{p}text_projection")),
            [("text_projection.weight".to_string(), Stored::Transposed)]
        );
        assert_eq!(
            big_g.canonical(&format!("{p}transformer.resblocks.5.attn.in_proj_bias")),
            [
                (
                    "encoder.layers.5.self_attn.q_proj.bias".to_string(),
                    Stored::Rows { index: 0, parts: 3 }
                ),
                (
                    "encoder.layers.5.self_attn.k_proj.bias".to_string(),
                    Stored::Rows { index: 1, parts: 3 }
                ),
                (
                    "encoder.layers.5.self_attn.v_proj.bias".to_string(),
                    Stored::Rows { index: 2, parts: 3 }
                ),
            ]
        );
        assert_eq!(big_g.canonical(&format!("{p}logit_scale")), []);
        assert_eq!(
            big_g.canonical(
                "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight"
            ),
            []
        );
        // An unknown key keeps its name, so that loading reports it as unused.
        assert_eq!(
            big_g.canonical(&format!("{p}transformer.resblocks.0.attn.extra")),
            whole("encoder.layers.0.attn.extra")
        );
    }
}
