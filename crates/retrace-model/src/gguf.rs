//! GGUF checkpoints (llama.cpp's single-file format) under the decoder's Hugging Face names: the
//! architecture from the metadata, matrices kept quantized for the quantized matmul, every other
//! tensor (norms, biases, a PRM's head) dequantized to f32, and the tokenizer rebuilt from the
//! file's own vocabulary when no `tokenizer.json` lies beside it.

use crate::config::ModelConfig;
use crate::error::ModelError;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor, ggml_file::qtensor_from_ggml};
use candle_core::{DType, Device, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use serde_json::{Value as Json, json};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Layer tensor names, Hugging Face's (under `model.layers.N.`) to llama.cpp's (under `blk.N.`).
const LAYER_NAMES: [(&str, &str); 9] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
];

/// llama.cpp's token types that become added tokens: control (special) and user-defined.
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;

/// An open GGUF file: its metadata and tensor index, tensors read on demand.
pub struct Gguf {
    path: PathBuf,
    file: File,
    content: Content,
    arch: String,
    n_head: usize,
    n_kv: usize,
}

fn err(path: &Path, msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {msg}", path.display()))
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Arc<Gguf>> {
        let file = File::open(path).map_err(|e| err(path, e))?;
        let mut reader = std::io::BufReader::new(file.try_clone().map_err(|e| err(path, e))?);
        let content = Content::read(&mut reader).map_err(|e| err(path, e))?;
        let arch = match content.metadata.get("general.architecture") {
            Some(v) => v.to_string().map_err(|e| err(path, e))?.clone(),
            None => return Err(err(path, "no general.architecture in its metadata")),
        };
        if !matches!(arch.as_str(), "llama" | "mistral" | "qwen2") {
            return Err(err(
                path,
                format!("architecture {arch:?} is not supported (llama, mistral, qwen2)"),
            ));
        }
        let mut g = Gguf {
            path: path.to_path_buf(),
            file,
            content,
            arch,
            n_head: 0,
            n_kv: 0,
        };
        g.n_head = g.arch_u32("attention.head_count")? as usize;
        g.n_kv = match g.meta(&format!("{}.attention.head_count_kv", g.arch)) {
            Some(v) => v.to_u32().map_err(|e| err(path, e))? as usize,
            None => g.n_head,
        };
        Ok(Arc::new(g))
    }

    fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn arch_u32(&self, key: &str) -> Result<u32> {
        let key = format!("{}.{key}", self.arch);
        match self.meta(&key) {
            Some(v) => v
                .to_u32()
                .map_err(|e| err(&self.path, format!("{key}: {e}"))),
            None => Err(err(&self.path, format!("no {key} in its metadata"))),
        }
    }

    fn arch_f32(&self, key: &str) -> Result<Option<f32>> {
        let key = format!("{}.{key}", self.arch);
        self.meta(&key)
            .map(|v| {
                v.to_f32()
                    .map_err(|e| err(&self.path, format!("{key}: {e}")))
            })
            .transpose()
    }

    /// The decoder's view of the checkpoint, as `config.json` would give it.
    pub fn config(&self) -> Result<ModelConfig> {
        let embed = self.info("token_embd.weight")?;
        let (vocab, hidden) = embed.shape.dims2()?;
        let head_dim = match self.meta(&format!("{}.attention.key_length", self.arch)) {
            Some(_) => Some(self.arch_u32("attention.key_length")? as usize),
            None => None,
        };
        // Stored as f32: the shortest decimal that rounds to it is what config.json held.
        let eps = self
            .arch_f32("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| err(&self.path, "no attention.layer_norm_rms_epsilon"))?;
        let eps: f64 = eps.to_string().parse().map_err(|e| err(&self.path, e))?;
        let factors = match self.content.tensor_infos.contains_key("rope_freqs.weight") {
            true => Some(
                self.tensor("rope_freqs.weight", &Device::Cpu)?
                    .dequantize(&Device::Cpu)?
                    .to_dtype(DType::F64)?
                    .to_vec1::<f64>()?,
            ),
            false => None,
        };
        let sliding = match self.meta(&format!("{}.attention.sliding_window", self.arch)) {
            Some(_) => Some(self.arch_u32("attention.sliding_window")? as usize),
            None => None,
        };
        // llama.cpp writes Mistral as "llama"; a window in the metadata windows every layer.
        let model_type = match (self.arch.as_str(), sliding) {
            ("llama", Some(_)) => "mistral".to_string(),
            _ => self.arch.clone(),
        };
        let cfg = ModelConfig {
            model_type,
            hidden_size: hidden,
            intermediate_size: self.arch_u32("feed_forward_length")? as usize,
            num_hidden_layers: self.arch_u32("block_count")? as usize,
            num_attention_heads: self.n_head,
            num_key_value_heads: Some(self.n_kv),
            head_dim,
            rms_norm_eps: eps,
            rope_theta: self.arch_f32("rope.freq_base")?.map(f64::from),
            max_position_embeddings: self.arch_u32("context_length")? as usize,
            vocab_size: vocab,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            sliding_window: sliding,
            use_sliding_window: sliding.map(|_| true),
            max_window_layers: sliding.map(|_| 0),
            attention_bias: self.content.tensor_infos.contains_key("blk.0.attn_q.bias"),
            mlp_bias: false,
            hidden_act: None,
            rope_scaling: None,
            rope_freq_factors: factors,
        };
        cfg.validate()
            .map_err(|e| err(&self.path, format!("metadata {e}")))?;
        Ok(cfg)
    }

    fn info(&self, name: &str) -> Result<&candle_core::quantized::gguf_file::TensorInfo> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| err(&self.path, format!("no tensor {name}")))
    }

    /// The GGUF name of a Hugging Face tensor name, if the file has it. Head tensors keep their
    /// Hugging Face names, or take llama.cpp's classifier names (`cls.*`, `cls.output.*`).
    fn name_of(&self, hf: &str) -> Option<String> {
        let has = |n: &str| self.content.tensor_infos.contains_key(n);
        if has(hf) {
            return Some(hf.to_string());
        }
        let (stem, leaf) = hf.rsplit_once('.')?;
        let mapped = match stem {
            "model.embed_tokens" => "token_embd".to_string(),
            "model.norm" => "output_norm".to_string(),
            "lm_head" => "output".to_string(),
            "score.0" | "v_head.summary" => "cls".to_string(),
            "score.2" => "cls.output".to_string(),
            _ => {
                let rest = stem.strip_prefix("model.layers.")?;
                let (layer, inner) = rest.split_once('.')?;
                let (_, short) = LAYER_NAMES.iter().find(|(h, _)| *h == inner)?;
                format!("blk.{layer}.{short}")
            }
        };
        let name = format!("{mapped}.{leaf}");
        has(&name).then_some(name)
    }

    /// Heads a row of Q or K belongs to when llama.cpp permuted it (Llama only): its converter
    /// turned Hugging Face's rotate-half rows into interleaved pairs, which this undoes.
    fn permuted_heads(&self, name: &str) -> Option<usize> {
        if self.arch != "llama" {
            return None;
        }
        let stem = name
            .strip_suffix(".weight")
            .or(name.strip_suffix(".bias"))?;
        if stem.ends_with(".attn_q") {
            Some(self.n_head)
        } else if stem.ends_with(".attn_k") {
            Some(self.n_kv)
        } else {
            None
        }
    }

    /// The tensor stored under GGUF name `name`, rows in Hugging Face's order.
    fn tensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        let info = self.info(name)?;
        let dims = info.shape.dims().to_vec();
        let dtype = info.ggml_dtype;
        let elems: usize = dims.iter().product();
        let size = elems / dtype.block_size() * dtype.type_size();
        let mut bytes = vec![0u8; size];
        self.file
            .read_exact_at(&mut bytes, self.content.tensor_data_offset + info.offset)
            .map_err(|e| err(&self.path, format!("tensor {name}: {e}")))?;
        if let Some(heads) = self.permuted_heads(name) {
            bytes = unpermute_rows(&bytes, dims[0], heads)
                .ok_or_else(|| err(&self.path, format!("tensor {name}: rows not per head")))?;
        }
        qtensor_from_ggml(dtype, &bytes, dims, device)
    }

    /// The matrix stored under Hugging Face name `hf` when it is quantized; `None` when it is
    /// absent or stored in f32/f16/bf16 (those load at full precision).
    pub(crate) fn quantized(&self, hf: &str, device: &Device) -> Result<Option<QTensor>> {
        let Some(name) = self.name_of(hf) else {
            return Ok(None);
        };
        if matches!(
            self.info(&name)?.ggml_dtype,
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
        ) {
            return Ok(None);
        }
        self.tensor(&name, device).map(Some)
    }

    /// Rows `ids` of the matrix under Hugging Face name `hf`, dequantized to f32 on the CPU.
    pub(crate) fn rows(&self, hf: &str, ids: &[usize]) -> Result<Tensor> {
        let name = self
            .name_of(hf)
            .ok_or_else(|| err(&self.path, format!("no tensor for {hf}")))?;
        let t = self.tensor(&name, &Device::Cpu)?;
        let idx: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        t.embedding(&Tensor::new(idx.as_slice(), &Device::Cpu)?)
    }

    fn strings(&self, key: &str) -> Result<Vec<String>> {
        let v = self
            .meta(key)
            .ok_or_else(|| err(&self.path, format!("no {key} in its metadata")))?;
        v.to_vec()
            .map_err(|e| err(&self.path, format!("{key}: {e}")))?
            .iter()
            .map(|s| s.to_string().cloned())
            .collect::<Result<_>>()
            .map_err(|e| err(&self.path, format!("{key}: {e}")))
    }

    fn token_id(&self, key: &str) -> Option<usize> {
        self.meta(&format!("tokenizer.ggml.{key}"))
            .and_then(|v| v.to_u32().ok())
            .map(|v| v as usize)
    }

    fn tokenizer_error(&self, reason: String) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            reason,
        }
    }

    /// llama.cpp's type of each of the `n` tokens (all normal when the file names none).
    fn token_types(&self, n: usize) -> std::result::Result<Vec<i32>, ModelError> {
        let fail = |reason: String| self.tokenizer_error(reason);
        match self.meta("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(|e| fail(e.to_string()))?
                .iter()
                .map(|t| t.to_i32())
                .collect::<Result<_>>()
                .map_err(|e| fail(format!("tokenizer.ggml.token_type: {e}"))),
            None => Ok(vec![1; n]),
        }
    }

    /// `tokenizer.json` for the file's own byte-level BPE vocabulary (`tokenizer.ggml.model =
    /// gpt2`), with the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`.
    pub fn tokenizer_json(&self) -> std::result::Result<String, ModelError> {
        let fail = |reason: String| self.tokenizer_error(reason);
        let model = self
            .meta("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if model != "gpt2" {
            return Err(fail(format!(
                "its tokenizer ({model:?}) can't be rebuilt from the file (only byte-level BPE, \
                 \"gpt2\", can); put the model's tokenizer.json and tokenizer_config.json beside it"
            )));
        }
        let tokens = self
            .strings("tokenizer.ggml.tokens")
            .map_err(|e| fail(e.to_string()))?;
        let merges = self
            .strings("tokenizer.ggml.merges")
            .map_err(|e| fail(e.to_string()))?;
        let types = self.token_types(tokens.len())?;
        let pre = self
            .meta("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
            .unwrap_or("default");
        let pre_tokenizer = pre_tokenizer(pre).ok_or_else(|| {
            fail(format!(
                "tokenizer.ggml.pre {pre:?} is not one retrace rebuilds (smollm, gpt2, default, \
                 qwen2, llama-bpe); put the model's tokenizer.json beside it"
            ))
        })?;
        let mut vocab = serde_json::Map::new();
        for (i, t) in tokens.iter().enumerate() {
            if vocab.insert(t.clone(), json!(i)).is_some() {
                return Err(fail(format!("token {t:?} is in the vocabulary twice")));
            }
        }
        let merges: Vec<Json> = merges
            .iter()
            .map(|m| match m.split_once(' ') {
                Some((a, b)) if !b.contains(' ') => Ok(json!([a, b])),
                _ => Err(fail(format!("merge {m:?} is not two tokens"))),
            })
            .collect::<std::result::Result<_, _>>()?;
        let added: Vec<Json> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(**t, TOKEN_CONTROL | TOKEN_USER_DEFINED))
            .map(|(i, t)| {
                json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": *t == TOKEN_CONTROL})
            })
            .collect();
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            // Offsets only: adds no token (a BOS comes from the chat template, as in transformers).
            "post_processor": {"type": "ByteLevel", "add_prefix_space": true,
                               "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                        "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });
        Ok(tokenizer.to_string())
    }

    /// `tokenizer_config.json` from the metadata: the chat template and the special tokens.
    pub fn tokenizer_config(&self) -> Json {
        let tokens = self.strings("tokenizer.ggml.tokens").unwrap_or_default();
        let name = |key: &str| {
            self.token_id(key)
                .and_then(|i| tokens.get(i).cloned())
                .map_or(Json::Null, Json::String)
        };
        json!({
            "bos_token": name("bos_token_id"),
            "eos_token": name("eos_token_id"),
            "pad_token": name("padding_token_id"),
            "chat_template": self
                .meta("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok())
                .map_or(Json::Null, |s| Json::String(s.clone())),
        })
    }
}

