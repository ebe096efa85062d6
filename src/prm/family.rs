//! The PRM families by name (docs/prm-formats.md), and what a config's `family` key selects:
//! a family's own checkpoint, or a trained head over a base.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    QwenMathPrm,
    Skywork,
    MathShepherd,
    Rlhflow,
    ChatLm,
    /// A sequence-classification reward model: one raw reward for the whole trace.
    OutcomeRm,
}

/// What a PRM's `family` key names: a family's checkpoint, or `head`, a head trained on a
/// frozen base. A head is not a format: it is a set of weights read through a family's format,
/// which its folder names, so a `Family` is always one the formatter can render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrmKind {
    Checkpoint(Family),
    /// A head folder `retrace train-head` wrote.
    Head,
}

impl Family {
    /// Every family, in the order the docs list them.
    pub const ALL: [Family; 6] = [
        Family::QwenMathPrm,
        Family::Skywork,
        Family::MathShepherd,
        Family::Rlhflow,
        Family::ChatLm,
        Family::OutcomeRm,
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
        }
    }

    /// Whether it scores the trace as a whole (one score) rather than each step.
    pub(crate) fn is_outcome(self) -> bool {
        self == Family::OutcomeRm
    }

    pub fn parse(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.as_str() == name)
    }

    /// The names, comma-separated, for messages.
    pub fn names() -> String {
        Family::ALL.map(Family::as_str).join(", ")
    }
}

impl PrmKind {
    const HEAD: &'static str = "head";

    pub fn as_str(self) -> &'static str {
        match self {
            PrmKind::Checkpoint(f) => f.as_str(),
            PrmKind::Head => Self::HEAD,
        }
    }

    pub fn parse(name: &str) -> Option<PrmKind> {
        match name {
            Self::HEAD => Some(PrmKind::Head),
            _ => Family::parse(name).map(PrmKind::Checkpoint),
        }
    }

    /// The family whose checkpoint it is; `None` for a head (its folder names its format).
    pub fn family(self) -> Option<Family> {
        match self {
            PrmKind::Checkpoint(f) => Some(f),
            PrmKind::Head => None,
        }
    }

    /// Whether it scores the trace as a whole (one score) rather than each step.
    pub(crate) fn is_outcome(self) -> bool {
        self.family().is_some_and(Family::is_outcome)
    }

    /// The names a `family` key takes, comma-separated, for messages.
    pub fn names() -> String {
        format!("{}, {}", Family::names(), Self::HEAD)
    }
}

impl From<Family> for PrmKind {
    fn from(f: Family) -> Self {
        PrmKind::Checkpoint(f)
    }
}

impl serde::Serialize for PrmKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for PrmKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <String as serde::Deserialize>::deserialize(d)?;
        PrmKind::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "family {name:?} is not one of {}",
                PrmKind::names()
            ))
        })
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
