//! What the commands print: the JSON shapes and the human forms.
//!
//! Every JSON object has the same fields for a holder, `null` where the
//! store cannot tell, so a script reads them without checking which
//! backend answered. Durations are whole milliseconds in JSON and
//! `12.4 s` for people.

use std::fmt::Write as _;
use std::io::{self, Write};
use std::time::Duration;

use dlock::backend::Holding;
use serde::Serialize;

/// A holding, as JSON shows it (flattened into the object of its key).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HoldingView {
    /// The holder's fencing token.
    pub token: Option<u64>,
    /// The identity the acquisition recorded (a leader's).
    pub identity: Option<String>,
    /// The holder's host.
    pub host: Option<String>,
    /// The holder's process id on that host.
    pub pid: Option<u32>,
    /// The holder's application label.
    pub label: Option<String>,
    /// How long it has held the key.
    pub held_for_ms: Option<u64>,
    /// How long its lease has left unless renewed.
    pub ttl_left_ms: Option<u64>,
}

impl HoldingView {
    pub fn of(holding: &Holding) -> Self {
        let holder = holding.holder.as_ref();
        Self {
            token: holding.token.map(|token| token.get()),
            identity: holding.identity.clone(),
            host: holder.map(|h| h.host.clone()),
            pid: holder.map(|h| h.pid),
            label: holder.and_then(|h| h.label.clone()),
            held_for_ms: holder.and_then(|h| h.held_for).map(millis),
            ttl_left_ms: holding.expires_in.map(millis),
        }
    }

    /// Whether `other` is the same lease: the same token and holder, the
    /// times aside.
    pub fn same_lease(&self, other: &Self) -> bool {
        (
            &self.token,
            &self.identity,
            &self.host,
            self.pid,
            &self.label,
        ) == (
            &other.token,
            &other.identity,
            &other.host,
            other.pid,
            &other.label,
        )
    }

    /// `web-3 (pid 4121, label "billing") as "leader-a"`, or `someone
    /// unknown` when the store keeps no record.
    pub fn holder_text(&self) -> String {
        let mut text = match (&self.host, self.pid) {
            (Some(host), Some(pid)) => {
                let mut text = format!("{} (pid {pid}", printable(host));
                if let Some(label) = &self.label {
                    let _ = write!(text, ", label {:?}", label);
                }
                text.push(')');
                text
            }
            _ => "someone unknown (no holder record)".to_owned(),
        };
        if let Some(identity) = &self.identity {
            let _ = write!(text, " as {identity:?}");
        }
        text
    }
}

/// One held key of `list`.
#[derive(Debug, Serialize)]
pub struct LockView {
    pub key: String,
    #[serde(flatten)]
    pub holding: HoldingView,
}

/// `list --json`.
#[derive(Debug, Serialize)]
pub struct ListView {
    pub prefix: String,
    pub locks: Vec<LockView>,
}

/// `show --json`: the holder's fields only when `held`.
#[derive(Debug, Serialize)]
pub struct ShowView {
    pub key: String,
    pub held: bool,
    #[serde(flatten)]
    pub holding: Option<HoldingView>,
}

/// `--json` when the command failed: the message also on stderr, and the
/// exit status the process ends with.
#[derive(Debug, Serialize)]
pub struct ErrorView<'a> {
    pub error: &'a str,
    pub exit_status: u8,
}

/// `release --json`: the holder's fields are those of the lease released.
#[derive(Debug, Serialize)]
pub struct ReleaseView {
    pub key: String,
    pub released: bool,
    #[serde(flatten)]
    pub holding: Option<HoldingView>,
}

/// One line of `watch --json`.
#[derive(Debug, Serialize)]
pub struct WatchEvent {
    /// When the change was seen, RFC 3339 in UTC.
    pub at: String,
    /// `held` or `free` (the state when the watch started), then
    /// `acquired` or `released`.
    pub event: &'static str,
    pub key: String,
    #[serde(flatten)]
    pub holding: Option<HoldingView>,
}

