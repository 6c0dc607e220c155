//! The files' names and the state file's format: what every process that
//! shares a lock directory must agree on, byte for byte.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::OwnerId;
use crate::key::LockKey;

pub(super) const STATE_HEADER: &str = "dlock-file-state v1";
/// Encoded names longer than this are replaced by a hash (file names are
/// limited to 255 bytes on most file systems).
pub(super) const MAX_PLAIN_NAME: usize = 160;

/// What `NAME.state` holds.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct State {
    pub(super) counter: u64,
    pub(super) owner: Option<OwnerId>,
    pub(super) expires_at_us: u64,
    pub(super) key: String,
}

/// When a lease of `ttl` taken at `now` (µs) ends: the ttl rounded up to
/// whole microseconds, never down, so the key outlives the holder's own
/// count of its lease rather than ending a fraction before it.
pub(super) fn expiry_after(now: u64, ttl: Duration) -> u64 {
    let ttl_us = u64::try_from(ttl.as_nanos().div_ceil(1_000)).unwrap_or(u64::MAX);
    now.saturating_add(ttl_us)
}

pub(super) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The file-name stem of a key: percent-encoded, or hashed when long.
pub(super) fn file_name(key: &LockKey) -> String {
    let mut name = String::with_capacity(key.as_str().len());
    for byte in key.as_str().bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-' {
            name.push(byte as char);
        } else {
            name.push_str(&format!("%{byte:02X}"));
        }
    }
    if name.len() <= MAX_PLAIN_NAME {
        name
    } else {
        format!("h-{:032x}", fnv1a_128(key.as_str().as_bytes()))
    }
}

/// FNV-1a, 128-bit: stable across builds and platforms (unlike std's
/// hasher), so every process maps a key to the same file.
fn fnv1a_128(bytes: &[u8]) -> u128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    bytes.iter().fold(OFFSET, |hash, &byte| {
        (hash ^ u128::from(byte)).wrapping_mul(PRIME)
    })
}

pub(super) fn render_state(state: &State) -> String {
    let owner = state
        .owner
        .map_or_else(|| "-".to_owned(), |owner| owner.to_string());
    format!(
        "{STATE_HEADER}\ncounter {}\nowner {owner}\nexpires_us {}\nkey {}",
        state.counter, state.expires_at_us, state.key
    )
}

pub(super) fn parse_state(text: &str) -> Option<State> {
    let mut lines = text.splitn(5, '\n');
    if lines.next()? != STATE_HEADER {
        return None;
    }
    let counter = lines.next()?.strip_prefix("counter ")?.parse().ok()?;
    let owner = match lines.next()?.strip_prefix("owner ")? {
        "-" => None,
        hex => Some(OwnerId::parse_hex(hex)?),
    };
    let expires_at_us = lines.next()?.strip_prefix("expires_us ")?.parse().ok()?;
    let key = lines.next()?.strip_prefix("key ")?.to_owned();
    Some(State {
        counter,
        owner,
        expires_at_us,
        key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_with_odd_keys() {
        let state = State {
            counter: 42,
            owner: OwnerId::random().ok(),
            expires_at_us: 1_700_000_000_000_000,
            key: "a\nb key \"quoted\"\nü".into(),
        };
        assert_eq!(parse_state(&render_state(&state)), Some(state));
    }

    #[test]
    fn corrupt_state_is_not_parsed() {
        assert_eq!(parse_state("garbage"), None);
        assert_eq!(parse_state(&format!("{STATE_HEADER}\ncounter x\n")), None);
    }

    #[test]
    fn file_names_are_distinct_and_bounded() {
        let name = |k: &str| file_name(&LockKey::new(k).expect("valid key"));
        assert_ne!(name("a:b"), name("a%3Ab"));
        assert_ne!(name("a.b"), name("a_b"));
        assert!(!name("x.y/../z").contains(['.', '/']));
        let long = "k".repeat(1000);
        assert!(name(&long).len() <= MAX_PLAIN_NAME);
        assert_ne!(name(&long), name(&"k".repeat(999)));
    }
}
