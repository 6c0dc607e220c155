//! Lock keys: validated, length-limited, and built from templates so that
//! interpolated values can never collide.
//!
//! A key is data, never code: backends pass it as a script or statement
//! argument. Templated keys escape every interpolated value, so the template
//! `a:{x}:{y}` gives different keys for `("1:2", "3")` and `("1", "2:3")`.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use crate::error::LockError;

/// The longest key accepted, in bytes (after escaping).
pub const MAX_KEY_LEN: usize = 1024;

/// A validated lock key: non-empty, at most [`MAX_KEY_LEN`] bytes, no NUL.
///
/// ```
/// use dlock_runtime::LockKey;
/// let key = LockKey::new("report:2026-11")?;
/// assert_eq!(key.as_str(), "report:2026-11");
/// assert!(LockKey::new("").is_err());
/// # Ok::<(), dlock_runtime::LockError>(())
/// ```
///
/// Cloning is cheap (a shared string): the core and the backends keep
/// copies of a held key in several places.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockKey(Arc<str>);

impl LockKey {
    /// Validates `key` as it is (no escaping: it is one whole key).
    pub fn new(key: impl Into<String>) -> Result<Self, LockError> {
        let key = key.into();
        if key.is_empty() {
            return Err(LockError::invalid_key(&key, "a lock key must not be empty"));
        }
        if key.len() > MAX_KEY_LEN {
            let reason = format!(
                "a lock key is at most {MAX_KEY_LEN} bytes, this one is {} bytes",
                key.len()
            );
            return Err(LockError::invalid_key(&key, reason));
        }
        if key.contains('\0') {
            return Err(LockError::invalid_key(
                &key,
                "a lock key must not contain NUL",
            ));
        }
        Ok(Self(Arc::from(key)))
    }

    /// Starts a templated key; see [`KeyBuilder`].
    pub fn builder() -> KeyBuilder {
        KeyBuilder::new()
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for LockKey {
    type Error = LockError;
    fn try_from(key: &str) -> Result<Self, LockError> {
        LockKey::new(key)
    }
}

impl TryFrom<String> for LockKey {
    type Error = LockError;
    fn try_from(key: String) -> Result<Self, LockError> {
        LockKey::new(key)
    }
}

/// Whether `c` is escaped when it appears in an interpolated value.
///
/// Values keep letters, digits, `-`, `_`, `.` and printable non-ASCII text;
/// everything else (ASCII punctuation such as `:` `/` `{` `%`, white space,
/// control characters) is percent-encoded. A template therefore needs one of
/// these characters between two placeholders to stay unambiguous.
pub fn is_escaped_in_values(c: char) -> bool {
    if c.is_ascii() {
        !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    } else {
        c.is_whitespace() || c.is_control()
    }
}

/// Whether `c` may appear in a key template's literal text: printable ASCII
/// other than `{` `}` `"` `'` `\` `%` and `` ` ``, the same for
/// `#[distributed_lock(key = "...")]` and [`KeyBuilder::lit`]. Above all no
/// `%`: a literal holding what an escaped value looks like (`%3A`) would let
/// different values give one key.
pub fn is_allowed_in_literals(c: char) -> bool {
    c.is_ascii_graphic() && !matches!(c, '{' | '}' | '"' | '\'' | '\\' | '%' | '`')
}

/// Builds a key from literal parts and escaped [`Display`](fmt::Display)
/// values: what `#[distributed_lock(key = "...")]` generates, usable by hand.
/// Literal parts may hold only what the macro allows in a template (see
/// [`is_allowed_in_literals`]); [`finish`](KeyBuilder::finish) refuses any
/// other.
///
/// ```
/// use dlock_runtime::LockKey;
/// let a = LockKey::builder().lit("a:").value(&"1:2").lit(":").value(&3).finish()?;
/// let b = LockKey::builder().lit("a:").value(&1).lit(":").value(&"2:3").finish()?;
/// assert_eq!(a.as_str(), "a:1%3A2:3");
/// assert_eq!(b.as_str(), "a:1:2%3A3");
/// assert_ne!(a, b);
/// # Ok::<(), dlock_runtime::LockError>(())
/// ```
#[derive(Debug, Default)]
pub struct KeyBuilder {
    key: String,
    /// A value was written and no separator followed it yet.
    open_value: bool,
    /// Two values touched with no separator between them.
    ambiguous: bool,
    /// The first literal part holding a character literals may not hold.
    refused_literal: Option<(String, char)>,
}

impl KeyBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a literal part as it is. A part holding a character
    /// [`is_allowed_in_literals`] refuses makes [`finish`](Self::finish)
    /// fail.
    pub fn lit(mut self, literal: &str) -> Self {
        if self.refused_literal.is_none()
            && let Some(c) = literal.chars().find(|&c| !is_allowed_in_literals(c))
        {
            self.refused_literal = Some((literal.to_owned(), c));
        }
        if literal.chars().any(is_escaped_in_values) {
            self.open_value = false;
        }
        self.key.push_str(literal);
        self
    }

    /// Appends a value, formatted with `Display` and escaped.
    pub fn value(mut self, value: &dyn fmt::Display) -> Self {
        if self.open_value {
            self.ambiguous = true;
        }
        self.open_value = true;
        // Formatting into the escaping writer cannot fail unless the value's
        // own Display impl reports an error; that is caught in `finish`.
        let before = self.key.len();
        let mut out = Escaping(&mut self.key);
        if write!(out, "{value}").is_err() {
            self.key.truncate(before);
            self.ambiguous = true;
        }
        self
    }

    /// Validates and returns the key.
    pub fn finish(self) -> Result<LockKey, LockError> {
        if let Some((literal, c)) = &self.refused_literal {
            let reason = format!(
                "the literal part {literal:?} holds {c:?}: literal text may only contain ASCII \
                 letters, digits and punctuation other than {{ }} \" ' \\ % ` (a '%' could \
                 pass for an escaped value, so two different values could give one key)"
            );
            return Err(LockError::invalid_key(&self.key, reason));
        }
        if self.ambiguous {
            return Err(LockError::invalid_key(
                &self.key,
                "two interpolated values need a separator such as ':' between them \
                 (or a value's Display implementation failed)",
            ));
        }
        LockKey::new(self.key)
    }
}

/// A `fmt::Write` that percent-encodes what [`is_escaped_in_values`] marks.
struct Escaping<'a>(&'a mut String);

