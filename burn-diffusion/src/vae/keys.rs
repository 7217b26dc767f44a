//! The names of the VAE's tensors. The model's fields follow diffusers' layout; the original
//! (LDM / BFL `ae.safetensors`) single-file layout and diffusers' deprecated attention names are
//! renamed to it here, in one place.
//!
//! Original → diffusers: `down.{i}.block.{j}` → `down_blocks.{i}.resnets.{j}`,
//! `down.{i}.downsample` → `down_blocks.{i}.downsamplers.0`, `up.{i}` → `up_blocks.{n-1-i}`
//! (the original counts decoder levels from the finest), `upsample` → `upsamplers.0`,
//! `mid.block_{1,2}` → `mid_block.resnets.{0,1}`, `mid.attn_1.{norm,q,k,v,proj_out}` →
//! `mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}` (stored there as 1×1
//! convolutions), `norm_out` → `conv_norm_out`, `nin_shortcut` → `conv_shortcut`; FLUX.2's file
//! (BFL's `flux2-vae.safetensors`, also ComfyUI's) keeps its quant convolutions inside the
//! encoder and decoder: `encoder.quant_conv` → `quant_conv`, `decoder.post_quant_conv` →
//! `post_quant_conv`. Its batch norm is `bn.running_mean` / `bn.running_var` in both layouts;
//! the batch norm's step counter (`bn.num_batches_tracked`) is not part of the model.

/// Prefixes of the VAE's keys in all-in-one checkpoints (SD/SDXL and ComfyUI files).
const PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];

/// The key layout of a VAE checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VaeLayout {
    /// diffusers' `AutoencoderKL` (`encoder.down_blocks.0.resnets.0...`).
    Diffusers,
    /// The original single file (`encoder.down.0.block.0...`), as in FLUX.1's `ae.safetensors`,
    /// FLUX.2's `flux2-vae.safetensors` and SDXL's `sdxl_vae.safetensors`.
    Original,
}

/// How a checkpoint's keys are written: their layout, the prefix they share, and the number of
/// decoder levels (which original-layout names count from the other end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct KeyScheme {
    pub layout: VaeLayout,
    pub prefix: &'static str,
    pub levels: usize,
}

impl KeyScheme {
    /// Recognizes the scheme from a checkpoint's keys, or `None` when they hold no VAE.
    pub fn detect(keys: &[&str]) -> Option<Self> {
        let prefix = PREFIXES
            .into_iter()
            .find(|p| {
                keys.iter()
                    .any(|k| k.starts_with(p) && k.contains("encoder."))
            })
            .unwrap_or("");
        let own = keys.iter().filter_map(|k| k.strip_prefix(prefix));
        let mut layout = None;
        let mut levels = 0;
        for key in own {
            let parts: Vec<&str> = key.split('.').collect();
            match parts.as_slice() {
                ["encoder", "down_blocks", ..] => layout = Some(VaeLayout::Diffusers),
                ["encoder", "down", ..] => layout = Some(VaeLayout::Original),
                ["decoder", "up_blocks" | "up", level, ..] => {
                    if let Ok(level) = level.parse::<usize>() {
                        levels = levels.max(level + 1);
                    }
                }
                _ => {}
            }
        }
        layout.map(|layout| Self {
            layout,
            prefix,
            levels,
        })
    }

    /// The diffusers name of a checkpoint key, or `None` for a key that is not the VAE's.
    pub fn canonical(&self, key: &str) -> Option<String> {
        let key = key.strip_prefix(self.prefix)?;
        let parts: Vec<&str> = key.split('.').collect();
        let own = match parts.as_slice() {
            ["bn", "num_batches_tracked"] => false,
            [root, ..] => matches!(
                *root,
                "encoder" | "decoder" | "quant_conv" | "post_quant_conv" | "bn"
            ),
            [] => false,
        };
        if !own {
            return None;
        }
        let renamed = match self.layout {
            VaeLayout::Diffusers => deprecated_attention(&parts),
            VaeLayout::Original => original(&parts, self.levels),
        };
        Some(renamed.join("."))
    }
}

