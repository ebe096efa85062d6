//! `--set` overrides: dotted `server.KEY=VALUE` / `reward.KEY=VALUE` /
//! `evaluator.NAME.KEY=VALUE` / `evaluator.NAME.TABLE.KEY=VALUE` applied to the TOML tree before
//! it is deserialised, so every key can be set without editing the file. A value is TOML; text
//! that is not (`model=some/path`) is taken as a string, which only a key that takes a string
//! accepts: for any other key the refusal names the `--set` and the type the key expects.

use crate::rule::{Refused, refuse};
use std::collections::BTreeMap;

/// Applies one override; the value is TOML, or else the bare text as a string, which is then
/// returned so that `check_bare` can see whether the key takes one.
pub(super) fn apply_override<'a>(
    table: &mut toml::Table,
    spec: &'a str,
) -> Result<Option<&'a str>, Refused> {
    let (path, raw) = spec
        .split_once('=')
        .ok_or_else(|| Refused(format!("override {spec:?} is not of the form path=value")))?;
    let raw = raw.trim();
    let (value, bare) = match parse_value(raw) {
        Some(value) => (value, None),
        None => (toml::Value::String(raw.to_string()), Some(raw)),
    };
    insert(table, spec, path, value)?;
    Ok(bare)
}

/// The refusal of `--set spec` whose bare text `raw` (not TOML, so taken as a string) landed on
/// a key that takes no string, read from the error deserialising the config gave; `None` when
/// that error is not about this value.
pub(super) fn check_bare(spec: &str, raw: &str, error: &str) -> Option<Refused> {
    let at = format!("invalid type: string {raw:?}, expected ");
    let expected = error.split_once(&at)?.1.lines().next()?.trim();
    Some(Refused(format!(
        "--set {spec}: expected {}, and `{raw}` is not one",
        readable(expected)
    )))
}

/// serde's name for a type, as a user of a TOML file would say it.
fn readable(expected: &str) -> String {
    match expected {
        "u8" | "u16" | "u32" | "u64" | "usize" | "i8" | "i16" | "i32" | "i64" | "isize" => {
            format!("an integer ({expected})")
        }
        "f32" | "f64" => format!("a number ({expected})"),
        "a boolean" => "a boolean (true or false)".into(),
        "a sequence" => "an array ([...])".into(),
        "a map" => "a table ({ ... })".into(),
        other => other.to_string(),
    }
}

/// Puts `value` at `path` (the part of `spec` before `=`).
fn insert(
    table: &mut toml::Table,
    spec: &str,
    path: &str,
    value: toml::Value,
) -> Result<(), Refused> {
    let parts: Vec<&str> = path.trim().split('.').collect();
    match parts.as_slice() {
        [section @ ("server" | "reward"), key] => {
            let section = table_in(table, section)
                .ok_or_else(|| Refused(format!("`{section}` is not a table")))?;
            section.insert(key.to_string(), value);
            Ok(())
        }
        ["evaluator", name, keys @ ..] if (1..=2).contains(&keys.len()) => {
            let mut t = evaluator(table, name, spec)?;
            if let [inner, _] = keys {
                t = table_in(t, inner).ok_or_else(|| {
                    Refused(format!("override {spec:?}: `{inner}` is not a table"))
                })?;
            }
            t.insert(keys[keys.len() - 1].to_string(), value);
            Ok(())
        }
        _ => refuse(format!(
            "override {spec:?}: the path must be server.KEY, reward.KEY, evaluator.NAME.KEY or \
             evaluator.NAME.TABLE.KEY (e.g. evaluator.NAME.vllm.base_url)"
        )),
    }
}

/// The `[[evaluator]]` table named `name`.
fn evaluator<'a>(
    table: &'a mut toml::Table,
    name: &str,
    spec: &str,
) -> Result<&'a mut toml::Table, Refused> {
    let list = table
        .get_mut("evaluator")
        .and_then(toml::Value::as_array_mut)
        .ok_or_else(|| Refused(format!("override {spec:?}: there is no [[evaluator]]")))?;
    list.iter_mut()
        .filter_map(toml::Value::as_table_mut)
        .find(|t| t.get("name").and_then(toml::Value::as_str) == Some(name))
        .ok_or_else(|| Refused(format!("override {spec:?}: no evaluator is named {name:?}")))
}

/// The table at `key` in `table`, made when missing; `None` when `key` holds something else.
fn table_in<'a>(table: &'a mut toml::Table, key: &str) -> Option<&'a mut toml::Table> {
    table
        .entry(key)
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
}

/// `raw` as a TOML value, if it is one.
fn parse_value(raw: &str) -> Option<toml::Value> {
    let doc = format!("v = {raw}");
    toml::from_str::<BTreeMap<String, toml::Value>>(&doc)
        .ok()?
        .remove("v")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_type_a_key_expected_from_serdes_error() {
        let error = "invalid type: string \"abc\", expected usize\nin `server.max_in_flight`";
        assert_eq!(
            check_bare("server.max_in_flight=abc", "abc", error),
            Some(Refused(
                "--set server.max_in_flight=abc: expected an integer (usize), and `abc` is not one"
                    .into()
            ))
        );
        // An error about another value, or of another kind, is not this override's.
        assert_eq!(check_bare("server.max_in_flight=abc", "xyz", error), None);
        let other = "unknown variant `abc`, expected one of `f32`, `bf16`";
        assert_eq!(check_bare("evaluator.p.dtype=abc", "abc", other), None);
        assert_eq!(readable("a boolean"), "a boolean (true or false)");
        assert_eq!(readable("struct VllmConfig"), "struct VllmConfig");
    }
}
