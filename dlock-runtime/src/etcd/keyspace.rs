//! Where a lock lives in etcd's keyspace, and the leases it is held with.

use std::time::Duration;

use crate::backend::OwnerId;
use crate::key::LockKey;

/// Every name the backend writes starts with this.
pub(super) const ROOT: &str = "dlock/";
/// The lock keys: `dlock/lock/<key>`, the owner id as the value, on the
/// holder's lease. Its create revision is the fencing token.
const LOCK: &str = "dlock/lock/";
/// The holder records: `dlock/holder/<key>`, on the same lease.
const HOLDER: &str = "dlock/holder/";
/// The identities of leases taken with one: `dlock/identity/<key>`, on
/// the same lease.
const IDENTITY: &str = "dlock/identity/";

/// The three names of one lock key. The key follows a fixed category
/// prefix, and no category's prefix is a prefix of another's, so no key
/// (whatever bytes it holds, `/` included) can name another category's
/// entry or another key's: the key needs no escaping.
pub(super) struct Names {
    pub(super) lock: String,
    pub(super) holder: String,
    pub(super) identity: String,
}

impl Names {
    pub(super) fn of(key: &LockKey) -> Self {
        Self::of_prefix(key.as_str())
    }

    /// The names for a key, or the range prefixes for a key prefix.
    pub(super) fn of_prefix(key: &str) -> Self {
        Self {
            lock: format!("{LOCK}{key}"),
            holder: format!("{HOLDER}{key}"),
            identity: format!("{IDENTITY}{key}"),
        }
    }
}

/// The key a lock name stands for, if it is one.
pub(super) fn key_of_lock(name: &[u8]) -> Option<&str> {
    std::str::from_utf8(name.strip_prefix(LOCK.as_bytes())?).ok()
}

/// The key a holder or identity name stands for, if it is one.
pub(super) fn key_of_record(name: &[u8]) -> Option<(&str, bool)> {
    let name = std::str::from_utf8(name).ok()?;
    if let Some(key) = name.strip_prefix(HOLDER) {
        return Some((key, false));
    }
    name.strip_prefix(IDENTITY).map(|key| (key, true))
}

/// A lease's ttl in etcd's unit, whole seconds: rounded up (a store that
/// keeps a lease a little longer keeps exclusion; one that keeps it
/// shorter would break it), at least one.
pub(super) fn lease_seconds(ttl: Duration) -> i64 {
    let seconds = ttl
        .as_secs()
        .saturating_add(u64::from(ttl.subsec_nanos() > 0));
    i64::try_from(seconds.max(1)).unwrap_or(i64::MAX)
}

/// The lease an owner holds its key with for a ttl of `seconds`: chosen by
/// the client (etcd allows it), so a retry of the same acquisition names
/// the same lease instead of leaving a second one behind, and a renewal
/// knows its lease without a read. A different ttl is a different lease
/// (etcd cannot change a lease's ttl; see `EtcdBackend::move_lease`).
///
/// Owner ids are 128 random bits, so two owners share a lease id with
/// odds of about one in 2^63 per pair; the id is positive (etcd reads 0 as
/// "choose one for me").
pub(super) fn lease_id(owner: &OwnerId, seconds: i64) -> i64 {
    let bytes = owner.as_bytes();
    let mut low = [0u8; 8];
    low.copy_from_slice(&bytes[..8]);
    let mut high = [0u8; 8];
    high.copy_from_slice(&bytes[8..]);
    let mixed = u64::from_le_bytes(low)
        ^ u64::from_le_bytes(high).rotate_left(17)
        ^ (seconds as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let id = (mixed & (i64::MAX as u64)) as i64;
    if id == 0 { 1 } else { id }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(lease_seconds(Duration::from_millis(1)), 1);
        assert_eq!(lease_seconds(Duration::from_millis(1000)), 1);
        assert_eq!(lease_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(lease_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn a_key_cannot_reach_another_category() {
        let key = LockKey::new("x/../holder/y").expect("a key");
        let names = Names::of(&key);
        assert_eq!(key_of_lock(names.lock.as_bytes()), Some(key.as_str()));
        assert_eq!(key_of_lock(names.holder.as_bytes()), None);
        assert_eq!(
            key_of_record(names.identity.as_bytes()),
            Some((key.as_str(), true))
        );
    }

    #[test]
    fn lease_ids_are_positive_and_depend_on_the_ttl() {
        let owner = OwnerId::from_bytes([0xff; 16]);
        let (a, b) = (lease_id(&owner, 1), lease_id(&owner, 2));
        assert!(a > 0 && b > 0);
        assert_ne!(a, b);
        assert_eq!(a, lease_id(&owner, 1));
    }
}