/// The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names, as `tokenizer.json` writes it.
fn pre_tokenizer(pre: &str) -> Option<Json> {
    let byte_level = |use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
               "use_regex": use_regex})
    };
    // The splits of Qwen2's and Llama 3's tokenizers, which differ only in how digits group.
    let split = |digits: &str| {
        let regex = format!(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{digits}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        );
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Some(match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "gpt2" | "default" => byte_level(true),
        "qwen2" => split(""),
        "llama-bpe" => split("{1,3}"),
        _ => return None,
    })
}

/// `bytes` holds `rows` equal rows; rows of each of `heads` heads go from llama.cpp's
/// interleaved order back to Hugging Face's (row `2i + s` of a head becomes row `s * d/2 + i`).
fn unpermute_rows(bytes: &[u8], rows: usize, heads: usize) -> Option<Vec<u8>> {
    if heads == 0 || !rows.is_multiple_of(heads) || !bytes.len().is_multiple_of(rows) {
        return None;
    }
    let (per_head, row) = (rows / heads, bytes.len() / rows);
    if !per_head.is_multiple_of(2) {
        return None;
    }
    let half = per_head / 2;
    let mut out = Vec::with_capacity(bytes.len());
    for h in 0..heads {
        for s in 0..2 {
            for i in 0..half {
                let src = h * per_head + 2 * i + s;
                out.extend_from_slice(&bytes[src * row..(src + 1) * row]);
            }
        }
    }
    Some(out)
}

