//! Caption tokenizers of the text encoders, built from a model folder's files the way
//! transformers 5 builds `CLIPTokenizer`, `T5Tokenizer` and `Qwen2Tokenizer` (the reference
//! pipelines' tokenizers), and called as FLUX's pipelines call them: padded to a fixed length,
//! truncated, end-of-text token kept ([`CaptionTokenizer`]); for FLUX.2's decoders, each caption
//! in the model's chat template first, with the attention mask ([`PromptTokenizer`]).
//!
//! Only the vocabulary (and merges, special tokens, NFKC map) comes from the files; the
//! normalization, pre-tokenization and post-processing are the reference classes' own, as in
//! transformers 5, so that a `tokenizer.json` written by an older version tokenizes the same.
//! Mistral's `tokenizer.json` (converted from its tekken file) is the exception: transformers
//! runs it as it is, and so does [`PromptTokenizer::mistral`].

// ref: huggingface/transformers@v5.24.0 src/transformers/models/clip/tokenization_clip.py
// ref: huggingface/transformers@v5.24.0 src/transformers/models/t5/tokenization_t5.py
// ref: huggingface/transformers@v5.24.0 src/transformers/models/qwen2/tokenization_qwen2.py
// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux/pipeline_flux.py (_get_clip_prompt_embeds, _get_t5_prompt_embeds)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux2/pipeline_flux2.py (format_input, _get_mistral_3_small_prompt_embeds)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux2/pipeline_flux2_klein.py (_get_qwen3_prompt_embeds)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux2/system_messages.py (SYSTEM_MESSAGE)

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use serde_json::Value;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{Lowercase, NFC, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::processors::roberta::RobertaProcessing;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, NormalizerWrapper, PaddingDirection, PaddingParams, PaddingStrategy,
    SplitDelimiterBehavior, Tokenizer, TruncationParams,
};

use crate::error::LoadError;

/// CLIP's context length, to which FLUX.1 and SDXL pad every caption.
pub const CLIP_LENGTH: usize = 77;
/// FLUX.1-dev's T5 length (`max_sequence_length`).
pub const T5_LENGTH_DEV: usize = 512;
/// FLUX.1-schnell's T5 length.
pub const T5_LENGTH_SCHNELL: usize = 256;

/// CLIP's pre-tokenization pattern: special tokens, English contractions, letter runs, single
/// digits, and runs of other non-space characters.
const CLIP_PATTERN: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";
/// SentencePiece's word-boundary marker.
const METASPACE: char = '▁';
/// FLUX.2's text length (`max_sequence_length`, dev and klein).
pub const FLUX2_TEXT_LENGTH: usize = 512;
/// The system message of FLUX.2-dev's prompts (BFL's `SYSTEM_MESSAGE`).
pub const FLUX2_SYSTEM_MESSAGE: &str = "You are an AI that reasons about image descriptions. You give structured responses focusing on object relationships, object\nattribution and actions without speculation.";
/// Qwen2's pre-tokenization pattern: English contractions, letter runs with one leading
/// non-letter, single digits, punctuation runs, newlines and other whitespace.
const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A caption tokenizer that gives rows of exactly [`CaptionTokenizer::length`] ids.
pub struct CaptionTokenizer {
    tokenizer: Tokenizer,
    folder: PathBuf,
    length: usize,
}

/// The special tokens of a tokenizer, as its folder names them.
struct SpecialTokens {
    bos: Option<String>,
    eos: String,
    pad: String,
    unk: String,
}

