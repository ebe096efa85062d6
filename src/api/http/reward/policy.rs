//! The policy's tokenizer, for trainers that hand a reward function token ids (AReaL's
//! `prompt_ids` / `completion_ids`, verl's `prompts` / `responses` tensors): loaded once from
//! `[reward] policy_tokenizer`, every id checked against its vocabulary (the error names the
//! field and index), then decoded as the trainers decode.

use super::{RewardBug, Sample, Text};
use crate::engine::EngineError;
use crate::field::FieldPath;
use std::path::Path;
use std::sync::Arc;
use tokenizers::Tokenizer;

/// The policy's tokenizer, as the server loaded it.
pub(crate) struct PolicyTokenizer {
    tokenizer: Tokenizer,
}

/// What a body with token ids gets from a server that has no policy tokenizer.
pub(super) const NO_TOKENIZER: &str = "token ids need the policy's tokenizer, and this server has \
                                       none: set [reward] policy_tokenizer to its folder";

impl PolicyTokenizer {
    /// Loads `tokenizer.json` from `path` (a folder, or the file itself); the error says which
    /// file and why.
    pub(crate) fn load(path: &Path) -> Result<PolicyTokenizer, String> {
        let file = match path.is_dir() {
            true => path.join("tokenizer.json"),
            false => path.to_path_buf(),
        };
        let tokenizer = Tokenizer::from_file(&file)
            .map_err(|e| format!("reading a tokenizer from {}: {e}", file.display()))?;
        Ok(PolicyTokenizer { tokenizer })
    }

    /// `ids` as text. With `skip_special`, special tokens (end of turn, end of text, padding)
    /// are left out, as verl decodes a response; without, they stay, as AReaL decodes a prompt.
    fn decode(
        &self,
        ids: &[u32],
        at: &FieldPath,
        skip_special: bool,
    ) -> Result<String, EngineError> {
        if let Some((i, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| self.tokenizer.id_to_token(**id).is_none())
        {
            return Err(EngineError::invalid(
                at.clone().at(i),
                format!(
                    "token id {id} is not in the policy tokenizer's vocabulary ({} tokens)",
                    self.tokenizer.get_vocab_size(true)
                ),
            ));
        }
        self.tokenizer
            .decode(ids, skip_special)
            .map_err(|e| EngineError::invalid(at.clone(), format!("could not be decoded: {e}")))
    }

    /// A sample's ids as text apart. The prompt keeps its special tokens: its chat markup is
    /// where the question is read (`[reward] question`). The completion drops them: end
    /// markers are not the response.
    fn decode_sample(&self, sample: Sample) -> Result<Sample, EngineError> {
        let Text::Ids { prompt, completion } = &sample.text else {
            return Ok(sample);
        };
        let text = Text::Apart {
            prompt: self.decode(prompt, &sample.prompt_at, false)?,
            is_question: false,
            response: self.decode(completion, &sample.at, true)?,
        };
        Ok(Sample { text, ..sample })
    }
}

/// Decodes every sample given as token ids, on a blocking thread (a batch of long rollouts is
/// real work); samples given as text pass through.
pub(super) async fn decode_ids(
    policy: Option<Arc<PolicyTokenizer>>,
    samples: Vec<Sample>,
) -> Result<Vec<Sample>, EngineError> {
    let Some(first) = samples.iter().find(|s| matches!(s.text, Text::Ids { .. })) else {
        return Ok(samples);
    };
    let Some(policy) = policy else {
        return Err(EngineError::invalid(first.at.clone(), NO_TOKENIZER));
    };
    tokio::task::spawn_blocking(move || {
        samples
            .into_iter()
            .map(|s| policy.decode_sample(s))
            .collect()
    })
    .await
    .map_err(|e| RewardBug::DecodePanicked(e.to_string()))?
}
