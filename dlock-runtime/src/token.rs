//! Fencing tokens: the number a protected resource uses to reject stale writes.

use std::fmt;

/// A monotonic fencing token handed out with every successful acquisition.
///
/// For one key, every acquisition returns a token strictly greater than every
/// token issued before it (also across process restarts). Send it with every
/// write to the protected resource; the resource keeps the highest token it has
/// accepted and rejects writes carrying a lower one (see [`crate::fence`]).
///
/// ```
/// use dlock_runtime::FencingToken;
/// let older = FencingToken::new(7);
/// let newer = FencingToken::new(8);
/// assert!(older < newer);
/// assert_eq!(newer.get(), 8);
/// assert_eq!(newer.to_string(), "8");
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value, as read back from a resource or a backend.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The raw value, to store next to the data the token protects.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> u64 {
        token.0
    }
}

/// The fencing tokens of a lease on several keys: one per key in the order the
/// keys were written (not the sorted order they were locked in); a key written
/// twice appears twice with the same token.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct FencingTokens(pub(crate) Vec<FencingToken>);

impl FencingTokens {
    /// The token of the `index`-th key as written, if there is one.
    pub fn get(&self, index: usize) -> Option<FencingToken> {
        self.0.get(index).copied()
    }

    /// How many tokens (one per key as written).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tokens in key order.
    pub fn iter(&self) -> impl Iterator<Item = FencingToken> + '_ {
        self.0.iter().copied()
    }

    /// The tokens as a slice, in key order.
    pub fn as_slice(&self) -> &[FencingToken] {
        &self.0
    }
}
