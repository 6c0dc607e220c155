//! The files' names and the state file's format: what every process that
//! shares a lock directory must agree on, byte for byte.
//!
//! `NAME.state` reads:
//!
//! ```text
//! dlock-file-state v1
//! counter 42
//! owner 0123456789abcdef0123456789abcdef
//! expires_us 1700000000000000
//! key the key as it is, newlines and all
//! \0identity 0123456789abcdef0123456789abcdef web-3%20(pid%204121)
//! \0holder 0123456789abcdef0123456789abcdef 1699999970000000 1%09web-3%094121%09billing
//! ```
//!
//! The lines after the key are fields, each started by a NUL: the key
//! cannot hold one, so `\n\0` marks the end of the key unambiguously.
//! Each names the owner that wrote it, and is there only while that owner
//! holds the key:
//!
//! - `identity`: the percent-encoded identity the owner gave, if any.
//! - `holder`: who took the key (the [`HolderInfo`](crate::HolderInfo)
//!   record, percent-encoded: host, pid and label) and when, in wall-clock
//!   microseconds since the Unix epoch. Every acquisition of this version
//!   writes it.
//!
//! Fields come after the key so that a state written without any is byte
//! for byte the format of the first version, and earlier versions read
//! them without calling the state corrupt: processes of every version can
//! share a directory during a rolling upgrade, both ways.
//!
//! - The first version keeps everything after `key ` as the key, and never
//!   compares it: it takes the fields for part of the key.
//! - The version that added `identity` reads the key up to the first field
//!   and skips fields it does not know, such as `holder`.
//! - This version reads a state of either without a `holder` field: its
//!   holder is unknown (`None`), never a corrupt state, and unknown fields
//!   a later version adds are skipped the same way.
//!
//! An earlier version that rewrites a state (a forced release, a retry by
//! the owner) may keep the fields as part of the key; the owner written in
//! each is why such a left-over line is never read as the identity or the
//! holder of a later holder.
//!
//! One field names no owner: `queued` (a bare word), there while the key's
//! queue of fair waiters (`NAME.queue`, below) may hold entries. It is a
//! hint, so that a plain release or acquisition never opens the queue file
//! when nobody queues: a left-over `queued` costs one look at an empty
//! queue, which then clears it, and a `queued` an earlier version dropped
//! while rewriting the state only lets that version's own release pass the
//! waiters by (they take the key at their next attempt), since every
//! queueing attempt reads the queue file whatever the state says and puts
//! the field back.
//!
//! Shared locks and permits add fields an earlier version skips (see the
//! `modes` module): a bare `group` (the `owner` line names the group of
//! shared and permit holders, and `expires_us` is its latest member's
//! expiry, so an earlier version sees the key held), one
//! `reader OWNER TOKEN EXPIRES_US SINCE_US +RECORD` or
//! `permit SLOT OWNER TOKEN EXPIRES_US SINCE_US +RECORD` a member (read
//! only with `group`), and one `mark OWNER EXPIRES_US` a writer-waiting
//! mark. An unreadable one is no member or mark, never a corrupt state.
//!
//! `NAME.queue` reads, one fair waiter a line, first in line first:
//!
//! ```text
//! dlock-file-queue v1
//! 0123456789abcdef0123456789abcdef 30000000 1700000003000000 +1%09web-3%094121%09billing -
//! fedcba9876543210fedcba9876543210 10000000 1700000003500000 +1%09web-4%09977%09 +leader%201
//! ```
//!
//! Each line: the waiter's owner, the ttl its attempt asked for (µs), when
//! its entry expires unless refreshed (wall clock, µs), its holder record
//! and its identity (`+` and the percent-encoded text, or `-` for none). It
//! is rewritten in place with the key locked, never read without that
//! lock; an unreadable line (a crash mid-write) is no entry, and a waiter
//! that lost its entry joins again at its next attempt.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::OwnerId;
use crate::key::LockKey;

pub(super) const STATE_HEADER: &str = "dlock-file-state v1";
pub(super) const QUEUE_HEADER: &str = "dlock-file-queue v1";
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
    /// Who `owner` said it is when it took the key; only ever with an owner.
    pub(super) identity: Option<String>,
    /// Which process `owner` is and when it took the key; only ever with
    /// an owner, and `None` for one an earlier version took.
    pub(super) holder: Option<HolderRecord>,
    /// The key's queue file may hold fair waiters (the `queued` field).
    pub(super) queued: bool,
    /// `owner` names the group of shared holders and permit holders, not
    /// an exclusive holder (the `group` field): its alive file is locked
    /// shared by every member, and `expires_at_us` is the latest member's.
    pub(super) group: bool,
    /// The shared holders and permit holders, while `group`.
    pub(super) members: Vec<Member>,
    /// Writer-waiting marks (rule M3): an owner and when its mark expires.
    pub(super) marks: Vec<(OwnerId, u64)>,
}

