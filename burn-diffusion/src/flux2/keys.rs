//! Every name of every FLUX.2 weight: its path in the Burn module tree, its key in BFL files and
//! where it lives in diffusers files.
//!
//! The fields follow BFL's keys, with FLUX.1's exceptions (`lin1` / `lin2` for an MLP's `0` /
//! `2`, `final_layer.ada_ln_modulation`). Diffusers splits a double block's fused `qkv` into
//! `to_q`, `to_k`, `to_v` (`add_*_proj` for text) and swaps the final modulation's halves, as
//! for FLUX.1; a single block's `linear1` stays whole (`attn.to_qkv_mlp_proj`).

use burn_lora::{LayoutNames, PeftAlpha};

use super::Flux2Config;
use crate::flux::{
    LinearKeys, VectorKeys, double_block_keys, final_layer_keys, layout_names, norm_keys, whole,
};

/// Every Linear of a model of this configuration, in module order.
pub fn linear_keys(config: &Flux2Config) -> Vec<LinearKeys> {
    let h = config.hidden_size;
    let mlp = config.mlp_hidden_dim();
    let named = |module: &str, diffusers: &str, d_input: usize, d_output: usize| {
        whole(
            module.to_string(),
            module.to_string(),
            diffusers.to_string(),
            d_input,
            d_output,
        )
    };
    let mut out = vec![named("img_in", "x_embedder", config.in_channels, h)];
    let embedders = [
        ("time_in", "timestep_embedder", true),
        ("guidance_in", "guidance_embedder", config.guidance_embed),
    ];
    for (bfl, diffusers, present) in embedders {
        if present {
            let d = format!("time_guidance_embed.{diffusers}");
            out.push(named(
                &format!("{bfl}.in_layer"),
                &format!("{d}.linear_1"),
                256,
                h,
            ));
            out.push(named(
                &format!("{bfl}.out_layer"),
                &format!("{d}.linear_2"),
                h,
                h,
            ));
        }
    }
    out.push(named(
        "txt_in",
        "context_embedder",
        config.context_in_dim,
        h,
    ));
    for (name, sets) in [
        ("double_stream_modulation_img", 2),
        ("double_stream_modulation_txt", 2),
        ("single_stream_modulation", 1),
    ] {
        out.push(named(
            &format!("{name}.lin"),
            &format!("{name}.linear"),
            h,
            3 * sets * h,
        ));
    }
    for i in 0..config.depth {
        let mlp_names = ["linear_in", "linear_out"];
        out.extend(double_block_keys(i, h, [2 * mlp, mlp], mlp_names, false));
    }
    for i in 0..config.depth_single_blocks {
        let (p, d) = (
            format!("single_blocks.{i}"),
            format!("single_transformer_blocks.{i}.attn"),
        );
        out.push(named(
            &format!("{p}.linear1"),
            &format!("{d}.to_qkv_mlp_proj"),
            h,
            3 * h + 2 * mlp,
        ));
        out.push(named(
            &format!("{p}.linear2"),
            &format!("{d}.to_out"),
            h + mlp,
            h,
        ));
    }
    out.extend(final_layer_keys(h, config.out_channels));
    out
}

/// Every RMS-norm scale of a model of this configuration.
pub(crate) fn vector_keys(config: &Flux2Config) -> Vec<VectorKeys> {
    norm_keys(config.depth, config.depth_single_blocks, config.head_dim())
}

/// The names of every adapted layer in each LoRA file layout: BFL module paths for kohya and
/// ai-toolkit files, diffusers paths (under `transformer.`) for PEFT files, built from
/// [`linear_keys`], the table that loads checkpoints. PEFT and ai-toolkit files carry alpha in
/// `lora_B` (diffusers' FLUX.2 loaders refuse `.alpha` keys); kohya files keep `.alpha`.
pub fn lora_names(config: &Flux2Config) -> LayoutNames {
    layout_names(linear_keys(config), PeftAlpha::Baked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    fn tiny(guidance_embed: bool) -> Flux2Config {
        Flux2Config::new(16, 16, 24, 64, 2, 2, 1, vec![8; 4], guidance_embed)
    }

    fn model_params(config: &Flux2Config) -> Vec<(String, Vec<usize>)> {
        crate::weights::param_shapes(&config.init::<Flex>(&Default::default()))
    }

    #[test]
    fn keys_cover_exactly_the_model_parameters_without_biases() {
        for config in [tiny(true), tiny(false)] {
            let mut expected: Vec<(String, Vec<usize>)> = linear_keys(&config)
                .into_iter()
                .map(|k| (format!("{}.weight", k.module), vec![k.d_input, k.d_output]))
                .chain(
                    vector_keys(&config)
                        .into_iter()
                        .map(|k| (k.module, vec![k.len])),
                )
                .collect();
            let mut actual = model_params(&config);
            expected.sort();
            actual.sort();
            assert_eq!(actual, expected);
        }
    }

    #[test]
    fn diffusers_names_of_the_flux2_layers() {
        let keys = linear_keys(&tiny(true));
        let find = |m: &str| keys.iter().find(|k| k.module == m).unwrap();
        let target = |m: &str| find(m).diffusers[0].target.clone();
        assert_eq!(
            target("double_blocks.1.txt_mlp.lin1"),
            "transformer_blocks.1.ff_context.linear_in"
        );
        assert_eq!(find("double_blocks.1.txt_mlp.lin1").d_output, 2 * 3 * 64);
        assert_eq!(
            find("double_blocks.1.txt_mlp.lin2").bfl,
            "double_blocks.1.txt_mlp.2"
        );
        assert_eq!(
            target("single_blocks.0.linear1"),
            "single_transformer_blocks.0.attn.to_qkv_mlp_proj"
        );
        assert_eq!(find("single_blocks.0.linear1").d_output, 9 * 64);
        assert_eq!(find("single_blocks.0.linear2").d_input, 4 * 64);
        assert_eq!(
            target("guidance_in.out_layer"),
            "time_guidance_embed.guidance_embedder.linear_2"
        );
        assert_eq!(
            target("double_stream_modulation_txt.lin"),
            "double_stream_modulation_txt.linear"
        );
        let halves: Vec<_> = find("final_layer.ada_ln_modulation")
            .diffusers
            .iter()
            .map(|r| (r.rows.clone(), r.to))
            .collect();
        assert_eq!(halves, [(64..128, 0), (0..64, 64)]);
    }
}