impl CaptionTokenizer {
    /// CLIP's byte-level BPE tokenizer from a tokenizer folder holding `tokenizer.json`, or
    /// `vocab.json` and `merges.txt` (FLUX.1-dev's `tokenizer/`); special tokens from
    /// `special_tokens_map.json` or `tokenizer_config.json` (defaults `<|startoftext|>`,
    /// `<|endoftext|>`). Each row is `bos, tokens…, eos`, truncated to `length` and padded with
    /// the pad token (77 for FLUX.1: [`CLIP_LENGTH`]).
    pub fn clip(folder: &Path, length: usize) -> Result<Self, LoadError> {
        let specials = SpecialTokens::read(
            folder,
            Some("<|startoftext|>"),
            "<|endoftext|>",
            "<|endoftext|>",
            "<|endoftext|>",
        )?;
        let error = |message: String| tokenizer_error(folder, message);
        let json = folder.join("tokenizer.json");
        let mut tokenizer = if json.is_file() {
            Tokenizer::from_file(&json).map_err(|e| tokenizer_error(&json, e.to_string()))?
        } else {
            let path = |name: &str| folder.join(name).to_string_lossy().into_owned();
            let bpe = BPE::from_file(&path("vocab.json"), &path("merges.txt"))
                .continuing_subword_prefix(String::new())
                .end_of_word_suffix("</w>".into())
                .fuse_unk(false)
                .unk_token(specials.unk.clone())
                .build()
                .map_err(|e| error(format!("vocab.json / merges.txt: {e}")))?;
            Tokenizer::new(bpe)
        };
        let bos = specials.bos.clone().unwrap_or_default();
        let tokens: Vec<AddedToken> = [&bos, &specials.eos, &specials.unk, &specials.pad]
            .into_iter()
            .map(|t| AddedToken::from(t.clone(), true))
            .collect();
        tokenizer.add_special_tokens(&tokens);
        let normalizer = NormalizerSequence::new(vec![
            NFC.into(),
            Replace::new(ReplacePattern::Regex(r"\s+".into()), " ")
                .map_err(|e| error(e.to_string()))?
                .into(),
            Lowercase.into(),
        ]);
        let split = Split::new(
            SplitPattern::Regex(CLIP_PATTERN.into()),
            SplitDelimiterBehavior::Removed,
            true,
        )
        .map_err(|e| error(e.to_string()))?;
        let pre_tokenizer =
            PreTokenizerSequence::new(vec![split.into(), ByteLevel::new(false, true, true).into()]);
        let post = RobertaProcessing::new(
            (
                specials.eos.clone(),
                id_of(&tokenizer, folder, &specials.eos)?,
            ),
            (bos.clone(), id_of(&tokenizer, folder, &bos)?),
        )
        .trim_offsets(false)
        .add_prefix_space(false);
        tokenizer
            .with_normalizer(Some(normalizer))
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_post_processor(Some(post));
        Self::finish(tokenizer, folder, &specials.pad, length)
    }

    /// T5's SentencePiece Unigram tokenizer from a tokenizer folder holding `tokenizer.json`
    /// (FLUX.1's `tokenizer_2/`): its NFKC map, then whitespace splitting with `▁` before each
    /// word. Each row is `tokens…, </s>`, truncated to `length` and padded with `<pad>` (512 for
    /// FLUX.1-dev, 256 for schnell: [`T5_LENGTH_DEV`], [`T5_LENGTH_SCHNELL`]).
    pub fn t5(folder: &Path, length: usize) -> Result<Self, LoadError> {
        let specials = SpecialTokens::read(folder, None, "</s>", "<pad>", "<unk>")?;
        let json = folder.join("tokenizer.json");
        let mut tokenizer =
            Tokenizer::from_file(&json).map_err(|e| tokenizer_error(&json, e.to_string()))?;
        let charsmap = match tokenizer.get_normalizer() {
            Some(NormalizerWrapper::Precompiled(p)) => Some(p.clone()),
            Some(NormalizerWrapper::Sequence(seq)) => seq.as_ref().iter().find_map(|n| match n {
                NormalizerWrapper::Precompiled(p) => Some(p.clone()),
                _ => None,
            }),
            _ => None,
        };
        let pre_tokenizer = PreTokenizerSequence::new(vec![
            WhitespaceSplit.into(),
            Metaspace::new(METASPACE, PrependScheme::Always, true).into(),
        ]);
        let eos = id_of(&tokenizer, folder, &specials.eos)?;
        let post = TemplateProcessing::builder()
            .try_single(format!("$A {}", specials.eos))
            .and_then(|b| b.try_pair(format!("$A {0} $B {0}", specials.eos)))
            .map_err(|e| tokenizer_error(folder, e.to_string()))?
            .special_tokens(vec![(specials.eos.as_str(), eos)])
            .build()
            .map_err(|e| tokenizer_error(folder, e.to_string()))?;
        tokenizer
            .with_normalizer(charsmap)
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_post_processor(Some(post));
        Self::finish(tokenizer, folder, &specials.pad, length)
    }

