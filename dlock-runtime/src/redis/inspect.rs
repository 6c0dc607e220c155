//! Who holds what: the holder script's answer read as a [`Holding`], and
//! the `SCAN` of the keyspace (every primary's, on a cluster) that lists
//! the held keys (for operators: the `dlock list` inspector). Its own
//! file: reading who holds a key is apart from taking and keeping one.

use std::time::Duration;

use ::redis::Value;

use super::RedisBackend;
use crate::backend::Holding;
use crate::error::{LockError, Operation};
use crate::holder::HolderInfo;
use crate::token::FencingToken;

/// How many names one `SCAN` step of a listing looks at, on each node: a
/// listing never keeps a server busy for long at a time.
const SCAN_COUNT: usize = 1000;

impl RedisBackend {
    /// The names matching `pattern` on the server, or on every primary of
    /// a cluster: `SCAN` steps of [`SCAN_COUNT`] until each node's cursor
    /// comes back to 0. A name may come twice (a key moved or rehashed
    /// during the scan); names that are not UTF-8 are not dlock's.
    pub(super) async fn scan(&self, prefix: &str, pattern: &str) -> Result<Vec<String>, LockError> {
        let slots = if self.is_cluster() {
            self.primary_slots(prefix).await?
        } else {
            vec![0]
        };
        let mut names = Vec::new();
        for slot in slots {
            let mut cursor = 0_u64;
            loop {
                let mut scan = ::redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT);
                let scan = &scan;
                let (reply, _) = self
                    .inner
                    .commands
                    .send(self.call_limit(), |mut conn| async move {
                        conn.query_at(scan, slot).await
                    })
                    .await
                    .map_err(|failure| {
                        self.error_at(Operation::List, prefix, self.describe(&failure))
                    })?;
                let (next, batch): (u64, Vec<Vec<u8>>) =
                    ::redis::from_redis_value(reply).map_err(|err| {
                        self.error_at(
                            Operation::List,
                            prefix,
                            format!("unexpected reply to SCAN: {err}"),
                        )
                    })?;
                names.extend(
                    batch
                        .into_iter()
                        .filter_map(|name| String::from_utf8(name).ok()),
                );
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(names)
    }

    /// A slot of each primary of the cluster, to send it a command without
    /// a key ([`commands::Connection::query_at`](super::commands::Connection::query_at)).
    async fn primary_slots(&self, prefix: &str) -> Result<Vec<u16>, LockError> {
        let slots = ::redis::cmd("CLUSTER").arg("SLOTS").to_owned();
        let slots = &slots;
        let (reply, _): (Value, bool) = self
            .inner
            .commands
            .send(self.call_limit(), |mut conn| async move {
                slots.query_async(&mut conn).await
            })
            .await
            .map_err(|failure| self.error_at(Operation::List, prefix, self.describe(&failure)))?;
        primary_slots(&reply).ok_or_else(|| {
            self.error_at(
                Operation::List,
                prefix,
                format!("unexpected reply {reply:?} to CLUSTER SLOTS"),
            )
        })
    }
}

/// The first slot of each primary in a `CLUSTER SLOTS` reply (ranges of
/// `[first slot, last slot, [host, port, …], replicas…]`); `None` for a
/// reply of another shape.
fn primary_slots(reply: &Value) -> Option<Vec<u16>> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let mut primaries: Vec<(&[Value], u16)> = Vec::new();
    for range in ranges {
        let Value::Array(parts) = range else {
            return None;
        };
        let [Value::Int(first), _, Value::Array(primary), ..] = parts.as_slice() else {
            return None;
        };
        let address = primary.get(..2)?;
        if !primaries.iter().any(|(known, _)| *known == address) {
            primaries.push((address, u16::try_from(*first).ok()?));
        }
    }
    Some(primaries.into_iter().map(|(_, slot)| slot).collect())
}

