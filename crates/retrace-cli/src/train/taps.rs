//! Taps: which decoder layers' hidden states make a step's feature. Named on the command line
//! (`final`, `topN`, `middle`, a layer `N`, a range `A-B`, each averaged, or parts joined by
//! `+`, whose means are concatenated) and resolved against the base's layer count; layer
//! `num_hidden_layers` is the state after the final norm. `topN` on a base of fewer than N
//! layers averages all of them. A part `span:X` reads X's mean over each step's own tokens
//! rather than at the step's read position.

use super::TrainError;
use candle_core::Tensor;
use retrace::Pool;

/// A candidate feature: its name as given and its parts, each the 0-based layers averaged
/// (at the read, or over the step's tokens: `pools`, one per part); the parts' means are
/// concatenated in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Tap {
    pub(crate) name: String,
    pub(crate) parts: Vec<Vec<usize>>,
    pub(crate) pools: Vec<Pool>,
}

/// One part as the base is asked for it: its layers and where they are read.
pub(crate) type TapPart = (Vec<usize>, Pool);

impl Tap {
    /// The tap's parts with their pools.
    pub(crate) fn with_pools(&self) -> impl Iterator<Item = TapPart> + '_ {
        self.parts.iter().cloned().zip(self.pools.iter().copied())
    }

    /// The pools a head folder records: none when every part is read at the read position,
    /// so such a folder reads as it did before pools existed.
    pub(crate) fn recorded_pools(&self) -> Vec<Pool> {
        match self.pools.iter().all(|p| *p == Pool::Read) {
            true => Vec::new(),
            false => self.pools.clone(),
        }
    }

    /// The tap's feature rows from every part's (`columns`, in `parts` order): its parts'
    /// columns side by side, as the served head concatenates its groups' means.
    pub(crate) fn rows(&self, parts: &[TapPart], columns: &[Tensor]) -> Result<Tensor, TrainError> {
        let mine = self
            .with_pools()
            .map(|p| {
                let i = parts.iter().position(|q| *q == p);
                i.and_then(|i| columns.get(i)).cloned().ok_or_else(|| {
                    TrainError::Usage(format!("tap {}: part {p:?} was not extracted", self.name))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        match mine.as_slice() {
            [one] => Ok(one.clone()),
            _ => Ok(Tensor::cat(&mine, 1)?),
        }
    }
}

/// Every part the taps name, once, in the order first named: what the base is asked for (and
/// the feature cache keyed by). A tap's feature is its parts' columns from these.
pub(crate) fn parts(taps: &[Tap]) -> Vec<TapPart> {
    let mut out: Vec<TapPart> = Vec::new();
    for p in taps.iter().flat_map(Tap::with_pools) {
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// The default candidates: the final normed state, the mean of the top four layers, the middle.
pub(crate) const DEFAULT: &str = "final,top4,middle";

/// Resolves each name of `specs` against a decoder of `layers` layers; duplicates (two names
/// for the same layers) keep the first.
pub(crate) fn resolve(specs: &[String], layers: usize) -> Result<Vec<Tap>, TrainError> {
    let mut out: Vec<Tap> = Vec::new();
    for spec in specs {
        let (parts, pools) = spec
            .split('+')
            .map(|part| match part.trim().strip_prefix("span:") {
                Some(inner) => Ok((one(spec, inner.trim(), layers)?, Pool::Span)),
                None => Ok((one(spec, part.trim(), layers)?, Pool::Read)),
            })
            .collect::<Result<Vec<_>, TrainError>>()?
            .into_iter()
            .unzip();
        let tap = Tap {
            name: spec.clone(),
            parts,
            pools,
        };
        if !out
            .iter()
            .any(|t| t.parts == tap.parts && t.pools == tap.pools)
        {
            out.push(tap);
        }
    }
    if out.is_empty() {
        return Err(TrainError::Usage("--taps names no tap".into()));
    }
    Ok(out)
}

/// One part of the tap `tap`: the layers it averages.
fn one(tap: &str, spec: &str, layers: usize) -> Result<Vec<usize>, TrainError> {
    let bad = |why: String| {
        TrainError::Usage(format!(
            "--taps {tap:?}: {why}; a tap is final, topN, middle, a layer N or a range A-B, \
             each read at the step's read position or, prefixed span:, averaged over the step's \
             tokens, or such parts joined by + (concatenated) (layers 0..={layers}, {layers} \
             being the state after the final norm)"
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
        let layers: Vec<_> = taps.iter().map(|t| t.parts.clone()).collect();
        assert_eq!(layers, [[vec![30]], [vec![26, 27, 28, 29]], [vec![15]]]);
        let taps = resolve(&specs("3-5,4,final,30"), 30).unwrap();
        assert_eq!(taps.len(), 3, "{taps:?}"); // 30 is final
        assert_eq!(taps[0].parts, [[3, 4, 5]]);
    }

    #[test]
    fn parts_joined_by_plus_are_concatenated_and_asked_for_once() {
        let taps = resolve(&specs("middle,middle+final,top2+ 15"), 30).unwrap();
        assert_eq!(taps[1].parts, [vec![15], vec![30]]);
        assert_eq!(taps[2].parts, [vec![28, 29], vec![15]]);
        let read = |l: Vec<usize>| (l, Pool::Read);
        assert_eq!(
            parts(&taps),
            [read(vec![15]), read(vec![30]), read(vec![28, 29])]
        );
        let e = resolve(&specs("middle+31"), 30).unwrap_err().to_string();
        assert!(
            e.starts_with("--taps \"middle+31\": the base has no layer 31"),
            "{e}"
        );
        assert!(resolve(&specs("middle+"), 30).is_err());
    }

    #[test]
    fn a_span_part_reads_the_same_layers_over_the_steps_tokens() {
        let taps = resolve(&specs("middle,middle+span:middle,span:middle"), 30).unwrap();
        assert_eq!(taps[1].parts, [vec![15], vec![15]]);
        assert_eq!(taps[1].pools, [Pool::Read, Pool::Span]);
        assert_eq!(taps[0].recorded_pools(), []);
        assert_eq!(taps[2].recorded_pools(), [Pool::Span]);
        // Asked for once each: the read and the span of layer 15 are two parts.
        assert_eq!(
            parts(&taps),
            [(vec![15], Pool::Read), (vec![15], Pool::Span)]
        );
        let e = resolve(&specs("span:31"), 30).unwrap_err().to_string();
        assert!(e.contains("no layer 31"), "{e}");
    }

    #[test]
    fn refuses_layers_the_base_lacks() {
        assert_eq!(resolve(&specs("top4"), 2).unwrap()[0].parts, [[0, 1]]);
        for s in ["31", "top0", "5-3", "x", "top", "2-31"] {
            let e = resolve(&specs(s), 30).unwrap_err().to_string();
            assert!(e.starts_with(&format!("--taps {s:?}")), "{e}");
        }
    }
}
