//! `--set` overrides: dotted `server.KEY=VALUE` / `reward.KEY=VALUE` / `evaluator.NAME.KEY=VALUE` applied to the TOML
//! tree before it is deserialised, so every key can be set without editing the file.

use std::collections::BTreeMap;

/// Applies `server.key=value` or `evaluator.NAME.key=value`; the value is TOML, or else a string.
pub(super) fn apply_override(table: &mut toml::Table, spec: &str) -> Result<(), String> {
    let (path, raw) = spec
        .split_once('=')
        .ok_or_else(|| format!("override {spec:?} is not of the form path=value"))?;
    let value = parse_value(raw.trim());
    let parts: Vec<&str> = path.trim().split('.').collect();
    match parts.as_slice() {
        [section @ ("server" | "reward"), key] => {
            let server = table
                .entry(*section)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let server = server
                .as_table_mut()
                .ok_or_else(|| format!("`{section}` is not a table"))?;
            server.insert(key.to_string(), value);
            Ok(())
        }
        ["evaluator", name, key] => {
            let list = table
                .get_mut("evaluator")
                .and_then(toml::Value::as_array_mut)
                .ok_or_else(|| format!("override {spec:?}: there is no [[evaluator]]"))?;
            let found = list
                .iter_mut()
                .filter_map(toml::Value::as_table_mut)
                .find(|t| t.get("name").and_then(toml::Value::as_str) == Some(name));
            let t = found
                .ok_or_else(|| format!("override {spec:?}: no evaluator is named {name:?}"))?;
            t.insert(key.to_string(), value);
            Ok(())
        }
        _ => Err(format!(
            "override {spec:?}: the path must be server.KEY, reward.KEY or evaluator.NAME.KEY"
        )),
    }
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