/// Writes `value` as one line of JSON.
pub fn json_line(out: &mut impl Write, value: &impl Serialize) -> io::Result<()> {
    serde_json::to_writer(&mut *out, value)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// `12.4 s`, `3 min 12 s`, `2 h 5 min`, `3 d 4 h`.
pub fn duration(d: Duration) -> String {
    let secs = d.as_secs();
    if secs < 60 {
        format!("{:.1} s", d.as_secs_f64())
    } else if secs < 3600 {
        format!("{} min {} s", secs / 60, secs % 60)
    } else if secs < 86_400 {
        format!("{} h {} min", secs / 3600, secs % 3600 / 60)
    } else {
        format!("{} d {} h", secs / 86_400, secs % 86_400 / 3600)
    }
}

fn duration_ms(ms: Option<u64>) -> String {
    ms.map_or_else(|| "-".to_owned(), |ms| duration(Duration::from_millis(ms)))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `text` with control characters escaped: a key is any text but NUL, and
/// one with an escape sequence must not drive the terminal.
pub fn printable(text: &str) -> String {
    if !text.contains(char::is_control) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The table `list` prints: a header and a row a key, columns aligned, and
/// the identity column only when some holder recorded one.
pub fn list_table(locks: &[LockView]) -> String {
    let with_identity = locks.iter().any(|lock| lock.holding.identity.is_some());
    let mut header = vec!["KEY", "HOST", "PID", "LABEL"];
    if with_identity {
        header.push("IDENTITY");
    }
    header.extend(["TOKEN", "HELD FOR", "TTL LEFT"]);
    let dash = || "-".to_owned();
    let rows: Vec<Vec<String>> = locks
        .iter()
        .map(|lock| {
            let h = &lock.holding;
            let mut row = vec![
                printable(&lock.key),
                h.host.as_deref().map_or_else(dash, printable),
                h.pid.map_or_else(dash, |pid| pid.to_string()),
                h.label.clone().unwrap_or_else(dash),
            ];
            if with_identity {
                row.push(h.identity.clone().unwrap_or_else(dash));
            }
            row.extend([
                h.token.map_or_else(dash, |t| t.to_string()),
                duration_ms(h.held_for_ms),
                duration_ms(h.ttl_left_ms),
            ]);
            row
        })
        .collect();
    let header: Vec<String> = header.into_iter().map(str::to_owned).collect();
    table(&header, &rows)
}

/// Columns padded to their widest cell, two spaces apart, no trailing
/// spaces.
fn table(header: &[String], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    for row in std::iter::once(header).chain(rows.iter().map(Vec::as_slice)) {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

/// The lines `show` prints for a held key.
pub fn show_text(key: &str, h: &HoldingView) -> String {
    let mut lines = vec![
        ("key", printable(key)),
        ("holder", h.holder_text()),
        (
            "token",
            h.token.map_or_else(|| "-".into(), |t| t.to_string()),
        ),
        ("held for", duration_ms(h.held_for_ms)),
        ("ttl left", duration_ms(h.ttl_left_ms)),
    ];
    for (_, value) in &mut lines[2..] {
        if value == "-" {
            value.push_str(" (not kept by the store)");
        }
    }
    let mut text = String::new();
    for (name, value) in lines {
        let _ = writeln!(text, "{:<10}{value}", format!("{name}:"));
    }
    text
}

/// The human form of a watch line: the time, what happened and to whom.
pub fn watch_text(event: &WatchEvent) -> String {
    let mut text = format!("{}  {:<8}", event.at, event.event);
    if let Some(h) = &event.holding {
        let _ = write!(text, "  {}", h.holder_text());
        if let Some(token) = h.token {
            let _ = write!(text, "  token {token}");
        }
        if event.event == "held"
            && let Some(ms) = h.held_for_ms
        {
            let _ = write!(text, "  held for {}", duration_ms(Some(ms)));
        }
        if event.event != "released"
            && let Some(ms) = h.ttl_left_ms
        {
            let _ = write!(text, "  ttl left {}", duration_ms(Some(ms)));
        }
    }
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(duration(Duration::from_millis(12_440)), "12.4 s");
        assert_eq!(duration(Duration::from_millis(250)), "0.2 s");
        assert_eq!(duration(Duration::from_secs(192)), "3 min 12 s");
        assert_eq!(duration(Duration::from_secs(7500)), "2 h 5 min");
        assert_eq!(duration(Duration::from_secs(273_600)), "3 d 4 h");
    }

    #[test]
    fn control_characters_in_a_key_are_escaped() {
        assert_eq!(printable("a\x1b[2Jb\n"), "a\\u{1b}[2Jb\\n");
        assert_eq!(printable("plain:key"), "plain:key");
    }

    fn view(key: &str, host: &str, pid: u32, identity: Option<&str>) -> LockView {
        LockView {
            key: key.into(),
            holding: HoldingView {
                token: Some(17),
                identity: identity.map(Into::into),
                host: Some(host.into()),
                pid: Some(pid),
                label: None,
                held_for_ms: Some(12_400),
                ttl_left_ms: None,
            },
        }
    }

    #[test]
    fn the_list_aligns_its_columns_and_shows_identities_only_when_there_are_some() {
        let table = list_table(&[view("a", "web-3", 4121, None), view("bbbb", "w", 7, None)]);
        assert_eq!(
            table,
            "KEY   HOST   PID   LABEL  TOKEN  HELD FOR  TTL LEFT\n\
             a     web-3  4121  -      17     12.4 s    -\n\
             bbbb  w      7     -      17     12.4 s    -\n"
        );
        let table = list_table(&[view("a", "web-3", 4121, Some("leader-1"))]);
        assert!(table.starts_with("KEY  HOST   PID   LABEL  IDENTITY  TOKEN"));
    }

    #[test]
    fn json_names_every_field_of_a_holder_even_when_unknown() {
        let unknown = HoldingView {
            token: None,
            identity: None,
            host: None,
            pid: None,
            label: None,
            held_for_ms: None,
            ttl_left_ms: Some(3),
        };
        let show = ShowView {
            key: "k".into(),
            held: true,
            holding: Some(unknown),
        };
        let value = serde_json::to_value(&show).ok();
        let expected = serde_json::json!({
            "key": "k", "held": true, "token": null, "identity": null, "host": null,
            "pid": null, "label": null, "held_for_ms": null, "ttl_left_ms": 3,
        });
        assert_eq!(value, Some(expected));
        let free = ShowView {
            key: "k".into(),
            held: false,
            holding: None,
        };
        assert_eq!(
            serde_json::to_value(&free).ok(),
            Some(serde_json::json!({"key": "k", "held": false}))
        );
    }
}