    /// Sets the fixed length: truncation, then padding on the right with `pad`.
    fn finish(
        mut tokenizer: Tokenizer,
        folder: &Path,
        pad: &str,
        length: usize,
    ) -> Result<Self, LoadError> {
        fixed_length(&mut tokenizer, folder, pad, PaddingDirection::Right, length)?;
        Ok(Self {
            tokenizer,
            folder: folder.to_path_buf(),
            length,
        })
    }

    /// The number of ids in every row.
    pub fn length(&self) -> usize {
        self.length
    }

    /// The ids of each caption, [`CaptionTokenizer::length`] per row.
    pub fn encode(&self, captions: &[&str]) -> Result<Vec<Vec<u32>>, LoadError> {
        Ok(self.encode_masked(captions)?.0)
    }

    /// The ids of each caption and their attention mask (1 for a caption's own tokens, 0 for
    /// the padding), [`CaptionTokenizer::length`] per row.
    pub fn encode_masked(&self, captions: &[&str]) -> Result<(Rows, Rows), LoadError> {
        let encodings = self
            .tokenizer
            .encode_batch(captions.to_vec(), true)
            .map_err(|e| tokenizer_error(&self.folder, e.to_string()))?;
        Ok(encodings
            .iter()
            .map(|e| (e.get_ids().to_vec(), e.get_attention_mask().to_vec()))
            .unzip())
    }

    /// The ids of each caption as a `[captions, length]` tensor on `device`.
    pub fn encode_tensor<B: Backend>(
        &self,
        captions: &[&str],
        device: &B::Device,
    ) -> Result<Tensor<B, 2, Int>, LoadError> {
        let rows = self.encode(captions)?;
        let ids: Vec<i64> = rows.iter().flatten().map(|&id| i64::from(id)).collect();
        let data = TensorData::new(ids, [rows.len(), self.length]);
        Ok(Tensor::from_data(data, device))
    }
}

/// Rows of ids or of mask values, one per caption.
type Rows = Vec<Vec<u32>>;

/// Sets `tokenizer` to give `length` ids per text: truncated at the end, then padded with `pad`
/// on the side `direction` names.
fn fixed_length(
    tokenizer: &mut Tokenizer,
    folder: &Path,
    pad: &str,
    direction: PaddingDirection,
    length: usize,
) -> Result<(), LoadError> {
    let pad_id = id_of(tokenizer, folder, pad)?;
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: length,
            ..Default::default()
        }))
        .map_err(|e| tokenizer_error(folder, e.to_string()))?;
    tokenizer.with_padding(Some(PaddingParams {
        strategy: PaddingStrategy::Fixed(length),
        direction,
        pad_id,
        pad_token: pad.to_string(),
        ..Default::default()
    }));
    Ok(())
}

/// The chat template a [`PromptTokenizer`] puts each caption in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChatTemplate {
    /// FLUX.2-dev: Mistral's system prompt and one user message, without generation prompt.
    Mistral,
    /// FLUX.2-klein: Qwen3's user message and generation prompt, thinking switched off.
    Qwen3,
}

/// The token ids and attention masks of a batch of prompts, one row of
/// [`PromptTokenizer::length`] per caption.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptTokens {
    /// Token ids.
    pub input_ids: Vec<Vec<u32>>,
    /// 1 for a token of the prompt, 0 for padding.
    pub attention_mask: Vec<Vec<u32>>,
}

/// [`PromptTokens`] as tensors, `[captions, length]` each.
pub struct PromptTensors<B: Backend> {
    /// Token ids.
    pub input_ids: Tensor<B, 2, Int>,
    /// 1 for a token of the prompt, 0 for padding.
    pub attention_mask: Tensor<B, 2, Int>,
}

/// A tokenizer of FLUX.2's decoder prompts: each caption in the model's chat template (as
/// `apply_chat_template` renders FLUX.2's messages), tokenized, truncated to a fixed length and
/// padded on the side the tokenizer folder names, with the attention mask.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    folder: PathBuf,
    length: usize,
    template: ChatTemplate,
    bos: String,
}