/// diffusers' old attention names (`query`, `key`, `value`, `proj_attn`) to the current ones.
fn deprecated_attention(parts: &[&str]) -> Vec<String> {
    let mut out = Vec::with_capacity(parts.len() + 1);
    for (i, part) in parts.iter().enumerate() {
        let in_attention = i >= 2 && parts[i - 2] == "attentions";
        match *part {
            "query" if in_attention => out.push("to_q".into()),
            "key" if in_attention => out.push("to_k".into()),
            "value" if in_attention => out.push("to_v".into()),
            "proj_attn" if in_attention => out.extend(["to_out".into(), "0".into()]),
            other => out.push(other.to_string()),
        }
    }
    out
}

/// An original-layout key, split at dots, in diffusers' layout.
fn original(parts: &[&str], levels: usize) -> Vec<String> {
    // FLUX.2 keeps its quant convolutions inside the encoder and decoder.
    if let ["encoder", conv @ "quant_conv", tail @ ..]
    | ["decoder", conv @ "post_quant_conv", tail @ ..] = parts
    {
        return std::iter::once(conv)
            .chain(tail)
            .map(|p| p.to_string())
            .collect();
    }
    let mut out: Vec<String> = Vec::with_capacity(parts.len() + 2);
    let mut rest = parts;
    if let [side, tail @ ..] = rest {
        out.push(side.to_string());
        rest = tail;
    }
    match rest {
        ["down", level, "block", tail @ ..] => {
            out.extend(["down_blocks".into(), level.to_string(), "resnets".into()]);
            rest = tail;
        }
        ["down", level, "downsample", tail @ ..] => {
            out.extend([
                "down_blocks".into(),
                level.to_string(),
                "downsamplers".into(),
                "0".into(),
            ]);
            rest = tail;
        }
        ["up", level, kind @ ("block" | "upsample"), tail @ ..] => {
            let level = level
                .parse::<usize>()
                .ok()
                .and_then(|l| levels.checked_sub(l + 1))
                .map_or_else(|| level.to_string(), |l| l.to_string());
            out.extend(["up_blocks".into(), level]);
            if *kind == "block" {
                out.push("resnets".into());
            } else {
                out.extend(["upsamplers".into(), "0".into()]);
            }
            rest = tail;
        }
        ["mid", block @ ("block_1" | "block_2"), tail @ ..] => {
            let index = if *block == "block_1" { "0" } else { "1" };
            out.extend(["mid_block".into(), "resnets".into(), index.into()]);
            rest = tail;
        }
        ["mid", "attn_1", layer, tail @ ..] => {
            out.extend(["mid_block".into(), "attentions".into(), "0".into()]);
            match *layer {
                "norm" => out.push("group_norm".into()),
                "q" => out.push("to_q".into()),
                "k" => out.push("to_k".into()),
                "v" => out.push("to_v".into()),
                "proj_out" => out.extend(["to_out".into(), "0".into()]),
                other => out.push(other.to_string()),
            }
            rest = tail;
        }
        ["norm_out", tail @ ..] => {
            out.push("conv_norm_out".into());
            rest = tail;
        }
        _ => {}
    }
    out.extend(rest.iter().map(|p| match *p {
        "nin_shortcut" => "conv_shortcut".to_string(),
        other => other.to_string(),
    }));
    out
}