/// A shared holder (a reader, `slot` `None`) or a permit holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Member {
    pub(super) owner: OwnerId,
    /// The permit slot; `None` for a reader.
    pub(super) slot: Option<u32>,
    /// The member's token: the phase token for a reader.
    pub(super) token: u64,
    /// When its lease ends: wall clock, µs.
    pub(super) expires_at_us: u64,
    /// When it took the key: wall clock, µs.
    pub(super) since_us: u64,
    /// Its encoded holder record.
    pub(super) record: String,
}

/// A fair waiter's entry in `NAME.queue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Waiter {
    pub(super) owner: OwnerId,
    /// The ttl its attempt asked for, in µs: a handoff grants that long.
    pub(super) ttl_us: u64,
    /// When the entry is skipped unless refreshed: wall clock, µs.
    pub(super) expires_at_us: u64,
    /// The holder record a handoff writes for it.
    pub(super) record: String,
    /// The identity a handoff records for it.
    pub(super) identity: Option<String>,
}

/// The `holder` field: the owner's encoded [`HolderInfo`](crate::HolderInfo)
/// record, kept as written (a reader decodes it), and when it took the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct HolderRecord {
    pub(super) record: String,
    /// When the key was taken: wall clock, µs since the Unix epoch.
    pub(super) since_us: u64,
}

/// When a lease of `ttl` taken at `now` (µs) ends: the ttl rounded up to
/// whole microseconds, never down, so the key outlives the holder's own
/// count of its lease rather than ending a fraction before it.
pub(super) fn expiry_after(now: u64, ttl: Duration) -> u64 {
    now.saturating_add(micros(ttl))
}

/// `duration` in whole microseconds, rounded up.
pub(super) fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos().div_ceil(1_000)).unwrap_or(u64::MAX)
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

/// Ends the key (which cannot hold a NUL) and starts a line of its own.
const FIELD_START: &str = "\n\0";

pub(super) fn render_state(state: &State) -> String {
    let owner = state
        .owner
        .map_or_else(|| "-".to_owned(), |owner| owner.to_string());
    let mut text = format!(
        "{STATE_HEADER}\ncounter {}\nowner {owner}\nexpires_us {}\nkey {}",
        state.counter, state.expires_at_us, state.key
    );
    if let (Some(owner), Some(identity)) = (state.owner, &state.identity) {
        text.push_str(&format!(
            "{FIELD_START}identity {owner} {}",
            encode(identity)
        ));
    }
    if let (Some(owner), Some(holder)) = (state.owner, &state.holder) {
        text.push_str(&format!(
            "{FIELD_START}holder {owner} {} {}",
            holder.since_us,
            encode(&holder.record)
        ));
    }
    if state.queued {
        text.push_str(&format!("{FIELD_START}{QUEUED_FIELD}"));
    }
    if state.group {
        text.push_str(&format!("{FIELD_START}{GROUP_FIELD}"));
    }
    for m in &state.members {
        let head = match m.slot {
            None => "reader".to_owned(),
            Some(slot) => format!("permit {slot}"),
        };
        text.push_str(&format!(
            "{FIELD_START}{head} {} {} {} {} +{}",
            m.owner,
            m.token,
            m.expires_at_us,
            m.since_us,
            encode(&m.record)
        ));
    }
    for (owner, expires_at_us) in &state.marks {
        text.push_str(&format!("{FIELD_START}mark {owner} {expires_at_us}"));
    }
    text
}

/// The field that says `owner` names the group of shared and permit
/// holders.
const GROUP_FIELD: &str = "group";

/// A `reader` or `permit` field's value (after the name): `None` if it
/// does not read as one, which is no member (as an unreadable field is
/// no field elsewhere).
fn parse_member(field: &str) -> Option<Member> {
    let (slot, rest) = if let Some(rest) = field.strip_prefix("reader ") {
        (None, rest)
    } else {
        let rest = field.strip_prefix("permit ")?;
        let (slot, rest) = rest.split_once(' ')?;
        (Some(slot.parse().ok()?), rest)
    };
    let mut words = rest.split(' ');
    let owner = OwnerId::parse_hex(words.next()?)?;
    let token = words.next()?.parse().ok()?;
    let expires_at_us = words.next()?.parse().ok()?;
    let since_us = words.next()?.parse().ok()?;
    let record = decode(words.next()?.strip_prefix('+')?)?;
    if words.next().is_some() {
        return None;
    }
    Some(Member {
        owner,
        slot,
        token,
        expires_at_us,
        since_us,
        record,
    })
}

