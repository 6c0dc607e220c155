//! Where a lock key lives in Redis.
//!
//! For a lock key `K`, with `T` = `K` with `%`, `{` and `}` percent-encoded:
//!
//! | name | type | holds |
//! | --- | --- | --- |
//! | `dlock:{T}:lock` | string, with a `PX` expiry | the holder's owner id (32 hex digits), a waiter mark (`-` or `+`) and, space-separated, its fencing token, the server time of the acquisition in µs and the holder record (`1`, host, pid, label, tab-separated: [`crate::HolderInfo::encode`]); one string, so an acquisition writes one key and a release deletes one |
//! | `dlock:{T}:fence` | string (integer), no expiry | the last fencing token issued for `K` |
//! | `dlock:{T}:info` | string, with the lock's `PX` expiry | only beside a lock value of the previous protocol (the owner id and the mark alone, 33 characters, written by a replica not yet upgraded, or by a handoff to its waiter): its owner id, the server time of the acquisition in µs and the holder record, space-separated; stretched by a renewal and deleted by the release of such a value; read only while that owner holds the lock |
//! | `dlock:{T}:holder` | string, no expiry | only for leases taken with an identity (leader election): the owner id, the token and the identity, written by the acquisition; read only while that owner holds the lock, overwritten by the next such acquisition |
//! | `dlock:{T}:released` | pub/sub channel | a message on every release someone may wait for, and on every acquisition with an identity |
//! | `dlock:{T}:queue` | string (or list), with a `PX` no shorter than its longest-lived entry's | only while fair waiters queue: one line per waiter in arrival order, its owner id (see the scripts); the first line ends in the queue's stamp, ` g<stamp>`, drawn when the queue was begun and kept by every rewrite. Begun by a backend with `list_queues`: a list of the owner ids in arrival order, the stamp last as `g<stamp>` |
//! | `dlock:{T}:waiter:<owner id>` | string, with the entry's `PX` | one per queued fair waiter while its entry lives: the ttl its attempt asked for (ms), its holder record and, after a line break, the stamp of the queue its line is in; refreshed by the waiter's attempts, deleted by the handoff to it or its leaving |
//! | `dlock:{T}:rejoin` | string, with an entry's `PX` | `1`, set by a fair waiter that found its entry alive and its line gone from the queue (the queue was lost): while it stands, a waiter whose user may not `GETRANGE` (and so cannot read the stamp) looks for its own line at every refresh and joins again without one |
//! | `dlock:{T}:handoff` | pub/sub channel | a message per handoff to a fair waiter: `<owner id> <token> <ms the lease lasts>`; each process with fair waiters on the key follows it once |
//! | `dlock:{T}:readers` | hash, with the read phase's `PX` | while two or more readers hold (the lock key then holds the read phase's sentinel, 32 zeros and the waiter mark): each reader's owner id → its expiry in server ms; read only while the sentinel stands and the phase key holds the token alone |
//! | `dlock:{T}:phase` | string, with the read phase's `PX` | the read phase's token, drawn by its first reader, and, while that reader is the phase's only one, `<token> <owner id>` (the key's `PX` then its expiry) |
//! | `dlock:{T}:writer` | string, `PX` [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL) | a writer-waiting mark: the owner id of an exclusive attempt that found readers, and `+` once a reader was refused by it; deleted when its owner takes the key or gives up |
//! | `dlock:{T}:slots` | hash, with the permits' `PX` | while permits are held (the lock key then holds the permits' sentinel, 31 zeros, `1` and the waiter mark): slot → `<expiry in server ms> <owner id>` |
//!
//! `{T}` is a Redis Cluster hash tag: all the keys hash to the same slot, so
//! the scripts that touch both are valid on a cluster. Encoding the braces
//! keeps the tag whole whatever `K` contains (a raw `}` would end it early,
//! and a key starting with `}` would leave an empty tag and split the two
//! keys across slots); encoding `%` too keeps the mapping one-to-one.
//!
//! **Listing.** Encoding works character by character, so the keys that
//! start with a prefix `P` are exactly those whose tag starts with `P`'s
//! tag: [`Backend::held`](crate::Backend::held) finds them with `SCAN …
//! MATCH dlock:{<P's tag>*}:lock` ([`scan_pattern`], with the glob's
//! `*?[]\` escaped), decodes each name back ([`key_of_lock_name`]) and
//! still checks the prefix on the decoded key, so no pattern can widen it.

use std::borrow::Cow;
use std::fmt::Write as _;

use crate::backend::OwnerId;
use crate::key::LockKey;

/// The Redis names of one lock key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keyspace {
    /// The string holding the owner id while the key is locked.
    pub(crate) lock: String,
    /// The fencing counter.
    pub(crate) fence: String,
    /// The channel a release is announced on.
    pub(crate) released: String,
}