impl PromptTokenizer {
    /// FLUX.2-dev's Mistral tokenizer from a tokenizer folder holding `tokenizer.json` (run as
    /// it is) and optionally `tokenizer_config.json` (special tokens, `padding_side`; defaults
    /// `<s>`, `<pad>`, left). Each prompt is
    /// `<s>[SYSTEM_PROMPT]`[`FLUX2_SYSTEM_MESSAGE`]`[/SYSTEM_PROMPT][INST]caption[/INST]` with
    /// `[IMG]` removed from the caption, tokenized without added special tokens (the template
    /// holds them), truncated to `length` ([`FLUX2_TEXT_LENGTH`] in the pipeline).
    pub fn mistral(folder: &Path, length: usize) -> Result<Self, LoadError> {
        let specials = SpecialTokens::read(folder, Some("<s>"), "</s>", "<pad>", "<unk>")?;
        let tokenizer = read_tokenizer_json(folder)?;
        let bos = specials.bos.unwrap_or_default();
        Self::finish(
            tokenizer,
            folder,
            &specials.pad,
            PaddingDirection::Left,
            length,
            ChatTemplate::Mistral,
            bos,
        )
    }

    /// FLUX.2-klein's Qwen3 tokenizer from a tokenizer folder holding `tokenizer.json` and
    /// optionally `tokenizer_config.json` (pad token, `padding_side`; defaults `<|endoftext|>`,
    /// right): its vocabulary, merges and added tokens under `Qwen2Tokenizer`'s NFC and byte-level
    /// pre-tokenization. Each prompt is
    /// `<|im_start|>user\ncaption<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n`,
    /// truncated to `length` ([`FLUX2_TEXT_LENGTH`] in the pipeline).
    pub fn qwen3(folder: &Path, length: usize) -> Result<Self, LoadError> {
        let specials =
            SpecialTokens::read(folder, None, "<|im_end|>", "<|endoftext|>", "<|endoftext|>")?;
        let mut tokenizer = read_tokenizer_json(folder)?;
        let split = Split::new(
            SplitPattern::Regex(QWEN_PATTERN.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| tokenizer_error(folder, e.to_string()))?;
        let pre_tokenizer = PreTokenizerSequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ]);
        tokenizer
            .with_normalizer(Some(NFC))
            .with_pre_tokenizer(Some(pre_tokenizer))
            .with_post_processor(None::<RobertaProcessing>);
        Self::finish(
            tokenizer,
            folder,
            &specials.pad,
            PaddingDirection::Right,
            length,
            ChatTemplate::Qwen3,
            String::new(),
        )
    }

    fn finish(
        mut tokenizer: Tokenizer,
        folder: &Path,
        pad: &str,
        default_side: PaddingDirection,
        length: usize,
        template: ChatTemplate,
        bos: String,
    ) -> Result<Self, LoadError> {
        let direction = padding_side(folder)?.unwrap_or(default_side);
        fixed_length(&mut tokenizer, folder, pad, direction, length)?;
        Ok(Self {
            tokenizer,
            folder: folder.to_path_buf(),
            length,
            template,
            bos,
        })
    }

    /// The number of ids in every row.
    pub fn length(&self) -> usize {
        self.length
    }

    /// The text of the prompt built around `caption`, as the chat template renders it.
    pub fn prompt(&self, caption: &str) -> String {
        match self.template {
            ChatTemplate::Mistral => format!(
                "{}[SYSTEM_PROMPT]{FLUX2_SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]{}[/INST]",
                self.bos,
                caption.replace("[IMG]", "")
            ),
            ChatTemplate::Qwen3 => format!(
                "<|im_start|>user\n{caption}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            ),
        }
    }

    /// The ids and attention mask of each caption's prompt.
    pub fn encode(&self, captions: &[&str]) -> Result<PromptTokens, LoadError> {
        let prompts: Vec<String> = captions.iter().map(|c| self.prompt(c)).collect();
        // Mistral's template holds its special tokens; Qwen's tokenizer adds none.
        let add_special = self.template == ChatTemplate::Qwen3;
        let encodings = self
            .tokenizer
            .encode_batch(prompts, add_special)
            .map_err(|e| tokenizer_error(&self.folder, e.to_string()))?;
        Ok(PromptTokens {
            input_ids: encodings.iter().map(|e| e.get_ids().to_vec()).collect(),
            attention_mask: encodings
                .iter()
                .map(|e| e.get_attention_mask().to_vec())
                .collect(),
        })
    }

    /// The ids and attention mask of each caption's prompt as `[captions, length]` tensors on
    /// `device`.
    pub fn encode_tensors<B: Backend>(
        &self,
        captions: &[&str],
        device: &B::Device,
    ) -> Result<PromptTensors<B>, LoadError> {
        let tokens = self.encode(captions)?;
        let tensor = |rows: &[Vec<u32>]| {
            let values: Vec<i64> = rows.iter().flatten().map(|&v| i64::from(v)).collect();
            Tensor::from_data(TensorData::new(values, [rows.len(), self.length]), device)
        };
        Ok(PromptTensors {
            input_ids: tensor(&tokens.input_ids),
            attention_mask: tensor(&tokens.attention_mask),
        })
    }
}

