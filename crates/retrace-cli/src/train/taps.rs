//! Taps: which decoder layers' hidden states, averaged, make a step's feature. Named on the
//! command line (`final`, `topN`, `middle`, a layer `N`, a range `A-B`) and resolved against
//! the base's layer count; layer `num_hidden_layers` is the state after the final norm. `topN`
//! on a base of fewer than N layers averages all of them.

use super::TrainError;

/// A candidate feature: its name as given and the 0-based layers averaged.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Tap {
    pub(crate) name: String,
    pub(crate) layers: Vec<usize>,
}

/// The default candidates: the final normed state, the mean of the top four layers, the middle.
pub(crate) const DEFAULT: &str = "final,top4,middle";

/// Resolves each name of `specs` against a decoder of `layers` layers; duplicates (two names
/// for the same layers) keep the first.
pub(crate) fn resolve(specs: &[String], layers: usize) -> Result<Vec<Tap>, TrainError> {
    let mut out: Vec<Tap> = Vec::new();
    for spec in specs {
        let tap = Tap {
            name: spec.clone(),
            layers: one(spec.trim(), layers)?,
        };
        if !out.iter().any(|t| t.layers == tap.layers) {
            out.push(tap);
        }
    }
    if out.is_empty() {
        return Err(TrainError::Usage("--taps names no tap".into()));
    }
    Ok(out)
}

fn one(spec: &str, layers: usize) -> Result<Vec<usize>, TrainError> {
    let bad = |why: String| {
        TrainError::Usage(format!(
            "--taps {spec:?}: {why}; a tap is final, topN, middle, a layer N or a range A-B \
             (layers 0..={layers}, {layers} being the state after the final norm)"
        ))
    };
    let number = |s: &str| {
        s.parse::<usize>()
            .map_err(|_| bad(format!("{s:?} is not a layer number")))
    };
    let in_range = |v: Vec<usize>| match v.iter().find(|&&l| l > layers) {
        Some(l) => Err(bad(format!("the base has no layer {l}"))),
        None => Ok(v),
    };
    match spec {
        "final" => Ok(vec![layers]),
        "middle" => Ok(vec![layers / 2]),
        _ if spec.starts_with("top") => {
            // A base with fewer layers than N averages all of them.
            let n = number(&spec[3..])?.min(layers);
            if n == 0 {
                return Err(bad("top0 names no layer".into()));
            }
            Ok((layers - n..layers).collect())
        }
        _ => match spec.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if a > b {
                    return Err(bad("the range is empty".into()));
                }
                in_range((a..=b).collect())
            }
            None => in_range(vec![number(spec)?]),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(s: &str) -> Vec<String> {
        s.split(',').map(String::from).collect()
    }

    #[test]
    fn resolves_names_against_the_layer_count() {
        let taps = resolve(&specs(DEFAULT), 30).unwrap();
        let layers: Vec<_> = taps.iter().map(|t| t.layers.clone()).collect();
        assert_eq!(layers, [vec![30], vec![26, 27, 28, 29], vec![15]]);
        let taps = resolve(&specs("3-5,4,final,30"), 30).unwrap();
        assert_eq!(taps.len(), 3, "{taps:?}"); // 30 is final
        assert_eq!(taps[0].layers, [3, 4, 5]);
    }

    #[test]
    fn refuses_layers_the_base_lacks() {
        assert_eq!(resolve(&specs("top4"), 2).unwrap()[0].layers, [0, 1]);
        for s in ["31", "top0", "5-3", "x", "top", "2-31"] {
            let e = resolve(&specs(s), 30).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--taps {s:?}")), "{e}");
        }
    }
}