impl Keyspace {
    /// The names for `key`.
    pub(crate) fn of(key: &LockKey) -> Self {
        let tag = hash_tag(key.as_str());
        Self {
            lock: name(&tag, "lock"),
            fence: name(&tag, "fence"),
            released: name(&tag, "released"),
        }
    }
}

/// The lock key's name, all a renewal or a release sends.
pub(crate) fn lock_name(key: &LockKey) -> String {
    name(&hash_tag(key.as_str()), "lock")
}

/// The previous protocol's holder info key's name (`dlock:{T}:info`): read
/// only by the holder script, for a value written without its record.
pub(crate) fn info_name(key: &LockKey) -> String {
    name(&hash_tag(key.as_str()), "info")
}

/// The `SCAN … MATCH` pattern of the lock names of every key that starts
/// with `prefix`: the prefix's tag with the glob's special characters
/// (`*?[]\`) escaped, then anything up to the tag's end. It may match
/// more than those (never fewer): check each name with
/// [`key_of_lock_name`] and the prefix.
pub(crate) fn scan_pattern(prefix: &str) -> String {
    let tag = hash_tag(prefix);
    let mut pattern = String::with_capacity(tag.len() + 16);
    pattern.push_str("dlock:{");
    for c in tag.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push_str("*}:lock");
    pattern
}

/// The lock key whose lock name is `name` (`dlock:{T}:lock`), or `None`
/// for a name dlock does not make that way.
pub(crate) fn key_of_lock_name(name: &str) -> Option<String> {
    let tag = name.strip_prefix("dlock:{")?.strip_suffix("}:lock")?;
    if tag.contains(['{', '}']) {
        return None;
    }
    let mut key = String::with_capacity(tag.len());
    let mut rest = tag;
    while let Some(at) = rest.find('%') {
        key.push_str(&rest[..at]);
        let escaped = rest.get(at + 1..at + 3)?;
        key.push(match escaped {
            "25" => '%',
            "7B" => '{',
            "7D" => '}',
            _ => return None,
        });
        rest = &rest[at + 3..];
    }
    key.push_str(rest);
    Some(key)
}

/// The queue's and `owner`'s entry key's names (`dlock:{T}:queue`,
/// `dlock:{T}:waiter:<owner id>`), all a fair attempt adds to a plain
/// one's: built only for a fair attempt (the release script names the
/// queue from the lock key). The scripts name other waiters' entry keys
/// the same way, from the queue's name.
pub(crate) fn queue_and_entry_names(key: &LockKey, owner: &OwnerId) -> (String, String) {
    let tag = hash_tag(key.as_str());
    let mut entry = name(&tag, "waiter:");
    entry.extend(owner.to_hex().map(char::from));
    (name(&tag, "queue"), entry)
}

/// The channel a release that hands `key` to a fair waiter publishes the
/// grant on, addressed to the waiter's owner id. The release script builds
/// the same name from the lock name.
pub(crate) fn handoff_channel(key: &LockKey) -> String {
    name(&hash_tag(key.as_str()), "handoff")
}

/// The names a shared lease's scripts take (`dlock:{T}:…`), from one
/// encoding of the key: built only for shared access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SharedNames {
    /// The lock key, holding the read phase's sentinel.
    pub(crate) lock: String,
    /// The fencing counter.
    pub(crate) fence: String,
    /// The readers' hash, while two or more read: owner id → expiry
    /// (server ms).
    pub(crate) readers: String,
    /// The writer-waiting mark: owner id and flag, `PX` its life.
    pub(crate) writer: String,
    /// The read phase: its token, and its one reader while it has one.
    pub(crate) phase: String,
    /// The channel a release is announced on.
    pub(crate) released: String,
}

impl SharedNames {
    /// The names for `key`.
    pub(crate) fn of(key: &LockKey) -> Self {
        let tag = hash_tag(key.as_str());
        Self {
            lock: name(&tag, "lock"),
            fence: name(&tag, "fence"),
            readers: name(&tag, "readers"),
            writer: name(&tag, "writer"),
            phase: name(&tag, "phase"),
            released: name(&tag, "released"),
        }
    }
}

/// The names a permit's scripts take (`dlock:{T}:…`), from one encoding
/// of the key: built only for permits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PermitNames {
    /// The lock key, holding the permits' sentinel.
    pub(crate) lock: String,
    /// The fencing counter.
    pub(crate) fence: String,
    /// The slots' hash: slot → `<expiry ms> <owner id>`.
    pub(crate) slots: String,
    /// The channel a release is announced on.
    pub(crate) released: String,
}

