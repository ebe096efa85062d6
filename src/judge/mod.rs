//! LLM judges behind an OpenAI-compatible endpoint: prompt templates, reply parsing and voting.

pub mod parse;
pub mod prompt;