/// The holder script's reply as a [`Holding`]; `None` for a reply of
/// another shape.
pub(super) fn read_holding(reply: &Value) -> Option<Option<Holding>> {
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok().map(str::to_owned),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    let parts = match reply {
        Value::Nil => return Some(None),
        Value::Array(parts) => parts,
        _ => return None,
    };
    let [
        Value::Int(remaining),
        record,
        fence,
        info,
        Value::Int(held_for),
    ] = parts.as_slice()
    else {
        return None;
    };
    // A part that is not text (a value another tool wrote, or a hand
    // edit) names nothing: that one holder is unknown, and a listing of
    // many keys still shows the others.
    let [record, fence, info] = [record, fence, info].map(|part| text(part).unwrap_or_default());
    // `<owner id> <token> <identity>`, the identity last (it may hold spaces).
    let recorded = record.splitn(3, ' ').collect::<Vec<_>>();
    let (token, identity) = match recorded.as_slice() {
        [_, token, identity] => (token.parse().ok(), Some((*identity).to_owned())),
        _ => (fence.parse().ok(), None),
    };
    let token = token.filter(|token| *token > 0).map(FencingToken::new);
    // An identity is only told with its own token.
    let identity = identity.filter(|_| token.is_some());
    // `<host>\t<pid>\t<label>` and how long ago it was taken, when the
    // holder's acquisition recorded it (an older dlock's did not).
    // A record a previous dlock's fair handoff copied whole from a
    // waiter's queue entry carries the queue's stamp after a line break.
    let info = info.split('\n').next().unwrap_or_default();
    let holder = HolderInfo::decode(info).map(|holder| match u64::try_from(*held_for) {
        Ok(micros) => holder.held_for(Duration::from_micros(micros)),
        Err(_) => holder,
    });
    let holding = Holding::new(token, identity).held_by(holder);
    Some(Some(match u64::try_from(*remaining) {
        Ok(ms) => holding.expiring_in(Duration::from_millis(ms)),
        Err(_) => holding,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    #[test]
    fn a_holder_reply_with_info_names_the_holder_and_how_long_it_held() {
        let me = HolderInfo::this_process(Some("billing"));
        let reply = Value::Array(vec![
            Value::Int(12_000),
            bulk(""),
            bulk("1700000000000042"),
            bulk(&me.encode()),
            Value::Int(2_500_000),
        ]);
        let holding = read_holding(&reply).expect("a holder reply").expect("held");
        assert_eq!(
            holding.token,
            Some(FencingToken::new(1_700_000_000_000_042))
        );
        assert_eq!(holding.expires_in, Some(Duration::from_secs(12)));
        assert_eq!(
            holding.holder,
            Some(me.held_for(Duration::from_millis(2_500)))
        );
    }

    #[test]
    fn a_holder_reply_without_info_or_with_a_damaged_one_names_nobody() {
        for info in ["", "2\tweb\t1\t", "garbage"] {
            let reply = Value::Array(vec![
                Value::Int(5),
                bulk(""),
                bulk("7"),
                bulk(info),
                Value::Int(-1),
            ]);
            let holding = read_holding(&reply).expect("a holder reply").expect("held");
            assert_eq!(holding.token, Some(FencingToken::new(7)), "{info:?}");
            assert_eq!(holding.holder, None, "{info:?}");
        }
        assert!(matches!(read_holding(&Value::Nil), Some(None)));
        // The shape before the info: not this script's answer.
        let short = Value::Array(vec![Value::Int(5), bulk(""), bulk("7")]);
        assert!(read_holding(&short).is_none());
    }

    #[test]
    fn cluster_slots_give_one_slot_a_primary() {
        let node =
            |port: i64, id: &str| Value::Array(vec![bulk("127.0.0.1"), Value::Int(port), bulk(id)]);
        let range = |first: i64, last: i64, primary: Value, replica: Value| {
            Value::Array(vec![Value::Int(first), Value::Int(last), primary, replica])
        };
        let reply = Value::Array(vec![
            range(0, 5460, node(7000, "a"), node(7003, "d")),
            range(5461, 10922, node(7001, "b"), node(7004, "e")),
            range(10923, 12000, node(7002, "c"), node(7005, "f")),
            // A second range of the first primary adds no node.
            range(12001, 16383, node(7000, "a"), node(7003, "d")),
        ]);
        assert_eq!(primary_slots(&reply), Some(vec![0, 5461, 10923]));
        assert_eq!(primary_slots(&Value::Int(1)), None);
    }
}