impl PermitNames {
    /// The names for `key`.
    pub(crate) fn of(key: &LockKey) -> Self {
        let tag = hash_tag(key.as_str());
        Self {
            lock: name(&tag, "lock"),
            fence: name(&tag, "fence"),
            slots: name(&tag, "slots"),
            released: name(&tag, "released"),
        }
    }
}

/// The holder record's name: built only for an acquisition with an
/// identity and for reading the holder.
pub(crate) fn holder_name(key: &LockKey) -> String {
    name(&hash_tag(key.as_str()), "holder")
}

/// `dlock:{tag}:suffix`, built without formatting machinery: this runs on
/// every acquire, renewal and release.
fn name(tag: &str, suffix: &str) -> String {
    let mut name = String::with_capacity(tag.len() + suffix.len() + 9);
    name.push_str("dlock:{");
    name.push_str(tag);
    name.push_str("}:");
    name.push_str(suffix);
    name
}

/// `key` with `%`, `{` and `}` percent-encoded, so it can sit between the
/// braces of a hash tag.
fn hash_tag(key: &str) -> Cow<'_, str> {
    if !key.contains(['%', '{', '}']) {
        return Cow::Borrowed(key);
    }
    let mut tag = String::with_capacity(key.len());
    for c in key.chars() {
        match c {
            '%' | '{' | '}' => {
                // Writing to a String cannot fail.
                let _ = write!(tag, "%{:02X}", c as u32);
            }
            other => tag.push(other),
        }
    }
    Cow::Owned(tag)
}

