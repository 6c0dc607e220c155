//! Renewals as calls: every mode's, as a batch puts them in one pipeline
//! (with the script loads that go before them when the server lost its
//! script cache), and a shared or permit renewal's own invocation. Its own
//! file: a batch of renewals mixes the modes in one pipeline, and a
//! release finds a permit's slot argument here too.

use ::redis::{Script, ScriptInvocation};

use super::keyspace::{self, PermitNames, SharedNames};
use super::{UNWAITED, held_value, scripts, ttl_millis};
use crate::backend::{Access, Renewal};

/// A permit slot as the permit scripts take it: its number, or empty for
/// the owner's slot, whichever.
pub(super) fn slot_arg(slot: Option<u32>) -> String {
    slot.map(|slot| slot.to_string()).unwrap_or_default()
}

/// The script, keys and arguments of a shared or permit renewal (rule M4).
fn side_renewal_parts(renewal: &Renewal<'_>) -> (&'static Script, Vec<String>, Vec<String>) {
    let (owner, ttl) = (renewal.owner.to_hex(), ttl_millis(renewal.ttl).to_string());
    let owner = String::from_utf8_lossy(&owner).into_owned();
    match renewal.access {
        Access::Permits { .. } => {
            let names = PermitNames::of(renewal.key);
            (
                &scripts::PERMIT_EXTEND,
                vec![names.lock, names.slots],
                vec![owner, ttl, slot_arg(renewal.slot)],
            )
        }
        _ => {
            let names = SharedNames::of(renewal.key);
            (
                &scripts::SHARED_EXTEND,
                vec![names.lock, names.readers, names.phase],
                vec![owner, ttl],
            )
        }
    }
}

/// Appends one owner-checked renewal call per lease of `leases` to `pipe`,
/// each by its script's hash.
pub(super) fn renewal_calls(pipe: &mut ::redis::Pipeline, leases: &[Renewal<'_>]) {
    for lease in leases {
        if lease.access != Access::Exclusive {
            let (script, keys, args) = side_renewal_parts(lease);
            let call = pipe.cmd("EVALSHA").arg(script.get_hash()).arg(keys.len());
            call.arg(keys).arg(args);
            continue;
        }
        let call = pipe.cmd("EVALSHA");
        let lock = keyspace::lock_name(lease.key);
        match lease.recorded {
            None => call.arg(scripts::EXTEND.get_hash()).arg(1).arg(lock),
            Some(_) => call
                .arg(scripts::EXTEND_AS.get_hash())
                .arg(2)
                .arg(lock)
                .arg(keyspace::holder_name(lease.key)),
        };
        call.arg(&held_value(lease.owner, UNWAITED)[..])
            .arg(ttl_millis(lease.ttl));
        if let Some((identity, token)) = lease.recorded {
            call.arg(token.get()).arg(identity);
        }
    }
}

/// The pipeline that sends `leases`' renewals again to a server without
/// their scripts: every renewal script loaded, then the batch, in one round
/// trip. One load after the other (each a round trip) would queue, each,
/// behind an acquisition's `WAIT` on the shared connection when replica
/// acks are asked for: four of them outlasted a 1.5 s lease's first renewal.
pub(super) fn reload_renewals(leases: &[Renewal<'_>]) -> ::redis::Pipeline {
    let mut reload = ::redis::pipe();
    reload.ignore_errors();
    for lua in [
        scripts::EXTEND_LUA,
        scripts::EXTEND_AS_LUA.as_str(),
        scripts::SHARED_EXTEND_LUA,
        scripts::PERMIT_EXTEND_LUA,
    ] {
        reload.cmd("SCRIPT").arg("LOAD").arg(lua).ignore();
    }
    renewal_calls(&mut reload, leases);
    reload
}

/// The invocation of a shared or permit renewal.
pub(super) fn side_renewal(renewal: &Renewal<'_>) -> ScriptInvocation<'static> {
    let (script, keys, args) = side_renewal_parts(renewal);
    let mut invocation = script.prepare_invoke();
    for key in keys {
        invocation.key(key);
    }
    for arg in args {
        invocation.arg(arg);
    }
    invocation
}
