//! `--set` overrides: dotted `server.KEY=VALUE` / `reward.KEY=VALUE` /
//! `evaluator.NAME.KEY=VALUE` / `evaluator.NAME.TABLE.KEY=VALUE` applied to the TOML tree before
//! it is deserialised, so every key can be set without editing the file.

use crate::rule::{Refused, refuse};
use std::collections::BTreeMap;

/// Applies one override; the value is TOML, or else a string.
pub(super) fn apply_override(table: &mut toml::Table, spec: &str) -> Result<(), Refused> {
    let (path, raw) = spec
        .split_once('=')
        .ok_or_else(|| Refused(format!("override {spec:?} is not of the form path=value")))?;
    let value = parse_value(raw.trim());
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

fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match toml::from_str::<BTreeMap<String, toml::Value>>(&doc) {
        Ok(mut m) => m
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}