/// `tokenizer.json` of a folder.
fn read_tokenizer_json(folder: &Path) -> Result<Tokenizer, LoadError> {
    let json = folder.join("tokenizer.json");
    Tokenizer::from_file(&json).map_err(|e| tokenizer_error(&json, e.to_string()))
}

/// The `padding_side` of a folder's `tokenizer_config.json`, if it names one.
fn padding_side(folder: &Path) -> Result<Option<PaddingDirection>, LoadError> {
    let file = folder.join("tokenizer_config.json");
    if !file.is_file() {
        return Ok(None);
    }
    let json: Value = crate::weights::read_json(&file)?;
    match json.get("padding_side").and_then(Value::as_str) {
        None => Ok(None),
        Some("left") => Ok(Some(PaddingDirection::Left)),
        Some("right") => Ok(Some(PaddingDirection::Right)),
        Some(other) => Err(tokenizer_error(
            &file,
            format!("padding_side `{other}` is neither left nor right"),
        )),
    }
}

impl SpecialTokens {
    /// Reads the special tokens from `special_tokens_map.json` or `tokenizer_config.json`,
    /// where each is a string or an object with a `content`.
    fn read(
        folder: &Path,
        bos: Option<&str>,
        eos: &str,
        pad: &str,
        unk: &str,
    ) -> Result<Self, LoadError> {
        let mut declared = serde_json::Map::new();
        for name in ["tokenizer_config.json", "special_tokens_map.json"] {
            let file = folder.join(name);
            if !file.is_file() {
                continue;
            }
            let json: Value = crate::weights::read_json(&file)?;
            if let Value::Object(map) = json {
                declared.extend(map);
            }
        }
        let token = |key: &str, default: &str| -> String {
            match declared.get(key) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => o
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or(default)
                    .to_string(),
                _ => default.to_string(),
            }
        };
        Ok(Self {
            bos: bos.map(|b| token("bos_token", b)),
            eos: token("eos_token", eos),
            pad: token("pad_token", pad),
            unk: token("unk_token", unk),
        })
    }
}

/// The id of `token`, which must be in the vocabulary.
fn id_of(tokenizer: &Tokenizer, folder: &Path, token: &str) -> Result<u32, LoadError> {
    tokenizer
        .token_to_id(token)
        .ok_or_else(|| tokenizer_error(folder, format!("`{token}` is not in the vocabulary")))
}

fn tokenizer_error(file: &Path, message: String) -> LoadError {
    LoadError::Tokenizer {
        file: file.to_path_buf(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_without_vocabulary_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let error = CaptionTokenizer::clip(dir.path(), CLIP_LENGTH)
            .err()
            .unwrap();
        assert!(matches!(error, LoadError::Tokenizer { .. }), "{error}");
        assert!(error.to_string().contains("vocab.json"), "{error}");
        let error = CaptionTokenizer::t5(dir.path(), T5_LENGTH_DEV)
            .err()
            .unwrap();
        assert!(error.to_string().contains("tokenizer.json"), "{error}");
    }

    #[test]
    fn special_tokens_come_from_either_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"pad_token": {"content": "!", "special": true}, "eos_token": "<e>"}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("special_tokens_map.json"),
            r#"{"eos_token": "<end>"}"#,
        )
        .unwrap();
        let specials =
            SpecialTokens::read(dir.path(), Some("<s>"), "</s>", "<pad>", "<unk>").unwrap();
        assert_eq!(specials.pad, "!");
        assert_eq!(specials.eos, "<end>");
        assert_eq!(specials.bos.as_deref(), Some("<s>"));
        assert_eq!(specials.unk, "<unk>");
    }
}