impl fmt::Write for Escaping<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for c in s.chars() {
            if is_escaped_in_values(c) {
                let mut buf = [0u8; 4];
                for byte in c.encode_utf8(&mut buf).bytes() {
                    write!(self.0, "%{byte:02X}")?;
                }
            } else {
                self.0.push(c);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two(x: &str, y: &str) -> String {
        LockKey::builder()
            .lit("a:")
            .value(&x)
            .lit(":")
            .value(&y)
            .finish()
            .map(|k| k.as_str().to_owned())
            .unwrap_or_default()
    }

    #[test]
    fn values_with_separators_do_not_collide() {
        assert_ne!(two("1:2", "3"), two("1", "2:3"));
        assert_ne!(two("1%3A2", "3"), two("1:2", "3"));
        assert_eq!(two("ü x", "{}"), "a:ü%20x:%7B%7D");
    }

    #[test]
    fn a_literal_holding_a_percent_escape_cannot_make_two_value_pairs_collide() {
        let key = |x: &str, y: &str| {
            LockKey::builder()
                .lit("job:")
                .value(&x)
                .lit("%3A")
                .value(&y)
                .finish()
        };
        // (":", "b") and ("", ":b") would both give `job:%3A%3Ab`.
        match key(":", "b") {
            Err(LockError::InvalidKey { reason, .. }) => {
                assert!(reason.contains("\"%3A\""), "names the literal: {reason}");
                assert!(reason.contains("'%'"), "names the character: {reason}");
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
        assert!(key("", ":b").is_err());
    }

    #[test]
    fn literals_refuse_what_the_macro_refuses() {
        for bad in ["{", "}", "\"", "'", "\\", "%", "`", " ", "\n", "ü"] {
            let key = LockKey::builder().lit("a").lit(bad).value(&1).finish();
            assert!(
                matches!(key, Err(LockError::InvalidKey { .. })),
                "{bad:?} was accepted"
            );
        }
        let key = LockKey::builder()
            .lit("a:b/c-d_e.f@g#h|")
            .value(&1)
            .finish();
        assert!(key.is_ok(), "{key:?}");
    }

    #[test]
    fn adjacent_values_without_separator_are_rejected() {
        let key = LockKey::builder().value(&1).lit("x").value(&2).finish();
        assert!(matches!(key, Err(LockError::InvalidKey { .. })));
        let key = LockKey::builder().value(&1).lit("x:").value(&2).finish();
        assert!(key.is_ok());
    }

    #[test]
    fn empty_long_and_nul_keys_are_rejected() {
        assert!(LockKey::new("").is_err());
        assert!(LockKey::new("a\0b").is_err());
        assert!(LockKey::new("k".repeat(MAX_KEY_LEN)).is_ok());
        let err = LockKey::new("k".repeat(MAX_KEY_LEN + 1)).err();
        match err {
            Some(LockError::InvalidKey { key, reason }) => {
                assert!(key.chars().count() <= 65, "long keys are cut in errors");
                assert!(reason.contains("1025 bytes"), "{reason}");
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
    }
}
