//! The PRM families by name: what a config's `family` key selects (docs/prm-formats.md).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    QwenMathPrm,
    Skywork,
    MathShepherd,
    Rlhflow,
    ChatLm,
    /// A sequence-classification reward model: one raw reward for the whole trace.
    OutcomeRm,
    /// A head trained on a frozen base (a head folder): not a format of its own; the folder's
    /// config names the format it reads.
    Head,
}

impl Family {
    /// Every family, in the order the docs list them.
    pub const ALL: [Family; 7] = [
        Family::QwenMathPrm,
        Family::Skywork,
        Family::MathShepherd,
        Family::Rlhflow,
        Family::ChatLm,
        Family::OutcomeRm,
        Family::Head,
    ];

    /// The family's name in configs and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::QwenMathPrm => "qwen2-math-prm",
            Family::Skywork => "skywork-prm",
            Family::MathShepherd => "math-shepherd",
            Family::Rlhflow => "rlhflow",
            Family::ChatLm => "chat-lm",
            Family::OutcomeRm => "outcome-rm",
            Family::Head => "head",
        }
    }

    /// Whether it scores the trace as a whole (one score) rather than each step.
    pub(crate) fn is_outcome(self) -> bool {
        self == Family::OutcomeRm
    }

    /// Whether it is an input format (every family but `head`).
    pub(crate) fn is_format(self) -> bool {
        self != Family::Head
    }

    pub fn parse(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.as_str() == name)
    }

    /// The names, comma-separated, for messages.
    pub fn names() -> String {
        Family::ALL.map(Family::as_str).join(", ")
    }
}

impl serde::Serialize for Family {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Family {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <String as serde::Deserialize>::deserialize(d)?;
        Family::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!("family {name:?} is not one of {}", Family::names()))
        })
    }
}