/// The diffusers name of a parameter from its path in the model: the fields are diffusers'
/// names, except the attention's output projection, which diffusers keeps in a list.
pub(crate) fn parameter_name(path: &str) -> String {
    path.replace(".to_out.", ".to_out.0.")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheme(keys: &[&str]) -> KeyScheme {
        KeyScheme::detect(keys).unwrap()
    }

    #[test]
    fn original_names_map_to_diffusers() {
        let keys = [
            "encoder.down.0.block.0.conv1.weight",
            "decoder.up.0.block.0.conv1.weight",
            "decoder.up.3.upsample.conv.weight",
        ];
        let s = scheme(&keys);
        assert_eq!((s.layout, s.prefix, s.levels), (VaeLayout::Original, "", 4));
        let cases = [
            (
                "encoder.down.2.block.1.nin_shortcut.bias",
                "encoder.down_blocks.2.resnets.1.conv_shortcut.bias",
            ),
            (
                "encoder.down.0.downsample.conv.weight",
                "encoder.down_blocks.0.downsamplers.0.conv.weight",
            ),
            (
                "decoder.up.0.block.2.norm1.weight",
                "decoder.up_blocks.3.resnets.2.norm1.weight",
            ),
            (
                "decoder.up.3.upsample.conv.bias",
                "decoder.up_blocks.0.upsamplers.0.conv.bias",
            ),
            (
                "encoder.mid.block_2.conv2.weight",
                "encoder.mid_block.resnets.1.conv2.weight",
            ),
            (
                "decoder.mid.attn_1.proj_out.weight",
                "decoder.mid_block.attentions.0.to_out.0.weight",
            ),
            (
                "decoder.mid.attn_1.norm.bias",
                "decoder.mid_block.attentions.0.group_norm.bias",
            ),
            (
                "encoder.mid.attn_1.k.weight",
                "encoder.mid_block.attentions.0.to_k.weight",
            ),
            ("encoder.norm_out.weight", "encoder.conv_norm_out.weight"),
            ("encoder.conv_in.weight", "encoder.conv_in.weight"),
            ("quant_conv.bias", "quant_conv.bias"),
            ("encoder.quant_conv.weight", "quant_conv.weight"),
            ("decoder.post_quant_conv.bias", "post_quant_conv.bias"),
            ("bn.running_var", "bn.running_var"),
        ];
        for (original, diffusers) in cases {
            assert_eq!(
                s.canonical(original).as_deref(),
                Some(diffusers),
                "{original}"
            );
        }
    }

    #[test]
    fn prefixed_checkpoints_ignore_other_components() {
        let keys = [
            "first_stage_model.encoder.down.0.block.0.conv1.weight",
            "model.diffusion_model.input_blocks.0.0.weight",
            "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
        ];
        let s = scheme(&keys);
        assert_eq!(s.prefix, "first_stage_model.");
        assert_eq!(s.canonical(keys[1]), None);
        assert_eq!(s.canonical(keys[2]), None);
        assert_eq!(
            s.canonical(keys[0]).as_deref(),
            Some("encoder.down_blocks.0.resnets.0.conv1.weight")
        );
    }

    #[test]
    fn deprecated_diffusers_attention_names_are_renamed() {
        let s = scheme(&["encoder.down_blocks.0.resnets.0.conv1.weight"]);
        assert_eq!(s.layout, VaeLayout::Diffusers);
        let cases = [
            (
                "encoder.mid_block.attentions.0.query.weight",
                "encoder.mid_block.attentions.0.to_q.weight",
            ),
            (
                "decoder.mid_block.attentions.0.proj_attn.bias",
                "decoder.mid_block.attentions.0.to_out.0.bias",
            ),
            (
                "decoder.up_blocks.1.resnets.0.conv1.weight",
                "decoder.up_blocks.1.resnets.0.conv1.weight",
            ),
        ];
        for (old, new) in cases {
            assert_eq!(s.canonical(old).as_deref(), Some(new), "{old}");
        }
    }

    #[test]
    fn the_batch_norm_step_counter_is_not_the_models() {
        for key in [
            "encoder.down.0.block.0.conv1.weight",
            "encoder.down_blocks.0.resnets.0.conv1.weight",
        ] {
            let s = scheme(&[key]);
            assert_eq!(s.canonical("bn.num_batches_tracked"), None);
            assert_eq!(
                s.canonical("bn.running_mean").as_deref(),
                Some("bn.running_mean")
            );
        }
    }

    #[test]
    fn a_file_without_vae_keys_is_not_recognized() {
        assert_eq!(KeyScheme::detect(&["img_in.weight", "txt_in.weight"]), None);
    }

    #[test]
    fn output_projection_is_the_first_of_its_list() {
        assert_eq!(
            parameter_name("decoder.mid_block.attentions.0.to_out.weight"),
            "decoder.mid_block.attentions.0.to_out.0.weight"
        );
    }
}