/// The slot-relevant part of a Redis key: what Redis Cluster hashes.
#[cfg(test)]
fn cluster_hash_part(name: &str) -> &str {
    if let Some(open) = name.find('{')
        && let Some(len) = name[open + 1..].find('}')
        && len > 0
    {
        return &name[open + 1..open + 1 + len];
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(key: &str) -> Keyspace {
        Keyspace::of(&LockKey::new(key).unwrap_or_else(|e| panic!("{e}")))
    }

    #[test]
    fn lock_and_fence_share_one_hash_tag_whatever_the_key() {
        for key in ["plain", "}", "}{", "a}b{c", "{}", "%7D", "ü}🔒{", "{x}:{y}"] {
            let names = names(key);
            let lock = cluster_hash_part(&names.lock);
            assert_eq!(lock, cluster_hash_part(&names.fence), "{key:?}");
            assert_eq!(lock, cluster_hash_part(&names.released), "{key:?}");
            let shared = SharedNames::of(&LockKey::new(key).unwrap_or_else(|e| panic!("{e}")));
            for other in [&shared.readers, &shared.writer, &shared.phase, &shared.lock] {
                assert_eq!(lock, cluster_hash_part(other), "{key:?}");
            }
            let permits = PermitNames::of(&LockKey::new(key).unwrap_or_else(|e| panic!("{e}")));
            assert_eq!(lock, cluster_hash_part(&permits.slots), "{key:?}");
            assert!(!lock.contains(['{', '}']), "{key:?} -> {lock:?}");
            assert!(
                names.lock.len() > lock.len(),
                "the tag is not the whole key"
            );
        }
    }

    #[test]
    fn different_keys_get_different_names() {
        let keys = ["a}b", "a%7Db", "a%7db", "a{b", "a%7Bb", "a%b", "a%25b"];
        for (i, a) in keys.iter().enumerate() {
            for b in &keys[i + 1..] {
                assert_ne!(names(a).lock, names(b).lock, "{a:?} vs {b:?}");
            }
        }
    }

    #[test]
    fn the_release_script_finds_the_channel_from_the_lock_name_for_every_key() {
        // The script publishes on `string.sub(KEYS[1], 1, -5) .. 'released'`.
        for key in ["plain", "}", "ü}🔒{", "lock", "x:lock:released"] {
            let names = names(key);
            let stem = names.lock.strip_suffix("lock").expect("ends in lock");
            assert_eq!(format!("{stem}released"), names.released, "{key:?}");
        }
    }

    #[test]
    fn the_lock_name_alone_is_the_one_of_the_full_layout() {
        for key in ["plain", "}", "a}b{c", "%7D"] {
            let key = LockKey::new(key).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(lock_name(&key), Keyspace::of(&key).lock);
        }
    }

    #[test]
    fn the_fair_names_share_the_locks_hash_tag_and_the_scripts_find_the_handoff_channel() {
        for key in ["plain", "}", "a}b{c", "ü}🔒{", "x:lock:queue"] {
            let lock_key = LockKey::new(key).unwrap_or_else(|e| panic!("{e}"));
            let names = names(key);
            let owner = OwnerId::random().expect("owner id");
            let (queue, entry) = queue_and_entry_names(&lock_key, &owner);
            // The release script names the queue and the fence from the
            // lock key: `string.sub(lock, 1, -5) .. 'queue'` (or 'fence').
            let stem = names.lock.strip_suffix("lock").expect("ends in lock");
            assert_eq!(queue, format!("{stem}queue"));
            assert_eq!(names.fence, format!("{stem}fence"));
            // The scripts name an entry `string.sub(queue, 1, -6) ..
            // 'waiter:' .. owner`, and a listing never takes it for a lock.
            let stem = queue.strip_suffix("queue").expect("ends in queue");
            assert_eq!(entry, format!("{stem}waiter:{owner}"));
            assert_eq!(key_of_lock_name(&entry), None);
            let channel = handoff_channel(&lock_key);
            for name in [&queue, &entry, &channel] {
                assert_eq!(
                    cluster_hash_part(name),
                    cluster_hash_part(&names.lock),
                    "{key:?}"
                );
            }
            // The scripts publish on `string.sub(lock, 1, -5) .. 'handoff'`.
            let stem = names.lock.strip_suffix("lock").expect("ends in lock");
            assert_eq!(format!("{stem}handoff"), channel);
            // Neither is a lock name: a listing never reads one as a held key.
            assert_eq!(key_of_lock_name(&queue), None);
            assert_eq!(key_of_lock_name(&channel), None);
        }
    }

    #[test]
    fn the_info_key_shares_the_locks_hash_tag() {
        for key in ["plain", "}", "a}b{c", "ü}🔒{"] {
            let info = info_name(&LockKey::new(key).unwrap_or_else(|e| panic!("{e}")));
            let names = names(key);
            assert_eq!(
                cluster_hash_part(&info),
                cluster_hash_part(&names.lock),
                "{key:?}"
            );
            // The scripts name it `string.sub(lock, 1, -5) .. 'info'`.
            let stem = names.lock.strip_suffix("lock").expect("ends in lock");
            assert_eq!(info, format!("{stem}info"));
        }
    }

    #[test]
    fn a_lock_name_decodes_back_to_its_key() {
        for key in [
            "plain",
            "}",
            "}{",
            "a}b{c",
            "{}",
            "%7D",
            "%",
            "ü}🔒{",
            "*?[a]%_\\",
        ] {
            assert_eq!(
                key_of_lock_name(&names(key).lock).as_deref(),
                Some(key),
                "{key:?}"
            );
        }
        for name in [
            "dlock:{a}:fence",
            "other:{a}:lock",
            "dlock:{a%}:lock",
            "dlock:{a%2}:lock",
            "dlock:{a%7b}:lock",
            "dlock:{a%41}:lock",
            "dlock:{a}b}:lock",
        ] {
            assert_eq!(key_of_lock_name(name), None, "{name:?}");
        }
    }

    /// Redis's glob, as `SCAN … MATCH` applies it, for the subset the
    /// pattern uses: literals, `\` escapes and `*`.
    fn glob_matches(pattern: &[char], text: &[char]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some(('*', rest)) => (0..=text.len()).any(|i| glob_matches(rest, &text[i..])),
            Some(('\\', rest)) => match (rest.split_first(), text.split_first()) {
                (Some((p, rest)), Some((t, text))) => p == t && glob_matches(rest, text),
                _ => false,
            },
            Some((p, rest)) => {
                !matches!(p, '?' | '[' | ']')
                    && text
                        .split_first()
                        .is_some_and(|(t, text)| p == t && glob_matches(rest, text))
            }
        }
    }

    #[test]
    fn the_scan_pattern_matches_the_lock_names_under_a_prefix_and_escapes_globs() {
        let matches = |prefix: &str, key: &str| {
            let pattern: Vec<char> = scan_pattern(prefix).chars().collect();
            let name: Vec<char> = names(key).lock.chars().collect();
            glob_matches(&pattern, &name)
        };
        for (prefix, key) in [
            ("", "a"),
            ("job:", "job:1"),
            ("*?[a]%_\\:", "*?[a]%_\\:x"),
            ("a{", "a{b}"),
            ("a", "a"),
        ] {
            assert!(matches(prefix, key), "{prefix:?} must match {key:?}");
        }
        for (prefix, key) in [("job:", "jobs:1"), ("*", "x"), ("[a]", "a"), ("a?", "ab")] {
            assert!(!matches(prefix, key), "{prefix:?} must not match {key:?}");
        }
        assert_eq!(scan_pattern("a*{"), "dlock:{a\\*%7B*}:lock");
    }

    #[test]
    fn the_layout_is_as_documented() {
        let names = names("job:{42}");
        assert_eq!(names.lock, "dlock:{job:%7B42%7D}:lock");
        assert_eq!(names.fence, "dlock:{job:%7B42%7D}:fence");
        assert_eq!(names.released, "dlock:{job:%7B42%7D}:released");
        let key = LockKey::new("job:{42}").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(info_name(&key), "dlock:{job:%7B42%7D}:info");
    }
}
