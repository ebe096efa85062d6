//! The keys of a judge's structured reply: what the output modes ask for (`output.rs`) and the
//! parser reads back (`parse.rs`), in one leaf both import.

/// The schema's property names, in the order the model should write them.
pub(crate) const ANALYSIS: &str = "analysis";
pub(crate) const EARLIEST_ERROR: &str = "earliest_error";
pub(crate) const ERROR_CATEGORY: &str = "error_category";
/// The names a reply may give as its category ("None" only with index -1).
pub(crate) const CATEGORY_NAMES: [&str; 4] =
    ["Misinterpretation", "Hallucination", "Reasoning", "None"];