/// The file's full-precision tensors for a `VarBuilder`, by Hugging Face name; quantized ones
/// come dequantized (the decoder asks `Gguf::quantized` first for the matrices it keeps quantized).
pub(crate) struct GgufTensors(pub(crate) Arc<Gguf>);

impl SimpleBackend for GgufTensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            return Err(err(
                &self.0.path,
                format!("tensor {name} has shape {:?}, expected {s:?}", t.shape()),
            ));
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        let g = &self.0;
        let gname = g
            .name_of(name)
            .ok_or_else(|| err(&g.path, format!("no tensor for {name}")))?;
        g.tensor(&gname, &Device::Cpu)?
            .dequantize(&Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.name_of(name).is_some()
    }
}

/// Whether `path` names a GGUF checkpoint (a file ending in `.gguf`) rather than a folder.
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // Two heads of 4 rows, one byte a row: llama.cpp's permute sends HF row s*2+i to 2i+s.
        let hf: Vec<u8> = (0..8).collect();
        let mut gguf = vec![0u8; 8];
        for h in 0..2 {
            for s in 0..2 {
                for i in 0..2 {
                    gguf[h * 4 + 2 * i + s] = hf[h * 4 + s * 2 + i];
                }
            }
        }
        assert_eq!(gguf, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(unpermute_rows(&gguf, 8, 2).unwrap(), hf);
        assert!(unpermute_rows(&gguf, 8, 3).is_none());
    }
}