/// A `mark` field's value: its owner and expiry.
fn parse_mark(field: &str) -> Option<(OwnerId, u64)> {
    let (owner, expires) = field.strip_prefix("mark ")?.split_once(' ')?;
    Some((OwnerId::parse_hex(owner)?, expires.parse().ok()?))
}

/// The field that says the queue file may hold entries.
const QUEUED_FIELD: &str = "queued";

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
    let mut fields = lines.next()?.split(FIELD_START);
    let key = fields.next()?.strip_prefix("key ")?.to_owned();
    // Only the fields the current owner wrote: one left behind by a holder
    // before (an earlier version rewrote the state, keeping the line) is
    // not this owner's. An unreadable one is no field: the counter is what
    // must never be lost. Lines a later version may add are skipped.
    let owners_field = |name: &str| {
        let prefix = format!("{name} ");
        fields
            .clone()
            .filter_map(move |field| field.strip_prefix(prefix.as_str())?.split_once(' '))
            .find(|(by, _)| owner.is_some() && OwnerId::parse_hex(by) == owner)
            .map(|(_, value)| value)
    };
    let queued = fields.clone().any(|field| field == QUEUED_FIELD);
    let group = owner.is_some() && fields.clone().any(|field| field == GROUP_FIELD);
    let members = if group {
        fields.clone().filter_map(parse_member).collect()
    } else {
        Vec::new()
    };
    let marks = fields.clone().filter_map(parse_mark).collect();
    let identity = owners_field("identity").and_then(decode);
    let holder = owners_field("holder").and_then(|value| {
        let (since_us, encoded) = value.split_once(' ')?;
        Some(HolderRecord {
            record: decode(encoded)?,
            since_us: since_us.parse().ok()?,
        })
    });
    Some(State {
        counter,
        owner,
        expires_at_us,
        key,
        identity,
        holder,
        queued,
        group,
        members,
        marks,
    })
}

pub(super) fn render_queue(waiters: &[Waiter]) -> String {
    let mut text = String::from(QUEUE_HEADER);
    for waiter in waiters {
        let identity = waiter.identity.as_deref().map_or_else(
            || "-".to_owned(),
            |identity| format!("+{}", encode(identity)),
        );
        text.push_str(&format!(
            "\n{} {} {} +{} {identity}",
            waiter.owner,
            waiter.ttl_us,
            waiter.expires_at_us,
            encode(&waiter.record)
        ));
    }
    text
}

/// The entries of a queue file, in order. A file that is not a queue, and
/// lines that do not read as entries, hold none: the queue is not precious
/// (its waiters join again), unlike the state's counter.
pub(super) fn parse_queue(text: &str) -> Vec<Waiter> {
    let mut lines = text.split('\n');
    if lines.next() != Some(QUEUE_HEADER) {
        return Vec::new();
    }
    lines
        .filter_map(|line| {
            let mut words = line.split(' ');
            let owner = OwnerId::parse_hex(words.next()?)?;
            let ttl_us = words.next()?.parse().ok()?;
            let expires_at_us = words.next()?.parse().ok()?;
            let record = decode(words.next()?.strip_prefix('+')?)?;
            let identity = match words.next()? {
                "-" => None,
                encoded => Some(decode(encoded.strip_prefix('+')?)?),
            };
            if words.next().is_some() {
                return None;
            }
            Some(Waiter {
                owner,
                ttl_us,
                expires_at_us,
                record,
                identity,
            })
        })
        .collect()
}

/// Percent-encodes `%`, spaces and control characters, so an identity
/// stays one field of one line whatever it holds.
fn encode(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '%' || c == ' ' || c.is_control() {
            let mut bytes = [0; 4];
            for byte in c.encode_utf8(&mut bytes).bytes() {
                encoded.push_str(&format!("%{byte:02X}"));
            }
        } else {
            encoded.push(c);
        }
    }
    encoded
}

/// The text `encode` made; `None` if `encoded` is not such text.
fn decode(encoded: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(encoded.len());
    let mut rest = encoded.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        rest = tail;
        match byte {
            b'%' => {
                let (hex, tail) = rest.split_at_checked(2)?;
                let digit = |d: u8| char::from(d).to_digit(16);
                let byte = digit(hex[0])? * 16 + digit(hex[1])?;
                bytes.push(u8::try_from(byte).ok()?);
                rest = tail;
            }
            b' ' | b'\n' => return None,
            _ => bytes.push(byte),
        }
    }
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests;
